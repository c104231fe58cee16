#!/usr/bin/env python3
"""Generates the tiny-model fixtures under tests/fixtures/ with Hugging Face transformers (the oracle).

For each family (Qwen3-VL, Qwen2.5-VL) it builds a tiny random model whose vocabulary is the tiny Qwen
tokenizer's (tests/fixtures/tiny-tokenizer: BPE ranks < 1000, special tokens at 1000..1025, embedding
rows padded to 1040), saves it, renders a few chats with the family's official chat template, and
stores what transformers computes in float32: input ids, the embeddings and every decoder layer's output
(recorded with forward hooks), full logits, 16 greedy tokens, and teacher-forced log-probs of a target.

Extra checkpoints exercise the loader: the Qwen2.5-VL model is written with the hub's names
(`model.layers.*`, `visual.*`), the Qwen3-VL model (tied embeddings, so no lm_head.weight) also as a
sharded index and in bfloat16 (its references are transformers' float32 computation on the
bf16-rounded weights).

Regenerate (from the repository root, after tools/make_tokenizer.py built the tiny tokenizer):
    python3 -m venv .venv-tools && .venv-tools/bin/pip install -r tools/requirements.txt
    .venv-tools/bin/python tools/gen_fixtures.py
"""

import json
import os
import shutil
import sys

import torch
from PIL import Image, ImageDraw
from safetensors.torch import load_file, save_file

import transformers
from transformers import (
    AutoImageProcessor,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests", "fixtures")
TINY_TOK = os.path.join(FIX, "tiny-tokenizer")

# Special ids of the tiny tokenizer (ranks < 1000, then the 26 Qwen added tokens in order).
ENDOFTEXT, IM_START, IM_END = 1000, 1001, 1002
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 1009, 1010, 1012, 1013
VOCAB = 1040
GREEDY_TOKENS = 16

PROMPTS = [
    {
        "name": "single_user",
        "messages": [{"role": "user", "content": "Open the settings app and turn on Wi-Fi."}],
        "target": "Action: click the Settings icon.",
    },
    {
        "name": "system_multi_turn",
        "messages": [
            {"role": "system", "content": "You are a careful GUI agent. Answer with one action."},
            {"role": "user", "content": "Step 1: the home screen is shown."},
            {"role": "assistant", "content": "Action: open the app drawer."},
            {"role": "user", "content": [{"type": "text", "text": "Now the drawer is open; find Maps."}]},
        ],
        "target": "Action: scroll down to find Maps.",
    },
    {
        "name": "code_cjk",
        "messages": [
            {
                "role": "user",
                "content": "def f(x):\n    return x * 2  # 翻倍\n\nWhat is f(21)? 请回答。 🙂",
            }
        ],
        "target": "42",
    },
]


IMAGES = os.path.join(FIX, "vl-images")

# Pixel budgets small enough for tiny grids: Qwen3-VL (factor 32) and Qwen2.5-VL (factor 28). The
# Qwen2.5-VL window is 4 merged tokens wide; the screenshot's 6-token-wide grid is not a multiple of it.
PIXELS = {"qwen3": (32 * 32 * 4, 32 * 32 * 24), "qwen25": (28 * 28 * 4, 28 * 28 * 30)}


def draw_images():
    """Small synthetic screenshots (PNG, JPEG, WebP) for the multimodal prompts."""
    os.makedirs(IMAGES, exist_ok=True)

    def screen(w, h, seed):
        g = torch.Generator().manual_seed(seed)
        img = Image.new("RGB", (w, h), (240, 240, 245))
        d = ImageDraw.Draw(img)
        for i in range(0, h, 6):
            d.line([(0, i), (w, i)], fill=(200 + i % 50, 210, 230 - i % 40))
        for _ in range(8):
            x0, y0 = int(torch.randint(0, max(1, w - 10), (1,), generator=g)), int(torch.randint(0, max(1, h - 6), (1,), generator=g))
            x1, y1 = min(w - 1, x0 + 5 + int(torch.randint(0, w // 2 + 1, (1,), generator=g))), min(h - 1, y0 + 3 + int(torch.randint(0, h // 3 + 1, (1,), generator=g)))
            c = tuple(int(v) for v in torch.randint(0, 256, (3,), generator=g))
            d.rectangle([x0, y0, x1, y1], fill=c, outline=(20, 20, 20))
        return img

    screen(200, 150, 1).save(os.path.join(IMAGES, "screen.png"))
    screen(120, 220, 2).save(os.path.join(IMAGES, "portrait.jpg"), quality=90)
    screen(24, 16, 3).save(os.path.join(IMAGES, "icon.png"))
    screen(600, 12, 4).save(os.path.join(IMAGES, "banner.png"))
    screen(160, 160, 5).save(os.path.join(IMAGES, "square.webp"), quality=90)


def img(name):
    return {"type": "image", "image": f"tests/fixtures/vl-images/{name}"}


def txt(t):
    return {"type": "text", "text": t}


VL_PROMPTS = [
    {"name": "one_image", "messages": [{"role": "user", "content": [img("screen.png"), txt("What is on the screen?")]}]},
    {
        "name": "two_images_text_between",
        "messages": [{"role": "user", "content": [img("screen.png"), txt("and then"), img("portrait.jpg"),
                                                   txt("Which screen shows the menu?")]}],
    },
    {"name": "upscaled_small", "messages": [{"role": "user", "content": [txt("A tiny icon:"), img("icon.png")]}]},
    {"name": "extreme_aspect", "messages": [{"role": "user", "content": [img("banner.png"), txt("Read the banner.")]}]},
    {
        "name": "multi_turn_images",
        "messages": [
            {"role": "system", "content": "You are a GUI agent."},
            {"role": "user", "content": [img("screen.png"), txt("Step 1: open settings.")]},
            {"role": "assistant", "content": "Action: click the gear icon."},
            {"role": "user", "content": [img("square.webp"), txt("Step 2: what now?")]},
        ],
    },
]


def write_preprocessor_config(out_dir, family):
    """The hub preprocessor config of the family with tiny pixel budgets."""
    src = "qwen3-vl-8b-instruct" if family == "qwen3" else "qwen2.5-vl-7b-instruct"
    with open(os.path.join(ROOT, "models", src, "preprocessor_config.json")) as f:
        cfg = json.load(f)
    lo, hi = PIXELS[family]
    if "size" in cfg:
        cfg["size"] = {"longest_edge": hi, "shortest_edge": lo}
    cfg.pop("min_pixels", None)
    cfg.pop("max_pixels", None)
    if family == "qwen25":
        cfg["size"] = {"longest_edge": hi, "shortest_edge": lo}
    with open(os.path.join(out_dir, "preprocessor_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def load_image(path):
    from transformers.image_utils import load_image as hf_load_image
    return hf_load_image(os.path.join(ROOT, path))


def run_vl_reference(model, family, tok, template, image_processor, prompt, cfg):
    """Everything the vision parity tests compare, for one multimodal chat."""
    text = tok.apply_chat_template(prompt["messages"], chat_template=template, tokenize=False,
                                   add_generation_prompt=True)
    paths = [part["image"] for m in prompt["messages"] if isinstance(m["content"], list)
             for part in m["content"] if part.get("type") == "image"]
    images = [load_image(p) for p in paths]
    proc = image_processor(images=images, return_tensors="pt")
    pixel_values, grid = proc["pixel_values"], proc["image_grid_thw"]
    merge = image_processor.merge_size
    # The processor's placeholder expansion: each <|image_pad|> becomes t*h*w/merge^2 pads.
    counts = iter((grid.prod(-1) // merge ** 2).tolist())
    parts = text.split("<|image_pad|>")
    expanded = parts[0] + "".join("<|image_pad|>" * next(counts) + p for p in parts[1:])
    ids = tok(expanded, add_special_tokens=False)["input_ids"]
    input_ids = torch.tensor([ids])
    mm = (input_ids == IMAGE_PAD).int()
    kw = dict(pixel_values=pixel_values, image_grid_thw=grid, mm_token_type_ids=mm)

    position_ids, _ = model.model.get_rope_index(input_ids, mm_token_type_ids=mm, image_grid_thw=grid)
    feats = model.model.get_image_features(pixel_values, image_grid_thw=grid, return_dict=True)
    embeds = torch.cat(list(feats.pooler_output), dim=0)
    deepstack = [torch.cat(list(d), dim=0) if isinstance(d, (list, tuple)) else d
                 for d in (getattr(feats, "deepstack_features", None) or [])]
    logits = model(input_ids=input_ids, **kw).logits[0]
    out = model.generate(input_ids, **kw, max_new_tokens=GREEDY_TOKENS, min_new_tokens=GREEDY_TOKENS,
                         do_sample=False, pad_token_id=ENDOFTEXT)
    greedy = out[0, len(ids):]
    seq = out[:, :-1]
    path_logits = model(input_ids=seq, **dict(kw, mm_token_type_ids=(seq == IMAGE_PAD).int())).logits[0, len(ids) - 1:]
    top2 = path_logits.topk(2, dim=-1).values
    margin = (top2[:, 0] - top2[:, 1]).min().item()
    return {
        "text": text, "paths": paths, "input_ids": ids, "pixel_values": pixel_values, "grid": grid,
        "position_ids": position_ids[:, 0, :], "embeds": embeds, "deepstack": deepstack, "logits": logits,
        "greedy": greedy, "margin": margin,
    }


def write_vl_reference(out_dir, model, family, tok, template):
    image_processor = AutoImageProcessor.from_pretrained(out_dir)
    tensors, meta = {}, []
    for i, p in enumerate(VL_PROMPTS):
        r = run_vl_reference(model, family, tok, template, image_processor, p, None)
        assert r["margin"] > 1e-3, f"{p['name']}: greedy path has a near-tie ({r['margin']})"
        tensors[f"v{i}.input_ids"] = torch.tensor(r["input_ids"], dtype=torch.int64)
        tensors[f"v{i}.pixel_values"] = r["pixel_values"].float().contiguous()
        tensors[f"v{i}.image_grid_thw"] = r["grid"].to(torch.int64).contiguous()
        tensors[f"v{i}.position_ids"] = r["position_ids"].to(torch.int64).contiguous()
        tensors[f"v{i}.image_embeds"] = r["embeds"].float().contiguous()
        for j, d in enumerate(r["deepstack"]):
            tensors[f"v{i}.deepstack.{j}"] = d.float().contiguous()
        tensors[f"v{i}.logits"] = r["logits"].float().contiguous()
        tensors[f"v{i}.greedy"] = r["greedy"].to(torch.int64).contiguous()
        meta.append({"name": p["name"], "messages": p["messages"], "rendered": r["text"], "images": r["paths"],
                     "greedy_margin": r["margin"]})
        print(f"  {p['name']}: {len(r['input_ids'])} tokens, grids {r['grid'].tolist()}, "
              f"greedy margin {r['margin']:.4f}")
    save_file(tensors, os.path.join(out_dir, "vl_reference.safetensors"))
    with open(os.path.join(out_dir, "vl_reference.json"), "w") as f:
        json.dump({"transformers": transformers.__version__, "torch": torch.__version__, "prompts": meta},
                  f, indent=1, ensure_ascii=False)


def init_weights(model, seed):
    """Re-initialises every parameter with a spread wide enough for decisive greedy choices."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / (p.shape[-1] ** 0.5) * 1.5)


def qwen3_config():
    return Qwen3VLConfig(
        text_config=dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            rms_norm_eps=1e-6,
            max_position_embeddings=4096,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 5000000.0,
                "mrope_section": [6, 5, 5],
                "mrope_interleaved": True,
            },
            bos_token_id=ENDOFTEXT,
            eos_token_id=IM_END,
            tie_word_embeddings=True,
        ),
        vision_config=dict(
            depth=3,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            num_position_embeddings=36,
            deepstack_visual_indexes=[0, 2],
        ),
        image_token_id=IMAGE_PAD,
        video_token_id=VIDEO_PAD,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        tie_word_embeddings=True,
    )


def qwen25_config():
    return Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=3,
            num_attention_heads=2,
            num_key_value_heads=1,
            rms_norm_eps=1e-6,
            max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "type": "mrope", "rope_theta": 1000000.0,
                             "mrope_section": [4, 6, 6]},
            bos_token_id=ENDOFTEXT,
            eos_token_id=IM_END,
            tie_word_embeddings=False,
        ),
        vision_config=dict(
            depth=4,
            hidden_size=32,
            intermediate_size=48,
            num_heads=2,
            out_hidden_size=64,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=112,
            fullatt_block_indexes=[1, 3],
        ),
        image_token_id=IMAGE_PAD,
        video_token_id=VIDEO_PAD,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        tie_word_embeddings=False,
    )


def chat_template(model_dir_name):
    with open(os.path.join(ROOT, "models", model_dir_name, "chat_template.json")) as f:
        return json.load(f)["chat_template"]


def text_layers(model):
    return model.model.language_model.layers


def run_reference(model, input_ids, target_ids):
    """Embeddings, per-layer outputs, logits, greedy tokens and target log-probs for one prompt."""
    recorded = []
    hooks = [model.model.language_model.embed_tokens.register_forward_hook(
        lambda m, i, o: recorded.append(o.detach().clone()))]
    for layer in text_layers(model):
        hooks.append(layer.register_forward_hook(
            lambda m, i, o: recorded.append((o[0] if isinstance(o, tuple) else o).detach().clone())))
    ids = torch.tensor([input_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    for h in hooks:
        h.remove()
    hidden = [h[0] for h in recorded]

    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=GREEDY_TOKENS, min_new_tokens=GREEDY_TOKENS,
                             do_sample=False, pad_token_id=ENDOFTEXT)
    greedy = out[0, len(input_ids):]
    # The greedy path must not hinge on near-ties, or float noise could flip it.
    with torch.no_grad():
        path_logits = model(input_ids=out[:, :-1]).logits[0, len(input_ids) - 1:]
    top2 = path_logits.topk(2, dim=-1).values
    margin = (top2[:, 0] - top2[:, 1]).min().item()
    assert margin > 1e-3, f"greedy path has a near-tie (margin {margin})"

    full = torch.tensor([input_ids + target_ids])
    with torch.no_grad():
        flog = model(input_ids=full).logits[0].double()
    lp = torch.log_softmax(flog, dim=-1)
    n = len(input_ids)
    token_lp = [lp[n - 1 + i, t].item() for i, t in enumerate(target_ids)]
    return {
        "logits": logits,
        "hidden": hidden,
        "greedy": greedy,
        "margin": margin,
        "target_logprobs": token_lp,
    }


def write_reference(out_dir, model, tok, template, prompts, file_stem="reference"):
    tensors, meta = {}, []
    for i, p in enumerate(prompts):
        text = tok.apply_chat_template(p["messages"], chat_template=template, tokenize=False,
                                       add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        target_ids = tok(p["target"], add_special_tokens=False)["input_ids"]
        r = run_reference(model, ids, target_ids)
        tensors[f"p{i}.input_ids"] = torch.tensor(ids, dtype=torch.int64)
        tensors[f"p{i}.logits"] = r["logits"].float().contiguous()
        for l, h in enumerate(r["hidden"]):
            tensors[f"p{i}.hidden.{l}"] = h.float().contiguous()
        tensors[f"p{i}.greedy"] = r["greedy"].to(torch.int64).contiguous()
        meta.append({
            "name": p["name"],
            "messages": p["messages"],
            "rendered": text,
            "target": p["target"],
            "target_ids": target_ids,
            "target_logprobs": r["target_logprobs"],
            "target_logprob_sum": sum(r["target_logprobs"]),
            "target_logprob_mean": sum(r["target_logprobs"]) / len(target_ids),
            "greedy_margin": r["margin"],
        })
        print(f"  {p['name']}: {len(ids)} tokens, greedy margin {r['margin']:.4f}")
    save_file(tensors, os.path.join(out_dir, f"{file_stem}.safetensors"))
    with open(os.path.join(out_dir, f"{file_stem}.json"), "w") as f:
        json.dump({"transformers": transformers.__version__, "torch": torch.__version__,
                   "prompts": meta}, f, indent=1, ensure_ascii=False)


def write_generation_config(out_dir):
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": ENDOFTEXT, "eos_token_id": [IM_END, ENDOFTEXT],
                   "pad_token_id": ENDOFTEXT, "do_sample": False}, f, indent=2)


def copy_tokenizer(out_dir):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(TINY_TOK, name), os.path.join(out_dir, name))


def fresh_dir(path):
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def hub_names(state):
    """Qwen2.5-VL as published on the hub: model.layers.*, model.embed_tokens, visual.*."""
    out = {}
    for k, v in state.items():
        if k.startswith("model.language_model."):
            k = "model." + k[len("model.language_model."):]
        elif k.startswith("model.visual."):
            k = "visual." + k[len("model.visual."):]
        out[k] = v
    return out


def build(family):
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(TINY_TOK, "tokenizer.json"))
    if family == "qwen3":
        cfg, cls, name, tmpl = qwen3_config(), Qwen3VLForConditionalGeneration, "tiny-qwen3-vl", "qwen3-vl-8b-instruct"
    else:
        cfg, cls, name, tmpl = qwen25_config(), Qwen2_5_VLForConditionalGeneration, "tiny-qwen2.5-vl", "qwen2.5-vl-7b-instruct"
    torch.manual_seed(0)
    model = cls(cfg).float().eval()
    init_weights(model, seed=1 if family == "qwen3" else 3)
    template = chat_template(tmpl)
    out = fresh_dir(os.path.join(FIX, name))
    print(f"{name}:")
    model.save_pretrained(out)
    if family == "qwen25":
        # Rewrite with the hub's names and check transformers reads them back to the same model.
        path = os.path.join(out, "model.safetensors")
        save_file(hub_names(load_file(path)), path, metadata={"format": "pt"})
        again = cls.from_pretrained(out, dtype=torch.float32).eval()
        for (ka, a), (kb, b) in zip(model.state_dict().items(), again.state_dict().items()):
            assert torch.equal(a, b), f"hub-name round trip changed {ka}"
    write_generation_config(out)
    write_preprocessor_config(out, family)
    copy_tokenizer(out)
    write_reference(out, model, tok, template, PROMPTS)
    write_vl_reference(out, model, family, tok, template)

    if family == "qwen3":
        sharded = fresh_dir(os.path.join(FIX, name + "-sharded"))
        model.save_pretrained(sharded, max_shard_size="400KB")
        write_generation_config(sharded)
        assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
        bf16 = fresh_dir(os.path.join(FIX, name + "-bf16"))
        model.to(torch.bfloat16).save_pretrained(bf16)
        write_generation_config(bf16)
        # Reference for bf16 weights: transformers in float32 on the bf16-rounded weights.
        rounded = cls.from_pretrained(bf16, dtype=torch.bfloat16).float().eval()
        print(f"{name}-bf16:")
        write_reference(bf16, rounded, tok, template, PROMPTS[:1])


def main():
    torch.set_grad_enabled(False)
    torch.use_deterministic_algorithms(True)
    draw_images()
    for family in sys.argv[1:] or ["qwen3", "qwen25"]:
        build(family)


if __name__ == "__main__":
    main()
