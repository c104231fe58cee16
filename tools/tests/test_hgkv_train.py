"""tools/hgkv_train.py: the DiD objective and group mining on hand-made values, and a short training run
on the tiny Qwen3-VL with utility labels of tests/fixtures/episode-sample made by the recall binary:

* the training objective falls and the drift terms stay within the cap (|A_r|, |A_n| <= 0.02 + 0.005
  slack on every training group of the exported checkpoint; the cap is a hinge penalty, not a hard
  constraint, so a step may overshoot it slightly);
* the exported PEFT directory loads in PEFT with the same tensors, and `recall logits` on it gives, on a
  prompt with two history screenshots, ungated logits equal to PEFT's and gated logits equal to the
  trainer's own gated forward (max abs difference <= 1e-4);
* with no history image (B = 0) the trainer's gated forward is the frozen model bit for bit;
* the trainer's frozen arm scores equal recall's labels (same prompts, same tokens).

RECALL_BIN names the recall binary (default target/release/recall); tests/hgkv_train.rs sets it.

    RECALL_BIN=target/release/recall .venv-tools/bin/python -m pytest -q tools/tests/test_hgkv_train.py
"""

import json
import os
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


# ---------------------------------------------------------------------------------------------- mining


def test_mining_rule():
    singles = {5: {1: -1.0, 2: -0.5, 3: -2.0, 4: -1.5}, 3: {1: -1.0, 2: -1.1}}
    groups = H.mine_groups("ep", singles, {5: {(4,): -1.5}}, [1, 2, 3])
    assert [(g.t, g.budget) for g in groups] == [(5, 1), (5, 2)]  # B = 3 and decision 3: too few older events
    b1, b2 = groups
    assert (b1.recent, b1.relevant, b1.wrong, b1.q_recent) == ((4,), 2, 3, -1.5)
    assert (b1.allocation("R"), b1.allocation("S"), b1.allocation("W")) == ((4,), (2,), (3,))
    assert (b2.recent, b2.relevant, b2.wrong) == ((3, 4), 2, 1)
    assert (b2.allocation("R"), b2.allocation("S"), b2.allocation("W")) == ((3, 4), (2, 4), (1, 4))
    # Ties, and gaps not above --min-gap, give no group.
    assert H.mine_groups("ep", {4: {1: -1.0, 2: -1.0, 3: -0.5}}, {}, [1]) == []
    assert H.mine_groups("ep", singles, {}, [2], min_gap=0.5) == []
    # The labels' Recent-B anchor must be the tail of the pool.
    with pytest.raises(H.TrainError, match="Recent-1 anchor"):
        H.mine_groups("ep", singles, {5: {(3,): -2.0}}, [1])


def write_lines(path, lines):
    with open(path, "w") as f:
        f.write("\n".join(json.dumps(x) if not isinstance(x, str) else x for x in lines) + "\n")


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
        (["--labels", str(labels), "--budgets", "4"], "no replacement groups"),
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
