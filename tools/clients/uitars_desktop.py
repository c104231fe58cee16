#!/usr/bin/env python3
"""The UI-TARS-desktop SDK (`@ui-tars/sdk`), replayed with the Python client.

Source: bytedance/UI-TARS-desktop @ 239b6544, `packages/ui-tars/sdk/src/Model.ts` (`invokeModelProvider`),
`utils.ts` (`preprocessResizeImage`, `convertToOpenAIMessages`), `GUIAgent.ts`, and
`packages/ui-tars/shared/src/constants/vlm.ts` (`MAX_IMAGE_LENGTH = 5`).

* The body the JS SDK sends: `stream: false`, explicit `null` for `seed`, `stop`, `frequency_penalty`
  and `presence_penalty`, `max_tokens: 65535` (UI-TARS-1.5), `temperature: 0`, `top_p: 0.7`, and the
  extra `thinking: {"type": "disabled"}` (a Volcengine field other servers ignore).
* No system message: the first user message is a string (the prompt, the history, the instruction).
  Each screenshot is a user message of one image; each answer a string assistant message. Past five
  images, the oldest image messages are deleted and their answers kept, so answers pile up.
* Screenshots at the logical screen size (1440x900 here), PNG, `data:image/png;base64,`.
"""

from common import TASKS, Recorder, b64, main, png_bytes, screenshot

MAX_IMAGE_LENGTH = 5
PROMPT = """You are a GUI agent. You are given a task and your action history, with screenshots. You need to perform the next action to complete the task.

## Output Format
```
Thought: ...
Action: ...
```

## Action Space
click(start_box='[x1, y1, x2, y2]')
type(content='')
scroll(start_box='[x1, y1, x2, y2]', direction='down or up or right or left')
wait()
finished()
call_user()

## Note
- Use English in `Thought` part.

## History Messages


## User Instruction
"""


def image(step: int) -> dict:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + b64(png_bytes(screenshot(1440, 900, step, seed=6)))}}]}


def replay(client, model: str, steps: int):
    rec = Recorder(client, model)
    conversation = [{"role": "user", "content": PROMPT + TASKS[2]}]
    for t in range(steps):
        conversation.append(image(t))
        images = [i for i, m in enumerate(conversation) if isinstance(m["content"], list)]
        for i in images[: max(0, len(images) - MAX_IMAGE_LENGTH)][::-1]:
            del conversation[i]
        s = rec.chat(messages=[dict(m) for m in conversation], stream=False, seed=None, stop=None,
                     frequency_penalty=None, presence_penalty=None, max_tokens=65535, temperature=0, top_p=0.7,
                     extra_body={"thinking": {"type": "disabled"}})
        if s.status != 200:
            break
        conversation.append({"role": "assistant", "content": s.content})
    return rec.steps


if __name__ == "__main__":
    main(replay, __doc__)
