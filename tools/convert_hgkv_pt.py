#!/usr/bin/env python3
"""Converts the CausalCache reference trainer's HGKV checkpoint (a torch `.pt` dict of tensors
"<module name>.lora_a" [r, in] and "<module name>.lora_b" [out, r]) into the safetensors file recall
loads with `--adapter FILE`. Rank comes from the tensors; alpha is recorded in the file's metadata
(the trainer's default is 16).

    .venv-tools/bin/python tools/convert_hgkv_pt.py hgkv.pt adapter.safetensors [--alpha 16]
"""

import argparse
import sys

import torch
from safetensors.torch import save_file


def convert(src, dst, alpha):
    state = torch.load(src, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    tensors = {k: v.detach().float().contiguous() for k, v in state.items() if k.endswith((".lora_a", ".lora_b"))}
    if not tensors:
        sys.exit(f"{src}: no '<module>.lora_a' / '<module>.lora_b' tensors")
    ranks = {v.shape[0] for k, v in tensors.items() if k.endswith(".lora_a")}
    if len(ranks) != 1:
        sys.exit(f"{src}: lora_a tensors disagree on the rank: {sorted(ranks)}")
    for k in tensors:
        twin = k[:-1] + ("b" if k.endswith("a") else "a")
        if twin not in tensors:
            sys.exit(f"{src}: {k} has no {twin}")
    rank = ranks.pop()
    save_file(tensors, dst, metadata={"format": "pt", "r": str(rank), "lora_alpha": str(alpha)})
    print(f"{dst}: {len(tensors)} tensors, rank {rank}, alpha {alpha}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--alpha", type=float, default=16.0)
    a = ap.parse_args()
    convert(a.src, a.dst, a.alpha)
