#!/usr/bin/env python3
"""The selector trainer's objective in PyTorch, and the fixture that checks recall's against it.

`recall selector train` (src/memory/selector_train.rs) minimises, on a batch of N implied marginals
with normalised features z, scaled targets y and P ordered within-state pairs (a, b):

    L = (1/N) Σ_i (p_i − y_i)²  +  λ · (1/P) Σ_(a,b) softplus(−(p_a − p_b)),
    p = fc3(gelu(fc2(gelu(fc1 z))))   (exact erf GELU)

This file is that objective written independently with torch autograd (float64). Run it to regenerate
tests/fixtures/selector-train/objective.safetensors (parameters, batch, λ, and the loss and gradients
torch computes), which tests/selector_train.rs compares with recall's hand-written backward pass:

    .venv-tools/bin/python tools/selector_objective.py
"""

import os

import torch
from safetensors.torch import save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "selector-train", "objective.safetensors")
NAMES = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias"]


class Scorer(torch.nn.Module):
    def __init__(self, hidden, features=28):
        super().__init__()
        self.fc1 = torch.nn.Linear(features, hidden)
        self.fc2 = torch.nn.Linear(hidden, hidden)
        self.fc3 = torch.nn.Linear(hidden, 1)
        self.act = torch.nn.GELU()

    def forward(self, z):
        return self.fc3(self.act(self.fc2(self.act(self.fc1(z))))).squeeze(-1)


def objective(model, z, y, pairs, rank_weight):
    p = model(z)
    loss = ((p - y) ** 2).mean()
    if len(pairs) and rank_weight > 0:
        d = p[pairs[:, 0]] - p[pairs[:, 1]]
        loss = loss + rank_weight * torch.nn.functional.softplus(-d).mean()
    return loss


def main():
    torch.manual_seed(16)
    hidden, n = 16, 40
    model = Scorer(hidden).double()
    with torch.no_grad():
        for prm in model.parameters():
            prm.mul_(3.0)  # larger weights: GELU's curved region and both softplus branches
    z = torch.randn(n, 28, dtype=torch.float64) * 1.5
    y = torch.randn(n, dtype=torch.float64)
    # States of 5 samples; every ordered pair with a larger target first.
    pairs = [(a, b) for s in range(0, n, 5) for a in range(s, s + 5) for b in range(s, s + 5) if y[a] > y[b]]
    pairs = torch.tensor(pairs, dtype=torch.int64)
    rank_weight = 0.7
    loss = objective(model, z, y, pairs, rank_weight)
    loss.backward()
    tensors = {name: prm.detach().clone() for name, prm in zip(NAMES, model.parameters())}
    tensors.update({"grad." + name: prm.grad.clone() for name, prm in zip(NAMES, model.parameters())})
    tensors.update({"z": z, "y": y, "pairs": pairs, "rank_weight": torch.tensor([rank_weight], dtype=torch.float64),
                    "loss": loss.detach().reshape(1)})
    save_file({k: v.contiguous() for k, v in tensors.items()}, OUT,
              metadata={"generator": "tools/selector_objective.py", "torch": torch.__version__})
    print("wrote %s (loss %.12f, %d pairs)" % (OUT, loss.item(), len(pairs)))


if __name__ == "__main__":
    main()
