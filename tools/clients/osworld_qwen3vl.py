#!/usr/bin/env python3
"""OSWorld's Qwen3-VL agent.

Source: xlang-ai/OSWorld `mm_agents/qwen3vl_agent.py` + `run_multienv_qwen3vl.py` (read from the full
OSWorld tree vendored in mrwwk/DeskCraft @ ba3cee3f, checked against karakuri-ai/OSWorld-JP @ 3301bf9f).

* `max_tokens=32768` only (temperature and top_p are commented out): more than the context some
  servers have left; the server must take it (vLLM refuses a request whose prompt + max_tokens exceeds
  the model's context).
* Screenshots: 1920x1080 smart-resized (factor 32, at most 16*16*4*12800 pixels) to 1920x1088, PNG.
* **The image comes before the text** in the turn that holds the instruction prompt (leading newline,
  `Previous actions:` with `Step i:` lines of the steps older than the window, or `None`).
* `history_n=4`: four past (screenshot, verbatim response) turns, then the current screenshot.
"""

from common import DESKTOP_SYSTEM, TASKS, b64, instruction_prompt, main, png_bytes, previous_actions, resized, run, screenshot

HISTORY_N = 4


def image(step: int) -> dict:
    img = resized(screenshot(1920, 1080, step, seed=4), 32, 3136, 16 * 16 * 4 * 12800)
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(png_bytes(img))}}


def messages(task: str, responses: list[str], t: int) -> list[dict]:
    prompt = instruction_prompt(task, previous_actions(responses, t - HISTORY_N), lead="\n")
    out = [{"role": "system", "content": [{"type": "text", "text": DESKTOP_SYSTEM}]}]
    window = list(range(max(0, t - HISTORY_N), t))
    first = window[0] if window else t
    out.append({"role": "user", "content": [image(first), {"type": "text", "text": prompt}]})
    for s in window:
        out.append({"role": "assistant", "content": [{"type": "text", "text": responses[s]}]})
        out.append({"role": "user", "content": [image(s + 1)]})
    return out


def replay(client, model: str, steps: int):
    return run(client, model, steps, lambda responses, t: {"messages": messages(TASKS[1], responses, t), "max_tokens": 32768})

if __name__ == "__main__":
    main(replay, __doc__)
