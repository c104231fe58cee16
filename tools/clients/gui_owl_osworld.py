#!/usr/bin/env python3
"""GUI-Owl-1.5 on OSWorld (the runner the Mobile-Agent-v3.5 README links, X-PLUG/OSWorld-MCP).

Source: X-PLUG/OSWorld-MCP @ 10ed9f49, `osworld/mm_agents/gui_owl_1_5_agent.py` (`_call_llm_openai`:
`chat.completions.create(model=..., messages=...)` — the payload's `max_tokens`/`top_p`/`temperature`
are built but not sent) and `osworld/run_multienv_gui_owl_1_5.py`.

* No sampling parameter.
* Screenshots: 1920x1080 smart-resized (factor 32, at most 16*16*4*12800 pixels) to 1920x1088, PNG. The
  current one is `data:image/png;base64,`; **past ones are labelled `data:image/jpeg;base64,` but hold
  PNG bytes** (the server must sniff the bytes).
* `history_n=4`. First user turn: the instruction prompt (with a leading newline) and the oldest kept
  screenshot; then each past response verbatim and the next screenshot; the last user turn wraps the
  current screenshot as a tool response: `<tool_response>\\n`, the app info (`None`), image, `\\n</tool_response>`.
"""

from common import DESKTOP_SYSTEM, TASKS, b64, instruction_prompt, main, png_bytes, previous_actions, resized, run, screenshot

HISTORY_N = 4


def url(step: int, label: str) -> dict:
    img = resized(screenshot(1920, 1080, step, seed=2), 32, 3136, 16 * 16 * 4 * 12800)
    return {"type": "image_url", "image_url": {"url": f"data:image/{label};base64," + b64(png_bytes(img))}}


def messages(task: str, responses: list[str], t: int) -> list[dict]:
    prompt = instruction_prompt(task, previous_actions(responses, t - HISTORY_N), lead="\n")
    out = [{"role": "system", "content": [{"type": "text", "text": DESKTOP_SYSTEM}]}]
    if t == 0:
        return out + [{"role": "user", "content": [{"type": "text", "text": prompt}, url(0, "png")]}]
    window = list(range(max(0, t - HISTORY_N), t))
    for k, s in enumerate(window):
        content = [{"type": "text", "text": prompt}, url(s, "jpeg")] if k == 0 else [url(s, "jpeg")]
        out += [{"role": "user", "content": content}, {"role": "assistant", "content": [{"type": "text", "text": responses[s]}]}]
    out.append({"role": "user", "content": [
        {"type": "text", "text": "<tool_response>\n"}, {"type": "text", "text": "None"}, url(t, "png"),
        {"type": "text", "text": "\n</tool_response>"}]})
    return out


def replay(client, model: str, steps: int):
    return run(client, model, steps, lambda responses, t: {"messages": messages(TASKS[2], responses, t)})

if __name__ == "__main__":
    main(replay, __doc__)
