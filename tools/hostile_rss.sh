#!/usr/bin/env bash
# Peak RSS of `recall` refusing the hostile inputs of docs/RELIABILITY.md ("Resource limits"): builds
# each input in a temporary directory, runs the CLI on it under GNU time, and prints the exit status,
# the peak RSS and the error line. Needs target/release/recall (cargo build --release), python3 and
# /usr/bin/time (Debian package `time`).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=target/release/recall
tiny=tests/fixtures/tiny-qwen3-vl
t=$(mktemp -d)
trap 'rm -rf "$t"' EXIT

python3 - "$t" <<'EOF'
import json, os, shutil, struct, sys, zlib
t = sys.argv[1]
def chunk(kind, data):
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
# A ~1 KB PNG whose IHDR declares 100000x100000 RGB pixels.
ihdr = struct.pack(">IIBBBBB", 100000, 100000, 8, 2, 0, 0, 0)
png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(bytes(1000), 0)) + chunk(b"IEND", b"")
open(f"{t}/bomb.png", "wb").write(png)
json.dump([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"{t}/bomb.png"}},
                                        {"type": "text", "text": "hi"}]}], open(f"{t}/bomb-chat.json", "w"))
# A model whose model.safetensors says its header is 2^60 bytes long.
shutil.copytree("tests/fixtures/tiny-qwen3-vl", f"{t}/header-2p60")
open(f"{t}/header-2p60/model.safetensors", "wb").write(struct.pack("<Q", 1 << 60) + b"{}")
# 10 MB of [[[...]]] as a messages file and as config.json.
nested = "[" * (5 << 20) + "]" * (5 << 20)
open(f"{t}/nested-chat.json", "w").write(nested)
shutil.copytree("tests/fixtures/tiny-qwen3-vl", f"{t}/nested-config")
open(f"{t}/nested-config/config.json", "w").write(nested)
# A sharded model whose index sends one tensor to ../x.safetensors.
shutil.copytree("tests/fixtures/tiny-qwen3-vl-sharded", f"{t}/traversal")
idx = json.load(open(f"{t}/traversal/model.safetensors.index.json"))
first = sorted(idx["weight_map"])[0]
idx["weight_map"][first] = "../x.safetensors"
json.dump(idx, open(f"{t}/traversal/model.safetensors.index.json", "w"))
EOF

run() {
    local name=$1
    shift
    local rc=0
    /usr/bin/time -v "$@" >"$t/out" 2>"$t/err" || rc=$?
    local rss wall
    rss=$(sed -n 's/.*Maximum resident set size (kbytes): //p' "$t/err")
    wall=$(sed -n 's/.*Elapsed (wall clock) time (h:mm:ss or m:ss): //p' "$t/err")
    printf '%-16s rc=%s  peak RSS %6s KB  wall %s\n    %s\n' "$name" "$rc" "$rss" "$wall" \
        "$(grep -m1 '^error' "$t/err" | sed "s|$t|\$T|g" || true)"
}

gen=(generate --backend cpu --max-tokens 1)
run baseline "$bin" "${gen[@]}" --model "$tiny" --prompt hi
run png-bomb "$bin" "${gen[@]}" --model "$tiny" --messages "$t/bomb-chat.json"
run header-2^60 "$bin" "${gen[@]}" --model "$t/header-2p60" --prompt hi
run nested-messages "$bin" "${gen[@]}" --model "$tiny" --messages "$t/nested-chat.json"
run nested-config "$bin" "${gen[@]}" --model "$t/nested-config" --prompt hi
run index-../ "$bin" "${gen[@]}" --model "$t/traversal" --tokenizer "$tiny/tokenizer.json" --prompt hi
