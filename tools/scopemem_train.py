#!/usr/bin/env python3
"""Train the ScopeMem first-opinion encoder (Zheng et al., 2026, §4.2) from `recall scopemem dump` files.

The trainer reads ONLY dump lines (docs/SCOPEMEM.md "Training from the dump") and the frozen actor:
nothing about the prompt or the encoder's inputs is rebuilt here, so training sees exactly what serving
computes. Per dump line:

* the actor's input is the line's `messages` rendered with the actor's chat template and image processor
  (images included, one `<|image_pad|>` per merged image token, as tools/hgkv_train.py does), with the
  generation prompt; the target is the recorded `reference` (teacher-forced);
* the encoder reads `ids` (its four fields' token ids, already cut to `max_positions`), embedded with the
  frozen actor's input embedding table, and `p0` (it computes H0 = -sum p ln p itself, as recall's does);
* its K prefix vectors are placed per the line's `placement`, as recall's `with_prefix` does: `prepend`
  before the whole prompt, `append` right before the final `<|im_start|>assistant\\n`; either way they are
  embedding rows positioned as text tokens (M-RoPE: the three axes equal, the positions after them shift).

Objective (docs/EVAL.md "Training objective"), only the encoder trains (the actor is frozen):

    L_t = CE_t + k_t * w_t * P_t                      (epoch 1: L_t = CE_t)

    CE_t = mean over the tokens y*_j of `reference`  -log pi_z(y*_j | z_t + c_t, y*_<j)
    k_t  = 1 if a0 (`first`) is right (EM against the reference, with `target_box` for click-like
           references), else 0 (--unscoped: k_t = 1 on every step; --no-preservation: k_t = 0)
    w_t  = p0[type(a0)], the actor's probability of a0's action type
    P_t  = sum_j m_j KL(pi_0(. | c_t, a0_<j) || pi_z(. | z_t + c_t, a0_<j)) / sum_j m_j   over `first_tokens`
           m_j = 10 on decision tokens (overlapping the JSON string values of `action`, `button`,
           `status`), 1 on argument tokens; pi_0 is the actor without a prefix (no gradient).

    recall scopemem dump --model ACTOR --dataset steps.jsonl [--placement append] --out train.jsonl
    .venv-tools/bin/python tools/scopemem_train.py --dump train.jsonl --actor ACTOR --epochs 2 --out out/sm
    recall scopemem run --model ACTOR --dataset test.jsonl --encoder out/sm/encoder [--placement append]

`--variant` picks what a new encoder reads (full, one-pass, task-only, history-only, fixed-query, no-history; the
paper's controls, docs/SCOPEMEM.md "Variants"); the objective is the same for all, and a0 always comes from the dump.
`no-history` is Table 7's history ablation, which the paper trains as a separate encoder.

The encoder is exported in recall's format (scopemem_config.json + scopemem.safetensors) to OUT/encoder;
OUT/scopemem_train_report.json holds the arguments, per-step losses and the objective on the training
set before and after training (the "loss first -> last" of the final report).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
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
from scopemem_encoder import FIELDS, VARIANTS, ScopeMemConfig, ScopeMemEncoder  # noqa: E402
from vl_inputs import image_paths  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ACTION_TYPES = ("key", "click", "long_press", "swipe", "type", "system_button", "open", "wait", "answer",
                "terminate")  # the mobile protocol's enum, in p0's order
DECISION_KEYS = ("action", "button", "status")
DECISION_WEIGHT = 10.0
MATCH_TOLERANCE = 25  # recall::agent::action::MATCH_TOLERANCE (mobile: Euclidean)
TEMPLATES = {"qwen3_vl": "qwen3-vl-8b-instruct", "qwen2_5_vl": "qwen2.5-vl-7b-instruct"}
ASSISTANT_TURN = "<|im_start|>assistant\n"
REPORT = "scopemem_train_report.json"
LAYOUTS = ("gui-owl", "paper")  # recall's --context names
# Every key the trainer reads from a dump line.
REQUIRED = ("messages", "reference", "first", "first_tokens", "p0", "ids", "placement", "max_positions",
            "action_types")


class DumpError(ValueError):
    """A dump line the trainer cannot use; the message names the file, the line and the field."""


# ---------------------------------------------------------------------------------------------- dump


def read_dump(paths) -> list:
    """The lines of one or more `recall scopemem dump` files, checked. Every line must hold every key of
    REQUIRED; all lines must agree on `placement` and `max_positions`."""
    if isinstance(paths, str):
        paths = [p for p in paths.split(",") if p]
    recs = []
    for path in paths:
        if not os.path.isfile(path):
            raise DumpError(f"{path}: no such dump file")
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{n}"
                try:
                    r = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DumpError(f"{where}: not JSON ({e})") from None
                if not isinstance(r, dict):
                    raise DumpError(f"{where}: not a JSON object")
                for k in REQUIRED:
                    if k not in r:
                        raise DumpError(f"{where}: missing field `{k}` (is this a `recall scopemem dump` line?)")
                if not isinstance(r["ids"], dict):
                    raise DumpError(f"{where}: `ids` is not an object")
                for k in FIELDS:
                    if k not in r["ids"]:
                        raise DumpError(f"{where}: missing field `ids.{k}`")
                    if len(r["ids"][k]) > r["max_positions"]:
                        raise DumpError(f"{where}: `ids.{k}` has {len(r['ids'][k])} ids > max_positions "
                                        f"{r['max_positions']}")
                if tuple(r["action_types"]) != ACTION_TYPES:
                    raise DumpError(f"{where}: `action_types` {r['action_types']} is not the mobile protocol's "
                                    f"{list(ACTION_TYPES)}")
                if len(r["p0"]) != len(ACTION_TYPES) or abs(sum(r["p0"]) - 1) > 1e-3:
                    raise DumpError(f"{where}: `p0` is not a distribution over {len(ACTION_TYPES)} action types")
                if r["placement"] not in ("prepend", "append"):
                    raise DumpError(f"{where}: `placement` {r['placement']!r}: expected prepend or append")
                if r.get("layout", "gui-owl") not in LAYOUTS:
                    raise DumpError(f"{where}: `layout` {r['layout']!r}: expected gui-owl or paper")
                if not isinstance(r["reference"], str):
                    raise DumpError(f"{where}: `reference` is not a response string")
                r["_where"], r["_dir"] = where, os.path.dirname(os.path.abspath(path))
                recs.append(r)
    if not recs:
        raise DumpError(f"{','.join(paths)}: no dump lines")
    for k in ("placement", "max_positions", "layout"):
        vals = sorted({str(r.get(k)) for r in recs})
        if len(vals) > 1:
            raise DumpError(f"the dump lines disagree on `{k}` ({', '.join(vals)}); train one encoder per {k}")
    return recs


# ---------------------------------------------------------------------------------------------- actions


def parse(r: str):
    """The `arguments` of a response's mobile tool call (canonical aliases applied), or None."""
    if "<tool_call>" not in r:
        return None
    tail = r.split("<tool_call>")[-1]
    if "</tool_call>" not in tail:
        return None
    try:
        obj = json.loads(tail.split("</tool_call>")[0].strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or obj.get("name") != "mobile_use" or not isinstance(obj.get("arguments"), dict):
        return None
    args = dict(obj["arguments"])
    a = {"tap": "click", "open_app": "open"}.get(args.get("action"), args.get("action"))
    if a not in ACTION_TYPES:
        return None
    args["action"] = a
    return args


def _point(v):
    if isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(x, (int, float)) for x in v):
        return v
    return None


def equivalent(x, y) -> bool:
    """Mobile action equivalence (mirrors recall::agent::action::equivalent)."""
    if x is None or y is None or x["action"] != y["action"]:
        return False
    for k in ("coordinate", "coordinate2"):
        if k in x or k in y:
            p, q = _point(x.get(k)), _point(y.get(k))
            if p is None or q is None or math.hypot(p[0] - q[0], p[1] - q[1]) > MATCH_TOLERANCE:
                return False
    for k in ("text", "button"):
        if k in x or k in y:
            if str(x.get(k, "")).casefold() != str(y.get(k, "")).casefold():
                return False
    return True


def exact_match(reference: str, output: str, target_box=None) -> bool:
    """EM as recall's eval counts it (src/agent/eval.rs `exact_match`)."""
    ref, out = parse(reference), parse(output)
    if out is None or ref is None:
        return False
    if equivalent(ref, out):
        return True
    p = _point(out.get("coordinate"))
    if target_box and p and ref["action"] in ("click", "long_press") and out["action"] == ref["action"]:
        x0, y0, x1, y1 = target_box
        return x0 <= p[0] <= x1 and y0 <= p[1] <= y1
    return False


# ---------------------------------------------------------------------------------------------- objective


def kl_rows(logp0: torch.Tensor, logpz: torch.Tensor) -> torch.Tensor:
    """KL(pi_0 || pi_z) per row of two log-prob matrices `[n, V]`."""
    return (logp0.exp() * (logp0 - logpz)).sum(-1)


def preservation(logp0: torch.Tensor, logpz: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """P_t: the mask-weighted mean of the per-token KL(pi_0 || pi_z)."""
    return (mask * kl_rows(logp0, logpz)).sum() / mask.sum()


def objective(ce: torch.Tensor, pres, k: bool, w: float, preserve: bool) -> torch.Tensor:
    """L_t = CE_t + k_t w_t P_t (preservation only when `preserve`, i.e. from epoch 2, and k_t = 1)."""
    if not preserve or not k or pres is None:
        return ce
    return ce + w * pres


def scope(correct: bool, mode: str) -> bool:
    """k_t for a step whose a0 is (not) right, under --preservation MODE."""
    return {"scoped": correct, "unscoped": True, "none": False}[mode]


def decision_mask(tok, first_tokens: list, first: str) -> torch.Tensor:
    """Per token of a0: DECISION_WEIGHT where the token overlaps a decision value (the JSON string value of
    `action`, `button` or `status` in `first`), else 1. Token character spans come from decoding
    `first_tokens` incrementally."""
    spans = [m.span(2) for m in re.finditer(r'"(%s)"\s*:\s*"([^"]*)"' % "|".join(DECISION_KEYS), first)]
    w, start = [], 0
    for j in range(len(first_tokens)):
        end = len(tok.decode(first_tokens[: j + 1]))
        w.append(DECISION_WEIGHT if any(start < e and s < end for s, e in spans) else 1.0)
        start = end
    return torch.tensor(w)


# ---------------------------------------------------------------------------------------------- actor


class Actor:
    """The frozen actor: tokenizer, chat template, image processor and forwards with an embedding run."""

    def __init__(self, model_dir: str, device: str = "cpu", dtype: str | None = None,
                 chat_template: str | None = None, image_root: str | None = None, image_cache: int = 32):
        from transformers import AutoImageProcessor, AutoModelForImageTextToText, PreTrainedTokenizerFast

        if not os.path.isfile(os.path.join(model_dir, "config.json")):
            raise DumpError(f"actor {model_dir}: no config.json")
        dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
            dtype or ("bfloat16" if device.startswith("cuda") else "float32")]
        self.model_dir, self.device, self.image_root = model_dir, torch.device(device), image_root
        self.tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(model_dir, "tokenizer.json"))
        self.image_processor = AutoImageProcessor.from_pretrained(model_dir)
        self.model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dt).to(self.device).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.embed = self.model.get_input_embeddings()
        self.hidden = self.model.config.text_config.hidden_size
        self.image_pad = self.model.config.image_token_id
        self.template = self._template(chat_template)
        self.turn = self.ids(ASSISTANT_TURN)
        self._vision_cached = functools.lru_cache(maxsize=image_cache)(self._vision)
        self._grids = {}

    def _template(self, path):
        candidates = [path] if path else [
            os.path.join(self.model_dir, "chat_template.json"), os.path.join(self.model_dir, "chat_template.jinja"),
            os.path.join(ROOT, "models", TEMPLATES.get(self.model.config.model_type, "?"), "chat_template.json")]
        for c in candidates:
            if c and os.path.isfile(c):
                with open(c, encoding="utf-8") as f:
                    return json.load(f)["chat_template"] if c.endswith(".json") else f.read()
        raise DumpError(f"no chat template for {self.model_dir} (tried {candidates}); pass --chat-template")

    def ids(self, text: str) -> list:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def _resolve(self, path: str, base: str) -> str:
        if os.path.isabs(path):
            return path
        for root in (self.image_root, os.getcwd(), base, ROOT):
            if root and os.path.isfile(os.path.join(root, path)):
                return os.path.join(root, path)
        raise DumpError(f"image {path}: not found (relative to --image-root, the working directory, {base} "
                        f"or {ROOT})")

    def _image(self, path: str):
        from transformers.image_utils import load_image

        proc = self.image_processor(images=[load_image(path)], return_tensors="pt")
        self._grids[path] = proc["image_grid_thw"]
        return proc["pixel_values"], proc["image_grid_thw"]

    def _grid(self, path: str) -> torch.Tensor:
        """An image's patch grid (only the grid is kept for every image; pixels are recomputed on use)."""
        if path not in self._grids:
            self._image(path)
        return self._grids[path]

    @torch.no_grad()
    def prompt(self, messages: list, base: str = ".") -> dict:
        """The prompt of a dump line: token ids (generation prompt appended, `<|image_pad|>` expanded), the
        image grids and the resolved image paths (their frozen vision features are computed on use, cached
        per image)."""
        text = self.tok.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                            add_generation_prompt=True)
        paths = [self._resolve(p, base) for p in image_paths(messages)]
        if not paths:
            return {"ids": torch.tensor(self.ids(text)), "grid": None, "images": ()}
        grid = torch.cat([self._grid(p) for p in paths])
        counts = (grid.prod(-1) // self.image_processor.merge_size ** 2).tolist()
        parts = text.split("<|image_pad|>")
        if len(parts) != len(counts) + 1:
            raise DumpError(f"the chat template rendered {len(parts) - 1} images, the messages have {len(counts)}")
        text = parts[0] + "".join("<|image_pad|>" * n + p for n, p in zip(counts, parts[1:]))
        ids = torch.tensor(self.ids(text))
        if int((ids == self.image_pad).sum()) != sum(counts):
            raise DumpError("image token count mismatch after tokenization")
        return {"ids": ids, "grid": grid, "images": tuple(paths)}

    @torch.no_grad()
    def _vision(self, path: str):
        """The frozen vision tower's output for one image: (merged features, deepstack features per layer)."""
        pixels, grid = self._image(path)
        out = self.model.model.get_image_features(pixels.to(self.device, self.model.dtype), grid.to(self.device),
                                                  return_dict=True)
        return type(out), out.pooler_output[0], [f[0] for f in out.deepstack_features]

    def vision(self, paths):
        """What transformers' `mm_encoder_outputs["image"]` holds for these images (cached per image)."""
        outs = [self._vision_cached(p) for p in paths]
        return outs[0][0](pooler_output=tuple(o[1] for o in outs),
                          deepstack_features=[tuple(o[2][i] for o in outs) for i in range(len(outs[0][2]))])

    def embed_ids(self, ids: list) -> torch.Tensor:
        """Rows of the frozen input embedding table, f32 `[n, hidden]` (what recall's `embed_tokens` gives)."""
        return self.embed(torch.tensor(ids, dtype=torch.long, device=self.device)).detach().float()

    def logits(self, prompt: dict, target: list, prefix: torch.Tensor | None = None,
               placement: str = "prepend") -> torch.Tensor:
        """Logits predicting each `target` token after the prompt, `[len(target), vocab]` (f32). With a
        prefix `[K, hidden]`: placed per `placement` as text-positioned embedding rows (recall's
        `with_prefix` and `Segment::Embeds`)."""
        p_ids = prompt["ids"]
        t_ids = torch.tensor(target, dtype=torch.long)
        if prefix is None:
            ids, at, k = torch.cat([p_ids, t_ids]), 0, 0
        else:
            k = prefix.shape[0]
            if placement == "prepend":
                at = 0
            else:
                n = len(self.turn)
                if p_ids[-n:].tolist() != self.turn:
                    raise DumpError("the rendered prompt does not end with the assistant turn")
                at = len(p_ids) - n
            ids = torch.cat([p_ids[:at], torch.zeros(k, dtype=torch.long), p_ids[at:], t_ids])
        ids = ids.to(self.device)
        mm = (ids == self.image_pad).int()
        mm[at:at + k] = 0  # embedding rows are text
        emb = self.embed(ids)
        if prefix is not None:
            emb = torch.cat([emb[:at], prefix.to(emb.dtype), emb[at + k:]])
        if prompt["grid"] is not None:
            pos, _ = self.model.model.get_rope_index(ids[None], mm_token_type_ids=mm[None],
                                                     image_grid_thw=prompt["grid"].to(self.device))
        else:
            pos = torch.arange(len(ids), device=self.device).view(1, 1, -1).expand(3, 1, -1)
        kw = {"inputs_embeds": emb[None], "position_ids": pos, "logits_to_keep": len(target) + 1}
        if prompt["grid"] is not None:
            kw.update(image_grid_thw=prompt["grid"].to(self.device),
                      mm_encoder_outputs={"image": self.vision(prompt["images"])})
        self.model.model.rope_deltas = None
        return self.model(**kw).logits[0, :-1].float()


# ---------------------------------------------------------------------------------------------- training


def encoder_fields(actor: Actor, rec: dict) -> dict:
    """The encoder's inputs of a dump line: its `ids`, embedded with the frozen actor's table."""
    return {k: actor.embed_ids(rec["ids"][k]) for k in FIELDS}


def encoder_prefix(actor: Actor, enc: ScopeMemEncoder, rec: dict) -> torch.Tensor:
    """The prefix `[K, hidden]` the encoder writes for a dump line (what recall computes in `prefix`)."""
    dev = next(enc.parameters()).device
    return enc({k: v.to(dev) for k, v in encoder_fields(actor, rec).items()},
               torch.tensor(rec["p0"], dtype=torch.float32, device=dev))


def prepare(actor: Actor, rec: dict) -> dict:
    """Everything a step needs that does not depend on the encoder (computed once)."""
    a0 = parse(rec["first"])
    p0 = torch.tensor(rec["p0"], dtype=torch.float32)
    return {
        "rec": rec, "prompt": actor.prompt(rec["messages"], rec["_dir"]), "target": actor.ids(rec["reference"]),
        "first_tokens": list(rec["first_tokens"]), "p0": p0,
        "w": float(p0[ACTION_TYPES.index(a0["action"])]) if a0 else 0.0,
        "correct": exact_match(rec["reference"], rec["first"], rec.get("target_box")),
        "mask": decision_mask(actor.tok, rec["first_tokens"], rec["first"]),
        "fields": encoder_fields(actor, rec), "placement": rec["placement"],
    }


def step_loss(actor: Actor, enc: ScopeMemEncoder, s: dict, preserve: bool, mode: str):
    """(L_t, CE_t, P_t or None) for a prepared step."""
    dev = next(enc.parameters()).device
    z = enc({k: v.to(dev) for k, v in s["fields"].items()}, s["p0"].to(dev))
    logits = actor.logits(s["prompt"], s["target"], z, s["placement"])
    ce = F.cross_entropy(logits, torch.tensor(s["target"], device=logits.device))
    k = scope(s["correct"], mode)
    if not (preserve and k and s["first_tokens"]):
        return ce, ce, None
    with torch.no_grad():
        logp0 = F.log_softmax(actor.logits(s["prompt"], s["first_tokens"]), -1)
    logpz = F.log_softmax(actor.logits(s["prompt"], s["first_tokens"], z, s["placement"]), -1)
    pres = preservation(logp0, logpz, s["mask"].to(logpz.device))
    return objective(ce, pres, k, s["w"], preserve), ce, pres


@torch.no_grad()
def evaluate(actor: Actor, enc: ScopeMemEncoder, data: list, preserve: bool, mode: str) -> dict:
    """Mean L, CE over `data` (encoder in eval mode)."""
    enc.eval()
    tot = [0.0, 0.0]
    for s in data:
        loss, ce, _ = step_loss(actor, enc, s, preserve, mode)
        tot[0] += loss.item()
        tot[1] += ce.item()
    return {"loss": tot[0] / len(data), "ce": tot[1] / len(data)}


def trained_layout(recs):
    """The dump's context layout (all lines agree, read_dump checks); None for a dump written before recall
    recorded it, with a warning: the encoder is then exported without the record and served unchecked."""
    layout = recs[0].get("layout")
    if layout is None:
        print("warning: the dump records no `layout`; the encoder will not record the context layout it was "
              "trained with (recall then serves it under any --context)", file=sys.stderr)
    return layout


def make_encoder(args, hidden: int, max_positions: int) -> tuple:
    if args.init:
        enc = ScopeMemEncoder.load(args.init)
        if enc.cfg.hidden_size != hidden or enc.cfg.max_positions != max_positions:
            raise DumpError(f"--init {args.init}: hidden {enc.cfg.hidden_size} / max_positions "
                            f"{enc.cfg.max_positions}, but the actor has hidden {hidden} and the dump "
                            f"max_positions {max_positions}")
        if args.variant and enc.cfg.variant() != args.variant:
            raise DumpError(f"--init {args.init} is a {enc.cfg.variant() or 'custom'} encoder, not --variant "
                            f"{args.variant}")
        return enc.train(), "init"
    size = args.encoder_size if args.encoder_size != "auto" else ("tiny" if hidden <= 256 else "paper")
    if size == "tiny":
        cfg = ScopeMemConfig(hidden_size=hidden, d_model=32, num_heads=2, ffn_size=64, conf_hidden=32,
                             max_positions=max_positions)
    else:
        cfg = ScopeMemConfig(hidden_size=hidden, max_positions=max_positions)
    return ScopeMemEncoder(cfg.with_variant(args.variant or "full")), size


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dump", required=True, help="`recall scopemem dump` file(s), comma-separated")
    p.add_argument("--actor", required=True, help="the actor's model directory (the one the dump was made with)")
    p.add_argument("--out", help="output directory (default: a new temporary directory)")
    p.add_argument("--epochs", type=int, default=2, help="epoch 1 is CE only; later epochs add preservation")
    p.add_argument("--steps", type=int, help="steps per epoch, cycling through the data (default: all lines)")
    p.add_argument("--preservation", choices=["scoped", "unscoped", "none"], default="scoped")
    p.add_argument("--unscoped", action="store_const", dest="preservation", const="unscoped",
                   help="ablation: preservation on every step (k_t = 1)")
    p.add_argument("--no-preservation", action="store_const", dest="preservation", const="none",
                   help="ablation: CE only")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--accumulate", type=int, default=1, help="steps per optimizer update")
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="the actor's dtype (default: float32 on CPU, bfloat16 on CUDA); the encoder is f32")
    p.add_argument("--encoder-size", choices=["auto", "paper", "tiny"], default="auto",
                   help="paper: d 384, 6 heads, ffn 1536; tiny: d 32, 2 heads, ffn 64; auto: tiny for hidden <= 256")
    p.add_argument("--variant", choices=list(VARIANTS),
                   help="what the encoder reads (docs/SCOPEMEM.md \"Variants\"): full (default: a0, task, summary, "
                        "recent actions, p0/H0), one-pass (task, summary, recent actions), task-only, history-only "
                        "(summary, recent actions), fixed-query (nothing), no-history (a0, task, p0/H0: Table 7's "
                        "separately trained history ablation)")
    p.add_argument("--init", help="start from this encoder directory instead of a fresh one")
    p.add_argument("--chat-template", help="chat template file (default: the actor's, else models/...)")
    p.add_argument("--image-root", help="directory relative image paths of the dump are resolved against first")
    p.add_argument("--image-cache", type=int, default=32, help="images whose vision features stay cached")
    p.add_argument("--no-eval", action="store_true", help="skip the objective on the data before/after training")
    return p.parse_args(argv)


def train(args) -> dict:
    """Runs the training; returns the report (with the trained encoder under `encoder`, not serialised)."""
    torch.manual_seed(args.seed)
    if args.device == "cpu":
        torch.use_deterministic_algorithms(True)
    t0 = time.time()
    recs = read_dump(args.dump)
    actor = Actor(args.actor, args.device, args.dtype, args.chat_template, args.image_root, args.image_cache)
    placement, max_positions = recs[0]["placement"], recs[0]["max_positions"]
    enc, size = make_encoder(args, actor.hidden, max_positions)
    enc = enc.to(args.device)
    data = [prepare(actor, r) for r in recs]
    n_params = sum(q.numel() for q in enc.parameters())
    variant = enc.cfg.variant() or "custom"
    print(f"{len(data)} dump lines ({placement}, max_positions {max_positions}), "
          f"{sum(s['correct'] for s in data)} with a right first opinion; {variant} encoder {n_params:,} "
          f"parameters ({size}); prepared in {time.time() - t0:.1f} s", file=sys.stderr)

    final_preserve = args.epochs >= 2 and args.preservation != "none"
    before = None if args.no_eval else evaluate(actor, enc, data, final_preserve, args.preservation)
    opt = torch.optim.AdamW(enc.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    gen = torch.Generator().manual_seed(args.seed)
    log = []
    for epoch in range(1, args.epochs + 1):
        preserve = epoch >= 2 and args.preservation != "none"
        n = args.steps if args.steps is not None else len(data)
        order = torch.randperm(len(data), generator=gen).tolist()
        totals = [0.0, 0.0, 0.0, 0]
        enc.train()
        for i in range(n):
            s = data[order[i % len(data)]]
            loss, ce, pres = step_loss(actor, enc, s, preserve, args.preservation)
            (loss / args.accumulate).backward()
            if (i + 1) % args.accumulate == 0 or i + 1 == n:
                torch.nn.utils.clip_grad_norm_(enc.parameters(), args.clip)
                opt.step()
                opt.zero_grad()
            totals[0] += loss.item()
            totals[1] += ce.item()
            if pres is not None:
                totals[2] += pres.item()
                totals[3] += 1
            log.append({"epoch": epoch, "step": i, "line": s["rec"].get("line"), "loss": loss.item(),
                        "ce": ce.item(), "preservation": None if pres is None else pres.item(),
                        "a0_right": s["correct"], "w": s["w"]})
            print(f"  epoch {epoch} step {i + 1}/{n}: loss {loss.item():.4f} (CE {ce.item():.4f}"
                  + ("" if pres is None else f", P {pres.item():.4f}") + ")", file=sys.stderr)
        phase = f"CE + {args.preservation} preservation" if preserve else "CE only"
        print(f"epoch {epoch} ({phase}): loss {totals[0] / n:.4f}, CE {totals[1] / n:.4f}, "
              f"P {totals[2] / max(totals[3], 1):.4f} on {totals[3]} steps", file=sys.stderr)
    after = None if args.no_eval else evaluate(actor, enc, data, final_preserve, args.preservation)

    out = args.out or tempfile.mkdtemp(prefix="scopemem-train-")
    enc.eval()
    layout = trained_layout(recs)
    # The encoder directory records what it was trained for; recall refuses to serve it under another.
    enc.cfg = dataclasses.replace(enc.cfg, layout=layout, placement=placement)
    enc_dir = os.path.join(out, "encoder")
    enc.cpu().save(enc_dir)
    check = ScopeMemEncoder.load(enc_dir)
    with torch.no_grad():
        fields = {k: v.cpu() for k, v in data[0]["fields"].items()}
        same = torch.equal(check(fields, data[0]["p0"]), enc(fields, data[0]["p0"]))
    if not same:
        raise RuntimeError("the exported encoder differs from the trained one")
    report = {"args": {k: v for k, v in vars(args).items()}, "variant": variant, "fields": list(enc.cfg.fields),
              "confidence": enc.cfg.confidence, "encoder_size": size, "parameters": n_params,
              "lines": len(data), "placement": placement, "layout": layout, "max_positions": max_positions,
              "a0_right": sum(s["correct"] for s in data), "before": before, "after": after,
              "steps": log, "encoder_dir": enc_dir, "seconds": time.time() - t0}
    with open(os.path.join(out, REPORT), "w") as f:
        json.dump(report, f, indent=1)
    report["encoder"] = enc
    report["actor"] = actor
    return report


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        r = train(args)
    except DumpError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if r["before"] is not None:
        print(f"loss on the {r['lines']} lines: {r['before']['loss']:.4f} -> {r['after']['loss']:.4f} "
              f"(CE {r['before']['ce']:.4f} -> {r['after']['ce']:.4f})", file=sys.stderr)
    if r["steps"]:
        print(f"training loss first -> last step: {r['steps'][0]['loss']:.4f} -> {r['steps'][-1]['loss']:.4f}",
              file=sys.stderr)
    print(f"encoder -> {r['encoder_dir']} ({r['seconds']:.1f} s)", file=sys.stderr)
    print(r["encoder_dir"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
