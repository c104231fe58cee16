#!/usr/bin/env python3
"""Text summary of an Nsight Systems GPU trace, short enough to commit (tools/device/profile.sh).

Input: the CSV of `nsys stats --report cuda_gpu_trace --format csv` (one row per kernel, memcpy and
memset on the GPU, with its start and duration in ns). Output, on stdout:

* the top kernels by total GPU time: launches, total ms, share of all GPU time, mean us;
* launch gaps: over the trace's span, the time the GPU ran nothing between one operation's end and
  the next one's start (host work and launch overhead, what CUDA graphs remove), as percentiles, the
  number and total of gaps over a threshold, and the largest gaps with the operations around them.

Standard library only. Usage: nsys_summary.py TRACE.csv [--top N] [--gap-us US]
"""
import argparse
import csv
import sys
from collections import defaultdict


def column(head, prefix):
    for i, name in enumerate(head):
        if name.strip().startswith(prefix):
            return i
    sys.exit(f"no '{prefix}' column in the trace header: {head}")


def read_ops(path):
    """(start ns, duration ns, name) of every GPU operation, sorted by start."""
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    head_at = next((i for i, r in enumerate(rows) if any(c.strip().startswith("Start") for c in r)), None)
    if head_at is None:
        sys.exit(f"{path}: no header row with a 'Start' column")
    head = rows[head_at]
    s, d, n = column(head, "Start"), column(head, "Duration"), column(head, "Name")
    ops = []
    for r in rows[head_at + 1:]:
        try:
            ops.append((float(r[s].replace(",", "")), float(r[d].replace(",", "")), r[n]))
        except (ValueError, IndexError):
            continue
    return sorted(ops)


def percentile(sorted_vals, q):
    if not sorted_vals:
        return 0.0
    return sorted_vals[min(len(sorted_vals) - 1, int(q * (len(sorted_vals) - 1) + 0.5))]


def kernel_table(ops, top):
    agg = defaultdict(lambda: [0, 0.0])
    for _, dur, name in ops:
        agg[name][0] += 1
        agg[name][1] += dur
    busy = sum(a[1] for a in agg.values()) or 1.0
    lines = [f"{'operation':60} {'launches':>8} {'total ms':>9} {'share':>6} {'mean us':>8}"]
    ranked = sorted(agg.items(), key=lambda kv: -kv[1][1])
    for name, (n, ns) in ranked[:top]:
        lines.append(f"{name[:60]:60} {n:>8} {ns / 1e6:>9.3f} {ns / busy:>6.1%} {ns / n / 1e3:>8.1f}")
    rest = ranked[top:]
    if rest:
        ns = sum(a[1] for _, a in rest)
        lines.append(f"{f'({len(rest)} more)':60} {sum(a[0] for _, a in rest):>8} {ns / 1e6:>9.3f} {ns / busy:>6.1%}")
    return lines


def gap_lines(ops, gap_us, top=5):
    """Idle time between consecutive operations (overlapping ones leave no gap)."""
    gaps, end, prev = [], None, None
    for start, dur, name in ops:
        if end is not None and start > end:
            gaps.append((start - end, prev, name))
        if end is None or start + dur > end:
            end, prev = start + dur, name
    span = (ops[-1][0] + ops[-1][1] - ops[0][0]) if ops else 0.0
    idle = sum(g for g, _, _ in gaps)
    us = sorted(g / 1e3 for g, _, _ in gaps)
    big = [g for g in us if g > gap_us]
    lines = [
        f"span {span / 1e6:.3f} ms, GPU busy {(span - idle) / 1e6:.3f} ms, idle in gaps {idle / 1e6:.3f} ms "
        f"({idle / span if span else 0:.1%}); {len(ops)} operations, {len(gaps)} gaps",
        f"gap us: p50 {percentile(us, 0.5):.1f}, p90 {percentile(us, 0.9):.1f}, p99 {percentile(us, 0.99):.1f}, "
        f"max {us[-1] if us else 0:.1f}; {len(big)} gaps over {gap_us:g} us total {sum(big) / 1e3:.3f} ms",
    ]
    for g, before, after in sorted(gaps, reverse=True)[:top]:
        lines.append(f"  {g / 1e3:>10.1f} us after {before[:40]} before {after[:40]}")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--gap-us", type=float, default=5.0)
    a = ap.parse_args()
    ops = read_ops(a.trace)
    if not ops:
        sys.exit(f"{a.trace}: no GPU operations")
    print("top GPU operations by total time (nsys cuda_gpu_trace)")
    print("\n".join(kernel_table(ops, a.top)))
    print()
    print("launch gaps (GPU idle between operations)")
    print("\n".join(gap_lines(ops, a.gap_us)))


if __name__ == "__main__":
    main()
