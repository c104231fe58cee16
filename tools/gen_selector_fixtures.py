#!/usr/bin/env python3
"""Fixtures for tests/selector.rs: a PyTorch reference of the marginal scorer MLP.

    .venv-tools/bin/python tools/gen_selector_fixtures.py [--out tests/fixtures/selector]

Writes
  scorer.safetensors   random MLP (28 -> 192 -> 192 -> 1, nn.GELU exact), fixed seed, recall's format
  scorer_cases.json    50 feature vectors, PyTorch outputs in float32 and float64
  converted.safetensors / converted_cases.json
                       a small (hidden 16) fake authors' bundle (`marginal_scorer.pt`, concat arch with a
                       3-wide readout) run through tools/convert_selector_pt.py, and the bundle's own
                       outputs (readout columns fed zeros, as the authors' server does)
and round-trips every input layout the converter accepts, failing loudly on a mismatch.

Normalisation follows the reference: (x - mean) / std in float64, then float32 for the f32 model.
"""

import argparse
import json
import os
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import convert_selector_pt as conv  # noqa: E402

N = 28
SEED = 20260726


def mlp(inp, hidden):
    return torch.nn.Sequential(
        torch.nn.Linear(inp, hidden), torch.nn.GELU(),
        torch.nn.Linear(hidden, hidden), torch.nn.GELU(),
        torch.nn.Linear(hidden, 1),
    )


def random_features(g, count):
    """Plausible feature vectors (ages, flags, ranks, distances) as float32."""
    rows = []
    for _ in range(count):
        t = int(torch.randint(2, 60, (1,), generator=g))
        s = int(torch.randint(1, t, (1,), generator=g))
        age = t - s
        flags = torch.randint(0, 2, (10,), generator=g).tolist()
        bucket = int(torch.randint(0, 5, (1,), generator=g))
        pool = int(torch.randint(1, t, (1,), generator=g))
        dist = float(torch.rand(1, generator=g) * 900) if flags[0] else -1.0
        row = [age, torch.log(torch.tensor(float(age), dtype=torch.float64)).item(),
               float(torch.randint(0, pool, (1,), generator=g)), s / max(t - 1, 1),
               float(age <= 2), float(age <= 3), float(age <= 5), float(age <= 9),
               float(pool), float(t - 1), float(flags[0]), float(sum(flags[:4])),
               float(flags[1]) if flags[0] else -1.0,
               *[float(bucket == i) for i in range(5)], dist, float(1 + flags[2] * flags[3])]
        size = int(torch.randint(0, 5, (1,), generator=g))
        if size == 0:
            row += [0.0, -1.0, -1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
        else:
            gap = float(torch.randint(1, 20, (1,), generator=g))
            row += [float(size), gap, gap + float(torch.rand(1, generator=g) * 5), float(flags[4] + flags[5]),
                    float(flags[6]), float(flags[6] and flags[0]), float(flags[7]), float(flags[8] * flags[9])]
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float64).float()


def reference(model, mean, std, x):
    xn64 = (x.double() - mean.double()) / std.double()
    with torch.no_grad():
        y32 = model.float()(xn64.float()).squeeze(-1)
        m64 = mlp(N, model[0].out_features).double()
        m64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
        y64 = m64(xn64).squeeze(-1)
    return y32, y64


def ours(model, mean, std):
    return {
        "feature_mean": mean.float().contiguous(), "feature_std": std.float().contiguous(),
        "fc1.weight": model[0].weight, "fc1.bias": model[0].bias,
        "fc2.weight": model[2].weight, "fc2.bias": model[2].bias,
        "fc3.weight": model[4].weight, "fc3.bias": model[4].bias,
    }


def check_round_trip(tmp, name, payload, expected, slice_fc1=None):
    src = os.path.join(tmp, f"{name}.pt")
    dst = os.path.join(tmp, f"{name}.safetensors")
    torch.save(payload, src)
    conv.convert(src, dst)
    got = load_file(dst)
    for k, v in expected.items():
        v = v.detach().float()
        if k == "fc1.weight" and slice_fc1 is not None:
            v = v[:, :slice_fc1]
        if tuple(got[k].shape) != tuple(v.shape) or not torch.equal(got[k], v):
            raise SystemExit(f"round trip {name}: {k} differs")
    print(f"round trip {name}: ok", file=sys.stderr)
    return dst


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "selector"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(SEED)
    g = torch.Generator().manual_seed(SEED)

    # 1. The main fixture: hidden 192.
    model = mlp(N, 192)
    # mean/std as the trainer computes them: population statistics of a training sample, std >= 1e-6
    train = random_features(g, 500).double()
    mean = train.mean(0).float()
    std = train.std(0, unbiased=False).clamp_min(1e-6).float()
    x = random_features(g, 50)
    y32, y64 = reference(model, mean, std, x)
    tensors = {k: v.detach().float().contiguous() for k, v in ours(model, mean, std).items()}
    save_file(tensors, os.path.join(args.out, "scorer.safetensors"), metadata={
        "format": "recall.selector.v1", "hidden": "192", "feature_names": ",".join(conv.FEATURE_NAMES)})
    with open(os.path.join(args.out, "scorer_cases.json"), "w") as f:
        json.dump({"features": [[float(v) for v in r] for r in x],
                   "f32": [float(v) for v in y32], "f64": [float(v) for v in y64]}, f)

    # 2. Converter round trips on every accepted layout.
    with tempfile.TemporaryDirectory() as tmp:
        small = mlp(N, 16)
        sample = random_features(g, 300).double()
        sm_mean = sample.mean(0).float()
        sm_std = sample.std(0, unbiased=False).clamp_min(1e-6).float()
        names = {"feature_names": conv.FEATURE_NAMES[:20], "set_feature_names": conv.FEATURE_NAMES[20:]}
        exp = ours(small, sm_mean, sm_std)
        # a. authors' bundle, two-tower with a readout tower (dropped)
        tower = {f"cheap.{k}": v for k, v in small.state_dict().items()}
        tower.update({f"readout.{k}": v for k, v in mlp(5, 64).state_dict().items() if k.startswith(("0.", "4."))})
        check_round_trip(tmp, "two_tower", {"model_state": tower, "mean": sm_mean.double().tolist(),
                                            "std": sm_std.double().tolist(), "hidden": 16, "readout_dim": 5,
                                            "intent_dims": 0, **names}, exp)
        # b. state_dict + mean/std
        check_round_trip(tmp, "state_dict", {"state_dict": small.state_dict(), "mean": sm_mean, "std": sm_std}, exp)
        # c. bare nn.Sequential state dict with buffers
        bare = dict(small.state_dict())
        bare.update({"feature_mean": sm_mean, "feature_std": sm_std})
        check_round_trip(tmp, "sequential", bare, exp)
        # d. authors' bundle, concat arch with 3 readout columns: fed zeros at serving time
        wide = mlp(N + 3, 16)
        concat = {f"net.{k}": v for k, v in wide.state_dict().items()}
        exp_wide = ours(wide, sm_mean, sm_std)
        dst = check_round_trip(tmp, "concat", {"model_state": concat, "mean": sm_mean.double().tolist(),
                                               "std": sm_std.double().tolist(), "hidden": 16, "readout_dim": 3,
                                               "intent_dims": 0, **names}, exp_wide, slice_fc1=N)
        # e. refusals
        for bad_name, bad in [("intent", {"model_state": tower, "mean": sm_mean.tolist(), "std": sm_std.tolist(),
                                          "intent_dims": 8, **names}),
                              ("names", {"model_state": tower, "mean": sm_mean.tolist(), "std": sm_std.tolist(),
                                         "feature_names": conv.FEATURE_NAMES[1:21],
                                         "set_feature_names": conv.FEATURE_NAMES[20:]})]:
            src = os.path.join(tmp, f"bad_{bad_name}.pt")
            torch.save(bad, src)
            try:
                conv.convert(src, os.path.join(tmp, "bad.safetensors"))
            except SystemExit:
                print(f"refusal {bad_name}: ok", file=sys.stderr)
            else:
                raise SystemExit(f"converter accepted a bad bundle ({bad_name})")

        # The concat conversion ships as a fixture with the bundle's own outputs (zeros in the readout
        # columns), so the Rust test checks converter + loader end to end.
        xs = random_features(g, 20)
        xn64 = (xs.double() - sm_mean.double()) / sm_std.double()
        with torch.no_grad():
            full = torch.cat([xn64.float(), torch.zeros(len(xs), 3)], dim=-1)
            yc = wide(full).squeeze(-1)
        with open(dst, "rb") as src_f, open(os.path.join(args.out, "converted.safetensors"), "wb") as out_f:
            out_f.write(src_f.read())
        with open(os.path.join(args.out, "converted_cases.json"), "w") as f:
            json.dump({"features": [[float(v) for v in r] for r in xs], "f32": [float(v) for v in yc]}, f)
    print(f"wrote fixtures to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
