#!/usr/bin/env python3
"""Synthetic utility labels from a known scorer, for `recall selector train` (tests/selector_train.rs).

Writes label lines in the format of `recall episode label` (docs/FORMATS.md "Utility labels"): per
decision a `decision` line with the selector's view (events with image hashes, the action bucket and
point after each, witness flags against the decision's reference action), then Q(S) for the empty
set, the Recent-B anchors (B = 1, 2), every singleton and the beam-teacher pairs (shortlist the top 6
singletons, beam 3) — the sets `recall episode label --budgets 1,2` scores.

The known utility: each event j of decision t has a value
    u(j) = 0.6·witness + 0.4·exp(−(age − 1)/2) + 0.15·[type] − 0.1·[scroll],   age = t − j,
and a set is worth Q(S) = Q0(t) + Σ over the distinct screenshots in S of the best u among the
members showing it (a repeated screenshot adds nothing). Every implied marginal Δ(j | S) is therefore
a function of the selector's features (age, witness, action type, duplicate_of_set_member), so a good
trainer ranks held-out candidates almost perfectly.

    python3 tools/gen_selector_synth.py            # tests/fixtures/selector-train/synthetic.jsonl
    python3 tools/gen_selector_synth.py --out F --episodes 20 --seed 7
No dependencies beyond the standard library; the output is a pure function of the arguments.
"""

import argparse
import json
import math
import os
import random

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUCKETS = ["click", "type", "key", "scroll", "other"]
WEIGHTS = [0.5, 0.15, 0.1, 0.15, 0.1]
MADE_WITH = {"model": "synthetic", "generator": "tools/gen_selector_synth.py"}


def episode_events(rng, steps):
    """Per step: (image hash, bucket, point or None); a fifth of the screens repeat an earlier one."""
    events = []
    for s in range(1, steps + 1):
        if events and rng.random() < 0.2:
            image = rng.choice(events)[0]
        else:
            image = rng.getrandbits(64)
        bucket = rng.choices(BUCKETS, WEIGHTS)[0]
        point = [float(rng.randrange(1000)), float(rng.randrange(1000))] if bucket == "click" else None
        events.append((image, bucket, point))
    return events


def witness(action, reference):
    """Equivalent actions: same bucket and, for clicks, within 25 on the grid."""
    (_, b, p), (rb, rp) = action, reference
    if b != rb:
        return False
    return p is None or rp is None or math.hypot(p[0] - rp[0], p[1] - rp[1]) <= 25


def value(t, j, ev, wit):
    age = t - j
    return (0.6 * wit + 0.4 * math.exp(-(age - 1) / 2) + 0.15 * (ev[1] == "type")
            - 0.1 * (ev[1] == "scroll"))


def q_of(t, subset, events, values):
    best = {}
    for j in subset:
        h = events[j - 1][0]
        best[h] = max(best.get(h, -1e9), values[j])
    return round(-2.0 - 0.01 * t + sum(best.values()), 12)


def decision_lines(name, t, events, rng):
    past = events[: t - 1]
    if rng.random() < 0.6:
        _, b, p = rng.choice(past)
        reference = (b, p)
    else:
        b = rng.choices(BUCKETS, WEIGHTS)[0]
        reference = (b, [float(rng.randrange(1000)), float(rng.randrange(1000))] if b == "click" else None)
    wit = {j: witness(past[j - 1], reference) for j in range(1, t)}
    values = {j: value(t, j, past[j - 1], wit[j]) for j in range(1, t)}
    context = {
        "reference_point": reference[1],
        "events": [{"step": j, "image_hash": "%016x" % past[j - 1][0], "next_bucket": past[j - 1][1],
                    "next_point": past[j - 1][2], "witness": wit[j]} for j in range(1, t)],
    }
    lines = [{"episode": name, "t": t, "kind": "decision", "context": context, "made_with": MADE_WITH}]

    def label(kind, subset):
        lines.append({"episode": name, "t": t, "kind": kind, "set": subset,
                      "q": q_of(t, subset, events, values), "made_with": MADE_WITH})

    anchors = []
    for b in (0, 1, 2):
        window = list(range(max(1, t - b), t))
        if window not in anchors:
            anchors.append(window)
    singles = [[j] for j in range(1, t)]
    for s in singles:
        label("singleton", s)
    for a in anchors:
        label("recent", a)
    ranked = sorted(range(1, t), key=lambda j: -q_of(t, [j], events, values))
    shortlist = ranked[:6]
    children = []
    for parent in shortlist[:3]:
        for c in shortlist:
            child = sorted({parent, c})
            if len(child) == 2 and child not in children:
                children.append(child)
    for c in children:
        label("beam", c)
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "fixtures", "selector-train", "synthetic.jsonl"))
    ap.add_argument("--episodes", type=int, default=20)
    ap.add_argument("--seed", type=int, default=2026)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    out = []
    for e in range(a.episodes):
        steps = rng.randrange(6, 11)
        events = episode_events(rng, steps)
        for t in range(3, steps + 1):
            out.extend(decision_lines("synthetic-%02d" % e, t, events, rng))
    with open(a.out, "w") as f:
        for line in out:
            f.write(json.dumps(line, separators=(",", ":")) + "\n")
    print("wrote %d lines to %s" % (len(out), a.out))


if __name__ == "__main__":
    main()
