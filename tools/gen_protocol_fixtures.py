#!/usr/bin/env python3
"""Generate the GUI-Owl protocol fixtures (`tests/fixtures/protocol/`) and the sample episode
(`tests/fixtures/episode-sample/`).

Oracle: the official rolling layout of GUI-Owl-1.5 (X-PLUG/MobileAgent, `Mobile-Agent-v3.5/android_world_v3.5/
android_world/agents/gui_owl.py`): the agent keeps one growing message list (system; first user turn with
`FIRST(NPA)` and x_1; then per step the assistant response and a user turn holding the next screenshot),
clears old user turns with `cut_current_messages(last_image = B + 1)` (the first user turn keeps its text,
later ones become empty) and rebuilds the prompt with `convert_format`, which folds the responses of the
cleared turns into `Step{i}: {action line}` lines of a new first user turn placed before the first kept
image. Both are re-implemented below from that description (gui_owl_protocol.md section 2), and checked
against the worked example of section 3 before anything is written.

For the desktop protocol the layout is identical; only the system prompt and the fold lines differ:
fold lines are rendered from the parsed `computer_use` arguments with CausalCache's templates
(`gui_owl_protocol.json › desktop_action_line_templates_causalcache`), falling back to
`Wait for the screen to update.` when a response cannot be parsed.

For a synthetic 6-step episode per platform (plus a final screenshot), every decision t = 1..7 (T = t - 1
completed steps, T = 0 included) and every budget B = 0..6 is rendered with Hugging Face's
`apply_chat_template` (Qwen3-VL Instruct template from `models/qwen3-vl-8b-instruct/chat_template.json`,
`add_generation_prompt=True`, no `tools=`) and tokenized with `models/qwen-vl-tokenizer`. `tests/protocol.rs`
checks that recall's renderer reproduces every text, image order and id list.

The sample episode is a synthetic GUI-Odyssey annotation with tiny PNGs drawn here with PIL, converted by
`tools/convert_odyssey.py`.

Usage (from the repository root):

    .venv-tools/bin/python tools/gen_protocol_fixtures.py
"""

from __future__ import annotations

import copy
import hashlib
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

import convert_odyssey  # noqa: E402

PROMPTS = ROOT / "src/memory/prompts"
TEMPLATE = ROOT / "models/qwen3-vl-8b-instruct/chat_template.json"
TOKENIZER = ROOT / "models/qwen-vl-tokenizer"
OUT = ROOT / "tests/fixtures/protocol/cases.json"
SAMPLE = ROOT / "tests/fixtures/episode-sample"

SHA256 = {
    "mobile": "a7b494381939614cb2e463b9380631bb249c79fd712e2cac5f1327b1a3faaa99",
    "desktop": "3898d407debf1dedf0f42d3271a7233593d7f81263718b02641b545f32480aa4",
}

FIRST = (
    "Please generate the next move according to the UI screenshot, instruction and previous actions."
    "\n\nInstruction: {goal}\n\nPrevious actions:\n{history}"
)
NPA = "No previous action."
DESKTOP_FALLBACK = "Wait for the screen to update."
RL_ALIASES = {
    "click": "left_click",
    "drag": "left_click_drag",
    "leftclick": "left_click",
    "doubleclick": "double_click",
    "rightclick": "right_click",
    "middleclick": "middle_click",
}


def mobile_call(arguments: dict) -> str:
    return json.dumps({"name": "mobile_use", "arguments": arguments}, ensure_ascii=False)


def desktop_call(arguments: dict) -> str:
    return json.dumps({"name": "computer_use", "arguments": arguments}, ensure_ascii=False)


MOBILE_EPISODE = {
    "instruction": "Set an alarm labelled “Réveil” for 7:00 in the Clock app.",
    "responses": [
        f"Action: Open the Clock app.\n<tool_call>\n{mobile_call({'action': 'open', 'text': 'Clock'})}\n</tool_call>",
        "Action: Tap the \"Alarm\" tab at the bottom.\n<tool_call>\n"
        f"{mobile_call({'action': 'click', 'coordinate': [180, 940]})}\n</tool_call>",
        "I see the alarm list.\nAction: first\nAction:   Swipe up to reveal more alarms.  \n<tool_call>\n"
        f"{mobile_call({'action': 'swipe', 'coordinate': [500, 800], 'coordinate2': [500, 200]})}\n</tool_call>",
        "Action: Type the label “Réveil 7h — café ☕”.\n<tool_call>\n"
        f"{mobile_call({'action': 'type', 'text': 'Réveil 7h — café ☕'})}\n</tool_call>",
        'Action: Press Back.\n<tool_call>\n{"arguments": {"button": "Back", "action": "system_button"}, '
        '"name": "mobile_use"}\n</tool_call>',
        f"Action: 完成任务。\n<tool_call>\n{mobile_call({'action': 'terminate', 'status': 'success'})}\n</tool_call>",
    ],
}

DESKTOP_EPISODE = {
    "instruction": "Save the open document as report.txt.",
    "responses": [
        "Action: Click the File menu.\n<tool_call>\n"
        f"{desktop_call({'action': 'click', 'coordinate': [120, 45]})}\n</tool_call>",
        "Action: Type the file name.\n<tool_call>\n"
        + desktop_call({"action": "type", "text": 'report "final".txt'})
        + "\n</tool_call>",
        f"Action: Save.\n<tool_call>\n{desktop_call({'action': 'key', 'keys': ['ctrl', 's']})}\n</tool_call>",
        # No closing tag: unparseable, so its fold line is the fallback.
        'Action: Scroll down.\n<tool_call>\n{"name": "computer_use", "arguments": {"action": "scroll", "pixels": -5}}',
        f"Action: Scroll down.\n<tool_call>\n{desktop_call({'action': 'scroll', 'pixels': -3})}\n</tool_call>",
        "Action: Give up.\n<tool_call>\n"
        f"{desktop_call({'action': 'terminate', 'status': 'failure'})}\n</tool_call>",
    ],
}


# ----- action lines -----------------------------------------------------------------------------------


def mobile_action_line(response: str) -> str:
    """gui_owl.py convert_format: text after the last 'Action:', before the next '<tool_call>', stripped."""
    return response.split("Action:")[-1].split("<tool_call>")[0].strip()


def desktop_action_line(response: str) -> str:
    """CausalCache render_official_action_line on the parsed computer_use call; fallback when unparseable."""
    try:
        if "<tool_call>" not in response or "</tool_call>" not in response:
            raise ValueError("missing tag")
        call = json.loads(response.split("<tool_call>")[-1].split("</tool_call>")[0].strip())
        args = dict(call["arguments"])
        action = RL_ALIASES.get(args["action"], args["action"])
        if action in ("left_click", "right_click", "middle_click", "double_click", "mouse_move"):
            x, y = args["coordinate"]
            verb = {
                "left_click": "Click at",
                "right_click": "Right-click at",
                "middle_click": "Middle-click at",
                "double_click": "Double-click at",
                "mouse_move": "Move the cursor to",
            }[action]
            return f"{verb} ({x}, {y})."
        if action == "left_click_drag":
            x2, y2 = args["coordinate2"]
            if "coordinate" in args:
                x, y = args["coordinate"]
                return f"Drag from ({x}, {y}) to ({x2}, {y2})."
            return f"Drag to ({x2}, {y2})."
        if action == "type":
            return f"Type {json.dumps(args['text'], ensure_ascii=False)}."
        if action == "key":
            return f"Press {'+'.join(args['keys'])}."
        if action == "scroll":
            return "Scroll up." if args["pixels"] > 0 else "Scroll down."
        if action == "hscroll":
            return "Scroll right." if args["pixels"] > 0 else "Scroll left."
        if action == "wait":
            return DESKTOP_FALLBACK
        if action == "terminate":
            return "Task completed." if args.get("status", "success") == "success" else "Task failed."
        if action == "answer":
            return f"Answer {json.dumps(args['text'], ensure_ascii=False)}."
    except (ValueError, KeyError, TypeError):
        pass
    return DESKTOP_FALLBACK


# ----- upstream rolling layout ------------------------------------------------------------------------


def text_part(t: str) -> dict:
    return {"type": "text", "text": t}


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def cut_current_messages(messages: list[dict], last_image: int) -> list[dict]:
    """Keep the images of the last `last_image` non-empty user turns; the first user turn (index 1)
    keeps its text part, older later user turns become empty."""
    non_empty = [i for i, m in enumerate(messages) if m.get("role") == "user" and m.get("content")]
    to_clear = non_empty[:-last_image] if len(non_empty) > last_image else []
    for i in to_clear:
        messages[i]["content"] = [messages[i]["content"][0]] if i == 1 else []
    return messages


def convert_format(goal: str, messages: list[dict], line_of) -> list[dict]:
    """Fold the responses that follow cleared user turns into a new first user turn, placed before the
    first user turn (after index 1) that still holds its image; keep everything from there on."""
    new_messages = copy.deepcopy(messages[:1])
    history = []
    for i, msg in enumerate(messages):
        content = msg.get("content")
        if msg.get("role") == "user" and (content == [] or (len(content) == 1 and content[0]["type"] == "text")):
            history.append(line_of(messages[i + 1]["content"][0]["text"]))
        if i != 1 and msg.get("role") == "user" and content != []:
            if not history:
                new_messages = copy.deepcopy(messages)
                new_messages[1]["content"][0]["text"] = FIRST.format(goal=goal, history=NPA)
                return new_messages
            history_string = "\n".join(f"Step{j + 1}: {h}" for j, h in enumerate(history))
            new_messages.append(
                {
                    "role": "user",
                    "content": [
                        text_part(FIRST.format(goal=goal, history=history_string)),
                        image_part(content[0]["image_url"]["url"]),
                    ],
                }
            )
            new_messages += copy.deepcopy(messages[i + 1 :])
            return new_messages
    return copy.deepcopy(messages)


def upstream_messages(system: str, goal: str, responses: list[str], images: list[str], t: int, b: int, line_of):
    """The input messages of decision t (1-based) with last_image = b + 1, replaying GUIOwl.step."""
    messages: list[dict] = []
    for step_idx in range(t):
        if step_idx == 0:
            messages = [
                {"role": "system", "content": [text_part(system)]},
                {"role": "user", "content": [text_part(FIRST.format(goal=goal, history=NPA)), image_part(images[0])]},
            ]
        else:
            messages.append({"role": "user", "content": [image_part(images[step_idx])]})
        messages = cut_current_messages(messages, b + 1)
        input_messages = convert_format(goal, messages, line_of)
        if step_idx == t - 1:
            return input_messages
        messages.append({"role": "assistant", "content": [text_part(responses[step_idx])]})
    raise AssertionError("unreachable")


def check_worked_example(system: str) -> None:
    """gui_owl_protocol.md section 3, Recent-2 (S = {4, 5}, decision 6)."""
    responses = [f"Action: <a{n}>\n<tool_call>\n{{}}\n</tool_call>" for n in range(1, 6)]
    images = [f"x{n}" for n in range(1, 7)]
    got = upstream_messages(system, "<goal>", responses, images, 6, 2, mobile_action_line)
    expected = [
        {"role": "system", "content": [text_part(system)]},
        {
            "role": "user",
            "content": [
                text_part(
                    "Please generate the next move according to the UI screenshot, instruction and previous "
                    "actions.\n\nInstruction: <goal>\n\nPrevious actions:\nStep1: <a1>\nStep2: <a2>\nStep3: <a3>"
                ),
                image_part("x4"),
            ],
        },
        {"role": "assistant", "content": [text_part(responses[3])]},
        {"role": "user", "content": [image_part("x5")]},
        {"role": "assistant", "content": [text_part(responses[4])]},
        {"role": "user", "content": [image_part("x6")]},
    ]
    assert got == expected, f"worked example mismatch:\n{json.dumps(got, indent=1)}"
    # B = 0 is the single-turn prompt; T = 0 is [system, user(FIRST(NPA), x1)] for any B.
    single = upstream_messages(system, "<goal>", responses, images, 6, 0, mobile_action_line)
    assert len(single) == 2 and single[1]["content"][0]["text"].endswith("Step5: <a5>")
    for b in range(0, 4):
        first = upstream_messages(system, "<goal>", responses, images, 1, b, mobile_action_line)
        assert len(first) == 2 and first[1]["content"][0]["text"].endswith(NPA)


# ----- sample episode ---------------------------------------------------------------------------------


def draw_screen(path: Path, color: tuple[int, int, int], mark: tuple[int, int]) -> None:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (36, 64), color)
    draw = ImageDraw.Draw(img)
    draw.rectangle([0, 0, 35, 5], fill=(30, 30, 30))  # status bar
    x, y = mark
    draw.ellipse([x - 3, y - 3, x + 3, y + 3], fill=(250, 250, 250))
    img.save(path, format="PNG")


def write_sample_episode() -> None:
    annotation = {
        "episode_id": "sample-0001",
        "device_info": {"product": "synthetic", "h": 64, "w": 36, "device_name": "Small Phone"},
        "task_info": {
            "category": "General_Tool",
            "app": ["Clock"],
            "instruction": "Open the Clock app, add a note “café ☕” and go back.",
        },
        "step_length": 6,
        "steps": [
            {"step": 0, "screenshot": "s0.png", "action": "CLICK", "info": [[500, 100]], "ps": ""},
            {"step": 1, "screenshot": "s1.png", "action": "TEXT", "info": "café ☕", "ps": ""},
            {"step": 2, "screenshot": "s2.png", "action": "SCROLL", "info": [[500, 800], [500, 200]], "ps": ""},
            {"step": 3, "screenshot": "s3.png", "action": "LONG_PRESS", "info": [[250, 1000]], "ps": ""},
            {"step": 4, "screenshot": "s4.png", "action": "CLICK", "info": "KEY_BACK", "ps": ""},
            {"step": 5, "screenshot": "s5.png", "action": "COMPLETE", "info": "", "ps": "done"},
        ],
    }
    colors = [(200, 60, 60), (60, 200, 60), (60, 60, 200), (200, 200, 60), (60, 200, 200), (200, 60, 200)]
    with tempfile.TemporaryDirectory() as tmp:
        shots = Path(tmp)
        for i, color in enumerate(colors):
            draw_screen(shots / f"s{i}.png", color, (6 + 4 * i, 20 + 6 * i))
        for old in SAMPLE.glob("*"):
            old.unlink()
        convert_odyssey.convert(annotation, shots, SAMPLE)
    print(f"wrote the sample episode to {SAMPLE}")


# ----- fixtures ---------------------------------------------------------------------------------------


def main() -> None:
    import transformers
    from transformers import PreTrainedTokenizerFast

    systems = {}
    for platform in ("mobile", "desktop"):
        data = (PROMPTS / f"gui_owl_{platform}_system.txt").read_bytes()
        assert hashlib.sha256(data).hexdigest() == SHA256[platform], f"{platform} system prompt sha256"
        systems[platform] = data.decode("utf-8")
    check_worked_example(systems["mobile"])

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER / "tokenizer.json"))
    template = json.loads(TEMPLATE.read_text())["chat_template"]

    episodes = {}
    cases = []
    for platform, episode, line_of in (
        ("mobile", MOBILE_EPISODE, mobile_action_line),
        ("desktop", DESKTOP_EPISODE, desktop_action_line),
    ):
        responses = episode["responses"]
        images = [f"{platform}/x{n}.png" for n in range(1, len(responses) + 2)]
        episodes[platform] = {
            "instruction": episode["instruction"],
            "steps": [{"screenshot": images[i], "response": r} for i, r in enumerate(responses)],
            "final_screenshot": images[-1],
            "action_lines": [line_of(r) for r in responses],
        }
        for t in range(1, len(responses) + 2):
            for b in range(0, 7):
                messages = upstream_messages(
                    systems[platform], episode["instruction"], responses, images, t, b, line_of
                )
                text = tokenizer.apply_chat_template(
                    messages, chat_template=template, tokenize=False, add_generation_prompt=True
                )
                ids = tokenizer.encode(text, add_special_tokens=False)
                shown = [
                    part["image_url"]["url"]
                    for m in messages
                    if m["role"] == "user"
                    for part in m["content"]
                    if part["type"] == "image_url"
                ]
                cases.append(
                    {
                        "platform": platform,
                        "t": t,
                        "T": t - 1,
                        "B": b,
                        "last_image": b + 1,
                        "allocation": list(range(max(1, t - b), t)),
                        "n_messages": len(messages),
                        "images": shown,
                        "text": text,
                        "ids": ids,
                    }
                )

    doc = {
        "generator": "tools/gen_protocol_fixtures.py",
        "transformers_version": transformers.__version__,
        "tokenizer": str(TOKENIZER.relative_to(ROOT)),
        "template": str(TEMPLATE.relative_to(ROOT)),
        "episodes": episodes,
        "cases": cases,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({k: v for k, v in doc.items() if k != "cases"}, ensure_ascii=False)[:-1] + ', "cases": [']
    lines.append(",\n".join(json.dumps(c, ensure_ascii=False) for c in cases))
    lines.append("]}")
    OUT.write_text("\n".join(lines) + "\n")
    json.loads(OUT.read_text())
    print(f"wrote {len(cases)} cases to {OUT}")

    write_sample_episode()


if __name__ == "__main__":
    main()
