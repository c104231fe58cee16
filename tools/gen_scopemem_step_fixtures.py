#!/usr/bin/env python3
"""ScopeMem step fixtures for the tiny Qwen3-VL, computed with HF transformers:

* p0: for a fixed first opinion a0, the probability of each of the 10 mobile action types at the
  decision position (a0 up to `"action": "`): each `TYPE"` continuation is tokenised jointly with the
  prefix, scored from the longest token prefix all ten share (log-softmax of HF's logits in float64,
  summed over the continuation), and the ten sums are normalised.
* prefix logits: 16 random prefix vectors prepended to the prompt's input embeddings
  (`inputs_embeds`, positions as text tokens) and the logits HF returns for every position.

    .venv-tools/bin/python tools/gen_scopemem_step_fixtures.py   (after tools/gen_fixtures.py)
"""

import json
import os

import torch
from safetensors.torch import save_file
from transformers import PreTrainedTokenizerFast, Qwen3VLForConditionalGeneration

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(ROOT, "tests", "fixtures", "tiny-qwen3-vl")
OUT = os.path.join(ROOT, "tests", "fixtures", "scopemem")
TYPES = ["key", "click", "long_press", "swipe", "type", "system_button", "open", "wait", "answer", "terminate"]
MESSAGES = [{"role": "user", "content": "Send the forecast to Alice."}]
FIRST = ('Action: Tap the send button.\n<tool_call>\n{"name": "mobile_use", "arguments": '
         '{"action": "click", "coordinate": [930, 285]}}\n</tool_call>')


def main():
    torch.manual_seed(0)
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(BASE, "tokenizer.json"))
    with open(os.path.join(ROOT, "models", "qwen3-vl-8b-instruct", "chat_template.json")) as f:
        template = json.load(f)["chat_template"]
    model = Qwen3VLForConditionalGeneration.from_pretrained(BASE, dtype=torch.float32).eval()
    text = tok.apply_chat_template(MESSAGES, chat_template=template, tokenize=False, add_generation_prompt=True)
    prompt = tok(text, add_special_tokens=False)["input_ids"]

    at = FIRST.index('"action": "') + len('"action": "')
    prefix = FIRST[:at]
    seqs = [tok(prefix + t + '"', add_special_tokens=False)["input_ids"] for t in TYPES]
    shared = 0
    while shared < min(map(len, seqs)) - 1 and all(s[shared] == seqs[0][shared] for s in seqs):
        shared += 1
    sums = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor([prompt + s])
            lp = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
            n = len(prompt) + shared
            sums.append(sum(lp[n - 1 + i, tok_id].item() for i, tok_id in enumerate(s[shared:])))
    sums = torch.tensor(sums, dtype=torch.float64)
    p0 = torch.softmax(sums, dim=0)

    g = torch.Generator().manual_seed(7)
    hidden = model.config.text_config.hidden_size
    prefix_vectors = torch.randn(16, hidden, generator=g) * 0.5
    with torch.no_grad():
        embeds = model.model.language_model.embed_tokens(torch.tensor([prompt]))
        inputs = torch.cat([prefix_vectors[None], embeds], dim=1)
        logits = model(inputs_embeds=inputs).logits[0]

    save_file({"prompt_ids": torch.tensor(prompt, dtype=torch.int64), "p0": p0.float(),
               "prefix": prefix_vectors.float().contiguous(), "prefix_logits": logits.float().contiguous()},
              os.path.join(OUT, "step_reference.safetensors"))
    with open(os.path.join(OUT, "step_reference.json"), "w") as f:
        json.dump({"messages": MESSAGES, "first_opinion": FIRST, "types": TYPES, "shared_tokens": shared,
                   "p0": p0.tolist()}, f, indent=1)
    print("p0", [round(x, 4) for x in p0.tolist()], "shared", shared, "prompt", len(prompt))


if __name__ == "__main__":
    main()
