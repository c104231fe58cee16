#!/usr/bin/env bash
# The one script to run on the H200 through the device tool, over binaries built here by
# tools/device/build.sh and carried in .device-bin/:
#
#   device run: carry [".device-bin"], timeout_s 540, command "bash tools/device/check.sh"
#
# Fits one run of at most 9 minutes: the step limits below sum to 480 s, leaving a minute for unpacking
# the binaries and the tool's own start. Newest kernels first, so that a run cut short still says the
# most about the code least seen on a device: decode attention v2, flash prefill/vision attention (with
# the v1 kernels against the CPU), the fused qk-norm/rope/KV write, decode-step CUDA graphs, exactness
# in batch-invariant mode, then op parity, the fixture models against HF and the HGKV bypass. The
# first step only builds the kernels (NVRTC -> CUBIN) into the kernel cache, which every later test
# binary reuses (the cache key is the source, options and NVRTC version, the same in every binary),
# so no step pays the compile again. (tests/kernel_compile.rs, the compile without a GPU, is CI's.)
#
# The full log goes to $OUT/device-check.log (date, commit, GPU at the top; commit it under docs/);
# the last screen printed is the summary table.
set -uo pipefail
cd "$(dirname "$0")/../.."
bin=.device-bin
# shellcheck source=tools/device/env.sh
source tools/device/env.sh
dir=${OUT:-/tmp}
log=$dir/device-check.log
: >"$log"
# shellcheck source=tools/device/unpack.sh
source tools/device/unpack.sh

for f in cuda_ops cuda_flash cuda_decode cuda_fused cuda_graphs cuda_exact MANIFEST_DIR; do
    [ -e "$bin/$f" ] || { echo "missing $bin/$f: run tools/device/build.sh here and carry .device-bin" >&2; exit 2; }
done
# Fixtures are found through the manifest dir baked into the binaries: make it point here.
manifest=$(cat "$bin/MANIFEST_DIR")
if [ "$manifest" != "$PWD" ] && [ ! -e "$manifest/tests/fixtures" ]; then
    mkdir -p "$(dirname "$manifest")" && ln -sfn "$PWD" "$manifest"
fi
mkdir -p "$RECALL_KERNEL_CACHE"

header=(
    "date:   $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    "commit: $(cat "$bin/COMMIT" 2>/dev/null || echo unknown)"
    "gpu:    $(nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader 2>&1 | head -1)"
    "cuda:   $RECALL_CUDA_LIB_DIR; kernel cache $RECALL_KERNEL_CACHE"
)
printf '%s\n' "${header[@]}" | tee -a "$log"

results=()
budget=0
# step NAME LIMIT_S COMMAND...: runs COMMAND under a timeout, appends its output to the log and one
# line to the summary: status, seconds used of the limit, the test counts and the first failing test.
step() {
    local name=$1 limit=$2
    shift 2
    budget=$((budget + limit))
    local t0 status part counts failed
    part=$(mktemp)
    t0=$(date +%s)
    echo "== $name (limit ${limit}s): $*" >>"$log"
    if timeout --kill-after=5 "$limit" "$@" >"$part" 2>&1; then status=PASS; else status="FAIL($?)"; fi
    if [ "$status" = PASS ] && grep -q 'SKIP' "$part"; then status=SKIPPED; fi
    cat "$part" >>"$log"
    counts=$(grep -oE '[0-9]+ passed; [0-9]+ failed' "$part" | awk '{p += $1; f += $3} END {if (NR) printf "%d passed, %d failed", p, f}')
    failed=$(grep -E '^test .* \.\.\. FAILED$' "$part" | head -1 | sed -E 's/^test (.*) \.\.\. FAILED$/\1/')
    results+=("$(printf '%-28s %-9s %4ss/%-4s %-22s %s' "$name" "$status" $(($(date +%s) - t0)) "$limit" "${counts:--}" "$failed")")
    rm -f "$part"
}

t=(--nocapture --test-threads=1)
step "kernels: NVRTC -> cache" 90 "$bin/cuda_flash" "${t[@]}" --exact flash_declines_unsupported_shapes_and_rejects_malformed_calls
step "decode attention v2" 90 "$bin/cuda_decode" "${t[@]}"
step "flash + v1 attention" 90 "$bin/cuda_flash" "${t[@]}" --skip flash_declines_unsupported
step "fused qk-norm/rope/KV" 30 "$bin/cuda_fused" "${t[@]}"
step "decode graphs" 40 "$bin/cuda_graphs" "${t[@]}"
step "batch-invariant exactness" 60 "$bin/cuda_exact" "${t[@]}"
step "op parity (+ v1 attention)" 60 "$bin/cuda_ops" "${t[@]}" --skip models::
step "fixture models vs HF" 40 "$bin/cuda_ops" "${t[@]}" models::tiny
step "HGKV bypass bitwise" 30 "$bin/cuda_ops" "${t[@]}" models::hgkv_bypass

cubins=$(find "$RECALL_KERNEL_CACHE" -name '*.cubin' 2>/dev/null | wc -l)
{
    echo
    echo "---- per-case lines: grep -E 'err|bitwise|SKIP|panicked|mismatch' $log"
    echo "---- summary (step limits sum to ${budget}s; kernel cache: $cubins CUBIN files, one per kernel file if every binary reused the first build)"
    printf '%s\n' "${header[@]:1:2}"
    printf '%-28s %-9s %10s %-22s %s\n' step status "used/limit" tests "first failure"
    printf '%s\n' "${results[@]}"
} | tee -a "$log"
printf '%s\n' "${results[@]}" | grep -qv ' PASS ' && exit 1
exit 0
