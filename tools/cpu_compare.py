#!/usr/bin/env python3
"""recall's CPU backend against HF transformers (PyTorch, f32) on the same weights and prompt.

Both run one greedy generation of the same chat (a text of about --prompt-tokens tokens, with
--images synthetic screenshots of --image-size before it) on this machine's cores, one after the other:

* HF: ``AutoModelForImageTextToText`` in float32 (bf16 checkpoints are upcast, so both compute on the
  same values; ``--hf-dtype bfloat16`` runs PyTorch's bf16 instead, the peer of recall's
  ``--recall-arg=--cpu-bf16-dot``), ``generate(do_sample=False)``; the vision tower timed on its own
  (``get_image_features``), the prefill as the first forward minus the tower, the decode as the mean
  of the later steps.
* recall: ``recall generate --backend cpu --json --profile`` (the load, the vision tower, the prefill
  forward and the decode forwards timed inside, the weights kept in the checkpoint's dtype). Its end
  to end is load + vision + prefill, against HF's vision + prefill with the model already loaded
  (the issue-29 target); the milliseconds from exec to the load's start are not counted.

It reports prefill seconds, decode ms/token, vision ms per screenshot, recall/HF ratios, whether the
greedy tokens are identical, and the GEMM throughput: recall's ``linear`` in the prefill (FLOPs it
counts over its time), PyTorch's 2048^3 f32 matmul, and this machine's f32 FMA peak, which recall's
``--profile`` measures in the same process right after the generation (``recall::backend::cpu::peak``;
``cargo bench --bench gemm -- peak`` times the same loop); the share of peak is the median of the
runs' own ratios.

    .venv-serve/bin/python tools/make_shape_model.py --out /tmp/shape-l4            # f32, 4+4 layers
    cargo build --release
    .venv-serve/bin/python tools/cpu_compare.py --model /tmp/shape-l4 --prompt-tokens 1278
    .venv-serve/bin/python tools/cpu_compare.py --model /tmp/shape-l4 --images 3 --prompt-tokens 200

Needs torch, transformers 5 and pillow (tools/requirements.txt).
"""

import argparse
import json
import os
import statistics
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="HF model directory (both load it)")
    ap.add_argument("--recall", default=str(ROOT / "target" / "release" / "recall"))
    ap.add_argument("--prompt-tokens", type=int, default=1278, help="about this many text tokens")
    ap.add_argument("--images", type=int, default=0, help="screenshots in the prompt")
    ap.add_argument("--image-size", default="640x360", help="WIDTHxHEIGHT of each screenshot")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs of each side, interleaved (recall, HF, recall, ...); medians reported")
    ap.add_argument("--peak-gflops", type=float, default=None,
                    help="use this f32 FMA peak instead of the one recall measures in each run")
    ap.add_argument("--hf-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="HF's compute dtype: float32 (the exact reference) or bfloat16 (PyTorch's bf16 "
                         "matmuls, the peer of recall's --cpu-bf16-dot)")
    ap.add_argument("--recall-arg", action="append", default=[],
                    help="extra argument for recall generate, e.g. --recall-arg=--cpu-bf16-dot; repeatable")
    ap.add_argument("--warm-recall", action="store_true",
                    help="run each timed recall process right after an identical untimed one: on VMs that "
                         "hand freed guest memory back to the host (free page reporting), a process started "
                         "after a pause pays host faults on every fresh page; HF's process stays warm anyway")
    ap.add_argument("--json", default=None, help="also write the report here")
    return ap.parse_args()


def screenshots(n, size, directory):
    from PIL import Image, ImageDraw
    w, h = (int(v) for v in size.split("x"))
    paths = []
    for i in range(n):
        img = Image.new("RGB", (w, h), (240, 240, 245))
        d = ImageDraw.Draw(img)
        for j in range(12):
            y = 20 + j * (h - 40) // 12
            d.rectangle([20, y, w - 20, y + (h - 40) // 16], fill=((37 * (i + j)) % 256, 90, 160))
            d.text((30, y + 2), f"Setting {i}.{j}", fill=(255, 255, 255))
        p = os.path.join(directory, f"shot{i}.png")
        img.save(p)
        paths.append(p)
    return paths


def chat(tokenizer, target, images):
    sentence = "Open the settings app, find the network page and turn on Wi-Fi before you go back. "
    per = len(tokenizer.encode(sentence, add_special_tokens=False))
    text = sentence * max(1, target // per)
    content = [{"type": "image", "path": p} for p in images] + [{"type": "text", "text": text}]
    return [{"role": "user", "content": content}]


class Hf:
    """The HF side: the model loaded once, then timed generations."""

    def __init__(self, model_dir, messages, dtype="float32"):
        import torch
        from transformers import AutoModelForImageTextToText, AutoProcessor
        self.torch = torch
        self.model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        processor = AutoProcessor.from_pretrained(model_dir)
        self.inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=True, return_tensors="pt")

    def run(self, new_tokens, images):
        from transformers import LogitsProcessor
        torch, model, inputs = self.torch, self.model, self.inputs
        stamps = []

        class Clock(LogitsProcessor):
            def __call__(self, input_ids, scores):
                stamps.append(time.perf_counter())
                return scores

        with torch.inference_mode():
            vision_s = 0.0
            if images:
                t = time.perf_counter()
                model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
                vision_s = time.perf_counter() - t
            t0 = time.perf_counter()
            out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, temperature=None,
                                 top_p=None, top_k=None, logits_processor=[Clock()])
        first = stamps[0] - t0
        decode = (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)
        return {
            "prompt_tokens": int(inputs["input_ids"].shape[1]),
            "vision_seconds": vision_s,
            "prefill_seconds": first - vision_s,
            "decode_ms_per_token": decode * 1e3,
            "tokens": out[0, inputs["input_ids"].shape[1]:].tolist(),
            "threads": torch.get_num_threads(),
        }


def median_of(runs, key):
    return statistics.median(r[key] for r in runs)


def torch_matmul_gflops():
    import torch
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    for _ in range(3):
        a @ b
    t = time.perf_counter()
    n = 10
    for _ in range(n):
        a @ b
    return 2 * 2048 ** 3 / ((time.perf_counter() - t) / n) / 1e9


def run_recall(binary, model_dir, messages_path, new_tokens, extra=(), warm=False):
    """One `recall generate` process, timed inside; with `warm`, an identical untimed run goes right
    before it (see --warm-recall)."""
    cmd = [binary, "generate", "--backend", "cpu", "--json", "--profile", "--model", model_dir,
           "--messages", messages_path, "--max-tokens", str(new_tokens), *extra]
    env = {**os.environ, "RUST_LOG": "warn"}
    if warm:
        subprocess.run(cmd, capture_output=True, env=env)
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        sys.exit(f"recall failed:\n{out.stderr}")
    r = json.loads(out.stdout)
    t = r["timings"]
    # The GEMM's ops: `linear`, and `swiglu` (gate and up with their product, fused).
    linear = [o for o in r["prefill_ops"] if o["op"] in ("linear", "swiglu")]
    gemm = sum(o["flops"] for o in linear) / max(1e-12, sum(o["seconds"] for o in linear)) / 1e9
    return {
        "prompt_tokens": r["prompt_tokens"],
        "load_seconds": t["load_seconds"],
        "vision_seconds": t["vision_seconds"],
        "prefill_seconds": t["prefill_seconds"],
        "decode_ms_per_token": t["decode_seconds"] / max(1, t["decode_steps"]) * 1e3,
        "tokens": r["tokens"],
        "linear_gflops_prefill": gemm,
        "fma_peak_gflops": r.get("fma_peak_gflops"),
        "prefill_ops": r["prefill_ops"],
        "backend": r["backend"],
    }


def main():
    args = parse()
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        images = screenshots(args.images, args.image_size, tmp)
        messages = chat(tokenizer, args.prompt_tokens, images)
        # recall reads image parts by path.
        ours = [{"role": m["role"], "content": [
            {"type": "image_url", "image_url": {"url": p["path"]}} if p["type"] == "image" else p
            for p in m["content"]]} for m in messages]
        path = os.path.join(tmp, "messages.json")
        with open(path, "w") as f:
            json.dump(ours, f)
        hf_side = Hf(args.model, messages, args.hf_dtype)
        if images:
            hf_side.run(1, images)  # warm-up of the tower's first call
        recs, hfs = [], []
        for _ in range(args.repeats):
            recs.append(run_recall(args.recall, args.model, path, args.new_tokens, args.recall_arg,
                                   warm=args.warm_recall))
            hfs.append(hf_side.run(args.new_tokens, images))
        rec, hf = dict(recs[0]), dict(hfs[0])
        for key in ("vision_seconds", "prefill_seconds", "decode_ms_per_token"):
            rec[key], hf[key] = median_of(recs, key), median_of(hfs, key)
        rec["load_seconds"] = median_of(recs, "load_seconds")
        for r in recs:
            r["end_to_end_seconds"] = r["load_seconds"] + r["vision_seconds"] + r["prefill_seconds"]
        rec["end_to_end_seconds"] = median_of(recs, "end_to_end_seconds")
        rec["linear_gflops_prefill"] = median_of(recs, "linear_gflops_prefill")
        peaks = [args.peak_gflops or r["fma_peak_gflops"] for r in recs]
        share_of_peak = (statistics.median(r["linear_gflops_prefill"] / p for r, p in zip(recs, peaks))
                         if all(peaks) else None)
        peak = statistics.median(peaks) if all(peaks) else None
        rec["runs"] = [{k: r[k] for k in ("load_seconds", "end_to_end_seconds", "vision_seconds", "prefill_seconds", "decode_ms_per_token",
                                          "linear_gflops_prefill", "fma_peak_gflops")} for r in recs]
        hf["runs"] = [{k: r[k] for k in ("vision_seconds", "prefill_seconds", "decode_ms_per_token")} for r in hfs]
        if any(r["tokens"] != rec["tokens"] for r in recs) or any(r["tokens"] != hf["tokens"] for r in hfs):
            sys.exit("a side's greedy tokens changed between runs")
    peak_torch = torch_matmul_gflops()
    n_img = max(1, args.images)
    report = {
        "model": args.model,
        "hf_dtype": args.hf_dtype,
        "recall_args": args.recall_arg,
        "warm_recall": args.warm_recall,
        "images": args.images,
        "new_tokens": args.new_tokens,
        "recall": {k: v for k, v in rec.items() if k != "prefill_ops"},
        "hf": hf,
        "prefill_ratio": rec["prefill_seconds"] / hf["prefill_seconds"],
        "end_to_end_ratio": rec["end_to_end_seconds"] / (hf["vision_seconds"] + hf["prefill_seconds"]),
        "decode_ratio": rec["decode_ms_per_token"] / hf["decode_ms_per_token"],
        "vision_ratio": (rec["vision_seconds"] / hf["vision_seconds"]) if args.images else None,
        "tokens_identical": rec["tokens"] == hf["tokens"],
        "torch_matmul_2048_gflops": peak_torch,
        "peak_gflops": peak,
        "linear_share_of_peak": share_of_peak,
    }
    print(f"prompt tokens: recall {rec['prompt_tokens']}, HF {hf['prompt_tokens']}; {args.images} screenshot(s); "
          f"{rec['backend']} {' '.join(args.recall_arg)} vs torch {args.hf_dtype} with {hf['threads']} threads; "
          f"medians of {args.repeats} interleaved runs{'; recall warm' if args.warm_recall else ''}")
    print("| | recall | HF transformers | recall / HF |")
    print("|---|---|---|---|")
    print(f"| prefill (s) | {rec['prefill_seconds']:.3f} | {hf['prefill_seconds']:.3f} | {report['prefill_ratio']:.2f} |")
    print(f"| decode (ms/token) | {rec['decode_ms_per_token']:.1f} | {hf['decode_ms_per_token']:.1f} | "
          f"{report['decode_ratio']:.2f} |")
    if args.images:
        both = [r["vision_seconds"] + r["prefill_seconds"] for r in (rec, hf)]
        print(f"| vision + prefill (s) | {both[0]:.3f} | {both[1]:.3f} | {both[0] / both[1]:.2f} |")
        print(f"| vision (ms/screenshot) | {rec['vision_seconds'] / n_img * 1e3:.0f} | "
              f"{hf['vision_seconds'] / n_img * 1e3:.0f} | {report['vision_ratio']:.2f} |")
    print(f"| recall load + vision + prefill vs HF vision + prefill (s) | {rec['end_to_end_seconds']:.3f} "
          f"(load {rec['load_seconds']:.3f}) | {hf['vision_seconds'] + hf['prefill_seconds']:.3f} | "
          f"{report['end_to_end_ratio']:.2f} |")
    print(f"| greedy tokens identical | {report['tokens_identical']} | | |")
    line = (f"GEMM: recall linear in prefill {rec['linear_gflops_prefill']:.0f} GFLOP/s; "
            f"torch 2048^3 matmul {peak_torch:.0f} GFLOP/s ({rec['linear_gflops_prefill'] / peak_torch:.0%})")
    if peak:
        line += f"; f32 FMA peak {peak:.0f} GFLOP/s, linear at {share_of_peak:.0%} of it (median of the runs)"
    print(line)
    if not report["tokens_identical"]:
        print(f"recall tokens {rec['tokens']}\nHF tokens     {hf['tokens']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
