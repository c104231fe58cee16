#!/usr/bin/env python3
"""Generate `tests/fixtures/penalties/cases.json`: greedy generations of the tiny Qwen3-VL under
repetition, frequency and presence penalties, computed by Hugging Face transformers.

* The repetition penalty is transformers' own `RepetitionPenaltyLogitsProcessor` (`generate(...,
  repetition_penalty=r)`): every token of the prompt or of the output so far has its logit divided by r
  when positive, multiplied by r otherwise.
* Frequency and presence penalties have no transformers processor; `VllmPenalties` below applies vLLM's
  formula (`vllm/model_executor/layers/utils.py::apply_penalties`, which follows OpenAI's definition):
  `logits -= frequency * count(output token)` then `logits -= presence * (count > 0)`, counting only the
  generated tokens. transformers runs its built-in processors first, so the order is vLLM's: repetition,
  then frequency, then presence.

Every case records the HF input ids (the chat rendered by the official template, image pads expanded),
the penalised greedy tokens, the unpenalised greedy tokens, and the smallest top-1/top-2 margin of the
processed scores along the path (asserted above float noise, so that the comparison cannot hinge on a
near-tie). `tests/penalties.rs` replays every case through recall's engine, batched and alone, and
through the reference path.

Usage (from the repository root, after tools/gen_fixtures.py):

    .venv-tools/bin/python tools/gen_penalty_fixtures.py
"""

from __future__ import annotations

import json
import os

import torch
from transformers import AutoImageProcessor, LogitsProcessor, LogitsProcessorList, PreTrainedTokenizerFast
from transformers import Qwen3VLForConditionalGeneration
from vl_inputs import expand_image_pads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "tests/fixtures/tiny-qwen3-vl")
OUT = os.path.join(ROOT, "tests/fixtures/penalties/cases.json")
IMAGE_PAD = 1012
MAX_NEW = 24

PROMPTS = [
    {"name": "text", "messages": [{"role": "user", "content": "Open the settings app and turn on Wi-Fi, then go back."}]},
    {
        "name": "system_and_history",
        "messages": [
            {"role": "system", "content": "You are a GUI agent. Answer with one action."},
            {"role": "user", "content": "Search for cats."},
            {"role": "assistant", "content": "Action: click the search bar."},
            {"role": "user", "content": "Now type the query."},
        ],
    },
    {
        "name": "image",
        "messages": [{"role": "user", "content": [{"type": "image", "image": "tests/fixtures/vl-images/screen.png"},
                                                  {"type": "text", "text": "What should I tap next?"}]}],
    },
]

# (name, repetition, frequency, presence): GUI-Owl's OSWorld agent sends repetition 1.05, UI-TARS
# frequency 1, Qwen3-VL's recommended settings presence 1.5; the others push the penalties to where
# they change the tiny model's choices.
SETTINGS = [
    ("repetition_1.05", 1.05, 0.0, 0.0),
    ("repetition_1.5", 1.5, 0.0, 0.0),
    ("repetition_0.7", 0.7, 0.0, 0.0),
    ("frequency_1", 1.0, 1.0, 0.0),
    ("frequency_-0.5", 1.0, -0.5, 0.0),
    ("presence_1.5", 1.0, 0.0, 1.5),
    ("all_three", 1.3, 0.6, 0.4),
]


class VllmPenalties(LogitsProcessor):
    """vLLM's frequency and presence penalties over the generated tokens only."""

    def __init__(self, prompt_len: int, frequency: float, presence: float):
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids, scores):
        out = input_ids[:, self.prompt_len:]
        counts = torch.zeros_like(scores)
        counts.scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        scores = scores - self.frequency * counts
        return scores - self.presence * (counts > 0).to(scores.dtype)


def inputs(prompt, tok, template, image_processor):
    """HF's input ids (and pixel inputs) for a chat, image pads expanded as the processor does."""
    text = tok.apply_chat_template(prompt["messages"], chat_template=template, tokenize=False,
                                   add_generation_prompt=True)
    paths = [p["image"] for m in prompt["messages"] if isinstance(m["content"], list) for p in m["content"]
             if p.get("type") == "image"]
    from transformers.image_utils import load_image
    text, kw = expand_image_pads(text, image_processor, [load_image(os.path.join(ROOT, p)) for p in paths])
    ids = tok(text, add_special_tokens=False)["input_ids"]
    input_ids = torch.tensor([ids])
    if paths:
        kw["mm_token_type_ids"] = (input_ids == IMAGE_PAD).int()
    return ids, input_ids, kw


def greedy(model, input_ids, kw, repetition, frequency, presence):
    processors = LogitsProcessorList()
    if frequency or presence:
        processors.append(VllmPenalties(input_ids.shape[1], frequency, presence))
    with torch.no_grad():
        out = model.generate(input_ids, **kw, max_new_tokens=MAX_NEW, do_sample=False, repetition_penalty=repetition,
                             logits_processor=processors, output_scores=True, return_dict_in_generate=True,
                             pad_token_id=1000)
    tokens = out.sequences[0, input_ids.shape[1]:].tolist()
    top2 = torch.stack([s[0].topk(2).values for s in out.scores])
    margin = (top2[:, 0] - top2[:, 1]).min().item()
    return tokens, margin


def main() -> None:
    import transformers

    model = Qwen3VLForConditionalGeneration.from_pretrained(MODEL, dtype=torch.float32).eval()
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(MODEL, "tokenizer.json"))
    image_processor = AutoImageProcessor.from_pretrained(MODEL)
    with open(os.path.join(ROOT, "models/qwen3-vl-8b-instruct/chat_template.json")) as f:
        template = json.load(f)["chat_template"]

    cases = []
    for prompt in PROMPTS:
        ids, input_ids, kw = inputs(prompt, tok, template, image_processor)
        plain, _ = greedy(model, input_ids, kw, 1.0, 0.0, 0.0)
        for name, rep, freq, pres in SETTINGS:
            tokens, margin = greedy(model, input_ids, kw, rep, freq, pres)
            assert margin > 1e-4, f"{prompt['name']}/{name}: near-tie on the greedy path (margin {margin})"
            cases.append({
                "name": f"{prompt['name']}/{name}",
                "messages": prompt["messages"],
                "input_ids": ids,
                "repetition_penalty": rep,
                "frequency_penalty": freq,
                "presence_penalty": pres,
                "tokens": tokens,
                "plain_tokens": plain,
                "margin": margin,
            })
    changed = sum(c["tokens"] != c["plain_tokens"] for c in cases)
    assert changed >= len(cases) // 2, f"only {changed} of {len(cases)} cases differ from plain greedy"
    doc = {
        "generator": "tools/gen_penalty_fixtures.py",
        "transformers_version": transformers.__version__,
        "model": "tests/fixtures/tiny-qwen3-vl",
        "eos_token_ids": [1002, 1000],
        "cases": cases,
    }
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        f.write(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {len(cases)} cases ({changed} differ from plain greedy) to {OUT}")


if __name__ == "__main__":
    main()
