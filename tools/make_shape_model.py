#!/usr/bin/env python3
"""Writes a random-weight Qwen3-VL model directory with the shape of Qwen3-VL-2B-Instruct, cut to a few layers.

Every width of the base config (hidden sizes, heads, head_dim, vocabulary, vision patching, mRoPE
sections, token ids) is kept; only the depths change: the decoder gets ``--layers`` layers and the
vision tower ``--vision-layers`` blocks. The vision tower's ``deepstack_visual_indexes`` are scaled to
the new depth (``floor(i * M / depth)``, de-duplicated: the 2B's [5, 11, 17] of 24 become [0, 1, 2] of
4), or set with ``--deepstack-indexes``. The weights are transformers' own random initialisation of
``Qwen3VLForConditionalGeneration`` under ``torch.manual_seed(--seed)``, made in float32 and written
(``save_pretrained``, safetensors) in ``--dtype``; a bfloat16 model is the float32 model of the same
seed rounded. The output directory is a complete, offline-loadable Hugging Face checkpoint:

    config.json, model.safetensors (transformers 5 shards only past 50 GB),
    generation_config.json, preprocessor_config.json, chat_template.json   (from --base)
    tokenizer.json, tokenizer_config.json                                   (from --tokenizer)

so ``recall`` and ``transformers`` (``AutoModelForImageTextToText``, ``AutoProcessor``,
``transformers serve``) load it the same way they load the real checkpoint. Its words are meaningless;
it is for timing and plumbing, never for quality. Weights are not bit-comparable across torch
versions: regenerate rather than compare.

Run from the repository root (needs torch and transformers 5; e.g. the venv of tools/requirements.txt):

    .venv-tools/bin/python tools/make_shape_model.py --out /tmp/qwen3-vl-2b-shape-l4
    .venv-tools/bin/python tools/make_shape_model.py --out /tmp/shape-bf16 --layers 28 --vision-layers 24 \\
        --dtype bfloat16 --seed 7
    .venv-tools/bin/python tools/make_shape_model.py --out /tmp/shape --check   # also load it back and generate

The 2B shape at --layers 4 --vision-layers 4 (667.5M parameters) is 2.67 GB (2.5 GiB) in float32 (the
151936 x 2048 tied embedding alone is 1.24 GB), half that in bfloat16; writing it takes about half a
minute and 4 GB of memory on 2 cores.
"""

import argparse
import json
import os
import shutil
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(ROOT, "models", "qwen3-vl-2b-instruct")
TOKENIZER = os.path.join(ROOT, "models", "qwen-vl-tokenizer")
BASE_FILES = ("generation_config.json", "preprocessor_config.json", "chat_template.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def scaled_deepstack(indexes, depth, new_depth):
    """The base's deepstack indexes moved to a tower of new_depth blocks, in order, each < new_depth."""
    return sorted({min(new_depth - 1, i * new_depth // depth) for i in indexes})


def parse_indexes(s):
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: expected a comma list of integers")


def dir_size(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def check(out, dtype):
    """Load the directory back with transformers (model + processor) and greedy-generate from a chat with an image."""
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    t = time.time()
    model = AutoModelForImageTextToText.from_pretrained(out, dtype=dtype, device_map="cpu").eval()
    processor = AutoProcessor.from_pretrained(out)
    print(f"check: loaded {type(model).__name__} + {type(processor).__name__} in {time.time() - t:.1f}s")
    image = Image.new("RGB", (64, 48), (200, 30, 30))
    messages = [
        {
            "role": "user",
            "content": [{"type": "image", "image": image}, {"type": "text", "text": "What is on the screen?"}],
        }
    ]
    inputs = processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    t = time.time()
    with torch.no_grad():
        ids = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    new = ids[0, inputs["input_ids"].shape[-1] :].tolist()
    print(
        f"check: prompt {inputs['input_ids'].shape[-1]} tokens (image grid {inputs['image_grid_thw'].tolist()}), "
        f"greedy {new} in {time.time() - t:.1f}s"
    )
    assert len(new) > 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output model directory (created; must be empty or absent)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers [4] (the 2B has 28)")
    p.add_argument("--vision-layers", type=int, default=4, help="vision tower blocks [4] (the 2B has 24)")
    p.add_argument(
        "--deepstack-indexes",
        type=parse_indexes,
        help="comma list of vision blocks feeding the deepstack mergers, each < --vision-layers "
        "[the base's, scaled to the new depth]",
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="weight dtype [float32]")
    p.add_argument("--seed", type=int, default=0, help="torch seed of the random initialisation [0]")
    p.add_argument("--base", default=BASE, help="directory with the base config.json and the files copied along")
    p.add_argument("--tokenizer", default=TOKENIZER, help="directory with tokenizer.json and tokenizer_config.json")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument("--check", action="store_true", help="then load it back with transformers and generate")
    a = p.parse_args()
    if a.layers < 1 or a.vision_layers < 1:
        p.error("--layers and --vision-layers must be at least 1")
    for d, names in ((a.base, ("config.json",) + BASE_FILES), (a.tokenizer, TOKENIZER_FILES)):
        missing = [n for n in names if not os.path.isfile(os.path.join(d, n))]
        if missing:
            p.error(f"{d} lacks {', '.join(missing)}")
    if os.path.exists(a.out) and os.listdir(a.out):
        if not a.force:
            p.error(f"{a.out} exists and is not empty (use --force to replace it)")
        shutil.rmtree(a.out)

    import torch
    import transformers
    from transformers import AutoConfig, Qwen3VLForConditionalGeneration

    cfg = AutoConfig.from_pretrained(a.base)
    if cfg.model_type != "qwen3_vl":
        p.error(f"{a.base}: model_type {cfg.model_type!r}, expected 'qwen3_vl'")
    text, vision = cfg.text_config, cfg.vision_config
    base_layers, base_depth = text.num_hidden_layers, vision.depth
    if a.deepstack_indexes is not None:
        deepstack = a.deepstack_indexes
        bad = [i for i in deepstack if not 0 <= i < a.vision_layers]
        if bad or sorted(set(deepstack)) != deepstack:
            p.error(f"--deepstack-indexes {deepstack}: need distinct increasing indexes in [0, {a.vision_layers})")
    else:
        deepstack = scaled_deepstack(vision.deepstack_visual_indexes, base_depth, a.vision_layers)
    if len(deepstack) > a.layers:
        print(
            f"note: {len(deepstack)} deepstack levels but {a.layers} decoder layers: "
            "transformers adds level k to layer k, so the extra levels are computed and unused",
            file=sys.stderr,
        )
    text.num_hidden_layers = a.layers
    vision.depth = a.vision_layers
    vision.deepstack_visual_indexes = deepstack
    # A `layer_types` list (if this transformers version keeps one) must follow the new depth.
    if getattr(text, "layer_types", None) is not None:
        text.layer_types = text.layer_types[: a.layers]

    dtype = getattr(torch, a.dtype)
    # The sub-configs carry the base's dtype ("bfloat16" in the 2B's text_config): make every one say what is written.
    for sub in (cfg, text, vision):
        sub.dtype = dtype
    t = time.time()
    torch.manual_seed(a.seed)
    model = Qwen3VLForConditionalGeneration(cfg).to(torch.float32).eval()
    if dtype != torch.float32:
        model = model.to(dtype)
    n_params = sum(t.numel() for t in model.parameters())
    print(
        f"Qwen3-VL shape of {os.path.relpath(a.base)}: decoder {a.layers}/{base_layers} layers, "
        f"vision {a.vision_layers}/{base_depth} blocks, deepstack {deepstack}, {n_params / 1e6:.1f}M parameters, "
        f"{a.dtype}, seed {a.seed} (transformers {transformers.__version__}, torch {torch.__version__}); "
        f"built in {time.time() - t:.1f}s"
    )

    t = time.time()
    os.makedirs(a.out, exist_ok=True)
    model.save_pretrained(a.out)
    # The base's own generation config (sampling defaults, eos ids), not the one derived from config.json.
    for name in BASE_FILES:
        shutil.copyfile(os.path.join(a.base, name), os.path.join(a.out, name))
    for name in TOKENIZER_FILES:
        shutil.copyfile(os.path.join(a.tokenizer, name), os.path.join(a.out, name))
    saved = json.load(open(os.path.join(a.out, "config.json")))
    assert saved["text_config"]["num_hidden_layers"] == a.layers
    assert saved["vision_config"]["depth"] == a.vision_layers
    assert saved["vision_config"]["deepstack_visual_indexes"] == deepstack
    print(f"wrote {a.out} in {time.time() - t:.1f}s: {dir_size(a.out) / 2**20:.1f} MiB")
    for name in sorted(os.listdir(a.out)):
        print(f"  {name:36s} {os.path.getsize(os.path.join(a.out, name)):>14,d} bytes")

    if a.check:
        del model
        check(a.out, dtype)


if __name__ == "__main__":
    main()
