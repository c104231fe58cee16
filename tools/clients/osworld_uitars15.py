#!/usr/bin/env python3
"""OSWorld's UI-TARS-1.5 agent: `frequency_penalty=1` and every past answer kept.

Source: xlang-ai/OSWorld `mm_agents/uitars15_v1.py` + `run_multienv_uitars15_v1.py` (vendored copy in
mrwwk/DeskCraft @ ba3cee3f). The runner hard-codes `runtime_conf`: history_n 5, temperature 0.0,
top_p 0.9, max_tokens 1000 (the command-line values are ignored).

* `frequency_penalty=1, max_tokens=1000, temperature=0.0, top_p=0.9`.
* System "You are a helpful assistant."; a user turn with the UI-TARS prompt (action space, output
  format, the instruction); then, for every past answer, its screenshot (only for the last
  `history_n - 1 = 4`) and the answer, box coordinates wrapped in `<|box_start|>`/`<|box_end|>`;
  the current screenshot last. Early history is a run of consecutive assistant messages.
* Screenshots: raw 1920x1080 PNG, `data:image/png;base64,`.
"""

import re

from common import TASKS, b64, main, png_bytes, run, screenshot

HISTORY_N = 5
PROMPT = """You are a GUI agent. You are given a task and your action history, with screenshots. You need to perform the next action to complete the task.

## Output Format
```
Thought: ...
Action: ...
```

## Action Space
click(start_box='<|box_start|>(x1,y1)<|box_end|>')
left_double(start_box='<|box_start|>(x1,y1)<|box_end|>')
right_single(start_box='<|box_start|>(x1,y1)<|box_end|>')
drag(start_box='<|box_start|>(x1,y1)<|box_end|>', end_box='<|box_start|>(x3,y3)<|box_end|>')
hotkey(key='')
type(content='') #If you want to submit your input, use "\\n" at the end of `content`.
scroll(start_box='<|box_start|>(x1,y1)<|box_end|>', direction='down or up or right or left')
wait() #Sleep for 5s and take a screenshot to check for any changes.
finished(content='xxx')

## Note
- Use Chinese in `Thought` part.
- Write a small plan and finally summarize your next action (with its target element) in one sentence in `Thought` part.

## User Instruction
"""


def add_box_token(response: str) -> str:
    return re.sub(r"start_box='\((\d+),\s*(\d+)\)'", r"start_box='<|box_start|>(\1,\2)<|box_end|>'", response)


def image(step: int) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(png_bytes(screenshot(1920, 1080, step, seed=5)))}}


def messages(task: str, responses: list[str], t: int) -> list[dict]:
    out = [{"role": "system", "content": [{"type": "text", "text": "You are a helpful assistant."}]},
           {"role": "user", "content": [{"type": "text", "text": PROMPT + task}]}]
    for i, r in enumerate(responses):
        if i >= t - (HISTORY_N - 1):
            out.append({"role": "user", "content": [image(i)]})
        out.append({"role": "assistant", "content": [{"type": "text", "text": add_box_token(r)}]})
    out.append({"role": "user", "content": [image(t)]})
    return out


def replay(client, model: str, steps: int):
    return run(client, model, steps, lambda responses, t: {
        "messages": messages(TASKS[0], responses, t), "frequency_penalty": 1, "max_tokens": 1000,
        "temperature": 0.0, "top_p": 0.9})

if __name__ == "__main__":
    main(replay, __doc__)
