#!/usr/bin/env python3
"""How far recall's logits are from HF transformers' float32 logits, per recall mode, on one prompt.

The error of an arithmetic mode only means something next to the error the peer's own choice of the
same arithmetic makes, so this prints, against HF in float32 (the reference):

* each recall mode (``recall logits`` with the given extra arguments; the default exact path, and
  e.g. ``--cpu-bf16-dot``, recall's bf16 products);
* HF itself in bfloat16 (PyTorch's CPU bf16 matmuls), the peer of ``--cpu-bf16-dot``;

as the largest absolute logit difference, its ratio to the largest |logit|, the mean absolute
difference, and the share of positions whose argmax (the greedy token) agrees with the reference.

    cargo build --release
    .venv-train/bin/python tools/make_shape_model.py --out /tmp/shape-l4-bf16 --dtype bfloat16
    .venv-train/bin/python tools/logits_compare.py --model /tmp/shape-l4-bf16 --mode "" --mode=--cpu-bf16-dot

Needs torch, transformers 5 and safetensors (tools/tests/requirements-train.txt).
"""

import argparse
import json
import os
import pathlib
import shlex
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from cpu_compare import ROOT, chat  # noqa: E402


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="HF model directory")
    ap.add_argument("--recall", default=str(ROOT / "target" / "release" / "recall"))
    ap.add_argument("--prompt-tokens", type=int, default=200, help="about this many text tokens")
    ap.add_argument("--mode", action="append", default=None,
                    help='extra arguments of one recall run ("" = the default path); repeatable')
    ap.add_argument("--json", default=None, help="also write the report here")
    return ap.parse_args()


def recall_logits(binary, model_dir, messages_path, extra, out):
    cmd = [binary, "logits", "--backend", "cpu", "--model", model_dir, "--messages", messages_path,
           "--out", out, *extra]
    run = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "RUST_LOG": "warn"})
    if run.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{run.stderr}")
    from safetensors.numpy import load_file
    t = load_file(out)
    return t["input_ids"], t["logits"]


def hf_logits(model_dir, messages, dtype):
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    inputs = AutoProcessor.from_pretrained(model_dir).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt")
    with torch.inference_mode():
        logits = model(**inputs).logits[0].float().numpy()
    return inputs["input_ids"][0].numpy(), logits


def error(got, want):
    import numpy as np
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    return {
        "max_abs": float(diff.max()),
        "max_abs_over_max_logit": float(diff.max() / np.abs(want).max()),
        "mean_abs": float(diff.mean()),
        "argmax_agreement": float((got.argmax(-1) == want.argmax(-1)).mean()),
    }


def main():
    args = parse()
    from transformers import AutoTokenizer
    messages = chat(AutoTokenizer.from_pretrained(args.model), args.prompt_tokens, [])
    modes = args.mode if args.mode is not None else [""]
    ids, reference = hf_logits(args.model, messages, "float32")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "messages.json")
        with open(path, "w") as f:
            json.dump(messages, f)
        for mode in modes:
            got_ids, got = recall_logits(args.recall, args.model, path, shlex.split(mode),
                                         os.path.join(tmp, "logits.safetensors"))
            if list(got_ids) != list(ids):
                sys.exit("recall and HF tokenised the prompt differently")
            rows.append({"side": f"recall {mode or '(exact)'}", **error(got, reference)})
    _, hf_bf16 = hf_logits(args.model, messages, "bfloat16")
    rows.append({"side": "HF bfloat16", **error(hf_bf16, reference)})
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"model": args.model, "tokens": len(ids), "rows": rows},
                                                      indent=2))
    print(f"\n{args.model}, {len(ids)} tokens, against HF float32 (max |logit| "
          f"{float(abs(reference).max()):.3f})")
    print("| side | max abs | / max logit | mean abs | argmax agrees |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['side']} | {r['max_abs']:.3e} | {r['max_abs_over_max_logit']:.2e} | {r['mean_abs']:.2e} | "
              f"{r['argmax_agreement']:.4f} |")


if __name__ == "__main__":
    main()
