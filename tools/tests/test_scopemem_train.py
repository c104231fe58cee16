"""tools/scopemem_train.py: the trainer reads only `recall scopemem dump` lines.

* the objective's pieces (KL, the decision-weighted preservation term, the scope k_t, the epoch-1 CE-only
  rule) on hand-computed values; EM with a target box; decision-token weights;
* a dump line lacking a field is a clear error naming the line and the field;
* the trainer's embedding-run forward (prefix rows placed as recall's `with_prefix` places them, text
  positions) equals transformers' own input_ids forward when the rows are real token embeddings, for
  `prepend` and `append`, on a prompt with screenshots (M-RoPE after the run);
* a short CPU run on 4 lines of tests/fixtures/eval/aitw_steps.jsonl dumped by the recall binary lowers the
  objective; the exported encoder loads in `recall scopemem dump --encoder`, whose `prefix` equals the
  trainer's own encoder output on the same lines (max abs difference <= 1e-5).

RECALL_BIN names the recall binary (default target/release/recall); tests/scopemem_train.rs sets it.

    RECALL_BIN=target/release/recall .venv-tools/bin/python -m pytest -q -p no:cacheprovider \\
        tools/tests/test_scopemem_train.py
"""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import scopemem_train as T  # noqa: E402

MODEL = os.path.join(ROOT, "tests", "fixtures", "tiny-qwen3-vl")
DATASET = os.path.join(ROOT, "tests", "fixtures", "eval", "aitw_steps.jsonl")
LINES = "1,2,3,4"
TOL = 1e-5


def recall_bin():
    path = os.environ.get("RECALL_BIN") or os.path.join(ROOT, "target", "release", "recall")
    if not os.path.isfile(path):
        pytest.skip(f"no recall binary at {path} (set RECALL_BIN or `cargo build --release`)")
    return path


def dump(out, *extra):
    cmd = [recall_bin(), "scopemem", "dump", "--model", MODEL, "--dataset", DATASET, "--lines", LINES,
           "--max-tokens", "32", "--backend", "cpu", "--out", str(out), *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, f"`{' '.join(cmd)}` failed:\n{p.stderr}"
    with open(out, encoding="utf-8") as f:
        return [json.loads(x) for x in f if x.strip()]


# ---------------------------------------------------------------------------------------------- objective


def test_kl_and_preservation_on_hand_computed_values():
    p0 = torch.tensor([[0.5, 0.5], [0.9, 0.1]])
    pz = torch.tensor([[0.25, 0.75], [0.9, 0.1]])
    kl = T.kl_rows(p0.log(), pz.log())
    want0 = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert kl[0].item() == pytest.approx(want0, abs=1e-6)
    assert kl[1].item() == pytest.approx(0.0, abs=1e-7)
    # a decision token (weight 10) and an argument token (weight 1): (10 KL0 + 1 KL1) / 11
    pres = T.preservation(p0.log(), pz.log(), torch.tensor([10.0, 1.0]))
    assert pres.item() == pytest.approx(10 * want0 / 11, abs=1e-6)


def test_objective_scope_and_epochs():
    ce, pres = torch.tensor(2.0), torch.tensor(0.5)
    assert T.objective(ce, pres, k=True, w=0.8, preserve=True).item() == pytest.approx(2.4)
    assert T.objective(ce, pres, k=False, w=0.8, preserve=True).item() == 2.0  # a0 wrong: in scope, CE only
    assert T.objective(ce, pres, k=True, w=0.8, preserve=False).item() == 2.0  # epoch 1: CE only
    assert T.scope(True, "scoped") and not T.scope(False, "scoped")
    assert T.scope(False, "unscoped") and not T.scope(True, "none")
    a = T.parse_args(["--dump", "x", "--actor", "y", "--unscoped"])
    assert a.preservation == "unscoped"
    assert T.parse_args(["--dump", "x", "--actor", "y", "--no-preservation"]).preservation == "none"


def click(x, y):
    call = json.dumps({"name": "mobile_use", "arguments": {"action": "click", "coordinate": [x, y]}})
    return f"Action: Click.\n<tool_call>\n{call}\n</tool_call>"


def test_exact_match_mirrors_recall():
    assert T.exact_match(click(500, 500), click(515, 515))        # Euclidean 21.2 <= 25
    assert not T.exact_match(click(500, 500), click(520, 520))    # 28.3
    assert T.exact_match(click(500, 500), click(600, 600), [550, 550, 650, 650])  # inside the box
    assert not T.exact_match(click(500, 500), "garbage")


def test_decision_tokens_weigh_ten():
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(MODEL, "tokenizer.json"))
    first = click(500, 500)
    ids = tok(first, add_special_tokens=False)["input_ids"]
    mask = T.decision_mask(tok, ids, first)
    assert len(mask) == len(ids)
    heavy = "".join(tok.decode([i]) for i, m in zip(ids, mask) if m == T.DECISION_WEIGHT)
    assert "click" in heavy and "500" not in heavy and "Action" not in heavy


# ---------------------------------------------------------------------------------------------- dump input


def test_a_dump_line_without_a_field_is_a_clear_error(tmp_path):
    good = {"messages": [], "reference": "x", "first": "y", "first_tokens": [], "p0": [0.1] * 10,
            "ids": {k: [] for k in T.FIELDS}, "placement": "prepend", "max_positions": 8,
            "action_types": list(T.ACTION_TYPES)}
    for missing in ("p0", "messages", "ids"):
        bad = dict(good)
        del bad[missing]
        path = tmp_path / f"no_{missing}.jsonl"
        path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
        with pytest.raises(T.DumpError, match=rf"no_{missing}\.jsonl:2: missing field `{missing}`"):
            T.read_dump(str(path))
    bad = dict(good, ids={"task": []})
    path = tmp_path / "ids.jsonl"
    path.write_text(json.dumps(bad) + "\n")
    with pytest.raises(T.DumpError, match=r"ids\.jsonl:1: missing field `ids\.first_opinion`"):
        T.read_dump(str(path))
    path = tmp_path / "mixed.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(dict(good, placement="append")) + "\n")
    with pytest.raises(T.DumpError, match="disagree on `placement`"):
        T.read_dump(str(path))
    path = tmp_path / "layouts.jsonl"
    path.write_text(json.dumps(dict(good, layout="paper")) + "\n" + json.dumps(dict(good, layout="gui-owl")) + "\n")
    with pytest.raises(T.DumpError, match="disagree on `layout`"):
        T.read_dump(str(path))
    path = tmp_path / "layout.jsonl"
    path.write_text(json.dumps(dict(good, layout="sideways")) + "\n")
    with pytest.raises(T.DumpError, match=r"layout\.jsonl:1: `layout` 'sideways'"):
        T.read_dump(str(path))
    # the command line reports it and exits 2, before loading any model
    path = tmp_path / "no_p0.jsonl"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "scopemem_train.py"), "--dump", str(path),
                        "--actor", MODEL], capture_output=True, text=True)
    assert p.returncode == 2 and "missing field `p0`" in p.stderr, p.stderr


def recall(*args):
    cmd = [recall_bin(), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, f"`{' '.join(cmd)}` failed:\n{p.stderr}"
    return p.stdout


# ---------------------------------------------------------------------------------------------- tiny model


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scopemem")
    recs = dump(tmp / "train.jsonl")
    out = tmp / "out"
    args = T.parse_args(["--dump", str(tmp / "train.jsonl"), "--actor", MODEL, "--epochs", "2", "--lr", "3e-3",
                         "--out", str(out), "--seed", "0"])
    report = T.train(args)
    return {"tmp": tmp, "recs": recs, "report": report, "out": out}


def test_training_lowers_the_objective(trained):
    r = trained["report"]
    print(f"objective {r['before']['loss']:.4f} -> {r['after']['loss']:.4f}, "
          f"steps {[round(s['loss'], 4) for s in r['steps']]}")
    assert r["lines"] == 4 and len(r["steps"]) == 8
    assert r["after"]["loss"] < r["before"]["loss"] - 1e-3
    saved = json.load(open(trained["out"] / T.REPORT))
    assert saved["before"] == r["before"] and saved["after"] == r["after"]


def test_the_encoder_records_the_layout_and_placement_it_was_trained_with(trained):
    """The exported scopemem_config.json carries the dump's `layout` and `placement` (what recall checks
    before serving), and so do the report and a reload."""
    rec = trained["recs"][0]
    assert (rec["layout"], rec["placement"]) == ("gui-owl", "prepend")
    cfg = json.load(open(trained["out"] / "encoder" / "scopemem_config.json"))
    assert (cfg["layout"], cfg["placement"]) == ("gui-owl", "prepend")
    assert (trained["report"]["layout"], trained["report"]["placement"]) == ("gui-owl", "prepend")
    loaded = T.ScopeMemEncoder.load(str(trained["out"] / "encoder"))
    assert (loaded.cfg.layout, loaded.cfg.placement) == ("gui-owl", "prepend")


def test_the_record_follows_the_dump_and_an_unrecorded_dump_records_nothing(trained, tmp_path, capsys):
    """An `append` dump gives an encoder recorded as `append`; a dump line without `layout` (written
    before recall recorded it) gives an encoder without the `layout` record, with a warning."""
    lines = [dict(r, placement="append") for r in trained["recs"][:1]]
    for r in lines:
        del r["layout"]
        r.pop("_where", None), r.pop("_dir", None)
    path = tmp_path / "append.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    args = T.parse_args(["--dump", str(path), "--actor", MODEL, "--epochs", "1", "--no-eval",
                         "--image-root", str(os.path.dirname(DATASET)), "--out", str(tmp_path / "out")])
    T.train(args)
    cfg = json.load(open(tmp_path / "out" / "encoder" / "scopemem_config.json"))
    assert cfg["placement"] == "append" and "layout" not in cfg
    assert "records no `layout`" in capsys.readouterr().err


def test_recall_refuses_an_encoder_under_another_placement(trained):
    """`recall scopemem run` with the recorded encoder and a different --placement or --context fails,
    naming the field, the trained value and the requested one."""
    enc_dir = str(trained["out"] / "encoder")
    for flag, value, trained_value in [("--placement", "append", "prepend"), ("--context", "paper", "gui-owl")]:
        cmd = [recall_bin(), "scopemem", "run", "--model", MODEL, "--dataset", DATASET, "--lines", "1",
               "--max-tokens", "4", "--backend", "cpu", "--encoder", enc_dir, flag, value]
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        field = flag.lstrip("-").replace("context", "layout")
        assert p.returncode != 0, p.stdout
        assert f"{field} `{trained_value}`" in p.stderr and f"{field} `{value}`" in p.stderr, p.stderr


def test_recall_serves_the_exported_encoder_as_trained(trained):
    enc_dir = str(trained["out"] / "encoder")
    served = dump(trained["tmp"] / "served.jsonl", "--encoder", enc_dir)
    actor, enc = trained["report"]["actor"], trained["report"]["encoder"]
    loaded = T.ScopeMemEncoder.load(enc_dir)
    worst = 0.0
    for rec, train_rec in zip(served, trained["recs"]):
        assert rec["ids"] == train_rec["ids"] and rec["p0"] == train_rec["p0"]
        k, hidden = enc.cfg.num_queries, enc.cfg.hidden_size
        recall_prefix = torch.tensor(rec["prefix"]).view(k, hidden)
        with torch.no_grad():
            ours = T.encoder_prefix(actor, enc, rec)
            ours_loaded = T.encoder_prefix(actor, loaded, rec)
        assert torch.equal(ours, ours_loaded)
        worst = max(worst, (ours - recall_prefix).abs().max().item())
    print(f"max |recall prefix - trainer prefix| = {worst:.3g}")
    assert worst <= TOL


@pytest.mark.parametrize("placement", ["prepend", "append"])
def test_embedding_run_is_placed_and_positioned_as_text(trained, placement):
    """Prefix rows that are real token embeddings give the logits of those tokens as text at the same
    place (HF computes M-RoPE from input_ids there): the run is positioned as recall positions it."""
    actor = trained["report"]["actor"]
    rec = trained["recs"][3]  # three screenshots
    prompt = actor.prompt(rec["messages"])
    target = actor.ids(rec["reference"])
    run = actor.ids("Step1: open the weather app, then search for Paris.")[:16]
    with torch.no_grad():
        got = actor.logits(prompt, target, actor.embed_ids(run), placement)
        ids = prompt["ids"].tolist()
        at = 0 if placement == "prepend" else len(ids) - len(actor.turn)
        ids = torch.tensor(ids[:at] + run + ids[at:] + target)[None]
        kw = {"input_ids": ids, "mm_token_type_ids": (ids == actor.image_pad).int(),
              "image_grid_thw": prompt["grid"],
              "pixel_values": torch.cat([actor._image(p)[0] for p in
                                         [actor._resolve(q, ".") for q in T.image_paths(rec["messages"])]])}
        want = actor.model(**kw, logits_to_keep=len(target) + 1).logits[0, :-1]
    diff = (got - want).abs().max().item()
    print(f"{placement}: max |embedding-run logits - input_ids logits| = {diff:.3g}")
    assert diff < 1e-4


def test_preservation_acts_when_the_first_opinion_is_right(trained, tmp_path):
    """The tiny actor's a0 never parses; with a0 set to the reference (a right first opinion) the
    preservation term is computed from epoch 2 with the confidence weight p0[type(a0)]."""
    actor = trained["report"]["actor"]
    lines = []
    for rec in trained["recs"][:2]:
        p0 = [0.5 / 9] * 10
        p0[T.ACTION_TYPES.index(T.parse(rec["reference"])["action"])] = 0.5
        rec = dict(rec, first=rec["reference"], first_tokens=actor.ids(rec["reference"]), p0=p0)
        lines.append(json.dumps(rec))
    path = tmp_path / "right.jsonl"
    path.write_text("\n".join(lines) + "\n")
    args = T.parse_args(["--dump", str(path), "--actor", MODEL, "--epochs", "2", "--steps", "1", "--no-eval",
                         "--out", str(tmp_path / "out")])
    r = T.train(args)
    assert r["a0_right"] == 2
    first, second = r["steps"]
    assert first["preservation"] is None and first["loss"] == first["ce"]  # epoch 1: CE only
    w = second["w"]
    assert w == pytest.approx(0.5) and second["preservation"] > 0
    assert second["loss"] == pytest.approx(second["ce"] + w * second["preservation"], rel=1e-5)


# ---------------------------------------------------------------------------------------------- variants

# The study's controls and Table 7's separately trained history ablation (`no-history`).
OTHERS = [v for v in T.VARIANTS if v != "full"]


@pytest.fixture(scope="module")
def variants(trained):
    """Every other variant trained on the same dump as the full encoder."""
    out = {}
    for v in OTHERS:
        args = T.parse_args(["--dump", str(trained["tmp"] / "train.jsonl"), "--actor", MODEL, "--epochs", "2",
                             "--lr", "3e-3", "--variant", v, "--out", str(trained["tmp"] / v), "--seed", "0"])
        out[v] = T.train(args)
    return out


@pytest.mark.parametrize("variant", OTHERS)
def test_each_variant_trains_and_recall_serves_it(trained, variants, variant):
    r = variants[variant]
    fields, conf = T.VARIANTS[variant]
    assert r["variant"] == variant and r["fields"] == list(fields) and r["confidence"] is conf
    print(f"{variant}: objective {r['before']['loss']:.4f} -> {r['after']['loss']:.4f}")
    assert r["after"]["loss"] < r["before"]["loss"] - 1e-3
    enc_dir = str(trained["out"].parent / variant / "encoder")
    served = dump(trained["tmp"] / f"served-{variant}.jsonl", "--encoder", enc_dir)
    worst = 0.0
    for rec in served:
        with torch.no_grad():
            ours = T.encoder_prefix(r["actor"], r["encoder"], rec)
        # what the variant does not read does not move its prefix
        blind = dict(rec, ids={k: (v if k in fields else [1, 2, 3]) for k, v in rec["ids"].items()},
                     p0=rec["p0"] if conf else [1.0] + [0.0] * 9)
        with torch.no_grad():
            assert torch.equal(T.encoder_prefix(r["actor"], r["encoder"], blind), ours)
        worst = max(worst, (ours - torch.tensor(rec["prefix"]).view_as(ours)).abs().max().item())
    print(f"{variant}: max |recall prefix - trainer prefix| = {worst:.3g}")
    assert worst <= TOL
    # served: `scopemem run` answers with the prefix and still reports the plain answer
    rows = [json.loads(x) for x in recall("scopemem", "run", "--model", MODEL, "--dataset", DATASET, "--lines", "1,2",
                                          "--max-tokens", "16", "--backend", "cpu", "--encoder", enc_dir).splitlines()]
    assert len(rows) == 2 and all(row["opinions"]["first"] is not None for row in rows)


def test_eval_compare_reports_two_variants(trained, variants, tmp_path):
    """`recall eval` with the full and the task-only encoder, then `recall eval --compare`."""
    reports = {}
    for name, enc_dir in [("full", trained["out"] / "encoder"),
                          ("task-only", trained["out"].parent / "task-only" / "encoder")]:
        path = tmp_path / f"{name}.json"
        recall("eval", "--model", MODEL, "--dataset", DATASET, "--lines", LINES, "--max-tokens", "16",
               "--backend", "cpu", "--encoder", str(enc_dir), "--bootstrap", "200", "--json", str(path))
        reports[name] = path
    out = tmp_path / "compare.json"
    md = recall("eval", "--compare", str(reports["full"]), str(reports["task-only"]), "--bootstrap", "200",
                "--json", str(out))
    c = json.load(open(out))
    counts = c["pairwise"]
    assert counts["steps"] == 4
    assert counts["both_right"] + counts["only_a_right"] + counts["only_b_right"] + counts["neither"] == 4
    assert c["advantage"] == pytest.approx(c["em_b"] - c["em_a"])
    # against the plain actor (both reports share a0): B's repairs - harms minus A's is B's advantage
    p = c["against_plain"]
    assert p["steps"] + p["plain_disagrees"] == 4
    net = (p["b"]["repairs"] - p["b"]["harms"]) - (p["a"]["repairs"] - p["a"]["harms"])
    if p["plain_disagrees"] == 0:
        assert net == counts["only_b_right"] - counts["only_a_right"]
    assert "only one keeps" in md


def test_trains_on_the_paper_layout(tmp_path):
    """A dump in the paper's context (one user turn, latest three screenshots) renders and trains."""
    cmd = [recall_bin(), "scopemem", "dump", "--model", MODEL, "--dataset", DATASET, "--lines", "5",
           "--max-tokens", "16", "--backend", "cpu", "--context", "paper", "--out", str(tmp_path / "paper.jsonl")]
    assert subprocess.run(cmd, capture_output=True, cwd=ROOT).returncode == 0
    rec = T.read_dump(str(tmp_path / "paper.jsonl"))[0]
    assert rec["layout"] == "paper" and len(rec["messages"]) == 2
    args = T.parse_args(["--dump", str(tmp_path / "paper.jsonl"), "--actor", MODEL, "--epochs", "1", "--no-eval",
                         "--variant", "one-pass", "--out", str(tmp_path / "out")])
    r = T.train(args)
    cfg = json.load(open(tmp_path / "out" / "encoder" / "scopemem_config.json"))
    assert (cfg["layout"], cfg["placement"]) == ("paper", "prepend")
    prompt = r["actor"].prompt(rec["messages"], rec["_dir"])
    assert prompt["grid"].shape[0] == 3  # three screenshots reach the actor
    assert len(r["steps"]) == 1 and math.isfinite(r["steps"][0]["loss"])
