#!/usr/bin/env bash
# The one script to run on the H200 through the device tool, over binaries built here by
# tools/device/build.sh and carried in .device-bin/:
#
#   device run: carry [".device-bin"], timeout_s 540, command "bash tools/device/check.sh"
#
# Runs: the NVRTC compile of every kernel for the device, op parity (CUDA vs CPU), the tiny fixture
# models on CUDA vs HF, the HGKV bypass bitwise check, the v2 kernels (flash prefill and vision
# attention, decode attention, fused qk-norm/rope/KV write) against the CPU and v1, and decode-step
# CUDA graphs bitwise against direct runs, and the engine's exactness in batch-invariant mode; prints
# a short table last. The full log goes to
# $OUT/device-check.log (copy it to docs/ with the date, commit and GPU printed at the top).
set -uo pipefail
cd "$(dirname "$0")/../.."
bin=.device-bin
cuda=${CUDA_HOME:-/usr/local/cuda-13.0}/targets/x86_64-linux
export RECALL_CUDA_LIB_DIR=${RECALL_CUDA_LIB_DIR:-$cuda/lib}
export RECALL_CUDA_INCLUDE=${RECALL_CUDA_INCLUDE:-$cuda/include}
export RECALL_NVRTC_LIB=${RECALL_NVRTC_LIB:-$RECALL_CUDA_LIB_DIR}
export RECALL_KERNEL_CACHE=${RECALL_KERNEL_CACHE:-/tmp/recall-kernels}
export LD_LIBRARY_PATH=$RECALL_CUDA_LIB_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
dir=${OUT:-/tmp}
log=$dir/device-check.log
: >"$log"
# shellcheck source=tools/device/unpack.sh
source tools/device/unpack.sh

for f in cuda_ops cuda_flash cuda_decode cuda_fused cuda_graphs cuda_exact kernel_compile MANIFEST_DIR; do
    [ -e "$bin/$f" ] || { echo "missing $bin/$f: run tools/device/build.sh here and carry .device-bin" >&2; exit 2; }
done
# Fixtures are found through the manifest dir baked into the binaries: make it point here.
manifest=$(cat "$bin/MANIFEST_DIR")
if [ "$manifest" != "$PWD" ] && [ ! -e "$manifest/tests/fixtures" ]; then
    mkdir -p "$(dirname "$manifest")" && ln -sfn "$PWD" "$manifest"
fi

{
    echo "date:   $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "commit: $(cat "$bin/COMMIT" 2>/dev/null || echo unknown)"
    echo "gpu:    $(nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader 2>&1 | head -1)"
    echo "cuda:   $RECALL_CUDA_LIB_DIR"
} | tee -a "$log"

results=()
step() {
    local name=$1 limit=$2
    shift 2
    local t0 status part
    part=$(mktemp)
    t0=$(date +%s)
    echo "== $name: $*" >>"$log"
    if timeout "$limit" "$@" >"$part" 2>&1; then status=PASS; else status="FAIL($?)"; fi
    if [ "$status" = PASS ] && grep -q 'SKIP' "$part"; then status=SKIPPED; fi
    cat "$part" >>"$log"
    results+=("$(printf '%-28s %-9s %5ss' "$name" "$status" $(( $(date +%s) - t0 )))")
    rm -f "$part"
}

step "kernel compile (sm_90)" 120 "$bin/kernel_compile" --nocapture
step "op parity" 300 "$bin/cuda_ops" --nocapture --test-threads=1 --skip models::
step "fixture models vs HF" 180 "$bin/cuda_ops" --nocapture --test-threads=1 models::tiny
step "HGKV bypass bitwise" 120 "$bin/cuda_ops" --nocapture --test-threads=1 models::hgkv_bypass
step "flash prefill/vision attn" 180 "$bin/cuda_flash" --nocapture --test-threads=1
step "decode attention v2" 180 "$bin/cuda_decode" --nocapture --test-threads=1
step "fused qk-norm/rope/KV" 120 "$bin/cuda_fused" --nocapture --test-threads=1
step "decode graphs bitwise" 120 "$bin/cuda_graphs" --nocapture --test-threads=1
step "batch-invariant exactness" 120 "$bin/cuda_exact" --nocapture --test-threads=1

echo
echo "---- per-case errors (full log: $log)"
grep -E 'rel err|bitwise|CUBIN for|SKIP|panicked|mismatch|plans cached' "$log" | tail -n 120
echo
echo "---- summary"
printf '%s\n' "${results[@]}"
printf '%s\n' "${results[@]}" | grep -qv ' PASS ' && exit 1
exit 0
