#!/usr/bin/env python3
"""Convert AndroidControl-, GUI-Odyssey- and AITW-style step records into recall's step JSONL.

The output format (one decision step per line; `src/agent/dataset.rs`, docs/EVAL.md):

    {"episode": id, "step": i (0-based), "subset": name or null, "instruction": goal,
     "platform": "mobile", "screenshots": [the last --images screens up to the current one, current last],
     "history": [the i previous reference responses], "reference": response,
     "target_box": [x0, y0, x1, y1] (AITW and GUI-Odyssey taps), "ui_annotations": [[y, x, h, w], ...] (AITW),
     "candidate_boxes": [[x0, y0, x1, y1], ...] (AndroidControl), "meta": {source fields}}

The box fields are what the benchmark scorers (`recall eval --scorer`, docs/EVAL.md "Benchmark scorers")
need; each is written only when the source has it (see "Boxes" below).

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
  Optional, for the `androidcontrol` scorer's candidate boxes: `step_check_pams` (one object per action,
  as the Qwen2.5-VL team's / InfiGUI-R1's preprocessed test set has them; only `action` and
  `candidate_bbox`, pixel [x0, y0, x1, y1] boxes, are read) or `accessibility_trees` (one per screenshot,
  each the JSON form of android_env's AndroidAccessibilityForest proto, `json_format.MessageToDict`).
  Pixel coordinates go to the grid with `round(px * 999 / (W - 1))`, the inverse of the protocol's
  `round(v / 999 * (W - 1))`, with W (H) the step's screenshot width (height).
* odyssey: OpenGVLab/GUI-Odyssey annotations (`task_info.instruction`, `steps[].screenshot/action/info`,
  and in the latest release `steps[].sam2_bbox`, the clicked element's [x1, y1, x2, y2] on 0-1000),
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
the direction of the finger's movement.

Boxes:

* AITW: every step with annotations gets `ui_annotations`, the screen's `annot_position` /
  `image/ui_annotations_positions` regrouped into [y, x, h, w] rows, values unchanged (fractions of the
  screen, as `check_actions_match` takes them). Taps also get a `target_box` (recall's own rule, not
  AITW's): the smallest annotation box containing the touch point (inclusive, unaugmented),
  `[floor(x*999), floor(y*999), ceil((x+w)*999), ceil((y+h)*999)]` clamped to 999; none when no box
  contains it.
* AndroidControl: click, long_press and open_app steps get `candidate_boxes`, each pixel box as
  `[x0*999/W, y0*999/H, x1*999/W, y1*999/H]` (W, H the screenshot's size; fractional, clamped to
  [0, 999]), so that box / 999 is the fraction the Qwen scorer computes (pixels / W, H). From
  `step_check_pams[i].candidate_bbox` when given; otherwise, for click and long_press only, the smallest
  (by area, positive) node of `accessibility_trees[i]` whose `bounds_in_screen` contain the action's
  point (an approximation of the preprocessing, which is not published).
* GUI-Odyssey: click and long_press steps with a `sam2_bbox` get it as `target_box`:
  `[ceil(x1*999/1000), ceil(y1*999/1000), floor(x2*999/1000), floor(y2*999/1000)]` clamped to the grid,
  exactly the grid points g whose g*1000/999 lies in the box (the scorer's test); none when that set is
  empty.

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
from fractions import Fraction
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


def pixel_box_to_grid(box, width, height) -> list[float]:
    """A pixel [x0, y0, x1, y1] box -> the grid, as fractions of the screen (pixels / W, H) times 999."""
    if not isinstance(box, list) or len(box) != 4 or not all(is_number(v) for v in box):
        raise ConvertError(f"box {box!r} is not [x0, y0, x1, y1]")
    x0, y0, x1, y1 = box
    if x0 > x1 or y0 > y1:
        raise ConvertError(f"box {box!r} needs x0 <= x1 and y0 <= y1")
    clamp = lambda v: min(999.0, max(0.0, v))  # noqa: E731
    return [clamp(x0 * 999 / width), clamp(y0 * 999 / height), clamp(x1 * 999 / width), clamp(y1 * 999 / height)]


def check_pam_boxes(check_pam, args) -> list:
    """`candidate_bbox` (pixels) of a preprocessed step: a list of boxes, or one bare box."""
    if not isinstance(check_pam, dict):
        raise ConvertError(f"step_check_pams entry {check_pam!r} is not an object")
    if "action" in check_pam and check_pam["action"] != args["action"]:
        raise ConvertError(f"step_check_pams action {check_pam['action']!r} is not the step's {args['action']!r}")
    boxes = check_pam.get("candidate_bbox") or []
    if len(boxes) == 4 and all(is_number(v) for v in boxes):
        return [boxes]
    return boxes


def forest_nodes(forest):
    """The nodes of an AndroidAccessibilityForest in JSON form (either field-name style)."""
    for window in (forest or {}).get("windows", []):
        yield from ((window.get("tree") or {}).get("nodes", []))


def smallest_node_box(forest, x, y):
    """Pixel bounds of the smallest positive-area node containing (x, y), inclusive; None if none does."""
    best = None
    for node in forest_nodes(forest):
        r = node.get("bounds_in_screen", node.get("boundsInScreen")) or {}
        left, top, right, bottom = (r.get(k, 0) for k in ("left", "top", "right", "bottom"))  # proto3: 0 omitted
        area = (right - left) * (bottom - top)
        if right > left and bottom > top and left <= x <= right and top <= y <= bottom:
            if best is None or area < best[0]:
                best = (area, [left, top, right, bottom])
    return None if best is None else best[1]


def androidcontrol_boxes(ep, i, action, args, width, height) -> list:
    """The step's candidate boxes on the grid (docstring: "Boxes")."""
    if args["action"] not in ("click", "long_press", "open"):
        return []
    pams = ep.get("step_check_pams")
    if pams is not None:
        boxes = check_pam_boxes(pams[i], args)
    elif ep.get("accessibility_trees") is not None and args["action"] != "open":
        action = json.loads(action) if isinstance(action, str) else action
        box = smallest_node_box(ep["accessibility_trees"][i], action["x"], action["y"])
        boxes = [box] if box else []
    else:
        return []
    return [pixel_box_to_grid(b, width, height) for b in boxes]


def androidcontrol_episodes(path: Path):
    """Yields (episode id, subset, instruction, steps) with steps = [(image, arguments, boxes, meta)]."""
    for ep in read_episodes(path):
        eid = str(ep["episode_id"])
        actions, shots = ep["actions"], ep["screenshots"]
        if len(shots) not in (len(actions), len(actions) + 1):
            raise ConvertError(f"episode {eid}: {len(shots)} screenshots for {len(actions)} actions")
        instr = ep.get("step_instructions") or [None] * len(actions)
        steps = []
        for i, action in enumerate(actions):
            try:
                w, h = ep["screenshot_widths"][i], ep["screenshot_heights"][i]
                args = androidcontrol_action(action, w, h)
                boxes = {"candidate_boxes": androidcontrol_boxes(ep, i, action, args, w, h)}
            except (KeyError, IndexError, TypeError, ConvertError, json.JSONDecodeError) as e:
                raise ConvertError(f"episode {eid} actions[{i}]: {e!r}") from e
            meta = {"source": "AndroidControl", "action": action, "step_instruction": instr[i]}
            steps.append((path.parent / shots[i], args, boxes, meta))
        yield eid, ep.get("subset"), ep["goal"], steps


# ---------------------------------------------------------------------------------------------- GUI-Odyssey


def sam2_to_grid(sam2):
    """GUI-Odyssey's `sam2_bbox` [x1, y1, x2, y2] (0-1000) -> the grid box holding exactly the grid points g
    with x1 <= g*1000/999 <= x2 (and so for y), the test `click_matching` makes; None when it holds none.
    Exact rational arithmetic, so a bound on a grid point is not lost to rounding."""
    if not isinstance(sam2, list) or len(sam2) != 4 or not all(is_number(v) for v in sam2):
        raise ConvertError(f"sam2_bbox {sam2!r} is not [x1, y1, x2, y2]")
    scale = lambda v: Fraction(v) * 999 / 1000  # noqa: E731
    lo = [max(0, math.ceil(scale(v))) for v in sam2[:2]]
    hi = [min(999, math.floor(scale(v))) for v in sam2[2:]]
    if lo[0] > hi[0] or lo[1] > hi[1]:
        return None
    return [lo[0], lo[1], hi[0], hi[1]]


def odyssey_episodes(path: Path, screenshots: Path):
    ann = json.loads(path.read_text())
    eid = str(ann.get("episode_id", path.stem))
    steps = []
    for i, st in enumerate(ann.get("steps", [])):
        try:
            args, line = convert_odyssey.map_action(st["action"], st.get("info", ""))
            sam2 = st.get("sam2_bbox") or None  # [] on steps that are not clicks
            box = sam2_to_grid(sam2) if sam2 and args["action"] in ("click", "long_press") else None
        except (KeyError, ValueError) as e:
            raise ConvertError(f"episode {eid} steps[{i}]: {e}") from e
        meta = {"source": "GUI-Odyssey", "action": st["action"], "info": st.get("info", ""),
                "category": (ann.get("task_info") or {}).get("category")}
        if sam2:
            meta["sam2_bbox"] = sam2
        steps.append((screenshots / st["screenshot"], args, {"target_box": box}, meta, line))
    yield eid, None, ann["task_info"]["instruction"], steps


# ---------------------------------------------------------------------------------------------- AITW


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def annotation_rows(positions) -> list[list[float]]:
    """AITW annotation positions, flattened (as the TFRecords and SeeClick store them) or already in rows,
    as [y, x, h, w] rows with the values unchanged; each must be a fraction of the screen in [0, 1]."""
    if not positions:
        return []
    if all(isinstance(r, list) for r in positions):
        rows = positions
    elif len(positions) % 4:
        raise ConvertError(f"annotation positions of length {len(positions)} is not a multiple of 4")
    else:
        rows = [positions[k:k + 4] for k in range(0, len(positions), 4)]
    for k, row in enumerate(rows):
        if len(row) != 4 or not all(is_number(v) and 0 <= v <= 1 for v in row):
            raise ConvertError(f"annotation {k} {row!r} is not (y, x, h, w) in [0, 1]")
    return [list(r) for r in rows]


def smallest_box(yx, rows):
    """The smallest (y, x, h, w) annotation row (fractions) containing point yx, as a grid box."""
    y, x = yx
    best = None
    for by, bx, bh, bw in rows:
        if by <= y <= by + bh and bx <= x <= bx + bw and (best is None or bh * bw < best[2] * best[3]):
            best = (by, bx, bh, bw)
    if best is None:
        return None
    by, bx, bh, bw = best
    return [max(0, math.floor(bx * 999)), max(0, math.floor(by * 999)),
            min(999, math.ceil((bx + bw) * 999)), min(999, math.ceil((by + bh) * 999))]


def aitw_action(kind, touch_yx, lift_yx, text, rows):
    """(arguments, target_box) for one AITW step; points are normalised (y, x), rows [y, x, h, w]."""
    if kind == 4:
        dy, dx = lift_yx[0] - touch_yx[0], lift_yx[1] - touch_yx[1]
        if math.hypot(dy, dx) <= TAP_DISTANCE:
            point = [norm_to_grid(touch_yx[1]), norm_to_grid(touch_yx[0])]
            return {"action": "click", "coordinate": point}, smallest_box(touch_yx, rows)
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
    if isinstance(doc, dict) and "episode_id" in doc:  # a raw dump of one step parses as one object
        doc = [doc]
    if isinstance(doc, dict):  # SeeClick: {subset: [[step, ...], ...]}
        for subset, episodes in doc.items():
            for episode in episodes:
                steps, eid, goal = [], None, None
                for i, st in enumerate(episode):
                    eid, goal = str(st["ep_id"]), st["goal"]
                    touch = [st["touch"][1], st["touch"][0]] if st.get("touch") else [-1.0, -1.0]
                    lift = [st["lift"][1], st["lift"][0]] if st.get("lift") else [-1.0, -1.0]
                    try:
                        rows = annotation_rows(st.get("annot_position"))
                        args, box = aitw_action(st["action_type_id"], touch, lift, st.get("type_text", ""), rows)
                    except (KeyError, ConvertError) as e:
                        raise ConvertError(f"{subset} episode {eid} step {i}: {e}") from e
                    meta = {"source": "AITW", "action_type_id": st["action_type_id"],
                            "action_type_text": st.get("action_type_text")}
                    boxes = {"target_box": box, "ui_annotations": rows}
                    steps.append((images / (st["img_filename"] + ".png"), args, boxes, meta))
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
                rows = annotation_rows(rec.get("image/ui_annotations_positions"))
                args, box = aitw_action(rec["results/action_type"], rec["results/yx_touch"],
                                        rec["results/yx_lift"], rec.get("results/type_action", ""), rows)
            except (KeyError, ConvertError) as e:
                raise ConvertError(f"episode {eid} step_id {rec.get('step_id')}: {e}") from e
            meta = {"source": "AITW", "action_type": rec["results/action_type"], "step_id": rec["step_id"]}
            steps.append((images / rec["image_path"], args, {"target_box": box, "ui_annotations": rows}, meta))
        yield eid, recs[0].get("subset"), recs[0]["goal_info"], steps


# ---------------------------------------------------------------------------------------------- output


def step_lines(eid, subset, instruction, steps, out_dir: Path, images: int, check: bool):
    """The JSONL records of one episode and the number of steps left out (no canonical action)."""
    shots, responses, records, skipped = [], [], [], 0
    for i, st in enumerate(steps):
        image, args, boxes, meta = st[:4]
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
            # target_box, ui_annotations, candidate_boxes: only those the source gave for this step.
            rec.update({k: v for k, v in (boxes or {}).items() if v})
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
