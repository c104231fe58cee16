#!/usr/bin/env python3
"""GUI-Owl-1.5 (Mobile-Agent-v3.5) on AndroidWorld, as its agent talks to a vLLM server.

Source: X-PLUG/MobileAgent @ 11cea575, `Mobile-Agent-v3.5/android_world_v3.5/android_world/agents/gui_owl.py`
(`GUIOwl.step`, `cut_current_messages`, `convert_format`, `pil_to_base64`) and `agents/infer_ma3.py`
(`GUIOwlWrapper.predict_mm`: `chat.completions.create(model=..., messages=payload)`, nothing else).

* No sampling parameter at all: the server's defaults (the checkpoint's generation_config.json) apply.
* System: one text part, GUI-Owl's mobile_use prompt. First user turn: the instruction and
  "Previous actions:" (`No previous action.` or `Step{i}: <action line>` lines), then the screenshot.
* Sliding window `last_image=5`: the last five screenshots stay as user turns with the verbatim
  responses between them; older steps fold into the first user text, whose image becomes the oldest
  kept screenshot.
* Images: the full 1080x2400 emulator frame as PNG, **bare base64 without a `data:` prefix** — which
  vLLM and recall refuse with a 400 (recall's says to add the prefix). `--data-url` replays the
  one-line fix (`"data:image/png;base64," + ...`) that makes the agent work against either server.
"""

from common import MOBILE_SYSTEM, TASKS, Recorder, b64, instruction_prompt, main, png_bytes, previous_actions, screenshot

LAST_IMAGE = 5
SIZE = (1080, 2400)


def messages(task: str, shots: list[str], responses: list[str]) -> list[dict]:
    """The request of decision t = len(responses) + 1 (shots has t screenshots, the last the current)."""
    t = len(responses)
    kept = min(t, LAST_IMAGE - 1)
    folded = responses[: t - kept]
    first = instruction_prompt(task, previous_actions(folded, t, line="Step{i}: {a}", empty="No previous action."))
    shown = list(range(t - kept, t + 1))  # screenshots of the kept steps, then the current one
    out = [{"role": "system", "content": [{"type": "text", "text": MOBILE_SYSTEM}]}]
    for k, s in enumerate(shown):
        part = {"type": "image_url", "image_url": {"url": shots[s]}}
        out.append({"role": "user", "content": [{"type": "text", "text": first}, part] if k == 0 else [part]})
        if s < t:
            out.append({"role": "assistant", "content": [{"type": "text", "text": responses[s]}]})
    return out


def replay(client, model: str, steps: int, data_url: bool = False):
    rec = Recorder(client, model)
    task, shots, responses = TASKS[0], [], []
    for step in range(steps):
        url = b64(png_bytes(screenshot(*SIZE, step)))
        shots.append(("data:image/png;base64," + url) if data_url else url)
        s = rec.chat(messages=messages(task, shots, responses))
        if s.status != 200:
            break  # the agent retries the same request ten times, then fails the task
        responses.append(s.content)
    return rec.steps


if __name__ == "__main__":
    import sys

    fix = "--data-url" in sys.argv
    if fix:
        sys.argv.remove("--data-url")
    main(lambda c, m, n: replay(c, m, n, data_url=fix), __doc__)
