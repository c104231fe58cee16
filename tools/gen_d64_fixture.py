#!/usr/bin/env python3
"""Generates tests/fixtures/tiny-qwen3-vl-d64: the tiny Qwen3-VL with head_dim 64, in bfloat16.

The main tiny model (tools/gen_fixtures.py) has head_dim 32, which the CUDA decode-attention v2 kernel
and the flash kernels' fast paths decline, so its model-level CUDA tests never run them. This one has
the smallest shape they cover (4 query / 2 KV heads × 64, hidden 128, 2 layers, the tiny tokenizer's
vocabulary) so that tests/cuda_graphs.rs replays decode steps that use v2. Its references are
transformers' float32 computation on the bf16-rounded weights, as for tiny-qwen3-vl-bf16, and
tests/decoder_parity.rs checks the CPU engine against them.

Regenerate (from the repository root, after tools/gen_fixtures.py):
    .venv-tools/bin/python tools/gen_d64_fixture.py
"""

import os

import torch
from transformers import PreTrainedTokenizerFast, Qwen3VLForConditionalGeneration

import gen_fixtures as g


def config():
    cfg = g.qwen3_config()
    t = cfg.text_config
    t.hidden_size, t.intermediate_size, t.head_dim = 128, 256, 64
    t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads = 2, 4, 2
    # The rotary sections (temporal, height, width) must sum to head_dim / 2 = 32 frequencies.
    t.rope_parameters = dict(t.rope_parameters, mrope_section=[12, 10, 10])
    v = cfg.vision_config
    v.out_hidden_size = 128
    v.deepstack_visual_indexes = [0, 1]
    return cfg


def main():
    torch.set_grad_enabled(False)
    torch.use_deterministic_algorithms(True)
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(g.TINY_TOK, "tokenizer.json"))
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(config()).float().eval()
    g.init_weights(model, seed=5)
    out = g.fresh_dir(os.path.join(g.FIX, "tiny-qwen3-vl-d64"))
    model.to(torch.bfloat16).save_pretrained(out)
    g.write_generation_config(out)
    g.write_preprocessor_config(out, "qwen3")
    g.copy_tokenizer(out)
    rounded = Qwen3VLForConditionalGeneration.from_pretrained(out, dtype=torch.bfloat16).float().eval()
    print("tiny-qwen3-vl-d64:")
    g.write_reference(out, rounded, tok, g.chat_template("qwen3-vl-8b-instruct"), g.PROMPTS[:1])


if __name__ == "__main__":
    main()
