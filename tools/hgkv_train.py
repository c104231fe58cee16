#!/usr/bin/env python3
"""Train the HGKV adapter (CausalCache's history-gated K/V LoRA) with the per-arm-anchored
difference-of-differences objective, and export it as a PEFT directory that `recall --adapter` loads.

Adapter. LoRA A [r, in], B [out, r] on `k_proj` and `v_proj` of the chosen decoder layers (default: the
last 8, clamped to the model; `--layers` overrides), rank 8, alpha 16 (scale alpha / r), no dropout. The
update `scale * B(A(h))` is added to the projection output (before k_norm and RoPE) through forward hooks,
only at the merged image tokens (`<|image_pad|>`) of the restored history screenshots: every image of the
prompt but the last, which is the current screen. Text, vision_start/end, the current image and the
response tokens are untouched; a prompt without a history image runs the frozen model bit for bit (the
hooks return the projection output unchanged). This is the mask recall computes (src/model/hgkv.rs).
`--adapter-mode ungated` trains the paper's control instead (same layers, every token).

Replacement groups (mined from `recall episode label` files, docs/FORMATS.md "Utility labels"). For each
decision t of an episode and each budget B in --budgets (B >= 1), with the event pool P = the eligible
steps of t in order and Recent-B = the last B steps of P (arm R; recall's pool ends at t - 1, so it is
steps t-B .. t-1):

    S = Recent-(B-1) + {j+}: the oldest recent slot replaced by the relevant frame
    W = Recent-(B-1) + {j-}: the same slot, the wrong frame

`--groups paper` (default; the paper's rule, "Per-B Fidelity-Restoration Supervision"), from the
`decision` lines' `context.events[].witness` (the action taken at that step is equivalent to the recorded
action at t):

    j+ = a witness step strictly older than the whole window: age t - s >= B + 1 (the paper's "age >= B+2"
         counts t - (s - 1), as the authors' desktop code does); one of several by a seeded choice
    j- = a non-witness step as old, nearest in age to j+ (two at equal distance: a seeded choice)

No eligible witness, or no non-witness as old, gives no group. The seeded choices (the authors pick the
same way; the paper does not say) hash --seed, the episode directory's name and t.

`--groups utility` (recall's earlier rule, an option): j+ / j- = the older step with the highest / lowest
frozen singleton utility Q({j}); a group needs two older steps and Q({j+}) - Q({j-}) > --min-gap (ties
give none; ranking ties break towards the more recent step). Label kinds other than `decision`,
`singleton` and `recent` (a consistency check of Recent-B) are ignored.

Objective (REFERENCE_NOTES "HGKV"). l = mean teacher-forced log-prob per token of the recorded response
r_t; suffix 0 = adapter off (frozen, computed once), A = adapter on:

    A_c = l_SA - l_S0,   A_r = l_RA - l_R0,   A_n = l_WA - l_W0
    L   = [m - (A_c - A_r)]+ + [m - A_c]+ + [m - (A_c - A_n)]+ + 2 ([|A_r| - 0.02]+ + [|A_n| - 0.02]+)
          + 1e-4 ||theta||^2,                                      m = 0.01

averaged over the groups of a batch (the L2 term once per step); AdamW without weight decay. The two DiD
hinges are unchanged by a uniform shift of the adapter-on arms; [m - A_c]+ is not (the shift moves A_c),
so the objective rewards a uniform lift up to m inside the drift cap (the paper's objective, as the
authors train it). With --low-memory (default on CUDA) each adapter-on arm is first scored without a
graph, then re-run with one and back-propagated with its scalar coefficient dL/dl, so one arm's
activations are alive at a time. In gated mode the K/V of the text the three arms share before their
first image is frozen, so it is computed once per group (--prefix-cache). On CPU a run is deterministic
given --seed and --threads.

Selection (the paper's pre-specified gates, per budget, on a development split: by episode when several
episodes are given, trajectory-disjoint; by decision otherwise). Every --eval-every steps the dev groups
are scored and, for each budget B with groups, B's gate passes when its mean DiD select (A_c - A_r) is
> 0, its percentile bootstrap 95% lower bound is > 0, and its mean |A_r| and mean |A_n| are < eps
(--gate-eps, 0.02); a budget with no dev groups fails. A checkpoint passes when every budget does. The
bootstrap (--bootstrap resamples) draws whole units, --bootstrap-unit: episodes (default; decisions when
the dev split has one episode) or decisions, so a decision's groups are never split. Of the passing
checkpoints the one with the largest pooled DiD select (all dev groups) is exported, ties to the earlier
step; when none passes the last one is, with a warning.

Outputs in --out: adapter_config.json + adapter_model.safetensors (PEFT names
`base_model.model.<module>.lora_{A,B}.weight`; `recall --adapter OUT` and `PeftModel.from_pretrained`
load it), and hgkv_report.json (arguments, groups, per-step losses, dev evaluations with each budget's
gate, selection, the exported checkpoint's per-group arms on the train and dev splits).

    recall episode label --model M --episode E --budgets 1,2,4 --out L.jsonl
    .venv-tools/bin/python tools/hgkv_train.py --model M --episodes E --labels L.jsonl \\
        --recall target/release/recall --out out/hgkv --steps 200 [--device cuda]

docs/TRAINING.md has the details.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import hashlib
import json
import logging
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vl_inputs import image_paths  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARGIN = 0.01
DRIFT_CAP = 0.02
DRIFT_WEIGHT = 2.0
L2 = 1e-4
ARMS = ("R", "S", "W")
TEMPLATES = {"qwen3_vl": "qwen3-vl-8b-instruct", "qwen2_5_vl": "qwen2.5-vl-7b-instruct"}
REPORT = "hgkv_report.json"

log = logging.getLogger("hgkv_train")


class TrainError(Exception):
    """A bad input: the message says which and why."""


# ---------------------------------------------------------------------------------------------- objective


def did_terms(l: dict) -> tuple:
    """(A_c, A_r, A_n) from the six arm scores R0 RA S0 SA W0 WA."""
    return l["SA"] - l["S0"], l["RA"] - l["R0"], l["WA"] - l["W0"]


def group_loss(l: dict, margin: float = MARGIN, cap: float = DRIFT_CAP, drift_weight: float = DRIFT_WEIGHT):
    """One group's DiD loss (without the L2 term) from its arm scores (floats or tensors)."""
    a_c, a_r, a_n = (torch.as_tensor(a, dtype=torch.float64) for a in did_terms(l))
    hinge = (torch.relu(margin - (a_c - a_r)) + torch.relu(margin - a_c) + torch.relu(margin - (a_c - a_n)))
    drift = torch.relu(a_r.abs() - cap) + torch.relu(a_n.abs() - cap)
    return hinge + drift_weight * drift


def l2_term(params, weight: float = L2):
    return weight * sum(p.double().pow(2).sum() for p in params)


# ---------------------------------------------------------------------------------------------- labels


@dataclass(frozen=True)
class Group:
    """One matched-budget replacement group: decision t of an episode at budget B."""
    episode: str
    t: int
    budget: int
    recent: tuple
    relevant: int
    wrong: int
    q_relevant: float | None  # the singleton utilities, when labelled
    q_wrong: float | None
    q_recent: float | None = None  # the labels' Recent-B anchor, when present

    def allocation(self, arm: str) -> tuple:
        if arm == "R":
            return self.recent
        frame = self.relevant if arm == "S" else self.wrong
        return tuple(sorted(self.recent[1:] + (frame,)))

    def describe(self) -> dict:
        d = {"episode": self.episode, "t": self.t, "budget": self.budget}
        d.update({arm: list(self.allocation(arm)) for arm in ARMS})
        d.update({"q_relevant": self.q_relevant, "q_wrong": self.q_wrong, "q_recent": self.q_recent})
        return d


def read_labels(path: str) -> tuple:
    """Singleton utilities {t: {step: q}}, Recent-B anchors {t: {set: q}}, the `made_with` of a label
    file and its `episode` field (None when absent). Lines of other kinds (beam sets, decision context
    lines, ...) are ignored."""
    if not os.path.isfile(path):
        raise TrainError(f"label file {path}: not found (make it with `recall episode label`)")
    singles, recents, made_with, episodes = {}, {}, None, set()
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise TrainError(f"{path}:{n}: not JSON ({e})") from None
            kind = rec.get("kind") if isinstance(rec, dict) else None
            if kind is not None and rec.get("episode") is not None:
                episodes.add(rec["episode"])
            if len(episodes) > 1:
                raise TrainError(f"{path}:{n}: labels of several episodes {sorted(episodes)}; give one label file "
                                 "per episode")
            if kind not in ("singleton", "recent"):
                continue
            try:
                t, s, q = int(rec["t"]), tuple(int(j) for j in rec["set"]), float(rec["q"])
            except (KeyError, TypeError, ValueError) as e:
                raise TrainError(f"{path}:{n}: a {kind} label needs integer `t`, integer list `set` and "
                                 f"number `q` ({e!r})") from None
            if not math.isfinite(q):
                raise TrainError(f"{path}:{n}: q is {q}")
            if kind == "singleton":
                if len(s) != 1:
                    raise TrainError(f"{path}:{n}: a singleton label with set {list(s)}")
                singles.setdefault(t, {})[s[0]] = q
            else:
                recents.setdefault(t, {})[s] = q
            mw = rec.get("made_with")
            if made_with is None:
                made_with = mw
            elif mw is not None and mw != made_with:
                raise TrainError(f"{path}:{n}: made_with differs from earlier lines; labels of different "
                                 "policies must not be mixed")
    if not singles:
        raise TrainError(f"label file {path}: no singleton labels")
    return singles, recents, made_with or {}, (episodes.pop() if episodes else None)


def read_events(path: str) -> dict:
    """The `decision` lines of a label file as {t: {step: witness}} (docs/FORMATS.md "Utility labels":
    `context.events[]` with `step` and `witness`, the paper's "following action equivalent to a*_t").
    Errors name the missing field: the paper's mining cannot run without it."""
    events = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            try:
                rec = json.loads(line) if line.strip() else None
            except json.JSONDecodeError as e:
                raise TrainError(f"{path}:{n}: not JSON ({e})") from None
            if not isinstance(rec, dict) or rec.get("kind") != "decision":
                continue
            if type(rec.get("t")) is not int:
                raise TrainError(f"{path}:{n}: a decision line without an integer `t`")
            events[rec["t"]] = decision_events(rec, f"{path}:{n}")
    if not events:
        raise TrainError(f"label file {path}: no `decision` lines (field `context.events[].witness`), which "
                         "--groups paper needs; re-label with a current `recall episode label`, or pass "
                         "--groups utility")
    return events


def decision_events(rec: dict, where: str) -> dict:
    """{step: witness} of one decision line, checking each field the paper's rule reads."""
    ctx = rec.get("context")
    if not isinstance(ctx, dict) or not isinstance(ctx.get("events"), list):
        raise TrainError(f"{where}: a decision line without `context.events` (--groups paper needs each "
                         "eligible step's `witness` flag)")
    out = {}
    for i, e in enumerate(ctx["events"]):
        for field, kind in (("step", int), ("witness", bool)):
            if not isinstance(e, dict) or type(e.get(field)) is not kind:
                raise TrainError(f"{where}: `context.events[{i}].{field}` is missing or not "
                                 f"{'an integer' if kind is int else 'a boolean'}")
        out[e["step"]] = e["witness"]
    return out


def check_anchor(episode: str, t: int, b: int, recent: tuple, recents: dict, pool: list) -> float | None:
    """The labels' Recent-B anchor score; an anchor that is not the tail of the pool is an error."""
    anchor = [s for s in recents.get(t, {}) if len(s) == b]
    if anchor and anchor[0] != recent:
        raise TrainError(f"{episode}: decision {t}: the labels' Recent-{b} anchor {list(anchor[0])} is "
                         f"not the last {b} steps of the pool {pool}")
    return recents.get(t, {}).get(recent)


def mine_utility_groups(episode: str, singles: dict, recents: dict, budgets, min_gap: float = 0.0) -> list:
    """`--groups utility` (recall's earlier rule, an option): j+ / j- = the older events with the highest /
    lowest frozen singleton utility; needs two older events and a gap above min_gap."""
    groups = []
    for t in sorted(singles):
        q = singles[t]
        pool = sorted(q)
        for b in budgets:
            if b < 1 or len(pool) < b + 2:
                continue
            recent, older = tuple(pool[-b:]), pool[:-b]
            q_recent = check_anchor(episode, t, b, recent, recents, pool)
            ranked = sorted(older, key=lambda j: (-q[j], -j))
            best, worst = ranked[0], ranked[-1]
            if q[best] - q[worst] <= min_gap:
                continue
            groups.append(Group(episode, t, b, recent, best, worst, q[best], q[worst], q_recent))
    return groups


def stable_pick(options: list, key: str, seed: int):
    """A uniform choice among `options` that depends only on (seed, key), so a rerun, another machine or
    another budget list picks the same frame (the authors pick ties this way, seeded by the decision)."""
    h = int.from_bytes(hashlib.sha256(f"{seed}/{key}".encode("utf-8")).digest()[:8], "big")
    return options[h % len(options)]


def paper_pair(t: int, b: int, witness: dict, recent: tuple, key: str, seed: int) -> tuple | None:
    """(j+, j-) of decision t at budget b by the paper's rule, or None when it gives no group.

    j+: a witness step strictly older than the whole Recent-B window (recall age t - s >= B + 1, the
    authors' age >= B + 2); one of several is picked by `stable_pick`. j-: a non-witness step as old,
    nearest in age to j+ (a tie between the two neighbours at equal distance picked by `stable_pick`)."""
    older = [s for s in sorted(witness) if t - s >= b + 1 and s < recent[0]]
    positives = [s for s in older if witness[s]]
    negatives = [s for s in older if not witness[s]]
    if not positives or not negatives:
        return None
    plus = stable_pick(positives, f"{key}:{t}:relevant", seed)
    gap = min(abs(s - plus) for s in negatives)
    minus = stable_pick([s for s in negatives if abs(s - plus) == gap], f"{key}:{t}:wrong", seed)
    return plus, minus


def mine_paper_groups(episode: str, events: dict, singles: dict, recents: dict, budgets, seed: int = 0) -> list:
    """`--groups paper` (the default): the paper's relevant / wrong restores (module docstring).
    `events` is read_events' {t: {step: witness}}; singleton utilities, when labelled, ride along."""
    groups, key = [], os.path.basename(os.path.normpath(episode))
    for t in sorted(events):
        pool = sorted(events[t])
        for b in budgets:
            if b < 1 or len(pool) < b + 1:
                continue
            recent = tuple(pool[-b:])
            q_recent = check_anchor(episode, t, b, recent, recents, pool)
            pair = paper_pair(t, b, events[t], recent, key, seed)
            if pair is None:
                continue
            q = singles.get(t, {})
            groups.append(Group(episode, t, b, recent, pair[0], pair[1], q.get(pair[0]), q.get(pair[1]), q_recent))
    return groups


def split_groups(groups: list, dev_fraction: float, seed: int) -> tuple:
    """(train, dev): whole episodes go to dev when there are several, else whole decisions."""
    if dev_fraction <= 0:
        return list(groups), []
    episodes = sorted({g.episode for g in groups})
    key = (lambda g: g.episode) if len(episodes) > 1 else (lambda g: (g.episode, g.t))
    units = sorted({key(g) for g in groups})
    if len(units) < 2:
        raise TrainError(f"a dev split needs at least 2 {'episodes' if len(episodes) > 1 else 'decisions'} "
                         f"with groups, found {len(units)} (or pass --dev-fraction 0)")
    if len(episodes) == 1:
        log.warning("one episode: the dev split holds out whole decisions, not trajectories")
    random.Random(seed).shuffle(units)
    n_dev = min(max(1, round(dev_fraction * len(units))), len(units) - 1)
    dev_units = set(units[:n_dev])
    return [g for g in groups if key(g) not in dev_units], [g for g in groups if key(g) in dev_units]


# ---------------------------------------------------------------------------------------------- prompts


def read_episode(path: str) -> dict:
    f = os.path.join(path, "episode.json")
    if not os.path.isfile(f):
        raise TrainError(f"episode {path}: no episode.json")
    with open(f, encoding="utf-8") as fh:
        ep = json.load(fh)
    return {i + 1: s.get("response") for i, s in enumerate(ep.get("steps", []))}


class Renderer:
    """Decision prompts as recall renders them (`recall episode render`), cached."""

    def __init__(self, recall: str, protocol: str | None):
        self.recall, self.protocol, self.cache = recall, protocol, {}

    def messages(self, episode: str, t: int, allocation: tuple) -> list:
        key = (episode, t, allocation)
        if key not in self.cache:
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "m.json")
                cmd = [self.recall, "episode", "render", "--episode", episode, "--step", str(t), "--out", out,
                       "--backend", "cpu"]
                if allocation:
                    cmd += ["--allocation", ",".join(map(str, allocation))]
                if self.protocol:
                    cmd += ["--protocol", self.protocol]
                p = subprocess.run(cmd, capture_output=True, text=True)
                if p.returncode != 0:
                    raise TrainError(f"`{' '.join(cmd)}` failed:\n{p.stderr.strip()}")
                with open(out, encoding="utf-8") as f:
                    self.cache[key] = json.load(f)
        return self.cache[key]


class Policy:
    """The frozen model, its tokenizer, chat template and image processor."""

    def __init__(self, model_dir: str, device: str = "cpu", dtype: str | None = None,
                 chat_template: str | None = None, image_cache: int = 32, min_pixels: int | None = None,
                 max_pixels: int | None = None):
        from transformers import AutoImageProcessor, AutoModelForImageTextToText, PreTrainedTokenizerFast

        if not os.path.isfile(os.path.join(model_dir, "config.json")):
            raise TrainError(f"model {model_dir}: no config.json")
        dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
            dtype or ("bfloat16" if device.startswith("cuda") else "float32")]
        self.model_dir, self.device = model_dir, torch.device(device)
        self.tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(model_dir, "tokenizer.json"))
        self.image_processor = AutoImageProcessor.from_pretrained(model_dir)
        if min_pixels or max_pixels:  # recall's --min-pixels / --max-pixels
            size = {"shortest_edge": min_pixels or self.image_processor.size["shortest_edge"],
                    "longest_edge": max_pixels or self.image_processor.size["longest_edge"]}
            self.image_processor = AutoImageProcessor.from_pretrained(model_dir, size=size)
        self.model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dt).to(self.device).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.image_pad = self.model.config.image_token_id
        self.template = self._template(chat_template)
        self.image = functools.lru_cache(maxsize=image_cache)(self._image)

    def _template(self, path: str | None) -> str:
        candidates = [path] if path else [
            os.path.join(self.model_dir, "chat_template.json"), os.path.join(self.model_dir, "chat_template.jinja"),
            os.path.join(ROOT, "models", TEMPLATES.get(self.model.config.model_type, "?"), "chat_template.json")]
        for c in candidates:
            if c and os.path.isfile(c):
                with open(c, encoding="utf-8") as f:
                    return json.load(f)["chat_template"] if c.endswith(".json") else f.read()
        raise TrainError(f"no chat template for {self.model_dir} (tried {candidates}); pass --chat-template")

    def _image(self, path: str) -> tuple:
        from transformers.image_utils import load_image

        if not os.path.isfile(path):
            raise TrainError(f"image {path}: not found")
        proc = self.image_processor(images=[load_image(path)], return_tensors="pt")
        return proc["pixel_values"], proc["image_grid_thw"]

    def prompt(self, messages: list) -> dict:
        """Token ids of the prompt (generation prompt appended, one `<|image_pad|>` per merged image token),
        its image paths and grids, and the history rows: the image tokens of every image but the last."""
        text = self.tok.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                            add_generation_prompt=True)
        paths = image_paths(messages)
        if not paths:
            ids = self.tok(text, add_special_tokens=False)["input_ids"]
            return {"ids": torch.tensor(ids), "images": [], "grid": None, "history": torch.zeros(0, dtype=torch.long)}
        grid = torch.cat([self.image(p)[1] for p in paths])
        counts = (grid.prod(-1) // self.image_processor.merge_size ** 2).tolist()
        parts = text.split("<|image_pad|>")
        if len(parts) != len(counts) + 1:
            raise TrainError(f"the chat template rendered {len(parts) - 1} images, the messages have {len(counts)}")
        text = parts[0] + "".join("<|image_pad|>" * n + p for n, p in zip(counts, parts[1:]))
        ids = torch.tensor(self.tok(text, add_special_tokens=False)["input_ids"])
        pos = (ids == self.image_pad).nonzero().flatten()
        if len(pos) != sum(counts):
            raise TrainError("image token count mismatch after tokenization")
        return {"ids": ids, "images": paths, "grid": grid, "history": pos[: len(pos) - counts[-1]]}

    def pixel_values(self, prompt: dict) -> torch.Tensor:
        return torch.cat([self.image(p)[0] for p in prompt["images"]])

    def target_ids(self, response: str) -> torch.Tensor:
        return torch.tensor(self.tok(response, add_special_tokens=False)["input_ids"])

    def model_inputs(self, prompt: dict, target: torch.Tensor | None = None) -> dict:
        """The keyword arguments of a transformers forward over prompt + target."""
        ids = prompt["ids"] if target is None else torch.cat([prompt["ids"], target])
        ids = ids[None].to(self.device)
        kw = {"input_ids": ids}
        if prompt["images"]:
            kw.update(pixel_values=self.pixel_values(prompt).to(self.device, self.model.dtype),
                      image_grid_thw=prompt["grid"].to(self.device), mm_token_type_ids=(ids == self.image_pad).int())
        return kw

    def forward(self, prompt: dict, target: torch.Tensor | None = None, keep: int = 0, prefix=None):
        """Logits of the last `keep` positions (0: all) of prompt + target. `prefix` = (P, cache): the
        K/V of the first P tokens (text only, from `prefix_cache`), which are then not recomputed."""
        kw = self.model_inputs(prompt, target)
        kw["logits_to_keep"] = keep
        ids = kw["input_ids"]
        mm = (ids == self.image_pad).int()
        if prefix is not None:
            n, cache = prefix
            if prompt["images"]:
                pos, _ = self.model.model.get_rope_index(ids, mm_token_type_ids=mm, image_grid_thw=kw["image_grid_thw"])
            else:
                pos = torch.arange(ids.shape[1], device=self.device).view(1, 1, -1).expand(3, 1, -1)
            kw.update(input_ids=ids[:, n:], position_ids=pos[..., n:], cache=copy.deepcopy(cache), use_cache=True)
            if "mm_token_type_ids" in kw:
                kw["mm_token_type_ids"] = mm[:, n:]
        return self.model(**kw).logits[0]

    def prefix_cache(self, ids: torch.Tensor):
        """The K/V cache of a text-only token prefix (frozen: no history image precedes it)."""
        with torch.no_grad():
            out = self.model(input_ids=ids[None].to(self.device), use_cache=True, logits_to_keep=1)
        return out["cache"] if "cache" in out else out["past_key_values"]

    def mean_logprob(self, prompt: dict, target: torch.Tensor, prefix=None) -> torch.Tensor:
        """Mean teacher-forced log-prob per token of `target` after the prompt (recall's Q)."""
        logits = self.forward(prompt, target, keep=len(target) + 1, prefix=prefix)[:-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, target.to(logits.device)[:, None])
        return lp.mean()


# ---------------------------------------------------------------------------------------------- adapter


ALL = "all"
TARGET = re.compile(r"(?:^|\.)language_model\.layers\.(\d+)\.self_attn\.(k_proj|v_proj)$")


class KVAdapter(torch.nn.Module):
    """LoRA on k_proj / v_proj of `layers`, applied by forward hooks at the rows `acting_on` sets."""

    def __init__(self, model, layers, rank: int = 8, alpha: float = 16.0, seed: int = 0):
        super().__init__()
        self.rank, self.alpha, self.scale, self.layers = rank, float(alpha), alpha / rank, sorted(layers)
        self.names, self.A, self.B = [], torch.nn.ParameterList(), torch.nn.ParameterList()
        self._rows, self._hooks = None, []
        found = {}
        for name, mod in model.named_modules():
            m = TARGET.search(name)
            if m:
                found[(int(m.group(1)), m.group(2))] = (name, mod)
        n_layers = 1 + max((k[0] for k in found), default=-1)
        for layer in self.layers:
            if not 0 <= layer < n_layers:
                raise TrainError(f"layer {layer} is out of range: the model has {n_layers} decoder layers")
        g = torch.Generator().manual_seed(seed)
        for layer in self.layers:
            for proj in ("k_proj", "v_proj"):
                name, mod = found[(layer, proj)]
                a = torch.empty(rank, mod.in_features)
                torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=g)  # as PEFT
                self.names.append(name)
                self.A.append(torch.nn.Parameter(a.to(mod.weight.device)))
                self.B.append(torch.nn.Parameter(torch.zeros(mod.out_features, rank, device=mod.weight.device)))
                self._hooks.append(mod.register_forward_hook(self._hook(len(self.names) - 1)))

    def _hook(self, i: int):
        def hook(mod, args, out):
            rows = self._rows
            if rows is None or (rows is not ALL and rows.numel() == 0):
                return out  # the frozen model, bit for bit
            a, b = self.A[i], self.B[i]
            x = args[0] if rows is ALL else args[0][:, rows.to(out.device)]
            delta = self.scale * F.linear(F.linear(x.to(a.dtype), a), b)
            if rows is ALL:
                return out + delta.to(out.dtype)
            return out.index_add(1, rows.to(out.device), delta.to(out.dtype))
        return hook

    @contextlib.contextmanager
    def acting_on(self, rows):
        """Inside: the adapter adds its update at `rows` (a LongTensor; ALL: every token; None: off)."""
        prev, self._rows = self._rows, rows
        try:
            yield
        finally:
            self._rows = prev

    def remove(self):
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def is_zero(self) -> bool:
        return all(not b.detach().any() for b in self.B)

    def peft_tensors(self) -> dict:
        out = {}
        for name, a, b in zip(self.names, self.A, self.B):
            out[f"base_model.model.{name}.lora_A.weight"] = a.detach().float().cpu().clone().contiguous()
            out[f"base_model.model.{name}.lora_B.weight"] = b.detach().float().cpu().clone().contiguous()
        return out

    def load_peft_tensors(self, tensors: dict):
        with torch.no_grad():
            for name, a, b in zip(self.names, self.A, self.B):
                a.copy_(tensors[f"base_model.model.{name}.lora_A.weight"])
                b.copy_(tensors[f"base_model.model.{name}.lora_B.weight"])

    def export(self, out_dir: str, base_model: str):
        """Writes a PEFT LoRA directory: adapter_config.json + adapter_model.safetensors."""
        from peft import LoraConfig
        from safetensors.torch import save_file

        os.makedirs(out_dir, exist_ok=True)
        cfg = LoraConfig(r=self.rank, lora_alpha=self.alpha, target_modules=["k_proj", "v_proj"],
                         layers_to_transform=self.layers, layers_pattern="layers", lora_dropout=0.0, bias="none",
                         base_model_name_or_path=base_model, inference_mode=True)
        cfg.save_pretrained(out_dir)
        save_file(self.peft_tensors(), os.path.join(out_dir, "adapter_model.safetensors"), metadata={"format": "pt"})

    @classmethod
    def from_peft(cls, model, adapter_dir: str):
        """The adapter of a PEFT directory this script (or PEFT) wrote, hooked into `model`."""
        from safetensors.torch import load_file

        with open(os.path.join(adapter_dir, "adapter_config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
        tensors = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
        layers = cfg.get("layers_to_transform")
        if layers is None:
            layers = sorted({int(k.split("layers.")[1].split(".")[0]) for k in tensors})
        adapter = cls(model, [layers] if isinstance(layers, int) else layers, cfg["r"], cfg["lora_alpha"])
        adapter.load_peft_tensors(tensors)
        return adapter


# ---------------------------------------------------------------------------------------------- training


class Scorer:
    """Arm scores of replacement groups: frozen (computed once) and through the adapter."""

    def __init__(self, policy: Policy, adapter: KVAdapter, renderer: Renderer, responses: dict, mode: str,
                 prefix_cache: int = 16):
        self.policy, self.adapter, self.renderer, self.responses, self.mode = policy, adapter, renderer, responses, mode
        self.off, self.prompts, self.targets = {}, {}, {}
        # The arms of a group share their text up to the first image: its K/V is frozen under the gated
        # adapter, so it is computed once (the ungated adapter acts there: no sharing).
        self.prefix_size = prefix_cache if mode == "gated" else 0
        self.prefixes = OrderedDict()

    def inputs(self, g: Group, arm: str) -> tuple:
        key = (g.episode, g.t, g.allocation(arm))
        if key not in self.prompts:
            self.prompts[key] = self.policy.prompt(self.renderer.messages(*key))
        tkey = (g.episode, g.t)
        if tkey not in self.targets:
            response = self.responses[g.episode].get(g.t)
            if not response:
                raise TrainError(f"{g.episode}: decision {g.t} has no recorded response")
            self.targets[tkey] = self.policy.target_ids(response)
        return self.prompts[key], self.targets[tkey]

    def prefix(self, g: Group):
        """(P, cache) for the text the arms of `g` share before their first image token, or None."""
        if self.prefix_size <= 0:
            return None
        key = (g.episode, g.t, g.budget)
        if key not in self.prefixes:
            ids = [self.inputs(g, arm)[0]["ids"] for arm in ARMS]
            n = min(len(i) for i in ids)
            for i in ids:
                pads = (i == self.policy.image_pad).nonzero()
                n = min(n, int(pads[0]) if len(pads) else len(i) - 1)
            diff = (torch.stack([i[:n] for i in ids]) != ids[0][:n]).any(0).nonzero()
            n = int(diff[0]) if len(diff) else n
            self.prefixes[key] = (n, self.policy.prefix_cache(ids[0][:n])) if n > 0 else None
            while len(self.prefixes) > self.prefix_size:
                self.prefixes.popitem(last=False)
        self.prefixes.move_to_end(key)
        return self.prefixes[key]

    def score(self, g: Group, arm: str, on: bool) -> torch.Tensor:
        prompt, target = self.inputs(g, arm)
        prefix = self.prefix(g)
        if not on:
            rows = None
        elif self.mode == "ungated":
            rows = ALL
        else:
            rows = prompt["history"] - (prefix[0] if prefix else 0)
        with self.adapter.acting_on(rows):
            return self.policy.mean_logprob(prompt, target, prefix)

    def check_prefix(self, g: Group) -> None:
        """Turns the prefix cache off unless it reproduces the full forward on `g` (frozen R arm)."""
        if self.prefix_size <= 0:
            return
        tol = 1e-4 if self.policy.model.dtype == torch.float32 else 2e-2
        try:
            with torch.no_grad():
                cached = self.score(g, "R", False).item()
                size, self.prefix_size = self.prefix_size, 0
                full = self.score(g, "R", False).item()
                self.prefix_size = size
        except (TypeError, ValueError, RuntimeError) as e:
            log.warning("prefix cache off: this model's forward does not take it (%s)", e)
            self.prefix_size, self.prefixes = 0, OrderedDict()
            return
        if abs(cached - full) > tol:
            log.warning("prefix cache off: it changes the frozen score by %.2e", abs(cached - full))
            self.prefix_size, self.prefixes = 0, OrderedDict()
        else:
            log.info("prefix cache on (%d groups kept; |cached - full| = %.1e)", self.prefix_size, abs(cached - full))

    def frozen(self, g: Group) -> dict:
        key = (g.episode, g.t, g.budget)
        if key not in self.off:
            with torch.no_grad():
                self.off[key] = {arm + "0": self.score(g, arm, False).item() for arm in ARMS}
        return self.off[key]

    def arms(self, g: Group) -> dict:
        """All six arm scores (floats), without a graph."""
        l = dict(self.frozen(g))
        if self.adapter.is_zero():
            l.update({arm + "A": l[arm + "0"] for arm in ARMS})  # B = 0: the adapter adds exact zeros
        else:
            with torch.no_grad():
                l.update({arm + "A": self.score(g, arm, True).item() for arm in ARMS})
        return l

    def backward(self, g: Group, weight: float, cfg, low_memory: bool) -> float:
        """Adds weight * dL_g/dtheta to the gradients; returns L_g.

        low_memory: score the three adapter-on arms without a graph first, then re-run each with one and
        back-propagate it with its scalar coefficient dL_g/dl (one arm's activations alive at a time);
        otherwise one forward per arm with the graph, and one backward."""
        off = {k: torch.tensor(v, dtype=torch.float64) for k, v in self.frozen(g).items()}
        if not low_memory:
            on = {arm + "A": self.score(g, arm, True).double() for arm in ARMS}
            loss = group_loss({**off, **on}, cfg.margin, cfg.drift_cap, cfg.drift_weight)
            (weight * loss).backward()
            return loss.item()
        leaves = {k: torch.tensor(v, dtype=torch.float64, requires_grad=k.endswith("A"))
                  for k, v in self.arms(g).items()}
        loss = group_loss(leaves, cfg.margin, cfg.drift_cap, cfg.drift_weight)
        loss.backward()
        for arm in ARMS:
            coef = leaves[arm + "A"].grad.item() * weight
            if coef != 0.0:
                (coef * self.score(g, arm, True)).backward()
        return loss.item()


def label_check(scorer: Scorer, groups: list) -> float | None:
    """Largest |frozen arm score - recall's label| over the arms a label scores: R (the Recent-B anchor)
    and, at B = 1, S and W (singletons)."""
    diffs = []
    for g in groups:
        off = scorer.frozen(g)
        if g.q_recent is not None:
            diffs.append(abs(off["R0"] - g.q_recent))
        if g.budget == 1:
            diffs += [abs(off[arm] - q) for arm, q in (("S0", g.q_relevant), ("W0", g.q_wrong)) if q is not None]
    return max(diffs, default=None)


def evaluate(scorer: Scorer, groups: list, cfg) -> list:
    rows = []
    for g in groups:
        l = scorer.arms(g)
        a_c, a_r, a_n = did_terms(l)
        rows.append({**g.describe(), **l, "A_c": a_c, "A_r": a_r, "A_n": a_n, "did": a_c - a_r,
                     "loss": group_loss(l, cfg.margin, cfg.drift_cap, cfg.drift_weight).item()})
    return rows


def cluster_bootstrap_means(values: list, clusters: list, n: int, seed: int) -> torch.Tensor:
    """`n` bootstrap means of `values`, resampling whole clusters (`clusters[i]` is the unit of
    `values[i]`) with replacement: each resample draws as many clusters as there are and averages every
    value of every drawn cluster, so values of one cluster (the groups of one decision) move together."""
    ids = {c: i for i, c in enumerate(dict.fromkeys(clusters))}
    unit = torch.tensor([ids[c] for c in clusters])
    v = torch.tensor(values, dtype=torch.float64)
    sums = torch.zeros(len(ids), dtype=torch.float64).index_add_(0, unit, v)
    counts = torch.zeros(len(ids), dtype=torch.float64).index_add_(0, unit, torch.ones_like(v))
    draw = torch.randint(len(ids), (n, len(ids)), generator=torch.Generator().manual_seed(seed))
    return sums[draw].sum(1) / counts[draw].sum(1)


def bootstrap_ci(values: list, n: int, seed: int, level: float = 0.95, clusters: list | None = None) -> tuple:
    """Percentile bootstrap interval of the mean; `clusters` (default: every value its own) are the
    resampling units. One unit gives the point estimate twice: there is nothing to resample."""
    if not values:
        return float("nan"), float("nan")
    clusters = list(range(len(values))) if clusters is None else clusters
    mean = torch.tensor(values, dtype=torch.float64).mean().item()
    if n <= 0 or len(set(clusters)) == 1:
        return mean, mean
    means = cluster_bootstrap_means(values, clusters, n, seed)
    lo, hi = torch.quantile(means, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64))
    return lo.item(), hi.item()


def bootstrap_unit(row: dict, unit: str):
    """The resampling unit of a scored group: its episode or its decision (episode, t)."""
    if unit == "episode":
        return row["episode"]
    if unit == "decision":
        return (row["episode"], row["t"])
    raise TrainError(f"bootstrap unit {unit!r} (expected episode or decision)")


def gate_summary(rows: list, n_boot: int, seed: int, eps: float, unit: str | None = None) -> dict:
    """The paper's gates on one set of scored groups: DiD select > 0 with a positive bootstrap lower
    bound (resampling `unit`s, see bootstrap_unit; None: single groups), mean |A_r| < eps, mean |A_n| < eps."""
    if not rows:
        return {"groups": 0, "pass": False}
    did = [r["did"] for r in rows]
    clusters = None if unit is None else [bootstrap_unit(r, unit) for r in rows]
    lo, hi = bootstrap_ci(did, n_boot, seed, clusters=clusters)
    s = {"groups": len(rows), "did_select": sum(did) / len(did), "did_ci95": [lo, hi],
         "abs_A_r": sum(abs(r["A_r"]) for r in rows) / len(rows),
         "abs_A_n": sum(abs(r["A_n"]) for r in rows) / len(rows),
         "A_c": sum(r["A_c"] for r in rows) / len(rows),
         "loss": sum(r["loss"] for r in rows) / len(rows)}
    s["gates"] = {"did_positive": s["did_select"] > 0, "did_lower_bound_positive": lo > 0,
                  "abs_A_r_below_eps": s["abs_A_r"] < eps, "abs_A_n_below_eps": s["abs_A_n"] < eps}
    s["pass"] = all(s["gates"].values())
    return s


def budget_gates(rows: list, budgets, n_boot: int, seed: int, eps: float, unit: str) -> dict:
    """The paper's per-B gates ("per-B DiD gates all pass"): `per_budget` holds gate_summary of each
    budget's groups and `pass` is true only when every budget in `budgets` passes (a budget without
    groups fails: it is untested). The top-level numbers pool every group (each decision's groups of
    all budgets resampled together); they rank passing checkpoints but gate nothing."""
    per = {str(b): gate_summary([r for r in rows if r["budget"] == b], n_boot, seed, eps, unit) for b in budgets}
    pooled = gate_summary(rows, n_boot, seed, eps, unit)
    pooled.pop("gates", None)
    return {**pooled, "per_budget": per, "pass": bool(per) and all(s["pass"] for s in per.values()),
            "bootstrap_unit": unit}


def better_checkpoint(s: dict, best: dict | None) -> bool:
    """Whether dev evaluation `s` replaces `best` as the checkpoint to export. The authors' rule for one
    adapter serving every budget: of the checkpoints passing every per-B gate, the largest pooled DiD
    select; a tie keeps the earlier step."""
    return s["pass"] and (best is None or s["did_select"] > best["did_select"])


def describe_gates(s: dict) -> str:
    """One log line: pooled DiD, then each budget's DiD [CI], drifts and verdict."""
    parts = [f"pooled DiD {s.get('did_select', float('nan')):+.5f}"]
    for b, x in s["per_budget"].items():
        if not x["groups"]:
            parts.append(f"B={b}: no groups FAIL")
            continue
        parts.append(f"B={b}: DiD {x['did_select']:+.5f} [{x['did_ci95'][0]:+.5f}, {x['did_ci95'][1]:+.5f}] "
                     f"|A_r| {x['abs_A_r']:.5f} |A_n| {x['abs_A_n']:.5f} {'PASS' if x['pass'] else 'fail'}")
    return "; ".join(parts)


def progress(iterable, total: int, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=False)


def parse_ints(s: str, what: str) -> list:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise TrainError(f"{what}: expected comma-separated integers, got `{s}`") from None


def default_recall() -> str | None:
    for c in (os.environ.get("RECALL_BIN"), os.path.join(ROOT, "target", "release", "recall")):
        if c and os.path.isfile(c):
            return c
    return None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--episodes", required=True, help="episode directories, comma-separated")
    p.add_argument("--labels", required=True, help="label files (`recall episode label`), one per episode, same order")
    p.add_argument("--recall", default=default_recall(),
                   help="the recall binary [env RECALL_BIN, else target/release/recall]")
    p.add_argument("--out", required=True, help="the adapter directory to write")
    p.add_argument("--budgets", default="1,2,4", help="budgets B >= 1 of the replacement groups [1,2,4]")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=8, help="groups per step [8]")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="model dtype [float32 on cpu, bfloat16 on cuda]; the LoRA weights stay float32")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16.0)
    p.add_argument("--layers", help="decoder layers, comma-separated [the last 8, clamped to the model]")
    p.add_argument("--adapter-mode", choices=["gated", "ungated"], default="gated",
                   help="gated: history screenshots only (HGKV); ungated: every token (the control)")
    p.add_argument("--dev-fraction", type=float, default=0.1, help="share of episodes (or decisions) held out [0.1]")
    p.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples of the dev gate [1000]")
    p.add_argument("--eval-every", type=int, help="dev evaluation period in steps [steps/10]")
    p.add_argument("--margin", type=float, default=MARGIN)
    p.add_argument("--drift-cap", type=float, default=DRIFT_CAP)
    p.add_argument("--drift-weight", type=float, default=DRIFT_WEIGHT)
    p.add_argument("--l2", type=float, default=L2)
    p.add_argument("--gate-eps", type=float, default=DRIFT_CAP, help="drift gate epsilon [0.02]")
    p.add_argument("--groups", choices=["paper", "utility"], default="paper",
                   help="mining rule: paper (witness j+ older than the window, age-matched non-witness j-) or "
                        "utility (best / worst singleton utility, recall's earlier rule) [paper]")
    p.add_argument("--min-gap", type=float, default=0.0, help="--groups utility: minimum Q({j+}) - Q({j-}) [0]")
    p.add_argument("--bootstrap-unit", choices=["episode", "decision"], default="episode",
                   help="what the dev gate's bootstrap resamples: episodes (the authors' cluster bootstrap; "
                        "decisions when the dev split holds whole decisions) or decisions [episode]")
    p.add_argument("--protocol", help="prompt protocol [the labels' made_with.protocol]")
    p.add_argument("--min-pixels", type=int, help="screenshot pixel budget [the labels' made_with, else the model's]")
    p.add_argument("--max-pixels", type=int, help="screenshot pixel budget [the labels' made_with, else the model's]")
    p.add_argument("--chat-template", help="chat template file [MODEL's, else this repo's for the model family]")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--low-memory", action=argparse.BooleanOptionalAction, default=None,
                   help="back-propagate the arms one at a time (an extra graph-free forward each) [on for cuda]")
    p.add_argument("--prefix-cache", type=int, default=16,
                   help="groups whose shared text-prefix K/V is kept (gated mode; 0: off) [16]")
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch < 1 or args.rank < 1:
        raise TrainError("--steps, --batch and --rank must be positive")
    if not 0 <= args.dev_fraction < 1:
        raise TrainError("--dev-fraction must be in [0, 1)")
    args.budgets = parse_ints(args.budgets, "--budgets")
    if not args.budgets or min(args.budgets) < 1:
        raise TrainError("--budgets: every budget must be >= 1 (B = 0 has no history slot to replace)")
    if not args.recall or not os.path.isfile(args.recall):
        raise TrainError(f"the recall binary {args.recall!r} does not exist (--recall or RECALL_BIN; "
                         "build it with `cargo build --release`)")
    return args


def load_groups(args) -> tuple:
    episodes = [os.path.abspath(e) for e in args.episodes.split(",") if e]
    labels = [lf for lf in args.labels.split(",") if lf]
    if len(episodes) != len(labels):
        raise TrainError(f"{len(episodes)} episodes but {len(labels)} label files: give one label file per episode")
    groups, responses, protocols, made = [], {}, set(), []
    for ep, lf in zip(episodes, labels):
        responses[ep] = read_episode(ep)
        singles, recents, made_with, labelled = read_labels(lf)
        if labelled is not None and os.path.exists(labelled) and os.path.realpath(labelled) != os.path.realpath(ep):
            log.warning("%s labels the episode %s, not %s: are the label files in the order of --episodes?",
                        lf, labelled, ep)
        if max(singles) > len(responses[ep]):
            raise TrainError(f"{lf}: labels for decision {max(singles)}, the episode {ep} has "
                             f"{len(responses[ep])} steps (wrong label file for this episode?)")
        if args.groups == "paper":
            mined = mine_paper_groups(ep, read_events(lf), singles, recents, args.budgets, args.seed)
        else:
            mined = mine_utility_groups(ep, singles, recents, args.budgets, args.min_gap)
        log.info("%s: %d groups from %d labelled decisions", ep, len(mined), len(singles))
        groups += mined
        protocols.add(made_with.get("protocol"))
        made.append({k: made_with.get(k) for k in ("model", "adapter", "adapter_mode", "protocol", "min_pixels",
                                                     "max_pixels")})
        if made_with.get("model") and os.path.realpath(made_with["model"]) != os.path.realpath(args.model):
            log.warning("%s was made with the model %s, this run trains on %s", lf, made_with["model"], args.model)
    if not groups:
        need = ("a witness step (its action equivalent to the recorded action at t) strictly older than the "
                "Recent-B window and a non-witness step as old (or pass --groups utility)"
                if args.groups == "paper" else "at least B + 2 earlier events and distinct singleton utilities")
        raise TrainError(f"no replacement groups mined at budgets {args.budgets} (--groups {args.groups}): a "
                         f"group needs a decision with {need}")
    protocols.discard(None)
    if args.protocol is None and len(protocols) > 1:
        raise TrainError(f"the label files use different protocols {sorted(protocols)}; pass --protocol")
    protocol = args.protocol or (protocols.pop() if protocols else None)
    return groups, responses, protocol, made


def pixel_budget(made: list, key: str) -> int | None:
    """The labels' min_pixels / max_pixels (recall's screenshot budget), when the label files agree."""
    values = {m.get(key) for m in made} - {None}
    if len(values) > 1:
        raise TrainError(f"the label files were made with different {key} {sorted(values)}; "
                         f"pass --{key.replace('_', '-')}")
    return values.pop() if values else None


class Config:
    def __init__(self, args):
        self.margin, self.drift_cap, self.drift_weight = args.margin, args.drift_cap, args.drift_weight


def gate_setup(groups: list, dev_g: list, unit: str) -> tuple:
    """(the budgets the dev gate checks, the bootstrap unit). Every budget with groups is gated (one
    without dev groups cannot pass); episodes are resampled only when the dev split holds several."""
    budgets = sorted({g.budget for g in groups})
    for b in budgets:
        if dev_g and not any(g.budget == b for g in dev_g):
            log.warning("B=%d has no dev groups: its gate cannot pass, so no checkpoint will", b)
    if unit == "episode" and len({g.episode for g in dev_g}) < 2:
        unit = "decision"
        if dev_g:
            log.info("the dev split has one episode: its bootstrap resamples decisions")
    return budgets, unit


def train(args) -> dict:
    t_start = time.time()
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = Config(args)
    groups, responses, protocol, made = load_groups(args)
    train_g, dev_g = split_groups(groups, args.dev_fraction, args.seed)
    log.info("%d groups (%s), %d train, %d dev", len(groups),
             ", ".join(f"B={b}: {sum(g.budget == b for g in groups)}" for b in args.budgets), len(train_g), len(dev_g))
    gate_budgets, unit = gate_setup(groups, dev_g, args.bootstrap_unit)
    gates = functools.partial(budget_gates, budgets=gate_budgets, n_boot=args.bootstrap, seed=args.seed,
                              eps=args.gate_eps, unit=unit)

    pixels = {k: args.__dict__[k] or pixel_budget(made, k) for k in ("min_pixels", "max_pixels")}
    policy = Policy(args.model, args.device, args.dtype, args.chat_template, **pixels)
    size = policy.image_processor.size
    log.info("screenshots: min_pixels %s, max_pixels %s", size["shortest_edge"], size["longest_edge"])
    n_layers = policy.model.config.get_text_config().num_hidden_layers
    layers = parse_ints(args.layers, "--layers") if args.layers else list(range(max(0, n_layers - 8), n_layers))
    if len(set(layers)) != len(layers) or not layers:
        raise TrainError(f"--layers: {layers} (need distinct layer indices)")
    adapter = KVAdapter(policy.model, layers, args.rank, args.alpha, args.seed)
    log.info("adapter: rank %d, alpha %g (scale %g), k_proj+v_proj on layers %s, %s", args.rank, args.alpha,
             adapter.scale, layers, args.adapter_mode)
    scorer = Scorer(policy, adapter, Renderer(args.recall, protocol), responses, args.adapter_mode, args.prefix_cache)

    scorer.check_prefix(groups[0])
    for g in progress(groups, len(groups), "frozen arms"):
        scorer.frozen(g)
    label_diff = label_check(scorer, groups)
    if label_diff is None:
        log.info("label check: no frozen arm has a label to compare with")
    elif any(m.get("adapter") for m in made):
        log.info("label check skipped: the labels were scored through an adapter")
        label_diff = None
    elif label_diff > 1e-3:
        log.warning("the frozen arm scores differ from recall's labels by up to %.2e: the prompts or pixels differ "
                    "from recall's (chat template? pixel budget? protocol?)", label_diff)
    else:
        log.info("label check: frozen arm scores match recall's labels within %.2e", label_diff)
    initial = evaluate(scorer, train_g, cfg)
    params = list(adapter.parameters())
    objective0 = sum(r["loss"] for r in initial) / len(initial) + l2_term(params, args.l2).item()

    low_memory = args.low_memory if args.low_memory is not None else policy.device.type != "cpu"
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    rng = random.Random(args.seed)
    eval_every = args.eval_every or max(1, args.steps // 10)
    losses, evals, best = [], [], None
    bar = progress(range(1, args.steps + 1), args.steps, "train")
    for step in bar:
        batch = rng.sample(train_g, min(args.batch, len(train_g)))
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for g in batch:
            total += scorer.backward(g, 1.0 / len(batch), cfg, low_memory) / len(batch)
        reg = l2_term(params, args.l2)
        reg.backward()
        opt.step()
        losses.append(total + reg.item())
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{losses[-1]:.5f}")
        elif step == 1 or step % max(1, args.steps // 20) == 0:
            log.info("step %d/%d loss %.6f", step, args.steps, losses[-1])
        if dev_g and (step % eval_every == 0 or step == args.steps):
            s = gates(evaluate(scorer, dev_g, cfg))
            s["step"] = step
            evals.append(s)
            log.info("step %d dev %s: %s", step, "PASS" if s["pass"] else "fail", describe_gates(s))
            if better_checkpoint(s, best[0] if best else None):
                best = (s, adapter.peft_tensors())

    if best is not None:
        selected, exported_step = best[0], best[0]["step"]
        adapter.load_peft_tensors(best[1])
    else:
        selected, exported_step = (evals[-1] if evals else None), args.steps
        why = "no checkpoint passed the dev gates" if dev_g else "no dev split (--dev-fraction 0)"
        log.warning("!" * 72)
        log.warning("!!! %s: exporting the LAST checkpoint (step %d), which is NOT gate-selected", why, args.steps)
        log.warning("!" * 72)
    adapter.export(args.out, args.model)
    final_train = evaluate(scorer, train_g, cfg)
    final_dev = evaluate(scorer, dev_g, cfg)
    objective1 = sum(r["loss"] for r in final_train) / len(final_train) + l2_term(params, args.l2).item()

    report = {
        "args": {k: v for k, v in vars(args).items()},
        "labels_made_with": made,
        "protocol": protocol,
        "label_check_max_abs_diff": label_diff,
        "layers": layers,
        "scale": adapter.scale,
        "groups": {"train": len(train_g), "dev": len(dev_g),
                   "by_budget": {str(b): sum(g.budget == b for g in groups) for b in args.budgets}},
        "train_loss": {"first": losses[0], "last": losses[-1], "per_step": losses},
        "train_objective": {"initial": objective0, "exported": objective1},
        "train": gates(final_train),
        "train_max_abs_A_r": max(abs(r["A_r"]) for r in final_train),
        "train_max_abs_A_n": max(abs(r["A_n"]) for r in final_train),
        "dev_evals": evals,
        "dev": gates(final_dev) if dev_g else None,
        "gate_budgets": gate_budgets,
        "bootstrap_unit": unit,
        "selected": selected,
        "exported_step": exported_step,
        "gates_passed": best is not None,
        "train_groups": final_train,
        "dev_groups": final_dev,
        "seconds": time.time() - t_start,
    }
    with open(os.path.join(args.out, REPORT), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    print_report(report, args.out)
    return report


def gate_row(s: dict) -> str:
    """`DiD [CI]  |A_r|  |A_n|` of one gate summary, or n/a."""
    if not s.get("groups"):
        return "n/a (no groups)"
    lo, hi = s["did_ci95"]
    return f"{s['did_select']:+.5f} [{lo:+.5f}, {hi:+.5f}]  {s['abs_A_r']:.5f}  {s['abs_A_n']:.5f}"


def print_report(r: dict, out: str):
    dev = r["dev"] or {}
    rows = [
        ("train loss (step 1 -> last)", f"{r['train_loss']['first']:.6f} -> {r['train_loss']['last']:.6f}"),
        ("train objective (init -> exported)",
         f"{r['train_objective']['initial']:.6f} -> {r['train_objective']['exported']:.6f}"),
        ("train |A_r| mean / max", f"{r['train']['abs_A_r']:.5f} / {r['train_max_abs_A_r']:.5f}"),
        ("train |A_n| mean / max", f"{r['train']['abs_A_n']:.5f} / {r['train_max_abs_A_n']:.5f}"),
        ("dev groups", str(dev.get("groups", 0))),
        (f"dev DiD [95% CI, {r['bootstrap_unit']}s] |A_r| |A_n|", ""),
    ]
    rows += [(f"  B={b} ({s['groups']} groups)", f"{gate_row(s)}  {'PASS' if s['pass'] else 'FAIL'}")
             for b, s in dev.get("per_budget", {}).items()]
    rows += [
        ("  pooled (ranks checkpoints)", gate_row(dev)),
        ("gates (every budget)", "PASS" if r["gates_passed"] else "FAIL (last checkpoint exported)"),
        ("exported step", str(r["exported_step"])),
        ("adapter", out),
    ]
    width = max(len(k) for k, _ in rows)
    print("HGKV training report")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    try:
        from tqdm.contrib.logging import logging_redirect_tqdm  # log lines above the progress bars
    except ImportError:
        logging_redirect_tqdm = contextlib.nullcontext
    try:
        with logging_redirect_tqdm():
            train(parse_args(argv))
    except TrainError as e:
        log.error("%s", e)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
