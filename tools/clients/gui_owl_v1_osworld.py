#!/usr/bin/env python3
"""GUI-Owl (Mobile-Agent-v3) on OSWorld: `owl_agent.py`, the agent that sends `repetition_penalty: 1.05`.

Source: X-PLUG/MobileAgent @ 799481983e, `Mobile-Agent-v3/os_world_v3/mm_agents/owl_agent.py` (also vendored
into OSWorld as `mm_agents/owl_agent.py`) and `run_guiowl.sh`.

* `max_tokens=2048, temperature=0, top_p=0.9, extra_body={"repetition_penalty": 1.05, "top_k": -1}`.
* System: two text parts ("You are a helpful assistant." and the tool prompt).
* No assistant turns: everything in ONE user message — the instruction with the history as text, then
  "Screenshot of step k:" and the last `history_n - 1 = 2` past screenshots, then "Current screenshot:".
  So the prompt is rebuilt every step (only the system turn and the message's head stay cached).
* Screenshots: raw 1920x1080 PNG (`data:image/png;base64,`; the OSWorld copy can upload to OSS and send
  http URLs instead).
"""

from common import DESKTOP_SYSTEM, TASKS, b64, main, png_bytes, previous_actions, run, screenshot

HISTORY_N = 3


def image(step: int) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(png_bytes(screenshot(1920, 1080, step, seed=3)))}}


def messages(task: str, responses: list[str], t: int) -> list[dict]:
    history = previous_actions(responses, len(responses), empty="No history. This is the first step.").replace("\n", "\n    ")
    text = ("Please generate the next move according to the UI screenshot, instruction and previous actions.\n"
            f"    Instruction: {task}\n    Previous actions:\n    {history}\n"
            "    Before answering, explain your reasoning step-by-step in <thinking></thinking> tags, and insert them "
            "before the <tool_call></tool_call> XML tags.\n    After your reasoning, summarize your action in "
            "<conclusion></conclusion> tags.")
    content = [{"type": "text", "text": text}]
    for s in range(max(0, t - (HISTORY_N - 1)), t):
        content += [{"type": "text", "text": f"Screenshot of step {s + 1}:\n"}, image(s)]
    content += [{"type": "text", "text": "Current screenshot:\n"}, image(t)]
    return [{"role": "system", "content": [{"type": "text", "text": "You are a helpful assistant."},
                                           {"type": "text", "text": DESKTOP_SYSTEM}]},
            {"role": "user", "content": content}]


def replay(client, model: str, steps: int):
    return run(client, model, steps, lambda responses, t: {
        "messages": messages(TASKS[0], responses, t), "max_tokens": 2048, "temperature": 0, "top_p": 0.9,
        "extra_body": {"repetition_penalty": 1.05, "top_k": -1}})

if __name__ == "__main__":
    main(replay, __doc__)
