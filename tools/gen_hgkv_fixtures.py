#!/usr/bin/env python3
"""HGKV fixtures: a random non-zero K/V LoRA for the tiny Qwen3-VL (rank 8, alpha 16, k_proj and
v_proj of decoder layers 1 and 2), saved as a PEFT directory and in the reference trainer's format
(through tools/convert_hgkv_pt.py), with the logits transformers computes for:

* ungated: PEFT's LoRA on every token (the model wrapped by `get_peft_model`);
* gated: the base model with forward hooks on those k_proj / v_proj modules that add
  `scale * B(A(x))` only at the merged tokens of the history images (every image but the last);
* base: the frozen model (only to check that the adapter changes the logits visibly).

Prompts: a text-only chat, and a chat with two history screenshots and the current one.

    .venv-tools/bin/python tools/gen_hgkv_fixtures.py   (after tools/gen_fixtures.py)
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file
from transformers import AutoImageProcessor, PreTrainedTokenizerFast, Qwen3VLForConditionalGeneration
from transformers.image_utils import load_image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests", "fixtures")
BASE = os.path.join(FIX, "tiny-qwen3-vl")
IMAGE_PAD = 1012
LAYERS = [1, 2]
RANK, ALPHA = 8, 16

TEXT = [{"role": "user", "content": "Open the settings app and turn on Wi-Fi."}]
IMAGES = [
    {"role": "user", "content": [{"type": "image", "image": "tests/fixtures/vl-images/screen.png"},
                                 {"type": "text", "text": "Step 1: open settings."}]},
    {"role": "assistant", "content": "Action: click the gear icon."},
    {"role": "user", "content": [{"type": "image", "image": "tests/fixtures/vl-images/square.webp"},
                                 {"type": "text", "text": "Step 2."}]},
    {"role": "assistant", "content": "Action: scroll down."},
    {"role": "user", "content": [{"type": "image", "image": "tests/fixtures/vl-images/icon.png"},
                                 {"type": "text", "text": "What now?"}]},
]


def inputs(tok, template, image_processor, messages):
    text = tok.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)
    paths = [p["image"] for m in messages if isinstance(m["content"], list) for p in m["content"]
             if p.get("type") == "image"]
    if not paths:
        return {"input_ids": torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])}, []
    proc = image_processor(images=[load_image(os.path.join(ROOT, p)) for p in paths], return_tensors="pt")
    grid = proc["image_grid_thw"]
    counts = (grid.prod(-1) // image_processor.merge_size ** 2).tolist()
    parts = text.split("<|image_pad|>")
    text = parts[0] + "".join("<|image_pad|>" * n + p for n, p in zip(counts, parts[1:]))
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    kw = {"input_ids": ids, "pixel_values": proc["pixel_values"], "image_grid_thw": grid,
          "mm_token_type_ids": (ids == IMAGE_PAD).int()}
    # History rows: the image tokens of every image but the last.
    pos = (ids[0] == IMAGE_PAD).nonzero().flatten().tolist()
    history = pos[: len(pos) - counts[-1]]
    return kw, history


def main():
    torch.manual_seed(0)
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(BASE, "tokenizer.json"))
    with open(os.path.join(ROOT, "models", "qwen3-vl-8b-instruct", "chat_template.json")) as f:
        template = json.load(f)["chat_template"]
    image_processor = AutoImageProcessor.from_pretrained(BASE)
    base = Qwen3VLForConditionalGeneration.from_pretrained(BASE, dtype=torch.float32).eval()

    cfg = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["k_proj", "v_proj"], layers_to_transform=LAYERS,
                     layers_pattern="layers", lora_dropout=0.0, bias="none")
    peft_model = get_peft_model(base, cfg).eval()
    g = torch.Generator().manual_seed(42)
    lora = {}
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
                lora[name] = p
    peft_dir = os.path.join(FIX, "hgkv-peft")
    shutil.rmtree(peft_dir, ignore_errors=True)
    peft_model.peft_config["default"].base_model_name_or_path = "tests/fixtures/tiny-qwen3-vl"
    peft_model.save_pretrained(peft_dir)
    os.remove(os.path.join(peft_dir, "README.md"))
    scale = ALPHA / RANK

    # The reference trainer's format, through the converter.
    ref = {}
    for name, p in lora.items():
        module = name.split("base_model.model.", 1)[1].split(".lora_")[0]
        ref[f"{module}.lora_{'a' if '.lora_A.' in name else 'b'}"] = p.detach().clone()
    ref_dir = os.path.join(FIX, "hgkv-ref")
    shutil.rmtree(ref_dir, ignore_errors=True)
    os.makedirs(ref_dir)
    with tempfile.TemporaryDirectory() as tmp:
        pt = os.path.join(tmp, "hgkv.pt")
        torch.save(ref, pt)
        subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_hgkv_pt.py"), pt,
                        os.path.join(ref_dir, "adapter.safetensors"), "--alpha", str(ALPHA)], check=True)

    tensors, meta = {}, []
    for i, (name, messages) in enumerate([("text", TEXT), ("images", IMAGES)]):
        kw, history = inputs(tok, template, image_processor, messages)
        with torch.no_grad():
            ungated = peft_model(**kw).logits[0]
            with peft_model.disable_adapter():
                base_logits = peft_model(**kw).logits[0]
                hooks = []
                for layer in LAYERS:
                    attn = base.model.language_model.layers[layer].self_attn
                    for proj in ("k_proj", "v_proj"):
                        key = f"base_model.model.model.language_model.layers.{layer}.self_attn.{proj}"
                        a, b = lora[f"{key}.lora_A.default.weight"], lora[f"{key}.lora_B.default.weight"]

                        def hook(mod, args, out, a=a, b=b):
                            out = out.clone()
                            x = args[0]
                            out[:, history] += scale * ((x[:, history] @ a.T) @ b.T)
                            return out

                        hooks.append(getattr(attn, proj).base_layer.register_forward_hook(hook)
                                     if hasattr(getattr(attn, proj), "base_layer")
                                     else getattr(attn, proj).register_forward_hook(hook))
                gated = peft_model(**kw).logits[0]
                for h in hooks:
                    h.remove()
        tensors[f"p{i}.input_ids"] = kw["input_ids"][0].to(torch.int64).contiguous()
        if "pixel_values" in kw:
            tensors[f"p{i}.pixel_values"] = kw["pixel_values"].float().contiguous()
            tensors[f"p{i}.image_grid_thw"] = kw["image_grid_thw"].to(torch.int64).contiguous()
        tensors[f"p{i}.history_rows"] = torch.tensor(history, dtype=torch.int64)
        tensors[f"p{i}.logits_ungated"] = ungated.float().contiguous()
        tensors[f"p{i}.logits_gated"] = gated.float().contiguous()
        d_gated = (gated - base_logits).abs().max().item()
        d_ungated = (ungated - base_logits).abs().max().item()
        print(f"  {name}: {kw['input_ids'].shape[1]} tokens, {len(history)} history rows; "
              f"|gated - base| {d_gated:.4f}, |ungated - base| {d_ungated:.4f}")
        assert d_ungated > 1e-2, "the adapter must change the ungated logits visibly"
        if history:
            assert d_gated > 1e-2, "the adapter must change the gated logits visibly"
        meta.append({"name": name, "messages": messages})
    save_file(tensors, os.path.join(ref_dir, "reference.safetensors"))
    with open(os.path.join(ref_dir, "reference.json"), "w") as f:
        json.dump({"rank": RANK, "alpha": ALPHA, "layers": LAYERS, "prompts": meta}, f, indent=1)


if __name__ == "__main__":
    main()
