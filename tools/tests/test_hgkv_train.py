"""tools/hgkv_train.py: the DiD objective and group mining on hand-made values, and a short training run
on the tiny Qwen3-VL with utility labels of tests/fixtures/episode-sample made by the recall binary:

* the training objective falls and the drift terms stay within the cap (|A_r|, |A_n| <= 0.02 + 0.005
  slack on every training group of the exported checkpoint; the cap is a hinge penalty, not a hard
  constraint, so a step may overshoot it slightly);
* the exported PEFT directory loads in PEFT with the same tensors, and `recall logits` on it gives, on a
  prompt with two history screenshots, ungated logits equal to PEFT's and gated logits equal to the
  trainer's own gated forward (max abs difference <= 1e-4);
* with no history image (B = 0) the trainer's gated forward is the frozen model bit for bit;
* the trainer's frozen arm scores equal recall's labels (same prompts, same tokens);
* the paper's group mining (`--groups paper`) on worked examples built from the paper's sentence (the
  utility rule picks other frames on the same decision), its age boundary, ties and empty cases, and on
  the decision lines of a recall label file;
* the per-budget dev gates (a checkpoint fails when one budget fails although the pooled numbers pass),
  the decision-level bootstrap (a decision's groups are drawn together), the checkpoint choice, and the
  fact that a uniform shift of the adapter-on arms is not cancelled by the gain hinge [m - A_c]+.

The training run uses `--groups utility`: episode-sample repeats no action, so it has no witness and the
paper's rule mines no group from it.

RECALL_BIN names the recall binary (default target/release/recall); tests/hgkv_train.rs sets it.

    RECALL_BIN=target/release/recall .venv-tools/bin/python -m pytest -q tools/tests/test_hgkv_train.py
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import hgkv_train as H  # noqa: E402

MODEL = os.path.join(ROOT, "tests", "fixtures", "tiny-qwen3-vl")
EPISODE = os.path.join(ROOT, "tests", "fixtures", "episode-sample")
SLACK = 0.005


def recall_bin():
    path = os.environ.get("RECALL_BIN") or os.path.join(ROOT, "target", "release", "recall")
    if not os.path.isfile(path):
        pytest.skip(f"no recall binary at {path} (set RECALL_BIN or `cargo build --release`)")
    return path


# ---------------------------------------------------------------------------------------------- objective


def arms(a_c, a_r, a_n):
    """Arm scores with the given adapter effects (frozen scores arbitrary)."""
    return {"R0": -2.0, "RA": -2.0 + a_r, "S0": -1.0, "SA": -1.0 + a_c, "W0": -3.0, "WA": -3.0 + a_n}


@pytest.mark.parametrize("a_c, a_r, a_n, want", [
    (0.0, 0.0, 0.0, 3 * 0.01),                       # untrained: the three hinges at m
    (0.005, 0.0, 0.0, 3 * 0.005),                    # A_c half the margin
    (0.05, 0.01, -0.03, 2 * (0.03 - 0.02)),          # hinges satisfied; wrong drift 0.01 over the cap
    (0.02, 0.03, 0.0, (0.01 + 0.01) + 2 * 0.01),     # A_c - A_r = -0.01: 0.02 hinge; recent drift 0.01 over
    (0.04, -0.025, 0.035, 0.005 + 2 * (0.005 + 0.015)),  # A_c - A_n = 0.005; both drift caps bind
    (-0.01, 0.0, 0.0, 0.02 + 0.02 + 0.02),           # harmful use of the relevant frame
])
def test_group_loss_on_hand_computed_arms(a_c, a_r, a_n, want):
    got = H.group_loss(arms(a_c, a_r, a_n)).item()
    assert got == pytest.approx(want, abs=1e-12)
    assert H.did_terms(arms(a_c, a_r, a_n)) == pytest.approx((a_c, a_r, a_n), abs=1e-12)


def test_group_loss_gradients_point_the_right_way():
    leaves = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in arms(-0.04, 0.03, -0.025).items()}
    H.group_loss(leaves).backward()
    # dL/dl_SA = -3 (three active hinges), dL/dl_RA = +1 (DiD hinge) + 2 (drift above the cap),
    # dL/dl_WA = +1 (DiD hinge) - 2 (drift below -cap); the frozen arms mirror them.
    assert leaves["SA"].grad.item() == pytest.approx(-3.0)
    assert leaves["RA"].grad.item() == pytest.approx(3.0)
    assert leaves["WA"].grad.item() == pytest.approx(-1.0)
    assert leaves["S0"].grad.item() == pytest.approx(3.0)


def test_l2_term():
    params = [torch.ones(2, 3), torch.full((4,), 2.0)]
    assert H.l2_term(params).item() == pytest.approx(1e-4 * (6 + 16))


def test_gate_summary():
    rows = [{"did": d, "A_c": d, "A_r": r, "A_n": n, "loss": 0.0}
            for d, r, n in [(0.01, 0.001, -0.002), (0.02, -0.003, 0.001), (0.03, 0.002, 0.0)]]
    s = H.gate_summary(rows, 500, 0, 0.02)
    assert s["did_select"] == pytest.approx(0.02)
    assert 0.01 <= s["did_ci95"][0] < 0.02 < s["did_ci95"][1] <= 0.03
    assert s["abs_A_r"] == pytest.approx(0.002) and s["abs_A_n"] == pytest.approx(0.001)
    assert s["pass"]
    rows[0]["did"] = -0.2  # the mean turns negative
    assert not H.gate_summary(rows, 500, 0, 0.02)["gates"]["did_positive"]
    rows[0]["did"], rows[0]["A_n"] = 0.01, 0.1  # mean |A_n| above eps
    s = H.gate_summary(rows, 500, 0, 0.02)
    assert s["gates"]["did_positive"] and not s["gates"]["abs_A_n_below_eps"] and not s["pass"]


def gate_rows(spec):
    """Scored groups from (episode, t, budget, did, A_r, A_n) (A_c = did + A_r, as evaluate writes it)."""
    return [{"episode": e, "t": t, "budget": b, "did": d, "A_c": d + r, "A_r": r, "A_n": n, "loss": 0.0}
            for e, t, b, d, r, n in spec]


# Pooled, these rows pass every gate; per budget, B = 2 fails one. The paper: "per-B DiD gates all pass".
PER_B_CASES = {
    # B=1: four groups, DiD 0.02 each, no drift. B=2: one group, DiD 0.02 but |A_n| = 0.03 > eps.
    # Pooled mean |A_n| = 0.03 / 5 = 0.006 < 0.02 passes; B=2's own mean |A_n| = 0.03 fails.
    "wrong_drift": ([("a", t, 1, 0.02, 0.0, 0.0) for t in (3, 4, 5, 6)] + [("b", 7, 2, 0.02, 0.0, 0.03)],
                    "abs_A_n_below_eps"),
    # B=1: six groups, DiD 0.02..0.03. B=2: two groups, DiD -0.004 and -0.002 (mean -0.003 < 0).
    # Pooled mean = (0.15 - 0.006) / 8 = 0.018 > 0.
    "did": ([("a", t, 1, 0.02 + 0.002 * i, 0.001, 0.0) for i, t in enumerate(range(3, 9))]
            + [("b", 4, 2, -0.004, 0.001, 0.0), ("b", 9, 2, -0.002, 0.001, 0.0)], "did_positive"),
}


@pytest.mark.parametrize("case", sorted(PER_B_CASES))
def test_per_budget_gate_fails_where_the_pooled_gate_passes(case):
    spec, failing = PER_B_CASES[case]
    rows = gate_rows(spec)
    assert H.gate_summary(rows, 500, 0, 0.02, "decision")["pass"], "the old pooled gate passes"
    s = H.budget_gates(rows, [1, 2], 500, 0, 0.02, "decision")
    assert s["per_budget"]["1"]["pass"] and not s["per_budget"]["2"]["pass"]
    assert not s["per_budget"]["2"]["gates"][failing]
    assert not s["pass"], "one failing budget fails the checkpoint"
    want = {"wrong_drift": (0.02, 0.006), "did": ((0.15 - 0.006) / 8, 0.0)}[case]
    assert (s["did_select"], s["abs_A_n"]) == pytest.approx(want, abs=1e-12)  # pooled numbers are reported
    b2 = {"wrong_drift": (0.02, 0.03), "did": (-0.003, 0.0)}[case]
    assert (s["per_budget"]["2"]["did_select"], s["per_budget"]["2"]["abs_A_n"]) == pytest.approx(b2, abs=1e-12)
    # Without B = 2 the first four (B = 1) groups pass; a gated budget without groups is untested, and fails.
    assert H.budget_gates(gate_rows(spec[:4]), [1], 500, 0, 0.02, "decision")["pass"]
    assert not H.budget_gates(gate_rows(spec[:4]), [1, 2], 500, 0, 0.02, "decision")["pass"]


def test_checkpoint_choice_is_the_largest_pooled_did_among_all_budget_passes():
    evals = [{"step": 1, "pass": False, "did_select": 0.05}, {"step": 2, "pass": True, "did_select": 0.01},
             {"step": 3, "pass": True, "did_select": 0.02}, {"step": 4, "pass": True, "did_select": 0.02}]
    best = None
    for s in evals:
        best = s if H.better_checkpoint(s, best) else best
    assert best["step"] == 3  # step 1 fails a budget; step 4 ties step 3 and the earlier one stays


def test_bootstrap_resamples_decisions_whole():
    # Decision (e, 5) has groups at B = 1, 2, 4 with DiD +0.03; decision (e, 9) one group with -0.03.
    # Resampling decisions, a draw of two decisions is {5, 5} -> 0.03, {9, 9} -> -0.03 or one of each ->
    # (3 * 0.03 - 0.03) / 4 = 0.015: no other bootstrap mean is possible. Resampling single groups would
    # also give e.g. 0 (two of each).
    values, clusters = [0.03, 0.03, 0.03, -0.03], [("e", 5)] * 3 + [("e", 9)]
    means = {round(m, 12) for m in H.cluster_bootstrap_means(values, clusters, 2000, 0).tolist()}
    assert means == {0.03, 0.015, -0.03}
    singles = {round(m, 12) for m in H.cluster_bootstrap_means(values, list(range(4)), 2000, 0).tolist()}
    assert 0.0 in singles and len(singles) == 5
    rows = gate_rows([("e", 5, b, 0.03, 0.0, 0.0) for b in (1, 2, 4)] + [("e", 9, 1, -0.03, 0.0, 0.0)])
    lo, hi = H.gate_summary(rows, 2000, 0, 0.02, "decision")["did_ci95"]
    assert (lo, hi) == pytest.approx((-0.03, 0.03))
    # Episodes as the unit: one episode holds both decisions, so nothing can be resampled.
    assert H.gate_summary(rows, 2000, 0, 0.02, "episode")["did_ci95"] == pytest.approx([0.015, 0.015], abs=1e-12)


def test_bootstrap_over_single_groups_is_the_earlier_interval():
    values = [0.01, 0.02, 0.03, -0.01, 0.05]
    idx = torch.randint(5, (300, 5), generator=torch.Generator().manual_seed(4))
    old = torch.quantile(torch.tensor(values, dtype=torch.float64)[idx].mean(1),
                         torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    assert H.bootstrap_ci(values, 300, 4) == pytest.approx(tuple(old), abs=1e-15)


@pytest.mark.parametrize("delta, want", [
    (0.004, 0.02 + 0.006),           # both DiD hinges stay at m; the gain hinge [m - A_c]+ drops by delta
    (0.01, 0.02),                    # the gain hinge is satisfied by the shift alone
    (0.015, 0.02),                   # still inside the drift cap: a uniform lift of m..cap costs nothing
    (0.03, 0.02 + 2 * (0.01 + 0.01)),  # beyond the cap both drift terms (weight 2) bite
])
def test_a_uniform_shift_of_the_adapter_on_arms_moves_only_the_gain_hinge(delta, want):
    """Docs/TRAINING.md "Objective": shifting every adapter-on arm (RA, SA, WA) by delta leaves A_c - A_r
    and A_c - A_n unchanged but moves A_c, A_r, A_n by delta, so [m - A_c]+ (and beyond the cap the drift
    terms) change: the objective does not cancel a uniform shift; it rewards one up to m within the cap."""
    base = arms(0.0, 0.0, 0.0)
    shifted = {k: v + (delta if k.endswith("A") else 0.0) for k, v in base.items()}
    a_c, a_r, a_n = H.did_terms(shifted)
    assert (a_c - a_r, a_c - a_n) == pytest.approx((0.0, 0.0), abs=1e-12)
    assert H.group_loss(base).item() == pytest.approx(3 * 0.01, abs=1e-12)
    assert H.group_loss(shifted).item() == pytest.approx(want, abs=1e-12)


# ---------------------------------------------------------------------------------------------- mining


def test_mining_rule():
    singles = {5: {1: -1.0, 2: -0.5, 3: -2.0, 4: -1.5}, 3: {1: -1.0, 2: -1.1}}
    groups = H.mine_utility_groups("ep", singles, {5: {(4,): -1.5}}, [1, 2, 3])
    assert [(g.t, g.budget) for g in groups] == [(5, 1), (5, 2)]  # B = 3 and decision 3: too few older events
    b1, b2 = groups
    assert (b1.recent, b1.relevant, b1.wrong, b1.q_recent) == ((4,), 2, 3, -1.5)
    assert (b1.allocation("R"), b1.allocation("S"), b1.allocation("W")) == ((4,), (2,), (3,))
    assert (b2.recent, b2.relevant, b2.wrong) == ((3, 4), 2, 1)
    assert (b2.allocation("R"), b2.allocation("S"), b2.allocation("W")) == ((3, 4), (2, 4), (1, 4))
    # Ties, and gaps not above --min-gap, give no group.
    assert H.mine_utility_groups("ep", {4: {1: -1.0, 2: -1.0, 3: -0.5}}, {}, [1]) == []
    assert H.mine_utility_groups("ep", singles, {}, [2], min_gap=0.5) == []
    # The labels' Recent-B anchor must be the tail of the pool.
    with pytest.raises(H.TrainError, match="Recent-1 anchor"):
        H.mine_utility_groups("ep", singles, {5: {(3,): -2.0}}, [1])


def write_lines(path, lines):
    with open(path, "w") as f:
        f.write("\n".join(json.dumps(x) if not isinstance(x, str) else x for x in lines) + "\n")


# ---------------------------------------------------------------------------------------------- paper mining
#
# The paper ("Per-B Fidelity-Restoration Supervision"): "Relevant restore: Recent-(B-1) + {v_j+}, the oldest
# recent visual slot replaced by the target-specific archived screenshot (age >= B+2, strictly older than the
# whole window); Wrong restore: the same slot replaced by an age-matched same-trajectory screenshot whose
# following action is not equivalent to a*_t." In a label file "target-specific" is an event whose
# `witness` is true (the action taken at that step is equivalent to the recorded action at t), and the
# paper's age is the authors' t - (s - 1): "age >= B+2" is recall's t - s >= B + 1, i.e. s <= t - B - 1,
# older than Recent-B = steps t-B .. t-1.

MW = {"model": "m", "adapter": None, "protocol": "mobile", "min_pixels": 4096, "max_pixels": 24576}


def decision_line(t, witnesses, pool=None):
    """A `decision` line as `recall episode label` writes it (docs/FORMATS.md "Utility labels")."""
    steps = pool or range(1, t)
    events = [{"step": s, "image_hash": f"{s:016x}", "next_bucket": "click", "next_point": [10.0 * s, 5.0],
               "witness": s in witnesses} for s in steps]
    return {"episode": "ep", "t": t, "kind": "decision", "labels": 0, "budgets": [1, 2, 4],
            "context": {"reference_point": [10.0, 5.0], "events": events}, "made_with": MW}


def singleton_lines(t, q):
    return [{"episode": "ep", "t": t, "kind": "singleton", "set": [s], "q": v, "sum_logprob": v, "tokens": 1,
             "made_with": MW} for s, v in q.items()]


def paper_groups(tmp_path, lines, budgets, seed=0, episode="ep"):
    """Mine `lines` by the paper's rule (read_labels needs singleton labels: any values do)."""
    if not any(x["kind"] == "singleton" for x in lines):
        lines = lines + [s for x in lines for s in singleton_lines(x["t"], {e["step"]: -1.0
                                                                             for e in x["context"]["events"]})]
    path = tmp_path / "labels.jsonl"
    write_lines(path, lines)
    singles, recents, _, _ = H.read_labels(str(path))
    return H.mine_paper_groups(episode, H.read_events(str(path)), singles, recents, budgets, seed)


# Decision t = 12 over steps 1..11. Witnesses (action equivalent to a*_12) at step 1 and at step 10; the
# singleton utilities favour step 7 (best older) and disfavour step 5 (worst older), and step 10 is the
# best frame overall, so the utility rule and the paper's rule disagree.
WORKED_Q = {1: -2.0, 2: -1.9, 3: -2.1, 4: -2.2, 5: -3.0, 6: -2.5, 7: -0.5, 8: -2.4, 9: -2.3, 10: -0.1, 11: -1.0}


def test_paper_mining_worked_example(tmp_path):
    lines = [decision_line(12, {1, 10})] + singleton_lines(12, WORKED_Q)
    got = {g.budget: g for g in paper_groups(tmp_path, lines, [2, 4, 8, 10])}
    # By hand from the paper's sentence:
    #   B=2:  Recent-2 = {10, 11}; older than the window: s <= 9 (age >= B+2 = 4 in the authors' count).
    #         The witness at 10 sits inside the window, so j+ = 1, the only eligible witness; the
    #         non-witnesses s <= 9 are 2..9 and the one nearest in age to step 1 is 2, so j- = 2.
    #         Relevant restore = Recent-1 + {1} = {1, 11}; wrong restore = {2, 11}.
    #   B=4:  Recent-4 = {8..11}; s <= 7: j+ = 1, j- = 2; S = {1, 9, 10, 11}, W = {2, 9, 10, 11}.
    #   B=8:  Recent-8 = {4..11}; s <= 3: j+ = 1, j- = 2 (3 is farther).
    #   B=10: Recent-10 = {2..11}; s <= 1: only the witness itself, no non-equivalent frame: no group.
    assert sorted(got) == [2, 4, 8]
    assert [(got[b].relevant, got[b].wrong) for b in (2, 4, 8)] == [(1, 2)] * 3
    assert (got[2].allocation("R"), got[2].allocation("S"), got[2].allocation("W")) == ((10, 11), (1, 11), (2, 11))
    assert (got[4].allocation("S"), got[4].allocation("W")) == ((1, 9, 10, 11), (2, 9, 10, 11))
    assert (got[2].q_relevant, got[2].q_wrong) == (-2.0, -1.9)  # the singleton utilities ride along
    # The utility rule (--groups utility) picks other frames on the same decision: best 7, worst 5.
    utility = {g.budget: g for g in H.mine_utility_groups("ep", {12: WORKED_Q}, {}, [2, 4])}
    assert [(utility[b].relevant, utility[b].wrong) for b in (2, 4)] == [(7, 5), (7, 5)]


def test_paper_mining_age_boundary(tmp_path):
    # t = 8, B = 2: Recent-2 = {6, 7}. A witness at step 5 has recall age 3 = B + 1 (the authors' age 4 =
    # B + 2): the youngest eligible age. Its nearest non-witness is 4.
    (g,) = paper_groups(tmp_path, [decision_line(8, {5})], [2])
    assert (g.recent, g.relevant, g.wrong) == ((6, 7), 5, 4)
    # A witness at step 6 (age B, the oldest recent slot itself) or 7 is inside the window: no group.
    assert paper_groups(tmp_path, [decision_line(8, {6, 7})], [2]) == []
    # No witness at all: no group.
    assert paper_groups(tmp_path, [decision_line(8, set())], [1, 2]) == []


def test_paper_mining_needs_a_non_equivalent_frame_as_old(tmp_path):
    # t = 6, B = 2: eligible s <= 3, every one a witness: no age-matched non-equivalent frame, no group;
    # the non-witnesses 4 and 5 are the recent window, not candidates.
    assert paper_groups(tmp_path, [decision_line(6, {1, 2, 3})], [2]) == []
    # At B = 1 step 4 is old enough (age 2) and is the nearest non-witness to any of them.
    (g,) = paper_groups(tmp_path, [decision_line(6, {1, 2, 3})], [1])
    assert g.wrong == 4 and g.relevant in (1, 2, 3)


def test_paper_mining_ties_and_several_witnesses_are_seeded_choices(tmp_path):
    # t = 10, B = 1, witness at 5 only: non-witnesses 4 and 6 are equally near in age.
    tie = {seed: paper_groups(tmp_path, [decision_line(10, {5})], [1], seed)[0] for seed in range(16)}
    assert all(g.relevant == 5 and g.wrong in (4, 6) for g in tie.values())
    assert {g.wrong for g in tie.values()} == {4, 6}, "a tie is a seeded uniform choice, not a fixed side"
    # Several eligible witnesses (1 and 10 at t = 12, B = 1): one of them, with its own nearest non-witness.
    pairs = {seed: (g.relevant, g.wrong) for seed in range(16)
             for g in paper_groups(tmp_path, [decision_line(12, {1, 10})], [1], seed)}
    assert set(pairs.values()) == {(1, 2), (10, 9)}
    # The choice depends on (seed, episode name, t) only: not on the budget list or the episode's directory.
    again = paper_groups(tmp_path, [decision_line(12, {1, 10})], [1, 2, 4], 3, episode="/x/y/ep")
    assert (again[0].budget, again[0].relevant, again[0].wrong) == (1, *pairs[3])


def test_paper_mining_reads_decision_lines_and_names_missing_fields(tmp_path):
    path = tmp_path / "l.jsonl"
    write_lines(path, [decision_line(4, {1})])
    assert H.read_events(str(path)) == {4: {1: True, 2: False, 3: False}}
    bad = decision_line(4, {1})
    del bad["context"]["events"][1]["witness"]
    write_lines(path, [bad])
    with pytest.raises(H.TrainError, match=r"l\.jsonl:1: `context\.events\[1\]\.witness` is missing"):
        H.read_events(str(path))
    write_lines(path, [{**decision_line(4, {1}), "context": {"reference_point": None}}])
    with pytest.raises(H.TrainError, match="without `context.events`"):
        H.read_events(str(path))
    write_lines(path, singleton_lines(4, {1: -1.0}))
    with pytest.raises(H.TrainError, match=r"no `decision` lines \(field `context\.events\[\]\.witness`\)"):
        H.read_events(str(path))


def test_paper_mining_on_recall_labels(tmp_path):
    """recall's own decision lines carry what the rule needs: an episode whose last recorded action
    repeats step 1's (a click at (500, 100)) gives exactly that witness, and the paper's groups follow."""
    recall = recall_bin()
    episode = tmp_path / "ep"
    shutil.copytree(EPISODE, episode)
    with open(episode / "episode.json") as f:
        ep = json.load(f)
    ep["steps"][5]["response"] = ep["steps"][0]["response"]
    with open(episode / "episode.json", "w") as f:
        json.dump(ep, f)
    labels = tmp_path / "labels.jsonl"
    subprocess.run([recall, "episode", "label", "--model", MODEL, "--episode", str(episode), "--budgets", "1,2",
                    "--out", str(labels), "--backend", "cpu"], check=True, capture_output=True)
    events = H.read_events(str(labels))
    assert events[6] == {1: True, 2: False, 3: False, 4: False, 5: False}
    assert not any(any(e.values()) for t, e in events.items() if t < 6)
    singles, recents, _, _ = H.read_labels(str(labels))
    groups = H.mine_paper_groups(str(episode), events, singles, recents, [1, 2])
    # B=1: Recent-1 = {5}, witness 1 (age 5 >= 2), nearest non-witness 2; B=2: Recent-2 = {4, 5}, same pair.
    got = [(g.t, g.budget, g.recent, g.relevant, g.wrong) for g in groups]
    assert got == [(6, 1, (5,), 1, 2), (6, 2, (4, 5), 1, 2)]
    assert groups[0].q_relevant == singles[6][1] and groups[0].q_recent == recents[6][(5,)]
    # The trainer's loading path (--groups paper is the default) mines the same groups.
    args = H.parse_args(["--model", MODEL, "--episodes", str(episode), "--labels", str(labels), "--recall", recall,
                         "--out", str(tmp_path / "out"), "--budgets", "1,2"])
    assert args.groups == "paper" and H.load_groups(args)[0] == groups


def test_read_labels(tmp_path):
    mw = {"model": "m", "adapter": None, "protocol": "mobile"}
    path = tmp_path / "l.jsonl"
    write_lines(path, [
        {"t": 3, "kind": "decision", "episode": "e", "reference": "x"},  # other kinds are ignored
        {"t": 3, "kind": "singleton", "set": [1], "q": -1.0, "made_with": mw},
        {"t": 3, "kind": "singleton", "set": [2], "q": -2.0, "made_with": mw},
        {"t": 3, "kind": "recent", "set": [2], "q": -2.0, "made_with": mw},
        {"t": 3, "kind": "beam", "set": [1, 2], "q": -1.5, "made_with": mw},
        "",
    ])
    singles, recents, made_with, episode = H.read_labels(str(path))
    assert singles == {3: {1: -1.0, 2: -2.0}} and recents == {3: {(2,): -2.0}} and made_with == mw
    assert episode == "e"
    with pytest.raises(H.TrainError, match="not found"):
        H.read_labels(str(tmp_path / "missing.jsonl"))
    write_lines(path, [{"t": 3, "kind": "singleton", "set": [1], "q": -1.0}, "{oops"])
    with pytest.raises(H.TrainError, match=r"l\.jsonl:2: not JSON"):
        H.read_labels(str(path))
    write_lines(path, [{"t": 3, "kind": "singleton", "set": [1], "q": -1.0, "made_with": mw},
                       {"t": 3, "kind": "singleton", "set": [2], "q": -1.0, "made_with": {**mw, "adapter": "a"}}])
    with pytest.raises(H.TrainError, match="must not be mixed"):
        H.read_labels(str(path))
    write_lines(path, [{"t": 3, "kind": "beam", "set": [1, 2], "q": -1.0}])
    with pytest.raises(H.TrainError, match="no singleton labels"):
        H.read_labels(str(path))
    write_lines(path, [{"t": 3, "kind": "singleton", "set": [1], "q": -1.0, "episode": "a"},
                       {"t": 3, "kind": "singleton", "set": [1], "q": -1.0, "episode": "b"}])
    with pytest.raises(H.TrainError, match="several episodes"):
        H.read_labels(str(path))


def test_dev_split_keeps_decisions_and_episodes_whole():
    g = [H.Group(ep, t, b, (t - 1,), 1, 2, 0.0, -1.0) for ep in ("a", "b") for t in (4, 5, 6) for b in (1, 2)]
    train, dev = H.split_groups(g, 0.5, 0)
    assert {x.episode for x in train}.isdisjoint({x.episode for x in dev}) and train and dev
    one = [x for x in g if x.episode == "a"]
    train, dev = H.split_groups(one, 0.34, 0)
    assert len(dev) == 2 and {x.t for x in train}.isdisjoint({x.t for x in dev})
    assert H.split_groups(one, 0.0, 0) == (one, [])
    with pytest.raises(H.TrainError, match="at least 2"):
        H.split_groups([x for x in one if x.t == 4], 0.5, 0)


def test_bad_inputs_get_clear_errors(tmp_path, caplog):
    binary = os.environ.get("RECALL_BIN") or sys.executable  # these fail before anything is rendered
    labels = tmp_path / "l.jsonl"
    write_lines(labels, [{"t": 6, "kind": "singleton", "set": [j], "q": -float(j)} for j in range(1, 6)])
    base = ["--model", MODEL, "--episodes", EPISODE, "--recall", binary, "--out", str(tmp_path / "out")]
    cases = [
        (["--labels", str(tmp_path / "missing.jsonl")], "not found"),
        (["--labels", str(labels), "--budgets", "4", "--groups", "utility"], "no replacement groups"),
        (["--labels", str(labels)], "no `decision` lines (field `context.events[].witness`)"),  # --groups paper
        (["--labels", f"{labels},{labels}"], "2 label files"),
        (["--labels", str(labels), "--budgets", "0,1"], "every budget must be >= 1"),
        (["--labels", str(labels), "--recall", str(tmp_path / "nope")], "does not exist"),
    ]
    for extra, message in cases:
        caplog.clear()
        assert H.main(base + extra) == 2
        assert message in caplog.text, (extra, caplog.text)


# ---------------------------------------------------------------------------------------------- training


def train(recall, labels, out):
    code = H.main(["--model", MODEL, "--episodes", EPISODE, "--labels", str(labels), "--recall", recall,
                   "--out", str(out), "--budgets", "1", "--steps", "4", "--batch", "2", "--lr", "5e-3",
                   "--groups", "utility",  # episode-sample repeats no action: the paper's rule finds no group
                   "--seed", "0", "--dev-fraction", "0.34", "--bootstrap", "200", "--eval-every", "2",
                   "--threads", "1"])  # one thread: far faster than two on a busy 2-core machine
    assert code == 0
    with open(os.path.join(out, H.REPORT)) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    recall = recall_bin()
    tmp = tmp_path_factory.mktemp("hgkv")
    labels = tmp / "labels.jsonl"
    subprocess.run([recall, "episode", "label", "--model", MODEL, "--episode", EPISODE, "--budgets", "0,1,2",
                    "--out", str(labels), "--backend", "cpu"], check=True, capture_output=True)
    out = tmp / "adapter"
    return {"recall": recall, "out": str(out), "report": train(recall, labels, out), "tmp": tmp, "labels": labels}


@pytest.fixture(scope="module")
def policy():
    return H.Policy(MODEL)


def test_training_lowers_the_loss_within_the_drift_cap(run):
    r = run["report"]
    print(f"\ntrain loss {r['train_loss']['per_step']}, objective {r['train_objective']}, "
          f"max |A_r| {r['train_max_abs_A_r']:.5f}, max |A_n| {r['train_max_abs_A_n']:.5f}, "
          f"label check {r['label_check_max_abs_diff']:.2e}, dev {r['dev']}")
    assert r["groups"] == {"train": 2, "dev": 1, "by_budget": {"1": 3}}
    assert r["train_loss"]["last"] < r["train_loss"]["first"]
    assert r["train_objective"]["exported"] < 0.5 * r["train_objective"]["initial"]
    assert r["train_max_abs_A_r"] <= H.DRIFT_CAP + SLACK
    assert r["train_max_abs_A_n"] <= H.DRIFT_CAP + SLACK
    assert all(g["A_c"] > 0 for g in r["train_groups"]), "the relevant frame gains from the adapter"
    # The trainer's prompts and frozen scores are recall's: B = 1 arms are singleton labels.
    assert r["label_check_max_abs_diff"] < 1e-4
    for key in ("did_select", "did_ci95", "abs_A_r", "abs_A_n", "pass"):
        assert key in r["dev"]
    assert isinstance(r["gates_passed"], bool) and r["exported_step"] in (2, 4)
    # Per-budget gates (one budget here); one episode, so the bootstrap resamples decisions.
    assert r["gate_budgets"] == [1] and r["bootstrap_unit"] == "decision"
    assert all(set(e["per_budget"]) == {"1"} and e["pass"] == e["per_budget"]["1"]["pass"] for e in r["dev_evals"])
    assert r["gates_passed"] == any(e["pass"] for e in r["dev_evals"])


def test_export_is_a_peft_directory(run):
    with open(os.path.join(run["out"], "adapter_config.json")) as f:
        cfg = json.load(f)
    assert (cfg["r"], cfg["lora_alpha"], sorted(cfg["target_modules"])) == (8, 16, ["k_proj", "v_proj"])
    assert cfg["layers_to_transform"] == [0, 1, 2]  # the last 8 layers, clamped to the tiny model's 3
    assert cfg["peft_type"] == "LORA" and cfg["lora_dropout"] == 0.0 and cfg["bias"] == "none"
    tensors = load_file(os.path.join(run["out"], "adapter_model.safetensors"))
    assert sorted(tensors) == sorted(f"base_model.model.model.language_model.layers.{i}.self_attn.{p}.lora_{f}.weight"
                                     for i in range(3) for p in ("k_proj", "v_proj") for f in "AB")
    assert any(t.abs().max() > 0 for k, t in tensors.items() if "lora_B" in k), "the adapter was trained"


def recall_logits(run, messages, mode):
    tmp = run["tmp"]
    m, out = tmp / f"m-{mode}.json", tmp / f"logits-{mode}.safetensors"
    with open(m, "w") as f:
        json.dump(messages, f)
    subprocess.run([run["recall"], "logits", "--model", MODEL, "--adapter", run["out"], "--adapter-mode", mode,
                    "--messages", str(m), "--out", str(out), "--backend", "cpu"], check=True, capture_output=True)
    return load_file(str(out))


def test_recall_loads_the_export_ungated_as_peft_and_gated_as_the_trainer(run, policy):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    messages = H.Renderer(run["recall"], "mobile").messages(EPISODE, 6, (2, 5))
    prompt = policy.prompt(messages)
    assert len(prompt["images"]) == 3 and len(prompt["history"]) > 0

    peft = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(MODEL, dtype=torch.float32),
                                     run["out"]).eval()
    exported = load_file(os.path.join(run["out"], "adapter_model.safetensors"))
    loaded = {k.replace(".default", ""): v for k, v in peft.state_dict().items() if "lora_" in k}
    assert sorted(loaded) == sorted(exported) and all(torch.equal(loaded[k], exported[k]) for k in exported)

    adapter = H.KVAdapter.from_peft(policy.model, run["out"])
    try:
        with torch.no_grad():
            base = policy.forward(prompt)
            with adapter.acting_on(prompt["history"]):
                gated = policy.forward(prompt)
            ungated = peft(**policy.model_inputs(prompt)).logits[0]
    finally:
        adapter.remove()
    diffs = {}
    for mode, want in (("gated", gated), ("ungated", ungated)):
        got = recall_logits(run, messages, mode)
        assert torch.equal(got["input_ids"], prompt["ids"].to(torch.int64)), f"{mode}: token ids differ"
        diffs[mode] = (got["logits"] - want).abs().max().item()
    effect = {"gated": (gated - base).abs().max().item(), "ungated": (ungated - base).abs().max().item()}
    print(f"\nmax |recall - reference|: {diffs}; adapter effect max |on - off|: {effect}")
    assert diffs["gated"] <= 1e-4 and diffs["ungated"] <= 1e-4
    assert min(effect.values()) > 1e-3, "the trained adapter must change the logits visibly"


def test_gated_adapter_without_history_is_the_frozen_model_bit_for_bit(run, policy):
    adapter = H.KVAdapter.from_peft(policy.model, run["out"])
    try:
        assert not adapter.is_zero()
        prompt = policy.prompt(H.Renderer(run["recall"], "mobile").messages(EPISODE, 6, ()))  # B = 0
        assert len(prompt["images"]) == 1 and len(prompt["history"]) == 0
        with torch.no_grad():
            frozen = policy.forward(prompt)
            with adapter.acting_on(prompt["history"]):
                gated = policy.forward(prompt)
        assert torch.equal(gated, frozen)
    finally:
        adapter.remove()


def test_prefix_cached_scores_match_the_full_forward(run, policy):
    """The training path (shared text prefix K/V, history rows shifted) equals a full forward."""
    adapter = H.KVAdapter.from_peft(policy.model, run["out"])
    try:
        g = H.Group(EPISODE, 6, 2, (4, 5), 2, 1, 0.0, -1.0)
        responses = {EPISODE: H.read_episode(EPISODE)}
        renderer = H.Renderer(run["recall"], "mobile")
        cached = H.Scorer(policy, adapter, renderer, responses, "gated", prefix_cache=4)
        full = H.Scorer(policy, adapter, renderer, responses, "gated", prefix_cache=0)
        with torch.no_grad():
            for arm in H.ARMS:
                a, b = cached.score(g, arm, True).item(), full.score(g, arm, True).item()
                assert abs(a - b) < 1e-5, (arm, a, b)
        assert cached.prefixes[(EPISODE, 6, 2)][0] > 0
    finally:
        adapter.remove()


def test_training_is_deterministic_given_the_seed(run):
    again = train(run["recall"], run["labels"], run["tmp"] / "again")
    assert again["train_loss"]["per_step"] == run["report"]["train_loss"]["per_step"]
    a = load_file(os.path.join(run["out"], "adapter_model.safetensors"))
    b = load_file(str(run["tmp"] / "again" / "adapter_model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_low_memory_backward_matches_the_joint_backward(run, policy):
    """One arm at a time with scalar coefficients (--low-memory) gives the joint backward's gradient."""
    adapter = H.KVAdapter.from_peft(policy.model, run["out"])
    try:
        d = run["report"]["dev_groups"][0]  # a group the objective still pulls on
        assert d["loss"] > 0
        g = H.Group(EPISODE, d["t"], 1, tuple(d["R"]), d["S"][0], d["W"][0], 0.0, -1.0)
        scorer = H.Scorer(policy, adapter, H.Renderer(run["recall"], "mobile"), {EPISODE: H.read_episode(EPISODE)},
                          "gated")
        cfg = H.Config(H.parse_args(["--model", MODEL, "--episodes", EPISODE, "--labels", "-", "--out", "-",
                                     "--recall", run["recall"]]))
        grads, losses = [], []
        for low_memory in (False, True):
            adapter.zero_grad(set_to_none=True)
            losses.append(scorer.backward(g, 0.5, cfg, low_memory))
            grads.append([torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in adapter.parameters()])
        assert losses[0] == pytest.approx(losses[1], abs=1e-6) and losses[0] > 0
        assert any(x.abs().max() > 0 for x in grads[0])
        for x, y in zip(*grads):
            assert torch.allclose(x, y, rtol=1e-4, atol=1e-7)
    finally:
        adapter.remove()
