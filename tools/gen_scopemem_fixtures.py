#!/usr/bin/env python3
"""ScopeMem encoder fixtures: a tiny encoder with seeded random weights and its PyTorch outputs.

Writes
* tests/fixtures/scopemem/encoder/: scopemem_config.json + scopemem.safetensors of a tiny encoder
  (hidden 64 = the text hidden size of tests/fixtures/tiny-qwen3-vl, d 32, 2 heads of 16, ffn 64,
  16 queries, 2 + 2 blocks, 32 positions per field); every parameter, LayerNorms included, is drawn at
  random with a spread that keeps activations O(1), so that a wrong detail anywhere changes the output;
* tests/fixtures/scopemem/cases.safetensors + cases.json: input cases whose fields are rows of the tiny
  actor's `model.language_model.embed_tokens.weight` (token ids listed in the JSON), p0 on the simplex
  (Dirichlet, one-hot, uniform, peaked), with empty fields and a field of exactly max_positions tokens;
  per case `case{i}.{field}` (non-empty fields only), `case{i}.p0`, `case{i}.out_f32` (the float32 forward)
  and `case{i}.out_f64` (the float64 forward on the same float32 weights and inputs, rounded to float32).

* tests/fixtures/scopemem/variants/{one-pass,task-only,history-only,fixed-query,no-history}/: the study's other
  encoders (1 self + 1 cross block, otherwise TINY's shape; fixed-query has no self block), seeded
  apart from the main encoder, and variants.safetensors + variants.json: per variant and case of
  cases.json, `{variant}.case{i}.out_f32` (the float32 forward on the same inputs; a variant reads only
  its own fields, so e.g. history-only on `first_step_one_hot` attends to nothing).

    .venv-tools/bin/python tools/gen_scopemem_fixtures.py
"""

import json
import os
import sys

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dataclasses  # noqa: E402

from scopemem_encoder import FIELDS, VARIANTS, ScopeMemConfig, ScopeMemEncoder, action_type_entropy  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests", "fixtures")
OUT = os.path.join(FIX, "scopemem")
ACTOR = os.path.join(FIX, "tiny-qwen3-vl", "model.safetensors")
EMBED = "model.language_model.embed_tokens.weight"
SEED = 20261026

TINY = ScopeMemConfig(hidden_size=64, d_model=32, num_heads=2, num_self_layers=2, num_cross_layers=2,
                      num_queries=16, ffn_size=64, conf_hidden=32, num_action_types=10, max_positions=32,
                      layer_norm_eps=1e-5)

# (name, field lengths in FIELDS order, p0 kind)
CASES = [
    ("all_fields", (5, 9, 12, 7), "dirichlet"),
    ("first_step_one_hot", (3, 20, 0, 0), "one_hot"),            # no summary or actions yet
    ("short_uniform", (1, 1, 1, 1), "uniform"),                   # context of 5 < 16 queries
    ("long_peaked", (17, 32, 25, 11), "peaked"),                  # task at max_positions
    ("no_first_opinion", (0, 6, 4, 2), "dirichlet"),
    ("all_empty", (0, 0, 0, 0), "dirichlet"),                     # the confidence token alone
]


def init_weights(enc, g):
    """Random weights with O(1) activations; LayerNorm gains and biases away from (1, 0)."""
    with torch.no_grad():
        for name, p in enc.named_parameters():
            if "norm" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("embed.weight") or name == "queries":
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:  # Linear weight [out, in]
                gain = 3.0 if name.startswith("in_proj") else 1.0
                p.copy_(gain * torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)


def make_p0(kind, g):
    n = TINY.num_action_types
    if kind == "one_hot":
        p = torch.zeros(n, dtype=torch.float64)
        p[3] = 1.0
    elif kind == "uniform":
        p = torch.full((n,), 1.0 / n, dtype=torch.float64)
    else:
        alpha = 0.2 if kind == "peaked" else 1.0
        gam = torch.distributions.Gamma(torch.full((n,), alpha, dtype=torch.float64), 1.0)
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=g)))
        p = gam.sample()
        p = p / p.sum()
    return p.to(torch.float32)


def main():
    g = torch.Generator().manual_seed(SEED)
    enc = ScopeMemEncoder(TINY)
    init_weights(enc, g)
    enc.eval()
    enc.save(os.path.join(OUT, "encoder"))
    enc = ScopeMemEncoder.load(os.path.join(OUT, "encoder"))  # round trip through our format
    enc64 = ScopeMemEncoder.load(os.path.join(OUT, "encoder")).double()
    n_params = sum(p.numel() for p in enc.parameters())
    assert n_params == TINY.num_parameters()

    table = load_file(ACTOR)[EMBED]  # [vocab, 64]
    assert table.shape[1] == TINY.hidden_size
    tensors, cases = {}, []
    for i, (name, lengths, kind) in enumerate(CASES):
        ids = {f: torch.randint(0, 1000, (n,), generator=g).tolist() for f, n in zip(FIELDS, lengths)}
        fields = {f: table[torch.tensor(ids[f], dtype=torch.long)] if ids[f] else table[:0] for f in FIELDS}
        p0 = make_p0(kind, g)
        with torch.no_grad():
            out32 = enc(fields, p0)
            out64 = enc64({f: e.double() for f, e in fields.items()}, p0.double())
        assert out32.shape == (TINY.num_queries, TINY.hidden_size)
        for f in FIELDS:
            if ids[f]:
                tensors[f"case{i}.{f}"] = fields[f].contiguous()
        tensors[f"case{i}.p0"] = p0
        tensors[f"case{i}.out_f32"] = out32.contiguous()
        tensors[f"case{i}.out_f64"] = out64.to(torch.float32).contiguous()
        cases.append({
            "name": name,
            "lengths": dict(zip(FIELDS, lengths)),
            "ids": ids,
            "p0": p0.tolist(),
            "h0": float(action_type_entropy(p0.double())),
            "context_len": 1 + sum(lengths),
            "max_abs_out": float(out32.abs().max()),
            "max_abs_f32_vs_f64": float((out32.double() - out64).abs().max()),
        })
        print(f"case {i} {name}: context {1 + sum(lengths)}, max|out| {cases[-1]['max_abs_out']:.3f}, "
              f"f32 vs f64 {cases[-1]['max_abs_f32_vs_f64']:.2e}")

    save_file(tensors, os.path.join(OUT, "cases.safetensors"), metadata={"format": "pt"})
    doc = {
        "generator": "tools/gen_scopemem_fixtures.py",
        "seed": SEED,
        "torch": torch.__version__,
        "actor_embeddings": {"file": "tests/fixtures/tiny-qwen3-vl/model.safetensors", "tensor": EMBED},
        "num_parameters": n_params,
        "fields": list(FIELDS),
        "cases": cases,
    }
    with open(os.path.join(OUT, "cases.json"), "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"{n_params} parameters; wrote {OUT}")
    variants(table, doc["cases"])


def variants(table, cases):
    """The one-pass and control encoders, with their outputs on the cases' inputs."""
    g = torch.Generator().manual_seed(SEED + 1)
    small = dataclasses.replace(TINY, num_self_layers=1, num_cross_layers=1)
    tensors, meta = {}, {}
    for name in VARIANTS:
        if name == "full":
            continue
        cfg = small.with_variant(name)
        enc = ScopeMemEncoder(cfg)
        init_weights(enc, g)
        enc.eval()
        path = os.path.join(OUT, "variants", name)
        enc.save(path)
        enc = ScopeMemEncoder.load(path)
        assert sum(p.numel() for p in enc.parameters()) == cfg.num_parameters()
        outs = []
        for i, case in enumerate(cases):
            fields = {f: table[torch.tensor(case["ids"][f], dtype=torch.long)] if case["ids"][f] else table[:0]
                      for f in FIELDS}
            with torch.no_grad():
                out = enc(fields, torch.tensor(case["p0"], dtype=torch.float32))
            tensors[f"{name}.case{i}.out_f32"] = out.contiguous()
            outs.append(float(out.abs().max()))
        meta[name] = {"num_parameters": cfg.num_parameters(), "max_abs_out": outs}
        print(f"variant {name}: {cfg.num_parameters()} parameters, max|out| per case {[round(x, 2) for x in outs]}")
    save_file(tensors, os.path.join(OUT, "variants.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(OUT, "variants.json"), "w") as f:
        json.dump({"generator": "tools/gen_scopemem_fixtures.py", "seed": SEED + 1, "torch": torch.__version__,
                   "cases": "cases.json", "variants": meta}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
