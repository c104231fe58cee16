#!/usr/bin/env python3
"""Qwen-Agent's OpenAI-compatible backend in raw function-calling mode (`use_raw_api=True`).

Source: QwenLM/Qwen-Agent @ 31a4d36d, `qwen_agent/llm/oai.py` (`_chat_complete_create`, `raw_chat`),
`qwen_agent/llm/base.py` (`seed` always sent), `qwen_agent/llm/qwenvl_oai.py` (images),
`BaseChatModel._conv_qwen_agent_messages_to_oai` (the messages fed back).

* Always streamed (`stream=True`, no `stream_options`); a random `seed` on every request; the agent's
  `generate_cfg` (`top_p` here) and `extra_body` (`chat_template_kwargs`) merged into the body.
* `tools` in the request (OpenAI form), no `tool_choice`: the server renders them with the model's
  template and parses `<tool_call>` into streamed `tool_calls` deltas, which the agent accumulates.
* Fed back: the assistant message with only `tool_calls` (no `content` key), then a `tool` message
  with the tool's result — here the new screenshot — carrying `id`, `name` and `extra` (not
  `tool_call_id`).
* Local images become `data:image/jpeg;base64,` with the short side at most 1080 pixels.
"""

import io
import random

from common import Recorder, b64, main, screenshot

TOOLS = [{"type": "function", "function": {
    "name": "mobile_use",
    "description": "Use a touchscreen to interact with a mobile device, and take screenshots.",
    "parameters": {"type": "object", "required": ["action"], "properties": {
        "action": {"type": "string", "enum": ["click", "long_press", "swipe", "type", "system_button", "open", "wait",
                                              "answer", "terminate"]},
        "coordinate": {"type": "array", "description": "(x, y): the point to tap, on a 1000x1000 grid."},
        "text": {"type": "string"}}}}}]


def jpeg(step: int) -> str:
    img = screenshot(1080, 2400, step, seed=7)
    scale = 1080 / min(img.size)
    if scale < 1:
        img = img.resize((round(img.width * scale), round(img.height * scale)))
    buf = io.BytesIO()
    img.convert("RGB").save(buf, format="JPEG")
    return "data:image/jpeg;base64," + b64(buf.getvalue())


def replay(client, model: str, steps: int):
    rec = Recorder(client, model)
    rng = random.Random(0)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": jpeg(0)}},
                                             {"type": "text", "text": "Open the Clock app and add an alarm at 7:00."}]}]
    for t in range(steps):
        s = rec.chat(messages=[dict(m) for m in messages], stream=True, seed=rng.randint(0, 2**30), top_p=0.8,
                     tools=TOOLS, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        if s.status != 200:
            break
        if not s.tool_calls:
            messages.append({"role": "assistant", "content": s.content})
            messages.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": jpeg(t + 1)}}]})
            continue
        call = s.tool_calls[0]
        assistant = {"role": "assistant", "tool_calls": [{"id": call["id"], "type": "function", "function": call["function"]}]}
        if s.content:
            assistant["content"] = s.content
        messages.append(assistant)
        messages.append({"role": "tool", "content": [{"type": "image_url", "image_url": {"url": jpeg(t + 1)}}],
                         "name": call["function"]["name"], "extra": {"function_id": call["id"]}, "id": call["id"]})
    return rec.steps


if __name__ == "__main__":
    main(replay, __doc__)
