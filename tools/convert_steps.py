#!/usr/bin/env python3
"""Convert AndroidControl-, GUI-Odyssey- and AITW-style step records into recall's step JSONL.

The output format (one decision step per line; `src/agent/dataset.rs`, docs/EVAL.md):

    {"episode": id, "step": i (0-based), "subset": name or null, "instruction": goal,
     "platform": "mobile", "screenshots": [the last --images screens up to the current one, current last],
     "history": [the i previous reference responses], "reference": response, "target_box": [x0, y0, x1, y1]
     (AITW taps only), "meta": {source fields}}

Every reference is GUI-Owl's trained response format, `Action: {line}\\n<tool_call>\\n{json}\\n</tool_call>`,
with a synthesised action line (the datasets carry no free text for it). Screenshot paths are written
relative to the output file's directory. Steps whose reference has no canonical `mobile_use` action
(GUI-Odyssey's KEY_APPSELECT -> Menu) are left out of the evaluated steps but stay in later steps'
history; the count is printed.

Sources (field names as the datasets publish them):

* androidcontrol: google-research `android_control/README.md`. The TFRecords hold `episode_id`, `goal`,
  `screenshots` (PNG bytes), `screenshot_widths`, `screenshot_heights`, `actions` (JSON strings, one per
  consecutive screenshot pair: len(screenshots) - 1 of them) and `step_instructions`. Input here: a JSON
  file (one episode object, or a list of them) or JSONL (one episode per line) with the same fields, the
  `screenshots` replaced by image paths relative to the input file (export them from the TFRecord once).
  Pixel coordinates go to the grid with `round(px * 999 / (W - 1))`, the inverse of the protocol's
  `round(v / 999 * (W - 1))`, with W (H) the step's screenshot width (height).
* odyssey: OpenGVLab/GUI-Odyssey annotations (`task_info.instruction`, `steps[].screenshot/action/info`),
  mapped exactly as tools/convert_odyssey.py does (imported from it); `--screenshots` is the image directory.
* aitw: either SeeClick's processed test file (`{"general": [[step, ...], ...], "install": ...}` with
  `img_filename`, `goal`, `action_type_id`, `action_type_text`, `touch`/`lift` as normalised [x, y],
  `type_text`, `annot_position` as flattened normalised (y, x, h, w)), the top-level key becoming the
  subset, or raw AITW TFRecord features dumped to JSONL, one step per line (`episode_id`, `step_id`,
  `goal_info`, `results/action_type`, `results/yx_touch`, `results/yx_lift` (normalised [y, x]),
  `results/type_action`, `image/ui_annotations_positions`, plus `image_path` and an optional `subset`).
  Images resolve against `--images-dir` (SeeClick: `{img_filename}.png`).

Action mapping (grid = the 0-999 integers GUI-Owl predicts):

| source | action | mobile_use arguments |
| --- | --- | --- |
| AndroidControl | click / long_press {x, y} | click / long_press at the grid point |
| AndroidControl | scroll {direction} | swipe along the direction's axis (below) |
| AndroidControl | open_app {app_name} | open, text = app_name |
| AndroidControl | input_text {text}; type {x, y, text} | type, text (type's click and enter are dropped) |
| AndroidControl | navigate_home / navigate_back | system_button Home / Back |
| AndroidControl | wait | wait |
| AITW | DUAL_POINT (4), |touch - lift| <= 0.04 | click at the touch point |
| AITW | DUAL_POINT (4), otherwise | swipe along the main axis of lift - touch (below) |
| AITW | TYPE (3) | type, text |
| AITW | PRESS_BACK / PRESS_HOME / PRESS_ENTER (5/6/7) | system_button Back / Home / Enter |
| AITW | STATUS_TASK_COMPLETE / STATUS_TASK_IMPOSSIBLE (10/11) | terminate success / failure |

Scrolls are normalised as AITW's scorer does (direction only): the finger moves between 0.2 and 0.8 of
the screen on the main axis at its middle on the other, i.e. grid 200 / 799 / 500. "scroll down" (content
moves to reveal what is below) is a finger moving up: swipe (500, 799) -> (500, 200); up: (500, 200) ->
(500, 799); right: (799, 500) -> (200, 500); left: (200, 500) -> (799, 500). AITW's DUAL_POINT swipes get
the direction of the finger's movement. AITW taps get a `target_box`: the smallest UI-annotation box
containing the touch point (inclusive, unaugmented), `[floor(x*999), floor(y*999), ceil((x+w)*999),
ceil((y+h)*999)]` clamped to 999; none when no box contains it.

Usage:

    .venv-tools/bin/python tools/convert_steps.py androidcontrol episodes.jsonl --out steps.jsonl
    .venv-tools/bin/python tools/convert_steps.py odyssey annotations/*.json --screenshots screenshots \\
        --out steps.jsonl
    .venv-tools/bin/python tools/convert_steps.py aitw aitw_data_test.json --images-dir aitw_images \\
        --out steps.jsonl
    options: --images N (screenshots per step, current included; default 3), --subset NAME,
             --no-check (do not require the images to exist)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import convert_odyssey  # noqa: E402

SWIPES = {  # finger movement per scroll direction (content direction), grid coordinates
    "down": ([500, 799], [500, 200]),
    "up": ([500, 200], [500, 799]),
    "right": ([799, 500], [200, 500]),
    "left": ([200, 500], [799, 500]),
}
TAP_DISTANCE = 0.04  # AITW: a dual-point gesture shorter than this (normalised) is a tap


class ConvertError(ValueError):
    pass


def px_to_grid(px, size) -> int:
    """A pixel coordinate on an axis of `size` pixels -> the 0..999 grid (inverse of round(v/999*(size-1)))."""
    if isinstance(px, bool) or not isinstance(px, (int, float)):
        raise ConvertError(f"coordinate {px!r} is not a number")
    if not isinstance(size, int) or size < 2:
        raise ConvertError(f"screen size {size!r} is not an integer >= 2")
    return min(999, max(0, round(px * 999 / (size - 1))))


def norm_to_grid(v) -> int:
    """A normalised [0, 1] coordinate -> the 0..999 grid."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConvertError(f"coordinate {v!r} is not a number")
    return min(999, max(0, round(v * 999)))


def action_line(args: dict) -> str:
    """The synthesised action line (same wording as tools/convert_odyssey.py)."""
    a = args["action"]
    if a == "click":
        return "Click at ({}, {}).".format(*args["coordinate"])
    if a == "long_press":
        return "Long press at ({}, {}).".format(*args["coordinate"])
    if a == "swipe":
        return "Swipe from ({}, {}) to ({}, {}).".format(*args["coordinate"], *args["coordinate2"])
    if a == "type":
        return f"Type {json.dumps(args['text'], ensure_ascii=False)}."
    if a == "open":
        return f"Open {json.dumps(args['text'], ensure_ascii=False)}."
    if a == "system_button":
        return f"Press the {args['button']} button."
    if a == "wait":
        return "Wait."
    if a == "terminate":
        return "Task completed." if args["status"] == "success" else "Task failed."
    raise ConvertError(f"no action line for {a!r}")


def response(args: dict, line: str | None = None) -> str:
    return convert_odyssey.make_response(line if line is not None else action_line(args), args)


def swipe(direction: str) -> dict:
    if direction not in SWIPES:
        raise ConvertError(f"unknown scroll direction {direction!r} (up, down, left, right)")
    a, b = SWIPES[direction]
    return {"action": "swipe", "coordinate": list(a), "coordinate2": list(b)}


# ---------------------------------------------------------------------------------------------- AndroidControl


def androidcontrol_action(action, width, height) -> dict:
    if isinstance(action, str):
        action = json.loads(action)
    t = action.get("action_type")
    if t in ("click", "long_press"):
        return {"action": t, "coordinate": [px_to_grid(action["x"], width), px_to_grid(action["y"], height)]}
    if t == "scroll":
        return swipe(action.get("direction"))
    if t == "open_app":
        return {"action": "open", "text": action["app_name"]}
    if t in ("input_text", "type"):
        return {"action": "type", "text": action["text"]}
    if t == "navigate_home":
        return {"action": "system_button", "button": "Home"}
    if t == "navigate_back":
        return {"action": "system_button", "button": "Back"}
    if t == "wait":
        return {"action": "wait"}
    raise ConvertError(f"unknown action_type {t!r}")


def read_episodes(path: Path) -> list[dict]:
    text = path.read_text()
    try:
        doc = json.loads(text)
        return doc if isinstance(doc, list) else [doc]
    except json.JSONDecodeError:
        return [json.loads(line) for line in text.splitlines() if line.strip()]


def androidcontrol_episodes(path: Path):
    """Yields (episode id, subset, instruction, steps) with steps = [(image, arguments, target_box, meta)]."""
    for ep in read_episodes(path):
        eid = str(ep["episode_id"])
        actions, shots = ep["actions"], ep["screenshots"]
        if len(shots) not in (len(actions), len(actions) + 1):
            raise ConvertError(f"episode {eid}: {len(shots)} screenshots for {len(actions)} actions")
        instr = ep.get("step_instructions") or [None] * len(actions)
        steps = []
        for i, action in enumerate(actions):
            try:
                args = androidcontrol_action(action, ep["screenshot_widths"][i], ep["screenshot_heights"][i])
            except (KeyError, IndexError, ConvertError, json.JSONDecodeError) as e:
                raise ConvertError(f"episode {eid} actions[{i}]: {e!r}") from e
            meta = {"source": "AndroidControl", "action": action, "step_instruction": instr[i]}
            steps.append((path.parent / shots[i], args, None, meta))
        yield eid, ep.get("subset"), ep["goal"], steps


# ---------------------------------------------------------------------------------------------- GUI-Odyssey


def odyssey_episodes(path: Path, screenshots: Path):
    ann = json.loads(path.read_text())
    eid = str(ann.get("episode_id", path.stem))
    steps = []
    for i, st in enumerate(ann.get("steps", [])):
        try:
            args, line = convert_odyssey.map_action(st["action"], st.get("info", ""))
        except (KeyError, ValueError) as e:
            raise ConvertError(f"episode {eid} steps[{i}]: {e}") from e
        meta = {"source": "GUI-Odyssey", "action": st["action"], "info": st.get("info", ""),
                "category": (ann.get("task_info") or {}).get("category")}
        steps.append((screenshots / st["screenshot"], args, None, meta, line))
    yield eid, None, ann["task_info"]["instruction"], steps


# ---------------------------------------------------------------------------------------------- AITW


def smallest_box(yx, positions):
    """The smallest (y, x, h, w) box (normalised, flattened list) containing point yx, as a grid box."""
    if not positions:
        return None
    if len(positions) % 4:
        raise ConvertError(f"annotation positions of length {len(positions)} is not a multiple of 4")
    y, x = yx
    best = None
    for k in range(0, len(positions), 4):
        by, bx, bh, bw = positions[k:k + 4]
        if by <= y <= by + bh and bx <= x <= bx + bw and (best is None or bh * bw < best[2] * best[3]):
            best = (by, bx, bh, bw)
    if best is None:
        return None
    by, bx, bh, bw = best
    return [max(0, math.floor(bx * 999)), max(0, math.floor(by * 999)),
            min(999, math.ceil((bx + bw) * 999)), min(999, math.ceil((by + bh) * 999))]


def aitw_action(kind, touch_yx, lift_yx, text, positions):
    """(arguments, target_box) for one AITW step; points are normalised (y, x)."""
    if kind == 4:
        dy, dx = lift_yx[0] - touch_yx[0], lift_yx[1] - touch_yx[1]
        if math.hypot(dy, dx) <= TAP_DISTANCE:
            point = [norm_to_grid(touch_yx[1]), norm_to_grid(touch_yx[0])]
            return {"action": "click", "coordinate": point}, smallest_box(touch_yx, positions)
        if abs(dy) >= abs(dx):
            return swipe("down" if dy < 0 else "up"), None  # finger up = content scrolls down
        return swipe("right" if dx < 0 else "left"), None
    if kind == 3:
        return {"action": "type", "text": text}, None
    buttons = {5: "Back", 6: "Home", 7: "Enter"}
    if kind in buttons:
        return {"action": "system_button", "button": buttons[kind]}, None
    if kind in (10, 11):
        return {"action": "terminate", "status": "success" if kind == 10 else "failure"}, None
    raise ConvertError(f"unknown AITW action type {kind!r}")


def aitw_episodes(path: Path, images: Path):
    text = path.read_text()
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        doc = [json.loads(line) for line in text.splitlines() if line.strip()]
    if isinstance(doc, dict):  # SeeClick: {subset: [[step, ...], ...]}
        for subset, episodes in doc.items():
            for episode in episodes:
                steps, eid, goal = [], None, None
                for i, st in enumerate(episode):
                    eid, goal = str(st["ep_id"]), st["goal"]
                    touch = [st["touch"][1], st["touch"][0]] if st.get("touch") else [-1.0, -1.0]
                    lift = [st["lift"][1], st["lift"][0]] if st.get("lift") else [-1.0, -1.0]
                    try:
                        args, box = aitw_action(st["action_type_id"], touch, lift, st.get("type_text", ""),
                                                st.get("annot_position") or [])
                    except (KeyError, ConvertError) as e:
                        raise ConvertError(f"{subset} episode {eid} step {i}: {e}") from e
                    meta = {"source": "AITW", "action_type_id": st["action_type_id"],
                            "action_type_text": st.get("action_type_text")}
                    steps.append((images / (st["img_filename"] + ".png"), args, box, meta))
                if steps:
                    yield eid, subset, goal, steps
        return
    # raw TFRecord features, one step per line, grouped by episode in order of step_id
    by_episode: dict[str, list] = {}
    for rec in doc:
        by_episode.setdefault(str(rec["episode_id"]), []).append(rec)
    for eid, recs in by_episode.items():
        recs.sort(key=lambda r: r["step_id"])
        steps = []
        for rec in recs:
            try:
                args, box = aitw_action(rec["results/action_type"], rec["results/yx_touch"],
                                        rec["results/yx_lift"], rec.get("results/type_action", ""),
                                        rec.get("image/ui_annotations_positions") or [])
            except (KeyError, ConvertError) as e:
                raise ConvertError(f"episode {eid} step_id {rec.get('step_id')}: {e}") from e
            meta = {"source": "AITW", "action_type": rec["results/action_type"], "step_id": rec["step_id"]}
            steps.append((images / rec["image_path"], args, box, meta))
        yield eid, recs[0].get("subset"), recs[0]["goal_info"], steps


# ---------------------------------------------------------------------------------------------- output


def step_lines(eid, subset, instruction, steps, out_dir: Path, images: int, check: bool):
    """The JSONL records of one episode and the number of steps left out (no canonical action)."""
    shots, responses, records, skipped = [], [], [], 0
    for i, st in enumerate(steps):
        image, args, box, meta = st[:4]
        line = st[4] if len(st) > 4 else None
        if check and not Path(image).is_file():
            raise ConvertError(f"episode {eid} step {i}: screenshot {image} does not exist")
        shots.append(os.path.relpath(Path(image).resolve(), out_dir.resolve()))
        resp = response(args, line)
        if args.get("action") == "system_button" and args.get("button") == "Menu":
            skipped += 1  # no canonical mobile action: not a scorable reference
        else:
            rec = {"episode": eid, "step": i, "subset": subset, "instruction": instruction, "platform": "mobile",
                   "screenshots": shots[max(0, i + 1 - images):], "history": list(responses),
                   "reference": resp}
            if box is not None:
                rec["target_box"] = box
            rec["meta"] = meta
            records.append(rec)
        responses.append(resp)
    return records, skipped


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", choices=["androidcontrol", "odyssey", "aitw"])
    p.add_argument("inputs", nargs="+", type=Path)
    p.add_argument("--out", type=Path, required=True, help="the output JSONL file")
    p.add_argument("--screenshots", type=Path, help="odyssey: the screenshots directory")
    p.add_argument("--images-dir", type=Path, help="aitw: the images directory")
    p.add_argument("--images", type=int, default=3, help="screenshots per step, the current one included")
    p.add_argument("--subset", help="subset name for every step (overrides the source's)")
    p.add_argument("--no-check", action="store_true", help="do not require the screenshots to exist")
    a = p.parse_args(argv)
    if a.images < 1:
        p.error("--images must be >= 1")
    out_dir = a.out.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    total = skipped = 0
    with open(a.out, "w") as f:
        for path in a.inputs:
            if a.source == "androidcontrol":
                episodes = androidcontrol_episodes(path)
            elif a.source == "odyssey":
                if a.screenshots is None:
                    p.error("odyssey needs --screenshots")
                episodes = odyssey_episodes(path, a.screenshots)
            else:
                episodes = aitw_episodes(path, a.images_dir or path.parent)
            for eid, subset, instruction, steps in episodes:
                records, n = step_lines(eid, a.subset or subset, instruction, steps, out_dir, a.images,
                                        not a.no_check)
                skipped += n
                for rec in records:
                    f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                total += len(records)
    print(f"{a.out}: {total} steps ({skipped} left out: no canonical action)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ConvertError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
