#!/usr/bin/env python3
"""ScopeMem first-opinion encoder: the PyTorch reference for `src/model/scopemem.rs`.

The encoder E_phi of ScopeMem (Zheng et al., 2026, §4.1) turns the actor's first opinion and its
context into K = 16 prefix vectors for the frozen actor's second pass. Architecture (every choice and
the parameter count are documented in docs/SCOPEMEM.md):

    fields (a0, task, summary, recent actions): frozen actor token embeddings [n_i, hidden]
      x = in_proj(e) + segment_embed[field] + pos_embed[0..n_i]          -> [n_i, d]
    confidence token: conf_mlp([p0, H0]) = fc2(gelu(fc1([p0, H0])))     -> [1, d]
    context = [confidence token; a0; task; summary; recent actions]        (empty fields skipped)
    2 pre-LN self-attention blocks over the context, then context_norm
    16 learned queries, 2 pre-LN cross-attention blocks (queries attend to the context)
    out_proj(out_norm(queries))                                            -> [16, hidden]

A block is `x = x + attn(norm1(x)[, ctx]); x = x + mlp(norm2(x))` with `mlp = fc2(gelu(fc1(x)))`,
GELU erf (`nn.GELU()`), LayerNorm eps from the config, attention heads of d / num_heads with scale
1/sqrt(head_dim), separate biased q/k/v/o projections, no dropout.

    from scopemem_encoder import ScopeMemEncoder, ScopeMemConfig
    enc = ScopeMemEncoder(ScopeMemConfig())            # the paper's size at hidden 4096
    enc.save("out/encoder")                            # scopemem_config.json + scopemem.safetensors
    enc = ScopeMemEncoder.load("out/encoder")
    prefix = enc({"first_opinion": e0, "task": e1, "summary": e2, "recent_actions": e3}, p0)  # [16, hidden]
"""

import dataclasses
import json
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

# The text fields in context order; the index is the field's segment id.
FIELDS = ("first_opinion", "task", "summary", "recent_actions")
# The encoders of the paper's study by what they read: (fields, confidence token). `full` and `no-history`
# read the first opinion; the others are one-pass (their prefix exists before the actor answers).
VARIANTS = {
    "full": (FIELDS, True),
    "one-pass": (("task", "summary", "recent_actions"), False),   # the paper's "history encoder"
    "task-only": (("task",), False),
    "history-only": (("summary", "recent_actions"), False),
    "fixed-query": ((), False),                                   # the fixed-query prefix
    # Table 7's history ablation: "removing history uses a separately trained encoder" (Appendix A.2):
    # the full encoder's inputs less the summary and the recent actions.
    "no-history": (("first_opinion", "task"), True),
}
CONFIG_FILE = "scopemem_config.json"
WEIGHTS_FILE = "scopemem.safetensors"
FORMAT_VERSION = 1


@dataclasses.dataclass
class ScopeMemConfig:
    hidden_size: int = 4096       # the actor's hidden size (input embeddings and output prefix)
    d_model: int = 384            # the encoder's width d
    num_heads: int = 6            # attention heads (head_dim = d_model / num_heads = 64)
    num_self_layers: int = 2      # self-attention blocks over the context
    num_cross_layers: int = 2     # cross-attention blocks (queries attend to the context)
    num_queries: int = 16         # K, the number of prefix vectors
    ffn_size: int = 1536          # MLP width of every block (4 d)
    conf_hidden: int = 384        # width of the confidence MLP's hidden layer
    num_action_types: int = 10    # length of p0
    max_positions: int = 256      # learned positions per field (a field may hold at most this many tokens)
    layer_norm_eps: float = 1e-5
    fields: tuple = FIELDS        # the text fields it reads, a sub-sequence of FIELDS (segment ids in this order)
    confidence: bool = True       # whether the confidence token from (p0, H0) leads the context
    # What it was trained with (the dump's `layout` and `placement`); recall refuses to serve it under
    # another. None: not recorded (left out of the JSON).
    layout: str = None
    placement: str = None

    def __post_init__(self):
        self.fields = tuple(self.fields)
        order = [FIELDS.index(f) for f in self.fields if f in FIELDS]
        if len(order) != len(self.fields) or order != sorted(set(order)):
            raise ValueError(f"fields: {list(self.fields)} must be a sub-sequence of {list(FIELDS)}")
        if not self.has_context() and self.num_self_layers:
            raise ValueError("num_self_layers: an encoder that reads nothing (fixed-query) must have 0")

    def has_context(self):
        return self.confidence or bool(self.fields)

    def needs_first_opinion(self):
        """Whether the prefix depends on the actor's first pass (a0, or p0 and H0)."""
        return self.confidence or "first_opinion" in self.fields

    def variant(self):
        for name, (fields, conf) in VARIANTS.items():
            if tuple(fields) == self.fields and conf == self.confidence:
                return name
        return None

    def with_variant(self, name):
        """This shape reading the inputs of the study variant `name` (see VARIANTS)."""
        fields, conf = VARIANTS[name]
        layers = 0 if name == "fixed-query" else self.num_self_layers
        return dataclasses.replace(self, fields=tuple(fields), confidence=conf, num_self_layers=layers)

    def to_json(self):
        d = {"model_type": "scopemem_encoder", "format_version": FORMAT_VERSION}
        d.update(dataclasses.asdict(self))
        d["fields"] = list(self.fields)
        for k in ("layout", "placement"):
            if d[k] is None:
                del d[k]
        if self.variant():
            d["variant"] = self.variant()
        return d

    @classmethod
    def from_json(cls, d):
        if d.get("model_type") != "scopemem_encoder":
            raise ValueError(f"model_type: expected 'scopemem_encoder', got {d.get('model_type')!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def num_parameters(self):
        """The parameter count, by the formula in docs/SCOPEMEM.md."""
        H, d, f, c = self.hidden_size, self.d_model, self.ffn_size, self.conf_hidden
        block = 2 * 2 * d + 4 * (d * d + d) + (d * f + f) + (f * d + d)
        fields = (H * d + d) + len(self.fields) * d + self.max_positions * d if self.fields else 0
        conf = (self.num_action_types + 1) * c + c + c * d + d if self.confidence else 0
        return (fields + conf + self.num_self_layers * block + (2 * d if self.has_context() else 0)
                + self.num_queries * d + self.num_cross_layers * block + 2 * d
                + (d * H + H))


class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.o_proj = nn.Linear(d, d)

    def forward(self, x, ctx):
        """`x: [m, d]` attends to `ctx: [n, d]` (ctx is x for self-attention). No mask."""
        m, n, h = x.shape[0], ctx.shape[0], self.heads
        if n == 0:  # nothing to attend to: the attention output is the empty sum, zero
            return self.o_proj(torch.zeros_like(x))
        q = self.q_proj(x).view(m, h, -1).transpose(0, 1)          # [h, m, hd]
        k = self.k_proj(ctx).view(n, h, -1).transpose(0, 1)        # [h, n, hd]
        v = self.v_proj(ctx).view(n, h, -1).transpose(0, 1)
        scores = (q @ k.transpose(1, 2)) / math.sqrt(q.shape[-1])   # [h, m, n]
        out = torch.softmax(scores, dim=-1) @ v                      # [h, m, hd]
        return self.o_proj(out.transpose(0, 1).reshape(m, -1))


class Mlp(nn.Module):
    def __init__(self, d_in, d_hidden, d_out):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-LN transformer block; with `ctx` the attention is cross-attention onto it."""

    def __init__(self, cfg):
        super().__init__()
        d = cfg.d_model
        self.norm1 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.attn = Attention(d, cfg.num_heads)
        self.norm2 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.mlp = Mlp(d, cfg.ffn_size, d)

    def forward(self, x, ctx=None):
        y = self.norm1(x)
        x = x + self.attn(y, y if ctx is None else ctx)
        return x + self.mlp(self.norm2(x))


def action_type_entropy(p0):
    """H0 = -sum p log p (natural log, 0 log 0 = 0), in p0's dtype."""
    return -torch.where(p0 > 0, p0 * torch.log(torch.where(p0 > 0, p0, torch.ones_like(p0))),
                        torch.zeros_like(p0)).sum()


class ScopeMemEncoder(nn.Module):
    def __init__(self, cfg: ScopeMemConfig):
        super().__init__()
        if cfg.d_model % cfg.num_heads:
            raise ValueError("num_heads must divide d_model")
        self.cfg = cfg
        d = cfg.d_model
        if cfg.fields:
            self.in_proj = nn.Linear(cfg.hidden_size, d)
            self.segment_embed = nn.Embedding(len(cfg.fields), d)
            self.pos_embed = nn.Embedding(cfg.max_positions, d)
        if cfg.confidence:
            self.conf_mlp = Mlp(cfg.num_action_types + 1, cfg.conf_hidden, d)
        self.self_layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_self_layers))
        if cfg.has_context():
            self.context_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.queries = nn.Parameter(torch.randn(cfg.num_queries, d) * 0.02)
        self.cross_layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_cross_layers))
        self.out_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.out_proj = nn.Linear(d, cfg.hidden_size)

    def context(self, fields, p0):
        """The context tokens `[(1 if confidence) + sum n_i, d]` before the self-attention blocks (only the
        fields the config reads; `p0` is ignored, and may be None, without the confidence token)."""
        unknown = set(fields) - set(FIELDS)
        if unknown:
            raise ValueError(f"unknown fields {sorted(unknown)} (expected {FIELDS})")
        parts = [self.queries.new_zeros(0, self.cfg.d_model)]
        if self.cfg.confidence:
            p0 = p0.to(self.queries.dtype)
            if p0.shape != (self.cfg.num_action_types,):
                raise ValueError(f"p0 must have shape ({self.cfg.num_action_types},), got {tuple(p0.shape)}")
            conf = torch.cat([p0, action_type_entropy(p0).reshape(1)])
            parts.append(self.conf_mlp(conf).unsqueeze(0))
        for s, name in enumerate(self.cfg.fields):
            e = fields.get(name)
            if e is None or e.shape[0] == 0:
                continue  # empty fields contribute no tokens
            n = e.shape[0]
            if n > self.cfg.max_positions:
                raise ValueError(f"field {name}: {n} tokens > max_positions {self.cfg.max_positions}")
            pos = torch.arange(n, device=e.device)
            x = self.in_proj(e.to(self.queries.dtype)) + self.segment_embed.weight[s] + self.pos_embed(pos)
            parts.append(x)
        return torch.cat(parts, 0)

    def forward(self, fields, p0):
        """`fields`: name -> `[n_i, hidden]` (missing or n_i = 0: skipped); `p0: [num_action_types]`.
        Returns the prefix `[num_queries, hidden]`."""
        h = self.context(fields, p0)
        for layer in self.self_layers:
            h = layer(h)
        ctx = self.context_norm(h) if self.cfg.has_context() else h
        q = self.queries
        for layer in self.cross_layers:
            q = layer(q, ctx)
        return self.out_proj(self.out_norm(q))

    def save(self, path):
        """Writes `scopemem_config.json` and `scopemem.safetensors` (float32) into directory `path`."""
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, CONFIG_FILE), "w") as f:
            json.dump(self.cfg.to_json(), f, indent=2)
            f.write("\n")
        tensors = {k: v.detach().to(torch.float32).contiguous() for k, v in self.state_dict().items()}
        save_file(tensors, os.path.join(path, WEIGHTS_FILE),
                  metadata={"format": "pt", "scopemem_format_version": str(FORMAT_VERSION)})

    @classmethod
    def load(cls, path):
        with open(os.path.join(path, CONFIG_FILE)) as f:
            cfg = ScopeMemConfig.from_json(json.load(f))
        enc = cls(cfg)
        enc.load_state_dict(load_file(os.path.join(path, WEIGHTS_FILE)), strict=True)
        return enc.eval()


if __name__ == "__main__":
    cfg = ScopeMemConfig()
    enc = ScopeMemEncoder(cfg)
    n = sum(p.numel() for p in enc.parameters())
    assert n == cfg.num_parameters(), (n, cfg.num_parameters())
    print(f"parameters at hidden {cfg.hidden_size}: {n:,}")
