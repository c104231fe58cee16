#!/usr/bin/env python3
"""ScopeMem training objective (Zheng et al., 2026, §4.2) on a frozen Qwen3-VL actor; text-only reference.

Only the first-opinion encoder E_phi (tools/scopemem_encoder.py) is trained. Per step t, with context c_t
(task + previous actions), reference response y*, first opinion a0 (the frozen actor's greedy answer
without a prefix) and prefix z_t = E_phi(a0, p0, task, summary, recent actions) prepended to the actor's
input embeddings (the 16 prefix vectors take positions 0..15, the text follows, as text tokens):

    L_t = CE_t + k_t * w_t * P_t                      (epoch 1: L_t = CE_t)

    CE_t = mean over the tokens y*_j of  -log pi_z(y*_j | z_t + c_t, y*_<j)
    k_t  = 1 if a0 is right (equivalent to y*; the scope of revision is k_t = 0), else 0
           (--preservation unscoped: k_t = 1 on every step; none: k_t = 0)
    w_t  = p0[type(a0)], the actor's probability of a0's action type (confidence weight, in [0, 1])
    P_t  = sum_j m_j KL(pi_0(. | c_t, a0_<j) || pi_z(. | z_t + c_t, a0_<j)) / sum_j m_j   over a0's tokens
           m_j = 10 for decision tokens (those overlapping the JSON string values of `action`, `button`,
           `status`, i.e. the action type and the categorical choices), 1 for argument tokens.

pi_0 is the frozen actor without a prefix (no gradient); KL is taken over the full vocabulary.
p0 (10 action types of the mobile protocol) is computed as the engine does: at a0's decision position
(right after `"action": "`; for an a0 without one, after the canonical `<tool_call>\\n{"name": "mobile_use",
"arguments": {"action": "`), each type's continuation `name"` is scored and the 10 sequence
probabilities are renormalised; H0 is its entropy (the encoder computes it).

Data (JSONL, one step per line; recall's step format plus `first`): `instruction`, `history` (previous
responses or action lines), `reference` (response or tool-call object), `first` (a0 response), optional
`first_correct` (overrides the built-in mobile equivalence check) and `summary` (default: the last three
history action lines). Screenshots are ignored: this is the text-only reference of the objective. Without
--data a handful of synthetic steps (right, wrong-coordinate, wrong-type and unparseable first opinions)
is used.

    .venv-tools/bin/python tools/scopemem_train.py --steps 8          # smoke: 2 epochs x 8 steps, < 1 min on CPU
    .venv-tools/bin/python tools/scopemem_train.py --actor tests/fixtures/tiny-qwen3-vl --data steps.jsonl \\
        --epochs 2 --lr 1e-4 --out out/scopemem

The trained encoder is exported in recall's format (scopemem_config.json + scopemem.safetensors, via
ScopeMemEncoder.save) to OUT/encoder; OUT defaults to a fresh temporary directory. OUT/train_log.json
records the per-step losses.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scopemem_encoder import ScopeMemConfig, ScopeMemEncoder  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ACTION_TYPES = ("key", "click", "long_press", "swipe", "type", "system_button", "open", "wait", "answer",
                "terminate")  # the mobile protocol's enum, in its order
DECISION_KEYS = ("action", "button", "status")
DECISION_WEIGHT = 10.0
DECISION_PREFIX = '<tool_call>\n{"name": "mobile_use", "arguments": {"action": "'
PROMPT = ("Please generate the next move according to the UI screenshot, instruction and previous actions."
          "\n\nInstruction: {goal}\n\nPrevious actions:\n{history}")


# ---------------------------------------------------------------------------------------------- actions


def response(line: str, args: dict) -> str:
    call = json.dumps({"name": "mobile_use", "arguments": args}, ensure_ascii=False)
    return f"Action: {line}\n<tool_call>\n{call}\n</tool_call>"


def action_line(r: str) -> str:
    return r.split("Action:")[-1].split("<tool_call>")[0].strip()


def parse(r: str):
    """The `arguments` of a response's tool call (canonical aliases applied), or None."""
    if not isinstance(r, str):
        r = "<tool_call>" + json.dumps(r) + "</tool_call>"
    if "<tool_call>" not in r:
        try:
            obj = json.loads(r)
        except json.JSONDecodeError:
            return None
    else:
        tail = r.split("<tool_call>")[-1]
        if "</tool_call>" not in tail:
            return None
        try:
            obj = json.loads(tail.split("</tool_call>")[0].strip())
        except json.JSONDecodeError:
            return None
    if isinstance(obj, dict) and "name" not in obj and "action" in obj:
        obj = {"name": "mobile_use", "arguments": obj}
    if not isinstance(obj, dict) or obj.get("name") != "mobile_use" or not isinstance(obj.get("arguments"), dict):
        return None
    args = dict(obj["arguments"])
    a = {"tap": "click", "open_app": "open"}.get(args.get("action"), args.get("action"))
    if a not in ACTION_TYPES or a == "key":
        return None
    args["action"] = a
    return args


def equivalent(x: dict, y: dict) -> bool:
    """Mobile action equivalence (mirrors recall::agent::action::equivalent)."""
    if x is None or y is None or x["action"] != y["action"]:
        return False
    for k in ("coordinate", "coordinate2"):
        if k in x or k in y:
            p, q = x.get(k), y.get(k)
            if p is None or q is None or math.hypot(p[0] - q[0], p[1] - q[1]) > 25:
                return False
    for k in ("text", "button"):
        if k in x or k in y:
            if str(x.get(k, "")).casefold() != str(y.get(k, "")).casefold():
                return False
    return True


def synthetic_steps():
    """Text-only steps with known first opinions: right, near-right, wrong coordinate, wrong type, garbage."""
    click = lambda x, y: response(f"Click at ({x}, {y}).", {"action": "click", "coordinate": [x, y]})  # noqa: E731
    typ = lambda t: response(f"Type {json.dumps(t)}.", {"action": "type", "text": t})  # noqa: E731
    home = response("Press the Home button.", {"action": "system_button", "button": "Home"})
    done = response("Task completed.", {"action": "terminate", "status": "success"})
    opn = response('Open "Clock".', {"action": "open", "text": "Clock"})
    steps = [
        ("Set an alarm for 7 am.", [], opn, opn),
        ("Set an alarm for 7 am.", [opn], click(500, 880), click(510, 890)),
        ("Set an alarm for 7 am.", [opn, click(500, 880)], typ("7:00"), click(300, 300)),
        ("Search for pizza nearby.", [home], click(500, 120), click(500, 700)),
        ("Search for pizza nearby.", [home, click(500, 120)], typ("pizza"), typ("pizza")),
        ("Search for pizza nearby.", [home, click(500, 120), typ("pizza")], done, "Action: Done.\n<tool_call>{"),
        ("Turn on Wi-Fi.", [], home, home),
        ("Turn on Wi-Fi.", [home], click(200, 40), done),
    ]
    return [{"instruction": g, "history": h, "reference": r, "first": f} for g, h, r, f in steps]


# ---------------------------------------------------------------------------------------------- actor


class Actor:
    """The frozen actor: token embeddings, forward on input embeddings, chat rendering."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration

        self.model = Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tok = AutoTokenizer.from_pretrained(path)
        self.embed = self.model.get_input_embeddings()
        self.hidden = self.model.config.text_config.hidden_size

    def ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def context_ids(self, instruction: str, history: list[str]) -> list[int]:
        lines = "\n".join(f"Step{i + 1}: {action_line(h) if '<tool_call>' in h else h}"
                          for i, h in enumerate(history)) or "No previous action."
        text = (f"<|im_start|>user\n{PROMPT.format(goal=instruction, history=lines)}<|im_end|>\n"
                "<|im_start|>assistant\n")
        return self.ids(text)

    def logits(self, embeds: torch.Tensor) -> torch.Tensor:
        """`embeds [L, hidden]` -> logits `[L, vocab]` (positions 0..L-1, as text tokens)."""
        h = self.model.model.language_model(inputs_embeds=embeds[None], use_cache=False).last_hidden_state
        return self.model.lm_head(h)[0]

    def target_logits(self, prefix, ctx: list[int], target: list[int]) -> torch.Tensor:
        """Logits predicting each `target` token given `[prefix] + ctx + target[:-1]`: `[len(target), vocab]`."""
        parts = ([prefix] if prefix is not None else []) + [self.embed(torch.tensor(ctx + target))]
        logits = self.logits(torch.cat(parts, 0))
        n = len(target)
        return logits[-n - 1:-1]

    @torch.no_grad()
    def p0(self, ctx: list[int], first: str) -> torch.Tensor:
        """The actor's probabilities over the 10 action types at a0's decision position (no prefix)."""
        m = re.search(r'"action"\s*:\s*"', first)
        head = first[:m.end()] if m else DECISION_PREFIX
        base = ctx + self.ids(head)
        scores = []
        for name in ACTION_TYPES:
            cont = self.ids(name + '"')
            logp = F.log_softmax(self.target_logits(None, base, cont), -1)
            scores.append(logp.gather(1, torch.tensor(cont)[:, None]).sum())
        return torch.softmax(torch.stack(scores), 0)


def decision_mask(actor: Actor, text: str) -> torch.Tensor:
    """Per token of `text`: DECISION_WEIGHT where the token overlaps a decision value, else 1."""
    enc = actor.tok(text, add_special_tokens=False, return_offsets_mapping=True)
    spans = [m.span(2) for m in re.finditer(r'"(%s)"\s*:\s*"([^"]*)"' % "|".join(DECISION_KEYS), text)]
    w = [DECISION_WEIGHT if any(s < e2 and s2 < e for s2, e2 in spans) else 1.0 for s, e in enc["offset_mapping"]]
    return torch.tensor(w)


def field_embeds(actor: Actor, text: str, max_len: int, keep_tail: bool) -> torch.Tensor:
    ids = actor.ids(text) if text else []
    ids = ids[-max_len:] if keep_tail else ids[:max_len]
    return actor.embed(torch.tensor(ids, dtype=torch.long)).detach()


# ---------------------------------------------------------------------------------------------- training


def prepare(actor: Actor, rec: dict, max_len: int) -> dict:
    """Everything a step needs that does not depend on the encoder (computed once)."""
    reference = rec["reference"]
    if not isinstance(reference, str):
        args = parse(reference)
        reference = response(args["action"], args) if args else json.dumps(reference)
    first, history = rec["first"], rec.get("history", [])
    ctx = actor.context_ids(rec["instruction"], history)
    a_first, a_ref = parse(first), parse(reference)
    correct = rec.get("first_correct", equivalent(a_first, a_ref))
    p0 = actor.p0(ctx, first)
    w = float(p0[ACTION_TYPES.index(a_first["action"])]) if a_first else 0.0
    lines = [action_line(h) if "<tool_call>" in h else h for h in history]
    summary = rec.get("summary", " ".join(lines[-3:]))
    first_ids = actor.ids(first)
    with torch.no_grad():
        logp0 = F.log_softmax(actor.target_logits(None, ctx, first_ids), -1)
    return {
        "ctx": ctx, "target": actor.ids(reference), "first_ids": first_ids, "p0": p0, "w": w,
        "k": bool(correct), "logp0": logp0, "mask": decision_mask(actor, first),
        "fields": {
            "first_opinion": field_embeds(actor, first, max_len, keep_tail=False),
            "task": field_embeds(actor, rec["instruction"], max_len, keep_tail=False),
            "summary": field_embeds(actor, summary, max_len, keep_tail=True),
            "recent_actions": field_embeds(actor, "\n".join(lines[-3:]), max_len, keep_tail=True),
        },
    }


def step_loss(actor: Actor, enc: ScopeMemEncoder, s: dict, preserve: bool, mode: str):
    """(L_t, CE_t, P_t or None)."""
    z = enc(s["fields"], s["p0"])  # [16, hidden]
    logits = actor.target_logits(z, s["ctx"], s["target"])
    ce = F.cross_entropy(logits, torch.tensor(s["target"]))
    k = {"scoped": s["k"], "unscoped": True, "none": False}[mode]
    if not (preserve and k and s["first_ids"]):
        return ce, ce, None
    logpz = F.log_softmax(actor.target_logits(z, s["ctx"], s["first_ids"]), -1)
    kl = (s["logp0"].exp() * (s["logp0"] - logpz)).sum(-1)  # KL(pi_0 || pi_z) per a0 token
    pres = (s["mask"] * kl).sum() / s["mask"].sum()
    return ce + s["w"] * pres, ce, pres


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--actor", default=os.path.join(ROOT, "tests", "fixtures", "tiny-qwen3-vl"))
    p.add_argument("--data", help="JSONL steps (default: built-in synthetic steps)")
    p.add_argument("--out", help="output directory (default: a new temporary directory)")
    p.add_argument("--epochs", type=int, default=2, help="epoch 1 is CE only; later epochs add preservation")
    p.add_argument("--steps", type=int, help="smoke mode: N steps per epoch, cycling through the data")
    p.add_argument("--preservation", choices=["scoped", "unscoped", "none"], default="scoped")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--accumulate", type=int, default=1, help="steps per optimizer update")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--encoder-size", choices=["auto", "paper", "tiny"], default="auto",
                   help="paper: d 384, 6 heads, ffn 1536, 256 positions; tiny: d 32, 2 heads, ffn 64, 32 pos.")
    a = p.parse_args(argv)
    torch.manual_seed(a.seed)
    t0 = time.time()

    actor = Actor(a.actor)
    size = a.encoder_size if a.encoder_size != "auto" else ("tiny" if actor.hidden <= 256 else "paper")
    cfg = ScopeMemConfig(hidden_size=actor.hidden)
    if size == "tiny":
        cfg = ScopeMemConfig(hidden_size=actor.hidden, d_model=32, num_heads=2, ffn_size=64, conf_hidden=32,
                             max_positions=32)
    enc = ScopeMemEncoder(cfg)
    records = synthetic_steps() if a.data is None else [json.loads(x) for x in open(a.data) if x.strip()]
    data = [prepare(actor, r, cfg.max_positions) for r in records]
    print(f"{len(data)} steps, {sum(s['k'] for s in data)} with a right first opinion; encoder "
          f"{sum(q.numel() for q in enc.parameters()):,} parameters ({size})", file=sys.stderr)

    opt = torch.optim.AdamW(enc.parameters(), lr=a.lr, weight_decay=a.weight_decay)
    log = []
    for epoch in range(1, a.epochs + 1):
        preserve = epoch >= 2 and a.preservation != "none"
        n = a.steps if a.steps is not None else len(data)
        order = torch.randperm(len(data)).tolist()
        totals = [0.0, 0.0, 0.0, 0]
        enc.train()
        for i in range(n):
            s = data[order[i % len(data)]]
            loss, ce, pres = step_loss(actor, enc, s, preserve, a.preservation)
            (loss / a.accumulate).backward()
            if (i + 1) % a.accumulate == 0 or i + 1 == n:
                torch.nn.utils.clip_grad_norm_(enc.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
            totals[0] += loss.item()
            totals[1] += ce.item()
            if pres is not None:
                totals[2] += pres.item()
                totals[3] += 1
            log.append({"epoch": epoch, "step": i, "loss": loss.item(), "ce": ce.item(),
                        "preservation": None if pres is None else pres.item(), "k": s["k"], "w": s["w"]})
        phase = f"CE + {a.preservation} preservation" if preserve else "CE only"
        print(f"epoch {epoch} ({phase}): loss {totals[0] / n:.4f}"
              f", CE {totals[1] / n:.4f}, P {totals[2] / max(totals[3], 1):.4f} on {totals[3]} steps",
              file=sys.stderr)

    out = a.out or tempfile.mkdtemp(prefix="scopemem-train-")
    enc.eval()
    enc.save(os.path.join(out, "encoder"))
    check = ScopeMemEncoder.load(os.path.join(out, "encoder"))
    with torch.no_grad():
        s = data[0]
        assert torch.equal(check(s["fields"], s["p0"]), enc(s["fields"], s["p0"])), "exported encoder differs"
    with open(os.path.join(out, "train_log.json"), "w") as f:
        json.dump({"args": vars(a), "encoder_size": size, "steps": log}, f, indent=1)
    print(f"encoder -> {os.path.join(out, 'encoder')} ({time.time() - t0:.1f} s)", file=sys.stderr)
    print(os.path.join(out, "encoder"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
