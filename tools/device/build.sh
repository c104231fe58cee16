#!/usr/bin/env bash
# Builds, here, the test binaries that tools/device/check.sh runs on the GPU machine (which has CUDA but
# no Rust toolchain), and copies them into .device-bin/ (git-ignored; name it in the device tool's
# `carry`). Release profile by default (`cargo test --release --no-run`); RECALL_DEVICE_PROFILE=dev uses
# the test profile instead (faster to build, slower to run).
#
#   tools/device/build.sh            # then: device run, carry [".device-bin"], command tools/device/check.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
out=.device-bin
profile=${RECALL_DEVICE_PROFILE:-release}
flags=()
[ "$profile" = release ] && flags+=(--release)
[ "$(uname -m)" = x86_64 ] || { echo "build.sh: the device is x86-64; this machine is $(uname -m)" >&2; exit 1; }

mkdir -p "$out"
tests=(cuda_ops cuda_flash cuda_decode cuda_fused cuda_graphs cuda_exact kernel_compile)
for t in "${tests[@]}"; do rm -f "$out/$t"; done
cargo test "${flags[@]}" --no-run $(printf -- "--test %s " "${tests[@]}") --message-format=json \
    | python3 -c '
import json, shutil, sys
out = sys.argv[1]
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    exe = m.get("executable")
    if m.get("reason") == "compiler-artifact" and exe and m["target"]["kind"] == ["test"]:
        dst = out + "/" + m["target"]["name"]
        shutil.copy2(exe, dst)
        print(f"{exe} -> {dst}")
' "$out"
# Debug info would take the binaries past the device tool's 64 MiB carry limit.
for t in "${tests[@]}"; do strip --strip-debug "$out/$t"; done
# Compressed: all of .device-bin must stay under the 64 MiB carry limit (check.sh unpacks).
tools/device/pack.sh "${tests[@]}"
# The tests find fixtures through the manifest dir baked in at build time; check.sh links it there.
pwd >"$out/MANIFEST_DIR"
{ git rev-parse HEAD 2>/dev/null || echo unknown; git status --porcelain 2>/dev/null | grep -q . && echo "(dirty)"; } \
    | paste -sd' ' >"$out/COMMIT"
echo "profile $profile, commit $(cat "$out/COMMIT")"
ls -la "$out"
