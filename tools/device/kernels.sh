#!/usr/bin/env bash
# The kernel benchmark harness on the GPU (docs/KERNELS.md): `recall kernels --backend cuda` validates
# every op case and kernel version against the CPU twin, then times each with a 256 MiB L2 flush before
# every run, against the H200's roofline (4200 GB/s, 790 TFLOP/s bf16).
#
# Here (no GPU needed):  tools/device/bench.sh build       # release `recall` binary -> .device-bin/recall
# Device call:          carry [".device-bin"], timeout_s 420, command "bash tools/device/kernels.sh"
#
# Env: CASES (all: parity + perf; parity | perf)  OPS (comma list, default every op)  ITERS (20)
#      WARMUP (3)  TIMEOUT (s, 360)  EXTRA (more flags for recall kernels)
# Output: $OUT/kernels.log (everything), $OUT/kernels.json (every row), $OUT/kernels.txt (the whole
# table), $OUT/kernels-summary.txt (printed last: the perf cases, the slowest parity rows by share of
# the roofline, and the validation count). The first run compiles the kernels with NVRTC into
# RECALL_KERNEL_CACHE (about a minute); the parity cases' CPU twins take seconds on 16 cores, the perf
# cases' about a second each.
set -uo pipefail
cd "$(dirname "$0")/../.."
bin=.device-bin
# shellcheck source=tools/device/env.sh
source tools/device/env.sh

CASES=${CASES:-all}
OPS=${OPS:-}
ITERS=${ITERS:-20}
WARMUP=${WARMUP:-3}
TIMEOUT=${TIMEOUT:-360}
dir=${OUT:-/tmp/recall-kernels-out}
mkdir -p "$dir" "$RECALL_KERNEL_CACHE"
log=$dir/kernels.log
# shellcheck source=tools/device/unpack.sh
source tools/device/unpack.sh
[ -x "$bin/recall" ] || { echo "missing $bin/recall: run 'tools/device/bench.sh build' here and carry .device-bin" >&2; exit 2; }

cmd=("$bin/recall" kernels --backend cuda --cases "$CASES" --iters "$ITERS" --warmup "$WARMUP"
    --json "$dir/kernels.json")
[ -n "$OPS" ] && cmd+=(--ops "$OPS")
# shellcheck disable=SC2206
[ -n "${EXTRA:-}" ] && cmd+=($EXTRA)
{
    echo "date:   $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "commit: $(cat "$bin/COMMIT" 2>/dev/null || echo unknown)"
    echo "gpu:    $(nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>&1 | head -1)"
    echo "run:    ${cmd[*]}"
} | tee "$log"
t0=$(date +%s)
timeout "$TIMEOUT" "${cmd[@]}" >"$dir/kernels.txt" 2>>"$log"
rc=$?
cat "$dir/kernels.txt" >>"$log"
echo "== recall kernels: exit $rc after $(( $(date +%s) - t0 )) s" | tee -a "$log"
[ "$rc" = 0 ] || grep -E "FAILED|failed|error|Error" "$log" | head -20

python3 - "$dir/kernels.json" "$rc" <<'EOF' | tee "$dir/kernels-summary.txt"
import json, sys

try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    sys.exit(f"no kernels.json ({e}); recall exited {sys.argv[2]}: see kernels.log")
roof = r.get("roofline") or {}
print(f"{r['backend']}: roofline {roof.get('gbs', 0):.0f} GB/s, {roof.get('tflops', 0):.1f} TFLOP/s "
      f"({roof.get('source', '-')}); {r['flush_bytes'] >> 20} MiB flush, {r['iters']} runs after {r['warmup']} warm-up")

def show(rows, title):
    print(f"\n{title}")
    print(f"{'op':19} {'version':15} {'case':40} {'max err':>8} {'med ms':>9} {'GB/s':>7} {'TFLOP/s':>8} {'bound':>5} {'% roof':>6}")
    for x in rows:
        t = x["timing"] or {}
        tf = f"{t.get('tflops', 0):8.1f}" if x["flops"] > 0 else f"{'-':>8}"
        print(f"{x['op'][:19]:19} {x['version'][:15]:15} {x['case'][:40]:40} {x['max_err']:8.1e} "
              f"{t.get('median_ms', 0):9.4f} {t.get('gbs', 0):7.0f} {tf} {t.get('bound', '-'):>5} {t.get('roofline_pct', 0):6.1f}")

rows = r["rows"]
perf = [x for x in rows if x["perf"]]
if perf:
    show(perf, "perf cases (Qwen3-VL-8B shapes):")
parity = sorted((x for x in rows if not x["perf"] and x["timing"]), key=lambda x: -x["timing"]["median_ms"])
show(parity[:12], "parity cases, the 12 slowest:")
worst = max((x["max_err"] / x["bound"] for x in rows if x["bound"] > 0), default=0)
print(f"\nvalidated {len(rows)} (case, version) pairs against the CPU twin (largest error {100 * worst:.0f}% "
      f"of its bound); {r['not_applicable']} not applicable; {len(r['failures'])} FAILED")
for f in r["failures"][:10]:
    print("  FAILED:", f[:200])
EOF
exit "$rc"
