#!/usr/bin/env bash
# Profile of a short `recall bench` run on the GPU. Default (PROFILER=nsys): Nsight Systems traces the
# run and tools/device/nsys_summary.py writes $OUT/profile-summary.txt, a text summary to commit: the
# top kernels by GPU time and the launch gaps (GPU idle between operations: host work and launch
# overhead). PROFILER=ncu: Nsight Compute with --clock-control none (never change the card's clocks),
# a few metrics per launch (DRAM and SM throughput, tensor-pipe activity), aggregated per kernel.
#
# Here:        tools/device/bench.sh build                  # .device-bin/recall
# Device call: carry [".device-bin"], timeout_s 400, command "bash tools/device/profile.sh"
#
# nsys is searched on the PATH, under the CUDA toolkit and /opt/nvidia. KINDS.md (2026-11-04) saw no
# nsys on the PATH and the copy inside Nsight Compute write a .qdstrm it could not turn into a report;
# the script then tries QdstrmImporter on it and, failing that, says so and exits 3 (rerun with
# PROFILER=ncu).
#
# Env: CONFIG (models/qwen3-vl-8b-instruct) LAYERS (3: the fewest that take the 8B tower's 3 deepstack
#      features) GRID (1x32x32) BUDGET (2) HISTORY (3) RESPONSE (8) SKIP (ncu: launches skipped first,
#      0) COUNT (ncu: launches profiled, 2000) TIMEOUT (s, 360) PROFILER (nsys | ncu)
# Output: $OUT/profile.log; nsys: $OUT/profile.nsys-rep, $OUT/profile_cuda_gpu_trace.csv,
# $OUT/profile-summary.txt (printed last); ncu: $OUT/profile.ncu-rep, $OUT/profile-kernels.csv and the
# per-kernel table (launches, total and mean time, share, DRAM and SM throughput in % of peak,
# tensor-pipe activity). Under ncu every launch is serialised and replayed, so times are per kernel,
# not the bench's wall time; the bench's own numbers under either profiler are not headline numbers.
set -uo pipefail
cd "$(dirname "$0")/../.."
bin=.device-bin
# shellcheck source=tools/device/env.sh
source tools/device/env.sh

CONFIG=${CONFIG:-models/qwen3-vl-8b-instruct}
LAYERS=${LAYERS:-3}
GRID=${GRID:-1x32x32}
BUDGET=${BUDGET:-2}
HISTORY=${HISTORY:-3}
RESPONSE=${RESPONSE:-8}
SKIP=${SKIP:-0}
COUNT=${COUNT:-2000}
TIMEOUT=${TIMEOUT:-360}
PROFILER=${PROFILER:-nsys}
dir=${OUT:-/tmp/recall-profile-out}
mkdir -p "$dir"
log=$dir/profile.log
# shellcheck source=tools/device/unpack.sh
source tools/device/unpack.sh
[ -x "$bin/recall" ] || { echo "missing $bin/recall: run 'tools/device/bench.sh build' here and carry .device-bin" >&2; exit 2; }
weights=/tmp
[ -d /dev/shm ] && weights=/dev/shm
run=("$bin/recall" bench --backend cuda --config-dir "$CONFIG" --layers "$LAYERS" --grid "$GRID"
    --budget "$BUDGET" --history "$HISTORY" --response-tokens "$RESPONSE" --system-tokens 256 --repeats 1
    --quick --weights-dir "$weights")
{
    echo "date:   $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "commit: $(cat "$bin/COMMIT" 2>/dev/null || echo unknown)"
    echo "gpu:    $(nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>&1 | head -1)"
    echo "run:    ${run[*]}"
} | tee "$log"

if [ "$PROFILER" = nsys ]; then
    nsys=$(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems*/*/bin/nsys \
        /opt/nvidia/nsight-compute/*/host/target-linux-x64/nsys 2>/dev/null | head -1)
    [ -n "$nsys" ] || { echo "nsys not found (rerun with PROFILER=ncu)" | tee -a "$log"; exit 3; }
    echo "== $nsys profile --trace=cuda" | tee -a "$log"
    timeout "$TIMEOUT" "$nsys" profile --trace=cuda --sample=none --cpuctxsw=none -o "$dir/profile" \
        --force-overwrite true "${run[@]}" >>"$log" 2>&1
    echo "== nsys exit $?" | tee -a "$log"
    if [ ! -s "$dir/profile.nsys-rep" ] && [ -s "$dir/profile.qdstrm" ]; then
        importer=$(ls "$(dirname "$nsys")"/QdstrmImporter /usr/local/cuda*/bin/QdstrmImporter \
            /opt/nvidia/nsight-*/*/host/*/QdstrmImporter 2>/dev/null | head -1)
        [ -n "$importer" ] && "$importer" -i "$dir/profile.qdstrm" >>"$log" 2>&1
    fi
    [ -s "$dir/profile.nsys-rep" ] || { tail -20 "$log"; echo "no nsys report (rerun with PROFILER=ncu)"; exit 3; }
    "$nsys" stats --report cuda_gpu_trace --format csv --force-export=true --output "$dir/profile" \
        "$dir/profile.nsys-rep" >>"$log" 2>&1
    {
        sed -n 1,4p "$log"
        echo
        python3 tools/device/nsys_summary.py "$dir/profile_cuda_gpu_trace.csv"
    } >"$dir/profile-summary.txt" 2>&1
    cat "$dir/profile-summary.txt"
    exit 0
fi

ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
[ -n "$ncu" ] || { echo "ncu not found" | tee -a "$log"; exit 2; }
metrics=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
echo "== $ncu --clock-control none --launch-skip $SKIP --launch-count $COUNT --metrics ..." | tee -a "$log"
timeout "$TIMEOUT" "$ncu" --clock-control none --launch-skip "$SKIP" --launch-count "$COUNT" \
    --metrics "$metrics" -o "$dir/profile" -f "${run[@]}" >>"$log" 2>&1
echo "== ncu exit $?" | tee -a "$log"
[ -s "$dir/profile.ncu-rep" ] || { tail -30 "$log"; exit 1; }
"$ncu" --import "$dir/profile.ncu-rep" --page raw --csv --metrics "$metrics" >"$dir/profile-kernels.csv" 2>>"$log"

python3 - "$dir/profile-kernels.csv" <<'EOF'
import csv, sys
from collections import defaultdict

rows = list(csv.reader(open(sys.argv[1])))
if len(rows) < 3:
    sys.exit("no kernel rows in the ncu export")
head = rows[0]
col = {name: i for i, name in enumerate(head)}
def val(r, m):
    try:
        return float(r[col[m]].replace(",", ""))
    except (KeyError, ValueError, IndexError):
        return None
agg = defaultdict(lambda: {"n": 0, "ns": 0.0, "dram": [], "sm": [], "tc": []})
for r in rows[2:]:  # row 1 holds the units
    name = r[col.get("Kernel Name", col.get("Function Name", 0))]
    a = agg[name[:60]]
    a["n"] += 1
    t = val(r, "gpu__time_duration.sum")
    a["ns"] += t or 0.0
    for k, m in (("dram", "dram__throughput.avg.pct_of_peak_sustained_elapsed"),
                 ("sm", "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
                 ("tc", "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active")):
        v = val(r, m)
        if v is not None:
            a[k].append(v)
unit = rows[1][col["gpu__time_duration.sum"]] if "gpu__time_duration.sum" in col else "ns"
scale = {"ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0, "nsecond": 1e-6}.get(unit, 1e-6)
total = sum(a["ns"] for a in agg.values()) or 1.0
mean = lambda v: sum(v) / len(v) if v else float("nan")
print(f"\n{'kernel':60} {'launches':>8} {'total ms':>9} {'mean us':>9} {'share':>6} {'DRAM%':>6} {'SM%':>6} {'TC%':>6}")
for name, a in sorted(agg.items(), key=lambda kv: -kv[1]["ns"]):
    ms = a["ns"] * scale
    print(f"{name:60} {a['n']:>8} {ms:>9.3f} {ms / a['n'] * 1e3:>9.1f} {a['ns'] / total:>6.1%} "
          f"{mean(a['dram']):>6.1f} {mean(a['sm']):>6.1f} {mean(a['tc']):>6.1f}")
print(f"{'all':60} {sum(a['n'] for a in agg.values()):>8} {total * scale:>9.3f}")
EOF
