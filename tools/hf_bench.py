#!/usr/bin/env python3
"""HF transformers on the same agent-step shapes as `recall bench`: the baseline of issue 9.

Random-initialised weights from the config (`from_config`, bf16, no network, no checkpoint), the
pass-1 prompt of a B-screenshot step, two configurations:

* ``eager``: HF's default path (sdpa attention, dynamic KV cache);
* ``static``: its strongest decode path on a GPU: a static KV cache, which makes ``generate``
  compile the decode step with ``torch.compile`` (mode "reduce-overhead", i.e. CUDA graphs). One
  untimed generation compiles first (about a minute for the 8B shape).

Measured per configuration: the vision tower on one screenshot (``get_image_features``), prefill of
the step prompt with every screenshot through the tower (time to the first token of ``generate``) and
decode ms/token (from per-token timestamps of the same ``generate``; a stopping criterion
synchronises and records each token). Prints JSON (and writes it with ``--json-out``).

The prompt: ``--layout-json`` takes the JSON of ``recall bench`` (``shapes.pass1_layout``: the exact
token ids and screenshot grids); without it the same layout is rebuilt here from the size flags
(same lengths, other ids).

  python3 tools/hf_bench.py --config models/qwen3-vl-8b-instruct --layout-json recall.json --device cuda
  python3 tools/hf_bench.py --tiny            # CPU check on tests/fixtures/tiny-qwen3-vl
"""

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_grid(s):
    parts = [int(p) for p in s.lower().replace(",", "x").split("x")]
    if len(parts) == 2:
        parts = [1] + parts
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"grid {s!r}: expected TxHxW or HxW in patches")
    return parts


def build_layout(a, cfg):
    """The pass-1 (Recent-B) prompt of recall's bench (src/bench/layouts.rs), same
    lengths, other ids: a list of ("text", ids) and ("image", step, grid)."""
    import random

    rng = random.Random(a.seed)
    hi = a.text_id_limit

    def ids(n):
        return [rng.randrange(hi) for _ in range(n)]

    t = a.history + 1
    alloc = list(range(t - a.budget, t))
    runs, text = [], []
    text += ids(3) + ids(a.system_tokens) + ids(2) + ids(3) + ids(48)
    first = alloc[0] if alloc else t
    text += ids(a.step_tokens * (first - 1)) if first > 1 else ids(4)
    prev = None
    for s in alloc + [t]:
        if prev is not None:
            text += ids(3) + ids(a.response_tokens) + ids(2) + ids(3)
            if s > prev + 1:
                text += ids(6) + ids(a.step_tokens * (s - prev - 1))
        text.append(cfg["vision_start_token_id"])
        runs.append(("text", text))
        runs.append(("image", s, list(a.grid)))
        text = [cfg["vision_end_token_id"]]
        prev = s
    text += ids(2) + ids(3)
    runs.append(("text", text))
    return runs


def layout_from_recall(path):
    with open(path) as f:
        report = json.load(f)
    runs = []
    for r in report["shapes"]["pass1_layout"]:
        if "Text" in r:
            runs.append(("text", r["Text"]))
        elif "Image" in r:
            runs.append(("image", r["Image"]["step"], r["Image"]["grid"]))
        else:
            raise SystemExit(f"{path}: unsupported layout run {list(r)}")
    return runs, report


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="directory with config.json (e.g. models/qwen3-vl-8b-instruct)")
    p.add_argument("--tiny", action="store_true", help="tiny fixture config and small sizes (CPU check)")
    p.add_argument("--device", default=None, help="cuda or cpu [cuda; cpu with --tiny]")
    p.add_argument("--layout-json", help="recall bench JSON: use its pass-1 prompt layout")
    p.add_argument("--layers", type=int, help="override the decoder depth (as recall bench --layers)")
    p.add_argument("--budget", type=int, default=4)
    p.add_argument("--grid", type=parse_grid, default=[1, 80, 128], help="TxHxW in patches [1x80x128]")
    p.add_argument("--history", type=int, default=8)
    p.add_argument("--response-tokens", type=int, default=64)
    p.add_argument("--system-tokens", type=int, default=1819)
    p.add_argument("--step-tokens", type=int, default=28)
    p.add_argument("--seed", type=int, default=0x5EED)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", default="eager,static", help="comma list of eager, static")
    p.add_argument("--attn", default="sdpa", help="attn_implementation [sdpa]")
    p.add_argument(
        "--compile",
        default="auto",
        choices=["auto", "force", "off"],
        help="static mode: auto = HF's own (GPU only), force = also on CPU, off = static cache only",
    )
    p.add_argument("--json-out")
    a = p.parse_args()
    if a.tiny:
        a.config = a.config or os.path.join(ROOT, "tests/fixtures/tiny-qwen3-vl")
        a.device = a.device or "cpu"
        a.budget, a.grid, a.history = 2, [1, 4, 4], 4
        a.response_tokens, a.system_tokens, a.step_tokens = 4, 24, 5
        a.repeats = min(a.repeats, 2)
    a.device = a.device or "cuda"
    if not a.config:
        p.error("--config is required (or --tiny)")

    import torch
    import transformers
    from transformers import AutoConfig, StoppingCriteria, StoppingCriteriaList

    torch.manual_seed(a.seed)
    dev = torch.device(a.device)
    cfg = AutoConfig.from_pretrained(a.config)
    text_cfg = getattr(cfg, "text_config", cfg)
    if a.layers:
        text_cfg.num_hidden_layers = a.layers
    raw = json.load(open(os.path.join(a.config, "config.json")))
    specials = [raw.get(k) for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")]
    a.text_id_limit = min([x for x in specials if isinstance(x, int)] + [text_cfg.vocab_size])

    recall_report = None
    if a.layout_json:
        layout, recall_report = layout_from_recall(a.layout_json)
    else:
        layout = build_layout(a, raw)
    vcfg = cfg.vision_config
    merge = vcfg.spatial_merge_size
    patch_dim = vcfg.in_channels * vcfg.temporal_patch_size * vcfg.patch_size**2
    ids, grids = [], []
    for r in layout:
        if r[0] == "text":
            ids += r[1]
        else:
            t_, h_, w_ = r[2]
            grids.append([t_, h_, w_])
            ids += [raw["image_token_id"]] * (t_ * h_ * w_ // (merge * merge))
    input_ids = torch.tensor([ids], dtype=torch.long, device=dev)
    mask = torch.ones_like(input_ids)
    grid_thw = torch.tensor(grids, dtype=torch.long, device=dev)
    patches = sum(t_ * h_ * w_ for t_, h_, w_ in grids)
    pixel_values = (torch.rand(patches, patch_dim, device=dev) * 2 - 1).to(torch.bfloat16)
    n_resp = a.response_tokens

    t0 = time.perf_counter()
    with torch.device(dev):
        model = transformers.AutoModelForImageTextToText.from_config(
            cfg, dtype=torch.bfloat16, attn_implementation=a.attn
        )
    model.eval()
    init_s = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    class Stamps(StoppingCriteria):
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores, **kw):
            sync()
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    inner = getattr(model, "model", model)

    def vision_once():
        one = grid_thw[-1:]
        n = int(one.prod())
        sync()
        c = time.perf_counter()
        with torch.inference_mode():
            inner.get_image_features(pixel_values=pixel_values[-n:], image_grid_thw=one)
        sync()
        return (time.perf_counter() - c) * 1e3

    def generate(static):
        stamps = Stamps()
        kw = dict(
            input_ids=input_ids,
            attention_mask=mask,
            pixel_values=pixel_values,
            image_grid_thw=grid_thw,
            max_new_tokens=n_resp,
            min_new_tokens=n_resp,
            do_sample=False,
            pad_token_id=0,
            stopping_criteria=StoppingCriteriaList([stamps]),
        )
        if static:
            kw["cache_implementation"] = "static"
            if a.compile == "off":
                kw["disable_compile"] = True
            elif a.compile == "force":
                cc = transformers.CompileConfig()
                cc._compile_all_devices = True  # a class attribute, not an __init__ argument
                kw["compile_config"] = cc
        sync()
        c = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**kw)
        sync()
        end = time.perf_counter()
        ts = stamps.times
        return {
            "prefill_ms": (ts[0] - c) * 1e3,
            "decode_ms_per_token": (ts[-1] - ts[0]) * 1e3 / max(len(ts) - 1, 1),
            "total_ms": (end - c) * 1e3,
            "tokens": out[0, input_ids.shape[1] :].tolist(),
        }

    result = {
        "tool": "hf_bench.py",
        "config": a.config,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "attn": a.attn,
        "layers": text_cfg.num_hidden_layers,
        "params": params,
        "init_s": init_s,
        "prompt_tokens": len(ids),
        "images": len(grids),
        "grid": grids[-1] if grids else None,
        "response_tokens": n_resp,
        "layout": "recall" if recall_report else "rebuilt",
        "modes": {},
    }
    vision = []
    vision_once()  # warm-up
    for _ in range(a.repeats):
        vision.append(vision_once())
    result["vision_ms_per_image"] = statistics.median(vision)
    for mode in [m.strip() for m in a.modes.split(",") if m.strip()]:
        static = mode == "static"
        if mode not in ("eager", "static"):
            raise SystemExit(f"unknown mode {mode!r}")
        row = {}
        try:
            c = time.perf_counter()
            generate(static)  # warm-up; compiles the decode step in static mode
            row["warmup_s"] = time.perf_counter() - c
            runs = [generate(static) for _ in range(a.repeats)]
            for k in ("prefill_ms", "decode_ms_per_token", "total_ms"):
                row[k] = statistics.median(r[k] for r in runs)
            row["tokens"] = runs[0]["tokens"]
            row["deterministic"] = all(r["tokens"] == runs[0]["tokens"] for r in runs)
            row["compiled"] = static and (a.compile == "force" or (a.compile == "auto" and dev.type == "cuda"))
        except Exception as e:  # report, keep the other mode
            row["error"] = f"{type(e).__name__}: {e}"
        result["modes"][mode] = row
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    text = json.dumps(result, indent=1)
    print(text)
    if a.json_out:
        with open(a.json_out, "w") as f:
            f.write(text)
    return 0 if all("error" not in r for r in result["modes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
