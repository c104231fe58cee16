#!/usr/bin/env python3
"""Generate `tests/fixtures/agent-qwen3-vl/`: the tiny Qwen3-VL fine-tuned (HF transformers, CPU) to answer
every chat with one GUI-Owl action, so that tests of tool calling, of the CausalCache policy protocol
and of the front-end replays (tools/clients/) see a real `<tool_call>` where the random tiny model
writes noise.

The answer, for any prompt (text or screenshots, any length up to the context used in training, tools
or none, GUI-Owl, UI-TARS or plain chats), is

    Action: Tap the search bar at the top of the screen.
    <tool_call>
    {"name": "mobile_use", "arguments": {"action": "click", "coordinate": [540, 120]}}
    </tool_call><|im_end|>

The weights start from tests/fixtures/tiny-qwen3-vl; every parameter is trained (AdamW) with
cross-entropy on the answer's tokens only, on generated prompts: chats rendered with the official
Qwen3-VL template (with and without `tools`, with tool calls and tool responses), GUI-Owl protocol chats
with the real system prompt and the answer fed back as history, UI-TARS-like chats, each with synthetic
screenshots of phone and desktop sizes. The script checks, before writing, that HF greedy decoding gives
exactly the answer on held-out prompts of every kind, with a top-1/top-2 margin along the answer well
above float noise. The config says a context of 262,144 tokens (Qwen3-VL's), so that front ends asking
for `max_tokens: 65535` fit.

Usage (from the repository root, after tools/gen_fixtures.py):

    .venv-tools/bin/python tools/gen_agent_model.py
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time

import torch
from PIL import Image, ImageDraw
from transformers import AutoImageProcessor, PreTrainedTokenizerFast, Qwen3VLForConditionalGeneration
from vl_inputs import expand_image_pads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(ROOT, "tests/fixtures/tiny-qwen3-vl")
OUT = os.path.join(ROOT, "tests/fixtures/agent-qwen3-vl")
MOBILE_SYSTEM = open(os.path.join(ROOT, "src/memory/prompts/gui_owl_mobile_system.txt")).read()
DESKTOP_SYSTEM = open(os.path.join(ROOT, "src/memory/prompts/gui_owl_desktop_system.txt")).read()
TEMPLATE = json.load(open(os.path.join(ROOT, "models/qwen3-vl-8b-instruct/chat_template.json")))["chat_template"]
RESPONSE = ('Action: Tap the search bar at the top of the screen.\n<tool_call>\n{"name": "mobile_use", "arguments": '
            '{"action": "click", "coordinate": [540, 120]}}\n</tool_call>')
IMAGE_PAD, IM_END = 1012, 1002
CONTEXT = 262144
WORDS = ("open the settings app turn on wifi search for cats tap button scroll down menu back home screen type "
         "message send photo gallery clock alarm note café ☕ weather paris calendar event save file window "
         "click select text copy paste browser tab address bar download 12 7:00 ok cancel").split()
SIZES = [(1080, 2400), (1920, 1080), (1920, 1088), (720, 1280), (1440, 900), (200, 150), (64, 64)]


# Set in main: random byte-level tokens decoded, so that the answer does not hang on the word list.
NOISE = None


def words(rng, lo, hi):
    n = rng.randint(lo, hi)
    if NOISE is not None and rng.random() < 0.2:
        return NOISE([rng.randrange(1000) for _ in range(n)])
    return " ".join(rng.choice(WORDS) for _ in range(n))


def screen(rng):
    w, h = rng.choice(SIZES)
    img = Image.new("RGB", (w, h), tuple(rng.randrange(256) for _ in range(3)))
    d = ImageDraw.Draw(img)
    for _ in range(rng.randint(2, 8)):
        x, y = rng.randrange(w), rng.randrange(h)
        d.rectangle([x, y, x + rng.randrange(1, w // 2 + 2), y + rng.randrange(1, h // 4 + 2)],
                    fill=tuple(rng.randrange(256) for _ in range(3)))
    return img


def image_part(rng, images):
    images.append(screen(rng))
    return {"type": "image"}


def tool(rng):
    name = rng.choice(["mobile_use", "computer_use", "get_weather", "search", "noop"])
    return {"type": "function", "function": {"name": name, "description": words(rng, 3, 12), "parameters": {
        "type": "object", "properties": {w: {"type": "string"} for w in rng.sample(WORDS, rng.randint(1, 4))}}}}


def gui_owl(rng, images):
    """GUI-Owl's mobile protocol: folded history, retained turns with the answer fed back, current screen."""
    t = rng.randint(0, 12)
    kept = min(t, rng.randint(0, 4))
    folded = "\n".join(f"Step{i + 1}: {words(rng, 2, 8)}" for i in range(t - kept)) or "No previous action."
    first = ("Please generate the next move according to the UI screenshot, instruction and previous actions.\n\n"
             f"Instruction: {words(rng, 3, 12)}\n\nPrevious actions:\n{folded}")
    system = rng.choice([MOBILE_SYSTEM, DESKTOP_SYSTEM])
    msgs = [{"role": "system", "content": [{"type": "text", "text": system}]},
            {"role": "user", "content": [{"type": "text", "text": first}, image_part(rng, images)]}]
    for _ in range(kept):
        msgs.append({"role": "assistant", "content": rng.choice([RESPONSE, f"Action: {words(rng, 2, 6)}\n<tool_call>\n"
                     f'{{"name": "mobile_use", "arguments": {{"action": "wait"}}}}\n</tool_call>'])})
        content = [image_part(rng, images)]
        if rng.random() < 0.3:
            content.insert(0, {"type": "text", "text": "Previous actions (continued):\n" + words(rng, 3, 10)})
        msgs.append({"role": "user", "content": content})
    return msgs, None


def plain(rng, images):
    msgs = []
    if rng.random() < 0.5:
        msgs.append({"role": "system", "content": words(rng, 3, 60)})
    for turn in range(rng.randint(1, 4)):
        content = [{"type": "text", "text": words(rng, 1, 80)}]
        for _ in range(rng.choice([0, 0, 1, 2])):
            content.insert(rng.randint(0, len(content)), image_part(rng, images))
        msgs.append({"role": "user", "content": content})
        if turn < 3 and rng.random() < 0.6:
            msgs.append({"role": "assistant", "content": rng.choice([RESPONSE, words(rng, 2, 30)])})
    if msgs[-1]["role"] != "user":
        msgs.append({"role": "user", "content": words(rng, 1, 20)})
    return msgs, None


# The answer as a client feeds it back: its text before `<tool_call>`, and its call as `tool_calls`.
ANSWER_CONTENT = RESPONSE[: RESPONSE.index("<tool_call>")]
ANSWER_CALL = {"type": "function", "function": {"name": "mobile_use",
                                                "arguments": {"action": "click", "coordinate": [540, 120]}}}


def with_tools(rng, images):
    tools = [tool(rng) for _ in range(rng.randint(1, 3))]
    first = [image_part(rng, images), {"type": "text", "text": words(rng, 2, 20)}]
    msgs = [{"role": "user", "content": first if rng.random() < 0.7 else first[::-1]}]
    if rng.random() < 0.3:
        msgs.insert(0, {"role": "system", "content": words(rng, 3, 40)})
    for _ in range(rng.randint(0, 4)):
        if rng.random() < 0.5:
            msgs.append({"role": "assistant", "content": rng.choice([ANSWER_CONTENT, [], ""]), "tool_calls": [ANSWER_CALL]})
        else:
            msgs.append({"role": "assistant", "content": rng.choice(["", words(rng, 1, 5)]), "tool_calls": [
                {"type": "function", "function": {"name": tools[0]["function"]["name"], "arguments": {"action": "click"}}}]})
        msgs.append({"role": "tool", "content": [image_part(rng, images)] if rng.random() < 0.5 else words(rng, 1, 10)})
        if rng.random() < 0.2:
            msgs.append({"role": "user", "content": words(rng, 1, 10)})
    return msgs, tools


def ui_tars(rng, images):
    msgs = [{"role": "system", "content": "You are a helpful assistant."}] if rng.random() < 0.5 else []
    msgs.append({"role": "user", "content": "You are a GUI agent. ## Output Format\nThought: ...\nAction: ...\n"
                 "## Action Space\n" + words(rng, 20, 120) + "\n## User Instruction\n" + words(rng, 3, 12)})
    for _ in range(rng.randint(0, 8)):
        if rng.random() < 0.7:
            msgs.append({"role": "user", "content": [image_part(rng, images)]})
        msgs.append({"role": "assistant", "content": rng.choice([RESPONSE, "Thought: " + words(rng, 3, 15)
                     + "\nAction: click(start_box='(100,200)')"])})
    msgs.append({"role": "user", "content": [image_part(rng, images)]})
    return msgs, None


KINDS = [gui_owl, plain, with_tools, ui_tars]


def encode(tok, processor, msgs, tools, images):
    text = tok.apply_chat_template(msgs, tools=tools, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True)
    text, kw = expand_image_pads(text, processor, images)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return ids, kw


def example(rng, tok, processor, kind=None):
    images = []
    msgs, tools = (kind or rng.choice(KINDS))(rng, images)
    return encode(tok, processor, msgs, tools, images)


def batch_loss(model, ids, kw, target):
    input_ids = torch.tensor([ids + target])
    labels = torch.full_like(input_ids, -100)
    labels[0, len(ids):] = torch.tensor(target)
    if kw:
        kw = dict(kw, mm_token_type_ids=(input_ids == IMAGE_PAD).int())
    return model(input_ids=input_ids, labels=labels, **kw).loss


def check(model, tok, processor, target, rng, n):
    """Greedy answers on `n` held-out prompts of every kind (some long); the worst margin."""
    worst, failures, lengths = float("inf"), [], []
    for i in range(n):
        ids, kw = example(rng, tok, processor, KINDS[i % len(KINDS)])
        lengths.append(len(ids))
        input_ids = torch.tensor([ids])
        if kw:
            kw = dict(kw, mm_token_type_ids=(input_ids == IMAGE_PAD).int())
        with torch.no_grad():
            out = model.generate(input_ids, **kw, max_new_tokens=len(target) + 4, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True, pad_token_id=1000, eos_token_id=IM_END)
        got = out.sequences[0, len(ids):].tolist()
        top2 = torch.stack([s[0].topk(2).values for s in out.scores])
        worst = min(worst, (top2[:, 0] - top2[:, 1]).min().item())
        if got != target:
            failures.append((i, len(ids), tok.decode(got)))
    return failures, worst, lengths


def main():
    t0 = time.time()
    torch.manual_seed(0)
    rng = random.Random(0)
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(BASE, "tokenizer.json"))
    global NOISE
    NOISE = lambda ids: tok.decode(ids)  # noqa: E731
    processor = AutoImageProcessor.from_pretrained(BASE)
    model = Qwen3VLForConditionalGeneration.from_pretrained(BASE, dtype=torch.float32)
    target = tok(RESPONSE + "<|im_end|>", add_special_tokens=False)["input_ids"]
    assert target[-1] == IM_END
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    steps = 3600
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    model.train()
    for step in range(steps):
        ids, kw = example(rng, tok, processor)
        loss = batch_loss(model, ids, kw, target)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0:
            print(f"step {step}: loss {loss.item():.4f} (prompt {len(ids)} tokens) {time.time() - t0:.0f}s", flush=True)
    model.eval()
    failures, margin, lengths = check(model, tok, processor, target, random.Random(12345), 64)
    print(f"held-out: {64 - len(failures)}/64 exact, min margin {margin:.3f}, prompts {min(lengths)}..{max(lengths)} tokens")
    assert not failures, failures[:3]
    assert margin > 1.0, f"margin {margin}"

    if os.path.exists(OUT):
        shutil.rmtree(OUT)
    model.config.text_config.max_position_embeddings = CONTEXT
    model.save_pretrained(OUT)
    for f in ["generation_config.json", "preprocessor_config.json", "tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(os.path.join(BASE, f), os.path.join(OUT, f))
    again = Qwen3VLForConditionalGeneration.from_pretrained(OUT, dtype=torch.float32).eval()
    for (ka, a), (kb, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), ka
    import transformers
    with open(os.path.join(OUT, "agent.json"), "w") as f:
        json.dump({"generator": "tools/gen_agent_model.py", "transformers_version": transformers.__version__,
                   "base": "tests/fixtures/tiny-qwen3-vl", "response": RESPONSE, "response_ids": target,
                   "steps": steps, "heldout_prompts": 64, "heldout_min_margin": margin,
                   "heldout_prompt_tokens": [min(lengths), max(lengths)]}, f, indent=1, ensure_ascii=False)
    print(f"wrote {OUT} in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
