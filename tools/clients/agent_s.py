#!/usr/bin/env python3
"""Agent-S with a locally hosted vLLM model (`LMMEnginevLLM`).

Source: simular-ai/Agent-S @ 5caa76cb, `gui_agents/s3/core/mllm.py` (`LMMAgent.add_message`: vLLM images
as `data:image;base64,` — no subtype) and `gui_agents/s3/core/engine.py` (`LMMEnginevLLM.generate`).

* `max_tokens=4096, temperature=0.0, top_p=0.8, extra_body={"repetition_penalty": 1.05}`.
* System: one text part (the worker's prompt). Each turn: user `[text, image]`, assistant `[text]` (the
  previous plan, verbatim). Engines without long context keep `max_trajectory_length=8` turns: older
  (user, assistant) pairs are dropped.
* Screenshots: raw 1920x1080 PNG bytes in `data:image;base64,`.
"""

from common import TASKS, Recorder, b64, main, png_bytes, screenshot

MAX_TRAJECTORY = 8
SYSTEM = ("You are an expert in graphical user interfaces and Python code. You are responsible for executing the "
          "current subtask of a larger task. Respond with your reasoning, then one `agent.` action in a python code "
          "block.")


def user(t: int, task: str) -> dict:
    text = f"Your task is: {task}\nThis is step {t + 1}. Here is the current screenshot."
    return {"role": "user", "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {
        "url": "data:image;base64," + b64(png_bytes(screenshot(1920, 1080, t, seed=8)))}}]}


def replay(client, model: str, steps: int):
    rec = Recorder(client, model)
    turns = []
    for t in range(steps):
        turns.append(user(t, TASKS[1]))
        while len(turns) > 2 * MAX_TRAJECTORY - 1:
            del turns[:2]
        messages = [{"role": "system", "content": [{"type": "text", "text": SYSTEM}]}] + turns
        s = rec.chat(messages=[dict(m) for m in messages], max_tokens=4096, temperature=0.0, top_p=0.8,
                     extra_body={"repetition_penalty": 1.05})
        if s.status != 200:
            break
        turns.append({"role": "assistant", "content": [{"type": "text", "text": s.content}]})
    return rec.steps


if __name__ == "__main__":
    main(replay, __doc__)
