#!/usr/bin/env python3
"""Convert GUI-Odyssey annotations into recall episode directories (docs/FORMATS.md).

GUI-Odyssey (OpenGVLab/GUI-Odyssey, `introduction.md` and `data/format_converter.py`) ships one JSON per
episode under `annotations/` and the screenshots under `screenshots/`. The fields used here:

* `task_info.instruction` -> the episode's `instruction` (platform `mobile`).
* `steps[i].screenshot` (a file name in the screenshots directory): the screen the annotator acted on at
  step i+1, i.e. `x_s`. It is copied (or symlinked with `--link`) into the episode directory.
* `steps[i].action` / `steps[i].info`: the annotated action. Coordinates are normalised to [0, 1000];
  they are mapped to GUI-Owl's 0-999 grid by `g = min(999, round(v * 999 / 1000))`.

Mapping to `mobile_use` tool calls (the action line is synthesised, since GUI-Odyssey has no free text):

| GUI-Odyssey action | info | tool-call arguments | action line |
| --- | --- | --- | --- |
| CLICK | [[x, y]] | {"action": "click", "coordinate": [x, y]} | Click at (x, y). |
| LONG_PRESS | [[x, y]] | {"action": "long_press", "coordinate": [x, y]} | Long press at (x, y). |
| CLICK / LONG_PRESS | KEY_BACK, KEY_HOME | {"action": "system_button", "button": "Back"/"Home"} | Press the Back/Home button. |
| CLICK / LONG_PRESS | KEY_APPSELECT | {"action": "system_button", "button": "Menu"} | Press the Menu button. |
| BACK, HOME | "" | {"action": "system_button", "button": "Back"/"Home"} | Press the Back/Home button. |
| SCROLL | [[x1, y1], [x2, y2]] | {"action": "swipe", "coordinate": [x1, y1], "coordinate2": [x2, y2]} | Swipe from (x1, y1) to (x2, y2). |
| TEXT, TYPE | the text | {"action": "type", "text": text} | Type "text". (json.dumps, ensure_ascii=False) |
| COMPLETE | "" | {"action": "terminate", "status": "success"} | Task completed. |
| INCOMPLETE, IMPOSSIBLE | "" | {"action": "terminate", "status": "failure"} | Task failed. |

`KEY_APPSELECT` (the recent-apps key) becomes `Menu`, the prompt's "application background menu" button;
CausalCache's canonical set rejects `Menu`, so recall's `parse_response` reports such a step as a parse
error (the step still enters the history with its action line). Mobile `terminate/failure` is likewise
coerced to success by the canonicaliser (and recorded). Any other action or info is an error naming the
episode and step.

The response is `Action: {line}\\n<tool_call>\\n{json.dumps({"name": "mobile_use", "arguments": args},
ensure_ascii=False)}\\n</tool_call>`, GUI-Owl's trained format. GUI-Odyssey records no screen after the last
step, so `final_screenshot` is omitted. The original fields are kept under `meta`.

Usage:

    .venv-tools/bin/python tools/convert_odyssey.py data/annotations/*.json \\
        --screenshots data/screenshots --out episodes/ [--link]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

EPISODE_FORMAT = "recall.episode/1"
KEY_BUTTONS = {"KEY_BACK": "Back", "KEY_HOME": "Home", "KEY_APPSELECT": "Menu"}


def to_grid(v) -> int:
    """GUI-Odyssey's [0, 1000] normalised value -> GUI-Owl's 0..999 integer grid."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"coordinate component {v!r} is not a number")
    if not 0 <= v <= 1000:
        raise ValueError(f"coordinate component {v!r} is outside [0, 1000]")
    return min(999, round(v * 999 / 1000))


def _point(p) -> list[int]:
    if not isinstance(p, (list, tuple)) or len(p) != 2:
        raise ValueError(f"expected a point [x, y], got {p!r}")
    return [to_grid(p[0]), to_grid(p[1])]


def _single_point(info) -> list[int]:
    # format_converter.py reads info[0]: the point is wrapped in a list ([[x, y]]); accept [x, y] too.
    if isinstance(info, (list, tuple)) and len(info) == 1:
        return _point(info[0])
    return _point(info)


def map_action(action: str, info) -> tuple[dict, str]:
    """(mobile_use arguments, action line) for one GUI-Odyssey step."""
    if action in ("CLICK", "LONG_PRESS"):
        if isinstance(info, str):
            if info not in KEY_BUTTONS:
                raise ValueError(f"unknown key {info!r}")
            button = KEY_BUTTONS[info]
            return {"action": "system_button", "button": button}, f"Press the {button} button."
        x, y = _single_point(info)
        if action == "CLICK":
            return {"action": "click", "coordinate": [x, y]}, f"Click at ({x}, {y})."
        return {"action": "long_press", "coordinate": [x, y]}, f"Long press at ({x}, {y})."
    if action in ("BACK", "HOME"):
        button = action.capitalize()
        return {"action": "system_button", "button": button}, f"Press the {button} button."
    if action == "SCROLL":
        if not isinstance(info, (list, tuple)) or len(info) != 2:
            raise ValueError(f"SCROLL needs [[x1, y1], [x2, y2]], got {info!r}")
        (x, y), (x2, y2) = _point(info[0]), _point(info[1])
        return (
            {"action": "swipe", "coordinate": [x, y], "coordinate2": [x2, y2]},
            f"Swipe from ({x}, {y}) to ({x2}, {y2}).",
        )
    if action in ("TEXT", "TYPE"):
        if not isinstance(info, str):
            raise ValueError(f"{action} needs a string, got {info!r}")
        return {"action": "type", "text": info}, f"Type {json.dumps(info, ensure_ascii=False)}."
    if action == "COMPLETE":
        return {"action": "terminate", "status": "success"}, "Task completed."
    if action in ("INCOMPLETE", "IMPOSSIBLE"):
        return {"action": "terminate", "status": "failure"}, "Task failed."
    raise ValueError(f"unknown action {action!r}")


def make_response(line: str, arguments: dict) -> str:
    call = json.dumps({"name": "mobile_use", "arguments": arguments}, ensure_ascii=False)
    return f"Action: {line}\n<tool_call>\n{call}\n</tool_call>"


def convert(annotation: dict, screenshots: Path, out_dir: Path, link: bool = False) -> dict:
    """Writes `out_dir/episode.json` and the step screenshots; returns the episode document."""
    episode_id = str(annotation.get("episode_id", out_dir.name))
    try:
        instruction = annotation["task_info"]["instruction"]
    except (KeyError, TypeError) as e:
        raise ValueError(f"episode {episode_id}: missing task_info.instruction") from e
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = []
    for i, step in enumerate(annotation.get("steps", [])):
        where = f"episode {episode_id} steps[{i}]"
        try:
            arguments, line = map_action(step["action"], step.get("info", ""))
        except (KeyError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from e
        src = screenshots / step["screenshot"]
        if not src.is_file():
            raise ValueError(f"{where}: screenshot {src} does not exist")
        name = f"step{i + 1:03d}{src.suffix or '.png'}"
        dst = out_dir / name
        if dst.exists() or dst.is_symlink():
            dst.unlink()
        if link:
            os.symlink(src.resolve(), dst)
        else:
            shutil.copyfile(src, dst)
        steps.append(
            {
                "screenshot": name,
                "response": make_response(line, arguments),
                "meta": {
                    "odyssey_step": step.get("step", i),
                    "odyssey_screenshot": step["screenshot"],
                    "odyssey_action": step["action"],
                    "odyssey_info": step.get("info", ""),
                },
            }
        )
    doc = {
        "format": EPISODE_FORMAT,
        "instruction": instruction,
        "platform": "mobile",
        "steps": steps,
        "meta": {
            "source": "GUI-Odyssey",
            "episode_id": episode_id,
            "device_info": annotation.get("device_info"),
            "task_info": annotation.get("task_info"),
        },
    }
    (out_dir / "episode.json").write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    return doc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("annotations", nargs="+", type=Path, help="GUI-Odyssey annotation JSON files")
    parser.add_argument("--screenshots", type=Path, required=True, help="the GUI-Odyssey screenshots directory")
    parser.add_argument("--out", type=Path, required=True, help="output root; one directory per episode")
    parser.add_argument("--link", action="store_true", help="symlink the screenshots instead of copying them")
    args = parser.parse_args()
    for path in args.annotations:
        annotation = json.loads(path.read_text())
        episode_id = str(annotation.get("episode_id", path.stem))
        doc = convert(annotation, args.screenshots, args.out / episode_id, link=args.link)
        print(f"{path} -> {args.out / episode_id} ({len(doc['steps'])} steps)")


if __name__ == "__main__":
    main()
