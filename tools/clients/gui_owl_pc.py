#!/usr/bin/env python3
"""GUI-Owl-1.5 (Mobile-Agent-v3.5) as a PC agent (`computer_use`).

Source: X-PLUG/MobileAgent @ 11cea575, `Mobile-Agent-v3.5/computer_use/run_gui_owl_1_5_for_pc.py` and
`computer_use/utils.py` (`build_messages(..., history_n=4)`, `image_to_base64`, `GUIOwlWrapper.predict_mm`).

* No sampling parameter (`chat.completions.create(model=..., messages=payload)`).
* Screenshots: a 1920x1080 screen smart-resized (factor 16, 3136..10035200 pixels) to 1920x1088, PNG,
  `data:image/png;base64,`.
* Window `history_n=4`: the last four steps as user/assistant turns (verbatim responses), the current
  screenshot last; older steps as `Step {i}: <action line>` in the first user text (`None` when empty).
* System: the computer_use prompt (here recall's desktop GUI-Owl prompt, the same `# Tools` shape).
"""

from common import DESKTOP_SYSTEM, TASKS, b64, instruction_prompt, main, png_bytes, previous_actions, resized, run, screenshot

HISTORY_N = 4


def image(step: int) -> dict:
    img = resized(screenshot(1920, 1080, step, seed=1), 16, 3136, 10035200)
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(png_bytes(img))}}


def messages(task: str, responses: list[str], t: int) -> list[dict]:
    prompt = instruction_prompt(task, previous_actions(responses, t - HISTORY_N))
    out = [{"role": "system", "content": [{"type": "text", "text": DESKTOP_SYSTEM}]}]
    window = list(range(max(0, t - HISTORY_N), t))
    for idx, s in enumerate(window):
        content = [{"type": "text", "text": prompt}, image(s)] if idx == 0 else [image(s)]
        out += [{"role": "user", "content": content}, {"role": "assistant", "content": [{"type": "text", "text": responses[s]}]}]
    if window:
        out.append({"role": "user", "content": [image(t)]})
    else:
        out.append({"role": "user", "content": [{"type": "text", "text": prompt}, image(t)]})
    return out


def replay(client, model: str, steps: int):
    return run(client, model, steps, lambda responses, t: {"messages": messages(TASKS[1], responses, t)})

if __name__ == "__main__":
    main(replay, __doc__)
