#!/usr/bin/env bash
# Throughput of 1 vs 2 `recall serve` replicas behind sglang-router, same load (docs/SCALING.md).
#
#   tools/bench_replicas.sh MODEL [THREADS_PER_REPLICA] [LOADGEN ARGS...]
#
# Starts replicas on loopback (RAYON_NUM_THREADS=THREADS_PER_REPLICA each, default: all cores), the
# router (`--policy manual --assignment-mode min_group`: the episode id in `x-smg-routing-key` pins an
# episode to one replica), and runs the same `recall loadgen` through it with one replica, then two;
# prints loadgen's table for each and the ratio. Needs `cargo build --release` and sglang-router
# (`pip install -r tools/tests/requirements.txt`; ROUTER=path overrides).
set -euo pipefail
model=${1:?usage: tools/bench_replicas.sh MODEL [THREADS_PER_REPLICA] [LOADGEN ARGS...]}
threads=${2:-$(nproc)}
shift $(( $# >= 2 ? 2 : 1 ))
load=("$@")
[ ${#load[@]} -gt 0 ] || load=(--clients 8 --steps 4 --max-tokens 16 --image-size 160x320)
bin=target/release/recall
router=${ROUTER:-$(command -v sglang-router || echo .venv-ci/bin/sglang-router)}
tmp=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$tmp"; }
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

start_replica() {  # name -> sets url (not in a subshell: pids must keep the replica)
  local port; port=$(free_port)
  RAYON_NUM_THREADS=$threads RUST_LOG=recall=warn "$bin" serve --model "$model" --backend cpu \
    --port "$port" --replica-id "$1" --served-model-name bench >"$tmp/$1.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 600); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.2; done
  url="http://127.0.0.1:$port"
}

run() {  # label n -> loadgen through a fresh router over n fresh replicas (no prefix cached before)
  local label=$1 n=$2 urls=() first=${#pids[@]}
  for i in $(seq "$n"); do start_replica "$label-$i"; urls+=("$url"); done
  set -- "${urls[@]}"
  local port; port=$(free_port)
  "$router" launch --host 127.0.0.1 --port "$port" --policy manual --assignment-mode min_group \
    --prometheus-host 127.0.0.1 --prometheus-port "$(free_port)" --log-level warn --worker-urls "$@" \
    >"$tmp/router-$label.log" 2>&1 &
  local rpid=$!
  for _ in $(seq 300); do
    [ "$(curl -sf "http://127.0.0.1:$port/workers" | python3 -c 'import json,sys; print(sum(w["is_healthy"] for w in json.load(sys.stdin)["workers"]))' 2>/dev/null)" = "$#" ] && break
    sleep 0.2
  done
  "$bin" loadgen --url "http://127.0.0.1:$port" --model bench --label "$label" --json "$tmp/$label.json" "${load[@]}"
  kill "$rpid"
  for p in "${pids[@]:$first}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
}

echo "model $model, $threads threads per replica, load: ${load[*]}"
run one-replica 1
run two-replicas 2
python3 - "$tmp/one-replica.json" "$tmp/two-replicas.json" <<'EOF'
import json, sys
one, two = (json.load(open(p)) for p in sys.argv[1:])
print(f"\n| replicas | req/s | out tok/s | E2E p50 ms | prefix hit | episodes on one replica |\n|---|---|---|---|---|---|")
for n, r in ((1, one), (2, two)):
    hit = r["prefix_cache_hit_rate"]
    print(f"| {n} | {r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.1f} | {r['e2e']['p50_ms']:.0f} | "
          f"{hit * 100 if hit is not None else float('nan'):.1f}% | {r['episodes_on_one_replica']} of {r['clients']} |")
print(f"\n2 / 1 replicas: {two['requests_per_s'] / one['requests_per_s']:.2f}x requests/s")
EOF
