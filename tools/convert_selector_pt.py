#!/usr/bin/env python3
"""Converts the CausalCache reference trainer's `marginal_scorer.pt` into the safetensors scorer recall
loads with `MarginalScorer::load` (layout in src/memory/selector/scorer.rs).

    .venv-tools/bin/python tools/convert_selector_pt.py marginal_scorer.pt selector.safetensors

Accepted inputs (checked in this order):

1. The authors' bundle (`scripts/train_selector_v4_marginal.py` in luojiaxuan/CausalCache):
   `{"model_state": state_dict, "mean": [28 floats], "std": [28 floats], "feature_names": [...20],
   "set_feature_names": [...8], "hidden": H, "readout_dim": R, "intent_dims": I, ...}` with the MLP at
   `cheap.{0,2,4}` (`--arch two_tower`) or `net.{0,2,4}` (`--arch concat`). The authors' serving code
   never feeds HGKV readouts online: the two-tower readout tower (`readout.*`) is masked off, and the
   concat model gets zeros in the R readout columns, so those columns of the first layer are dropped
   here without changing any output. Bundles with intent features (I > 0) are refused: recall does not
   compute them. Feature names, when present, must match recall's 28-feature layout.
2. `{"state_dict": ..., "mean": ..., "std": ...}` with the same state-dict conventions.
3. A bare state dict of an `nn.Sequential` (`0.weight`, `2.weight`, `4.weight` and biases, optionally
   under a prefix) with `feature_mean`/`feature_std` (or `mean`/`std`) buffers; `fc1/fc2/fc3` names
   are accepted too.

The scorer records `event_indexing` (`--event-indexing`, default `desktop`): the authors train their
selectors on desktop features (`selector_v4_features.py`: a recall step s is their event s - 1, so
age = t - s + 1 and in_recent_B is exactly Recent-B), and recall serves the bundle with the indexing it
was trained with. `mobile` (age = t - s) reproduces their MobileWorld deployment code, which feeds the
same bundle ages one smaller.
"""

import argparse
import re
import sys

import torch
from safetensors.torch import save_file

FEATURE_NAMES = [
    "age", "log_age", "recency_rank", "relative_position", "in_recent_1", "in_recent_2", "in_recent_4",
    "in_recent_8", "pool_size", "trajectory_length", "witness_match", "witness_count", "witness_rank",
    "action_type_click", "action_type_type", "action_type_key", "action_type_scroll", "action_type_other",
    "coord_distance", "dedup_multiplicity", "set_size", "min_age_gap_to_set", "mean_age_gap_to_set",
    "n_recent_in_set", "n_witness_in_set", "witness_redundancy", "event_older_than_set",
    "duplicate_of_set_member",
]
N = len(FEATURE_NAMES)


def fail(msg):
    raise SystemExit(f"convert_selector_pt: {msg}")


def find_linears(state):
    """The three Linear layers as [(weight, bias)] in order, from fc1..fc3 or <prefix><idx>.weight."""
    if all(f"fc{i}.weight" in state for i in (1, 2, 3)):
        return [(state[f"fc{i}.weight"], state[f"fc{i}.bias"]) for i in (1, 2, 3)], "fc"
    for prefix in ("cheap.", "net.", "model.", "mlp.", ""):
        idx = sorted(
            int(m.group(1))
            for k in state
            for m in [re.fullmatch(re.escape(prefix) + r"(\d+)\.weight", k)]
            if m
        )
        if len(idx) == 3:
            layers = []
            for i in idx:
                w, b = state[f"{prefix}{i}.weight"], state.get(f"{prefix}{i}.bias")
                if b is None:
                    fail(f"{prefix}{i}.bias missing")
                layers.append((w, b))
            return layers, prefix
    fail(f"no three-layer MLP found among keys {sorted(state)[:12]}...")


def load(src):
    obj = torch.load(src, map_location="cpu", weights_only=True)
    if not isinstance(obj, dict):
        fail(f"{src}: expected a dict, got {type(obj).__name__}")
    info = {}
    if "model_state" in obj:
        state, mean, std = obj["model_state"], obj.get("mean"), obj.get("std")
        info = {k: obj.get(k) for k in ("feature_names", "set_feature_names", "readout_dim", "intent_dims", "hidden")}
        info["layout"] = "causalcache bundle"
    elif "state_dict" in obj:
        state, mean, std = obj["state_dict"], obj.get("mean"), obj.get("std")
        info["layout"] = "state_dict + mean/std"
    else:
        state = obj
        mean = obj.get("feature_mean", obj.get("mean"))
        std = obj.get("feature_std", obj.get("std"))
        info["layout"] = "bare state dict"
    if mean is None or std is None:
        fail(f"{src}: no normalisation mean/std ({info['layout']})")
    return state, torch.as_tensor(mean, dtype=torch.float64), torch.as_tensor(std, dtype=torch.float64), info


def convert(src, dst, indexing="desktop"):
    state, mean, std, info = load(src)
    if int(info.get("intent_dims") or 0):
        fail(f"{src}: bundle has {info['intent_dims']} intent features; recall computes only the 28 cheap+set features")
    names = info.get("feature_names")
    if names is not None:
        full = list(names) + list(info.get("set_feature_names") or [])
        if full != FEATURE_NAMES:
            fail(f"{src}: feature layout {full} differs from recall's {FEATURE_NAMES}")
    layers, prefix = find_linears(state)
    (w1, b1), (w2, b2), (w3, b3) = layers
    readout = int(info.get("readout_dim") or 0)
    if w1.shape[1] == N + readout and readout and prefix == "net.":
        # concat arch: serving feeds zeros for the readout columns, so they never contribute
        w1 = w1[:, :N]
    if mean.numel() != N or std.numel() != N:
        fail(f"{src}: mean/std have {mean.numel()}/{std.numel()} values, expected {N}")
    h = w1.shape[0]
    expect = {"fc1.weight": (h, N), "fc1.bias": (h,), "fc2.weight": (h, h), "fc2.bias": (h,),
              "fc3.weight": (1, h), "fc3.bias": (1,)}
    tensors = {
        "feature_mean": mean.float(), "feature_std": std.float(),
        "fc1.weight": w1, "fc1.bias": b1, "fc2.weight": w2, "fc2.bias": b2, "fc3.weight": w3, "fc3.bias": b3,
    }
    for name, shape in expect.items():
        if tuple(tensors[name].shape) != shape:
            fail(f"{src}: {name} has shape {tuple(tensors[name].shape)}, expected {shape}")
    if bool((std <= 0).any()):
        fail(f"{src}: feature_std has non-positive entries")
    tensors = {k: v.detach().float().contiguous() for k, v in tensors.items()}
    save_file(tensors, dst, metadata={
        "format": "recall.selector.v1",
        "hidden": str(h),
        "feature_names": ",".join(FEATURE_NAMES),
        "source_layout": info["layout"],
        "source_prefix": prefix,
        "event_indexing": indexing,
    })
    return h, info["layout"]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--event-indexing", choices=["desktop", "mobile"], default="desktop",
                    help="how the bundle's training features counted ages [desktop: the authors' trainer]")
    args = ap.parse_args()
    h, layout = convert(args.src, args.dst, args.event_indexing)
    print(f"{args.dst}: hidden {h}, from {layout}", file=sys.stderr)
