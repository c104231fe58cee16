#!/usr/bin/env bash
# recall serve and HF's `transformers serve --continuous-batching` side by side, one after the other,
# on the same weights and the same agent-shaped load (`recall loadgen`); prints both tables and writes
# their JSON reports. docs/PERFORMANCE.md records the runs.
#
#   cargo build --release
#   python3 -m venv .venv-serve && .venv-serve/bin/pip install "transformers[serving]==5.24.0" \
#       torch==2.15.0 torchvision==0.29.2
#   tools/serve_compare.sh tests/fixtures/tiny-qwen3-vl tiny --clients 8 --steps 4
#   .venv-tools/bin/python tools/make_shape_model.py --out /tmp/shape-l4      # Qwen3-VL-2B, 4 layers
#   tools/serve_compare.sh /tmp/shape-l4 2b-l4 --clients 4 --steps 3
#
# Everything after the label goes to `recall loadgen` for both servers. OUT (default
# /tmp/serve-compare) receives the reports and the servers' logs.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { echo "usage: $0 MODEL_DIR LABEL [loadgen flags...]" >&2; exit 2; }
model=$(realpath "$1"); name=$2; shift 2
out=${OUT:-/tmp/serve-compare}
recall=target/release/recall
hf=.venv-serve/bin/transformers
[ -x "$recall" ] || { echo "build recall first: cargo build --release" >&2; exit 2; }
[ -x "$hf" ] || { echo "install transformers serve into .venv-serve (see the header)" >&2; exit 2; }
mkdir -p "$out"

# One directory both servers load: the model's files, plus the chat template transformers needs.
dir="$out/$name-model"
rm -rf "$dir" && mkdir -p "$dir"
for f in "$model"/*; do ln -s "$f" "$dir/"; done
[ -e "$dir/chat_template.json" ] || cp models/qwen3-vl-2b-instruct/chat_template.json "$dir/"

wait_up() { # url pid log
  for _ in $(seq 1 1200); do
    curl -sf "$1/health" >/dev/null && return 0
    kill -0 "$2" 2>/dev/null || { echo "the server died:"; tail -20 "$3"; exit 1; }
    sleep 0.25
  done
  echo "the server did not come up"; exit 1
}
stop() { kill -TERM "$1" 2>/dev/null || true; wait "$1" 2>/dev/null || true; }

# run LABEL PORT MODEL_FIELD SERVER_COMMAND...: starts the server, waits for /health, runs the load,
# stops the server.
run() {
  local label=$1 port=$2 field=$3; shift 3
  echo "== $label"
  "$@" --port "$port" > "$out/$name-$label.log" 2>&1 &
  local pid=$!
  wait_up "http://127.0.0.1:$port" $pid "$out/$name-$label.log"
  "$recall" loadgen --url "http://127.0.0.1:$port" --model "$field" --label "$label" \
    --json "$out/$name-$label.json" "${load[@]}" | tee "$out/$name-$label.md"
  stop $pid
}
load=("$@")
echo "$(nproc) cores"
run recall 8401 "$name" "$recall" serve --model "$dir" --served-model-name "$name" --backend cpu
run transformers 8402 "$dir" env HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$hf" serve "$dir" \
  --continuous-batching --device cpu --dtype float32 --host 127.0.0.1

echo "== $name"
cat "$out/$name-recall.md"
tail -n 1 "$out/$name-transformers.md"
