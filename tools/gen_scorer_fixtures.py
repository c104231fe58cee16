#!/usr/bin/env python3
"""Generate the benchmark-scorer fixtures (`tests/fixtures/scorers/{aitw,androidcontrol,odyssey}.json`).

Every case is a pair of `mobile_use` actions on the 0–999 grid (the bare arguments, as `parse_reference`
reads them), an optional context (UI boxes), the expected verdict and the rule it exercises. The verdict
comes from an oracle, named in each case's `oracle` field:

* `authors`: the benchmark authors' own matching code, run unchanged on the mapped actions:
  - AITW: google-research/google-research `android_in_the_wild/action_matching.py`
    (`check_actions_match`, commit 8d8a4f1b27753c7580d16261a1468b3d6ad2c3d3) with `action_type.py`, under JAX
    (float32, as the authors run it). Pass the directory that holds `android_in_the_wild/` with
    `--aitw-src`; the code is not part of this repository.
  - GUI-Odyssey: OpenGVLab/GUI-Odyssey `src/eval_mm/GUIOdyssey_action_matching.py` (`action_matching`) and,
    for scroll directions, `data/format_converter.py` (`decode_action`), commit
    e12788f6c4197a8003730abce68ffc7dedaab3ab. Pass the checkout's root with `--odyssey-src`.
* `re-expression`: AndroidControl's authors publish no matching code; the rule is the Qwen2.5-VL team's
  AndroidControl scorer (gist 1f5d19495788de0d905c5ac6341153f5 by LukeForeverYoung, linked from
  QwenLM/Qwen2.5-VL issue #904, 2025-03-10) as its public derivatives reproduce it, re-expressed below in
  `androidcontrol_rule` (see docs/EVAL.md, "Benchmark scorers").
* `mapping`: the action has no counterpart in the benchmark's action space, so recall's mapping (not the
  authors' code) decides: no match.

The mapping of recall's actions onto each benchmark's inputs is recall's (docs/EVAL.md) and mirrors
`src/agent/scorers.rs`: grid value g ↦ g / 999 of the screen (AITW, AndroidControl) or g · 1000 / 999 on
GUI-Odyssey's 0–1000 scale.

Usage (from the repository root; JAX is needed for the AITW oracle only):

    python3 -m venv /tmp/jaxenv && /tmp/jaxenv/bin/pip install jax numpy
    /tmp/jaxenv/bin/python tools/gen_scorer_fixtures.py --aitw-src DIR --odyssey-src DIR
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "scorers"
GRID = 999.0


def load_module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- actions ---------------------------------------------------------------------------------------------


def click(x, y):
    return {"action": "click", "coordinate": [x, y]}


def long_press(x, y):
    return {"action": "long_press", "coordinate": [x, y]}


def swipe(x1, y1, x2, y2):
    return {"action": "swipe", "coordinate": [x1, y1], "coordinate2": [x2, y2]}


def type_(text):
    return {"action": "type", "text": text}


def open_(text):
    return {"action": "open", "text": text}


def answer(text):
    return {"action": "answer", "text": text}


def button(name):
    return {"action": "system_button", "button": name}


def terminate(status="success"):
    return {"action": "terminate", "status": status}


WAIT = {"action": "wait"}


def case(cid, predicted, reference, why, context=None):
    return {"id": cid, "predicted": predicted, "reference": reference, "context": context or {}, "why": why}


# --- AITW ------------------------------------------------------------------------------------------------

# Off-screen, zero-size box: contains no on-screen point. The authors' code reduces over the boxes with
# `jnp.max`, which fails on an empty list; recall reads "no annotations" as "distance rule only", which this
# box reproduces exactly.
AITW_NO_BOX = [2.0, 2.0, 0.0, 0.0]


def aitw_action(a):
    """recall action → (AITW action type, touch (y, x), lift (y, x)) or None (no AITW counterpart)."""
    act = a["action"]
    none = [-1.0, -1.0]
    if act in ("click", "long_press"):
        x, y = a["coordinate"]
        p = [y / GRID, x / GRID]
        return 4, p, p
    if act == "swipe":
        (x1, y1), (x2, y2) = a["coordinate"], a["coordinate2"]
        return 4, [y1 / GRID, x1 / GRID], [y2 / GRID, x2 / GRID]
    if act == "type":
        return 3, none, none
    if act == "system_button":
        return {"Back": 5, "Home": 6, "Enter": 7}[a["button"]], none, none
    if act == "terminate":
        return (10 if a["status"] == "success" else 11), none, none
    return None


def aitw_cases():
    box_row = [0.40, 0.10, 0.05, 0.80]  # a wide list row: y, x, height, width
    box_sq = [0.50, 0.50, 0.10, 0.10]  # 1.4-augmented: y, x in [0.43, 0.67]
    box_top = [0.01, 0.30, 0.10, 0.40]  # top clamps to 0, so the augmented box ends at 0.24, not 0.18
    return [
        case("tap_same_point", click(500, 500), click(500, 500), "taps at the same point"),
        case("tap_distance_139", click(639, 500), click(500, 500),
             "139/999 = 0.1391 of the screen <= _TAP_DISTANCE_THRESHOLD 0.14"),
        case("tap_distance_140", click(640, 500), click(500, 500),
             "140/999 = 0.1401 > 0.14, no annotation box"),
        case("tap_vertical_140", click(500, 640), click(500, 500),
             "the threshold is the same along y: 0.1401 > 0.14"),
        case("tap_diagonal_98", click(598, 598), click(500, 500),
             "Euclidean: sqrt(2)*98/999 = 0.1387 <= 0.14"),
        case("tap_diagonal_99", click(599, 599), click(500, 500),
             "Euclidean, not per axis: sqrt(2)*99/999 = 0.1401 > 0.14"),
        case("tap_same_box_far_apart", click(850, 425), click(150, 425),
             "0.70 apart but both inside the same (augmented) UI annotation box", {"ui_annotations": [box_row]}),
        case("tap_augmented_box_inside", click(659, 659), click(450, 450),
             "0.30 apart; the pred is outside the original box (0.5-0.6) but inside its 1.4x augmentation "
             "(0.43-0.67)", {"ui_annotations": [box_sq]}),
        case("tap_augmented_box_outside", click(680, 680), click(450, 450),
             "just outside the augmented box (0.681 > 0.67) and 0.33 apart", {"ui_annotations": [box_sq]}),
        case("tap_augmented_box_edge_low", click(660, 430), click(450, 660),
             "just inside the augmented box's top edge y = 0.43 (grid 430 = 0.4304); 0.31 apart",
             {"ui_annotations": [box_sq]}),
        case("tap_augmented_box_edge_out", click(660, 429), click(450, 660),
             "grid 429 = 0.4294 < 0.43: just above the augmented box; 0.31 apart",
             {"ui_annotations": [box_sq]}),
        case("tap_top_clamp_quirk", click(500, 220), click(500, 50),
             "box at y 0.01, h 0.1: the augmented top clamps to 0 but the height stays 2.4h, so the box ends "
             "at 0.24 (not 0.18); 0.17 apart, both inside", {"ui_annotations": [box_top]}),
        case("tap_top_clamp_outside", click(500, 250), click(500, 50),
             "0.2503 is below the clamped augmented box (0.24) and 0.20 apart", {"ui_annotations": [box_top]}),
        case("tap_float32_bottom_edge", click(900, 950), click(500, 999),
             "box y 0.949, h 0.03 ends at 0.928 + 0.072: exactly 1.0 in float32 (the authors' JAX) but "
             "0.9999999999999999 in float64; the reference on the bottom row (999/999 = 1.0) is inside only "
             "in float32; 0.40 apart", {"ui_annotations": [[0.949, 0.30, 0.03, 0.40]]}),
        case("tap_different_boxes", click(500, 900), click(500, 425),
             "in two different boxes and 0.48 apart", {"ui_annotations": [box_row, [0.85, 0.3, 0.1, 0.4]]}),
        case("tap_one_in_box_near", click(500, 560), click(500, 430),
             "only one point is in the box, but they are 0.13 apart", {"ui_annotations": [box_row]}),
        case("long_press_is_tap", long_press(520, 510), click(500, 500),
             "AITW has no long press: both are DUAL_POINT taps"),
        case("short_swipe_is_tap", swipe(500, 500, 520, 530), click(500, 500),
             "touch-lift distance 36/999 = 0.036 <= 0.04: the swipe is a tap, at the reference's point"),
        case("swipe_039_is_tap", swipe(500, 500, 500, 539), click(500, 500),
             "39/999 = 0.0390 <= _SWIPE_DISTANCE_THRESHOLD 0.04: a tap"),
        case("swipe_041_is_swipe", swipe(500, 500, 500, 541), click(500, 500),
             "41/999 = 0.0410 > 0.04: a swipe, and a tap never matches a swipe"),
        case("tap_vs_swipe", click(500, 500), swipe(500, 799, 500, 200), "tap against a scroll"),
        case("swipe_same_direction", swipe(300, 900, 310, 100), swipe(500, 799, 500, 200),
             "both vertical (main axis y)"),
        case("swipe_opposite_direction", swipe(500, 200, 500, 799), swipe(500, 799, 500, 200),
             "AITW compares the main axis only: up and down both are vertical"),
        case("swipe_axis_differs", swipe(799, 500, 200, 500), swipe(500, 799, 500, 200),
             "horizontal against vertical"),
        case("swipe_diagonal_tie_vertical", swipe(200, 200, 500, 500), swipe(500, 799, 500, 200),
             "|dy| = |dx|: argmax picks the first axis, y (vertical)"),
        case("swipe_diagonal_tie_horizontal", swipe(200, 200, 500, 500), swipe(799, 500, 200, 500),
             "the tie resolves to vertical, so it does not match a horizontal swipe"),
        case("swipe_slightly_horizontal", swipe(200, 200, 501, 500), swipe(799, 500, 200, 500),
             "|dx| = 301 > |dy| = 300: horizontal"),
        case("type_same_text", type_("weather in paris"), type_("weather in paris"), "TYPE = TYPE"),
        case("type_text_ignored", type_("london"), type_("weather in paris"),
             "non-dual-point actions match on their type alone: the typed text is not compared"),
        case("type_vs_tap", type_("paris"), click(500, 500), "TYPE against DUAL_POINT"),
        case("back_back", button("Back"), button("Back"), "PRESS_BACK = PRESS_BACK"),
        case("back_home", button("Back"), button("Home"), "PRESS_BACK != PRESS_HOME"),
        case("enter_enter", button("Enter"), button("Enter"), "PRESS_ENTER = PRESS_ENTER"),
        case("enter_vs_type", button("Enter"), type_("x"), "PRESS_ENTER != TYPE"),
        case("back_vs_tap", button("Back"), click(30, 30), "a button press against a tap"),
        case("complete_complete", terminate(), terminate(), "STATUS_TASK_COMPLETE both"),
        case("complete_vs_impossible", terminate(), terminate("failure"),
             "a reference terminate with status failure is STATUS_TASK_IMPOSSIBLE (11) != 10"),
        case("impossible_impossible", terminate("failure"), terminate("infeasible"),
             "any non-success status is STATUS_TASK_IMPOSSIBLE"),
        case("open_no_counterpart", open_("Chrome"), open_("Chrome"),
             "AITW has no open-app action: no match"),
        case("wait_no_counterpart", WAIT, WAIT, "AITW has no wait action: no match"),
        case("answer_no_counterpart", answer("42"), terminate(), "AITW has no answer action: no match"),
    ]


def aitw_expected(mod, c):
    p, r = aitw_action(c["predicted"]), aitw_action(c["reference"])
    if p is None or r is None:
        return False, "mapping"
    boxes = c["context"].get("ui_annotations") or [AITW_NO_BOX]
    out = mod.check_actions_match(p[1], p[2], p[0], r[1], r[2], r[0], np.array(boxes, dtype=np.float64))
    return bool(out), "authors"


# --- GUI-Odyssey -----------------------------------------------------------------------------------------


def ody_scale(g):
    return g * 1000.0 / GRID


def odyssey_action(a, decode_action):
    """recall action → (GUI-Odyssey action, info) or None."""
    act = a["action"]
    if act in ("click", "long_press"):
        x, y = a["coordinate"]
        return ("CLICK" if act == "click" else "LONG_PRESS"), [ody_scale(x), ody_scale(y)]
    if act == "swipe":
        # The direction is invariant under the (monotone, uniform) scaling to 0-1000, so it is taken on the
        # exact grid integers: scaled floats could turn an exact |dx| = |dy| tie into a rounding accident.
        label = decode_action("SCROLL", [a["coordinate"], a["coordinate2"]])  # "SCROLL: UP"
        return "SCROLL", label.split(":")[1].strip()
    if act == "type":
        return "TYPE", a["text"]
    if act == "system_button":
        return {"Back": ("PRESS_BACK", ""), "Home": ("PRESS_HOME", "")}.get(a["button"])
    if act == "terminate":
        return ("COMPLETE", "") if a["status"] == "success" else ("IMPOSSIBLE", "")
    return None


def odyssey_cases():
    box = [400, 400, 600, 500]  # the reference element's sam2 box on the grid (x1, y1, x2, y2)
    return [
        case("click_same_point", click(500, 500), click(500, 500), "same point"),
        case("click_distance_139", click(639, 500), click(500, 500),
             "139/999 = 0.1391 <= CLICK_COORD_THRESHOLD 0.14 (coordinates / 1000)"),
        case("click_distance_140", click(640, 500), click(500, 500), "0.1401 > 0.14, no sam2 box"),
        case("click_diagonal_98", click(402, 402), click(500, 500), "sqrt(2)*98/999 = 0.1387 <= 0.14"),
        case("click_diagonal_99", click(401, 401), click(500, 500), "Euclidean: 0.1401 > 0.14"),
        case("click_in_sam2_box", click(595, 405), click(420, 495),
             "0.18 apart but the prediction lies in the element's sam2 box", {"target_box": box}),
        case("click_sam2_edge", click(600, 500), click(400, 400), "the box is inclusive: x = x2, y = y2",
             {"target_box": box}),
        case("click_sam2_just_out", click(601, 500), click(400, 400),
             "one grid unit right of the box and 0.22 apart", {"target_box": box}),
        case("click_sam2_pred_only", click(450, 450), click(900, 900),
             "only the prediction is tested against the box; the reference may lie outside it",
             {"target_box": box}),
        case("click_vs_long_press", long_press(500, 500), click(500, 500),
             "CLICK != LONG_PRESS: the action names must be equal"),
        case("long_press_near", long_press(550, 520), long_press(500, 500), "LONG_PRESS uses the click rule"),
        case("long_press_far", long_press(700, 520), long_press(500, 500), "0.20 > 0.14"),
        case("scroll_same_direction", swipe(100, 900, 120, 850), swipe(500, 800, 500, 200),
             "both UP (dy < 0 dominates); lengths and positions do not matter"),
        case("scroll_opposite", swipe(500, 200, 500, 800), swipe(500, 800, 500, 200), "DOWN against UP"),
        case("scroll_left_right", swipe(800, 500, 200, 500), swipe(200, 500, 800, 500), "LEFT against RIGHT"),
        case("scroll_tie_is_vertical", swipe(200, 200, 500, 500), swipe(500, 100, 500, 900),
             "|dx| = |dy| is not |dx| > |dy|: vertical, DOWN"),
        case("scroll_tie_not_right", swipe(200, 200, 500, 500), swipe(100, 500, 900, 500),
             "the tie is DOWN, not RIGHT"),
        case("scroll_tie_offset", swipe(100, 200, 400, 500), swipe(500, 100, 500, 900),
             "an exact tie away from the diagonal (dx = dy = 300) is vertical too"),
        case("scroll_zero_is_down", swipe(500, 500, 500, 500), swipe(500, 100, 500, 900),
             "no movement: dy < 0 is false, so DOWN"),
        case("scroll_horizontal_by_one", swipe(200, 200, 501, 500), swipe(100, 500, 900, 500),
             "|dx| 301 > |dy| 300: RIGHT"),
        case("type_exact", type_("weather in paris"), type_("weather in paris"), "identical text"),
        case("type_contained", type_("weather"), type_("weather in paris"), "pred in gt"),
        case("type_contains", type_("the weather in paris today"), type_("weather in paris"), "gt in pred"),
        case("type_case_sensitive", type_("AB"), type_("ab"),
             "no casefolding: Levenshtein 2 / 2 gives ANLS 0 < 0.5"),
        case("type_case_one_letter", type_("Paris"), type_("paris"),
             "case-sensitive, but 1 - 1/5 = 0.8 >= TEXT_ANLS_THRESHOLD 0.5"),
        case("type_anls_half", type_("abxy"), type_("abcd"), "1 - 2/4 = 0.5 >= 0.5 (inclusive)"),
        case("type_anls_below", type_("axyz"), type_("abcd"), "1 - 3/4 = 0.25 < 0.5"),
        case("type_strip", type_("  hello "), type_("hello"), "both texts are stripped"),
        case("type_empty_pred", type_(""), type_("weather"), "'' is contained in every string"),
        case("type_unicode", type_("café"), type_("cafe"), "Levenshtein on code points: 1 - 1/4 = 0.75"),
        case("type_vs_click", type_("paris"), click(500, 500), "TYPE != CLICK"),
        case("back_back", button("Back"), button("Back"), "PRESS_BACK: type match is enough"),
        case("back_home", button("Back"), button("Home"), "PRESS_BACK != PRESS_HOME"),
        case("complete_complete", terminate(), terminate(), "COMPLETE: type match is enough"),
        case("complete_vs_impossible", terminate(), terminate("failure"), "COMPLETE != IMPOSSIBLE"),
        case("enter_no_counterpart", button("Enter"), button("Enter"), "GUI-Odyssey has no Enter key"),
        case("open_no_counterpart", open_("Maps"), open_("Maps"), "GUI-Odyssey has no open-app action"),
        case("wait_no_counterpart", WAIT, WAIT, "GUI-Odyssey has no wait action"),
    ]


def odyssey_expected(mod, decode_action, c):
    p, r = odyssey_action(c["predicted"], decode_action), odyssey_action(c["reference"], decode_action)
    if p is None or r is None:
        return False, "mapping"
    box = c["context"].get("target_box")
    sam2 = [ody_scale(v) for v in box] if box is not None else None
    out = mod.action_matching(p[0], p[1], r[0], r[1], sam2)
    return out["is_correct"] == "yes", "authors"


# --- AndroidControl --------------------------------------------------------------------------------------

AC_BBOX_ENLARGE_FACTOR = 1.2
AC_POINT_DISTANCE_THRESHOLD = 0.04


def ac_check_text(pred, gt):
    pred, gt = pred.lower().strip(), gt.lower().strip()
    return pred in gt or gt in pred


def ac_enlarge(b, s):
    x_center, y_center = (b[0] + b[2]) / 2, (b[1] + b[3]) / 2
    w, h = (b[2] - b[0]) * s, (b[3] - b[1]) * s
    return [x_center - w / 2, y_center - h / 2, x_center + w / 2, y_center + h / 2]


def ac_check_click(point, boxes, gt_point):
    for b in boxes:
        e = ac_enlarge(b, AC_BBOX_ENLARGE_FACTOR)
        if e[0] <= point[0] <= e[2] and e[1] <= point[1] <= e[3]:
            return True
    if gt_point is None:
        return False
    return bool(np.linalg.norm([gt_point[0] - point[0], gt_point[1] - point[1]]) <= AC_POINT_DISTANCE_THRESHOLD)


def ac_direction(start, end):
    dx, dy = end[0] - start[0], end[1] - start[1]
    if abs(dx) > abs(dy):
        return "right" if dx > 0 else "left"
    return "down" if dy > 0 else "up"


def androidcontrol_rule(pred, ref, boxes):
    """Re-expression of the Qwen team's AndroidControl scorer; coordinates as fractions of the screen."""
    norm = lambda p: [p[0] / GRID, p[1] / GRID]  # noqa: E731
    boxes = [[b[0] / GRID, b[1] / GRID, b[2] / GRID, b[3] / GRID] for b in boxes]
    pa, ra = pred["action"], ref["action"]
    if ra in ("wait", "terminate"):
        return pa == ra
    if ra == "system_button":
        return pa == ra and pred["button"].lower().strip() == ref["button"].lower().strip()
    if ra == "type":
        return pa == ra and ac_check_text(pred["text"], ref["text"])
    if ra == "open":
        if pa == "open":
            return ac_check_text(pred["text"], ref["text"])
        if pa == "click" and boxes:
            b = boxes[0]
            return ac_check_click(norm(pred["coordinate"]), boxes, [(b[0] + b[2]) / 2, (b[1] + b[3]) / 2])
        return False
    if ra == "swipe":
        return pa == ra and ac_direction(pred["coordinate"], pred["coordinate2"]) == ac_direction(
            ref["coordinate"], ref["coordinate2"])
    if ra in ("click", "long_press"):
        return pa == ra and ac_check_click(norm(pred["coordinate"]), boxes, norm(ref["coordinate"]))
    return None  # no AndroidControl counterpart (answer)


def androidcontrol_cases():
    box = [400.0, 400.0, 600.0, 600.0]  # 1.2x enlarged: [380, 620]
    icon = [100.0, 800.0, 200.0, 900.0]
    return [
        case("click_same_point", click(500, 500), click(500, 500), "same point"),
        case("click_distance_39", click(539, 500), click(500, 500),
             "39/999 = 0.0390 <= POINT_DISTANCE_THRESHOLD 0.04 (fractions of the screen)"),
        case("click_distance_40", click(540, 500), click(500, 500), "40/999 = 0.0400400 > 0.04"),
        case("click_vertical_40", click(500, 460), click(500, 500), "the same along y: 0.0400400 > 0.04"),
        case("click_diagonal_28", click(528, 528), click(500, 500), "sqrt(2)*28/999 = 0.0396 <= 0.04"),
        case("click_diagonal_29", click(529, 529), click(500, 500), "Euclidean: sqrt(2)*29/999 = 0.0411 > 0.04"),
        case("click_in_candidate_box", click(590, 410), click(450, 560),
             "far from the reference point but inside the element's candidate box",
             {"candidate_boxes": [box]}),
        case("click_in_enlarged_box", click(615, 500), click(450, 500),
             "outside the box (600) but inside its 1.2x enlargement about the centre (620)",
             {"candidate_boxes": [box]}),
        case("click_enlarged_edge", click(620, 500), click(450, 500),
             "at the enlarged edge 620 (inclusive, up to floating point)", {"candidate_boxes": [box]}),
        case("click_outside_enlarged", click(625, 500), click(450, 500),
             "625 > 620 and 0.175 from the reference point", {"candidate_boxes": [box]}),
        case("click_second_candidate", click(150, 850), click(500, 500), "any candidate box counts",
             {"candidate_boxes": [box, icon]}),
        case("click_vs_long_press", long_press(500, 500), click(500, 500), "long_press is not click"),
        case("long_press_near", long_press(520, 510), long_press(500, 500), "22/999 = 0.022 <= 0.04"),
        case("long_press_far", long_press(600, 500), long_press(500, 500), "0.1 > 0.04, no candidate box"),
        case("type_same", type_("weather in paris"), type_("weather in paris"), "identical text"),
        case("type_casefold_contained", type_("Paris"), type_("weather in paris"),
             "lower-cased and stripped, then containment either way"),
        case("type_strip", type_(" WEATHER IN PARIS  "), type_("weather in paris"), "strip and lower"),
        case("type_different", type_("london"), type_("weather in paris"), "neither contains the other"),
        case("type_empty_pred", type_(""), type_("weather in paris"), "'' is contained in every string"),
        case("type_vs_click", type_("paris"), click(500, 500), "the action types differ"),
        case("open_same", open_("Chrome"), open_("chrome"), "app names compared like typed text"),
        case("open_contained", open_("Google Chrome"), open_("Chrome"), "containment"),
        case("open_different", open_("Maps"), open_("Chrome"), "different app"),
        case("open_by_click_on_icon", click(150, 850), open_("Chrome"),
             "a click on the app's icon (the first candidate box) opens it", {"candidate_boxes": [icon]}),
        case("open_by_click_near_icon", click(150, 905), open_("Chrome"),
             "below the icon box (y 900) but inside its 1.2x enlargement (y up to 910)",
             {"candidate_boxes": [icon]}),
        case("open_by_click_outside_icon", click(150, 960), open_("Chrome"),
             "outside the enlarged icon box (y 790-910) and 0.11 from its centre", {"candidate_boxes": [icon]}),
        case("open_by_click_no_icon", click(150, 850), open_("Chrome"),
             "without a candidate box a click never opens the app"),
        case("swipe_same_direction", swipe(300, 900, 310, 100), swipe(500, 799, 500, 200),
             "both move the finger up"),
        case("swipe_opposite_direction", swipe(500, 200, 500, 799), swipe(500, 799, 500, 200),
             "down against up"),
        case("swipe_left_right", swipe(799, 500, 200, 500), swipe(200, 500, 799, 500), "left against right"),
        case("swipe_tie_vertical", swipe(200, 200, 500, 500), swipe(500, 200, 500, 799),
             "|dx| = |dy|: vertical, down"),
        case("swipe_horizontal_by_one", swipe(200, 200, 501, 500), swipe(200, 500, 799, 500),
             "|dx| 301 > |dy| 300: right"),
        case("swipe_vs_click", swipe(500, 799, 500, 200), click(500, 500), "the action types differ"),
        case("back_back", button("Back"), button("Back"), "equal buttons"),
        case("back_home", button("Back"), button("Home"), "different buttons"),
        case("wait_wait", WAIT, WAIT, "wait: type match is enough"),
        case("wait_vs_click", click(500, 500), WAIT, "the action types differ"),
        case("terminate_terminate", terminate(), terminate("failure"),
             "terminate: type match is enough (mobile statuses are coerced to success)"),
        case("answer_no_counterpart", answer("42"), answer("42"), "AndroidControl has no answer action"),
    ]


def androidcontrol_expected(c):
    out = androidcontrol_rule(c["predicted"], c["reference"], c["context"].get("candidate_boxes", []))
    if out is None:
        return False, "mapping"
    return bool(out), "re-expression"


# --- driver ----------------------------------------------------------------------------------------------

SOURCES = {
    "aitw": "google-research/google-research android_in_the_wild/action_matching.py "
            "(check_actions_match, commit 8d8a4f1b27753c7580d16261a1468b3d6ad2c3d3), run under JAX",
    "androidcontrol": "Qwen2.5-VL team's AndroidControl scorer (gist LukeForeverYoung/"
                      "1f5d19495788de0d905c5ac6341153f5, QwenLM/Qwen2.5-VL#904), re-expressed in "
                      "tools/gen_scorer_fixtures.py",
    "odyssey": "OpenGVLab/GUI-Odyssey src/eval_mm/GUIOdyssey_action_matching.py (action_matching) and "
               "data/format_converter.py (decode_action), commit e12788f6c4197a8003730abce68ffc7dedaab3ab",
}


def write(name, cases):
    OUT.mkdir(parents=True, exist_ok=True)
    ids = [c["id"] for c in cases]
    assert len(ids) == len(set(ids)), f"{name}: duplicate ids"
    doc = {"scorer": name, "source": SOURCES[name], "generated_by": "tools/gen_scorer_fixtures.py",
           "cases": cases}
    path = OUT / f"{name}.json"
    path.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    n_true = sum(c["expected"] for c in cases)
    print(f"{path}: {len(cases)} cases ({n_true} match, {len(cases) - n_true} do not)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--aitw-src", type=Path, required=True,
                    help="directory holding android_in_the_wild/{action_matching,action_type}.py")
    ap.add_argument("--odyssey-src", type=Path, required=True, help="GUI-Odyssey checkout root")
    args = ap.parse_args()

    sys.path.insert(0, str(args.aitw_src))
    from android_in_the_wild import action_matching as aitw  # noqa: E402  (the authors' module)

    ody = load_module("GUIOdyssey_action_matching", args.odyssey_src / "src/eval_mm/GUIOdyssey_action_matching.py")
    fmt = load_module("format_converter", args.odyssey_src / "data/format_converter.py")

    out = []
    for c in aitw_cases():
        c["expected"], c["oracle"] = aitw_expected(aitw, c)
        out.append(c)
    write("aitw", out)

    out = []
    for c in odyssey_cases():
        c["expected"], c["oracle"] = odyssey_expected(ody, fmt.decode_action, c)
        out.append(c)
    write("odyssey", out)

    out = []
    for c in androidcontrol_cases():
        c["expected"], c["oracle"] = androidcontrol_expected(c)
        out.append(c)
    write("androidcontrol", out)


if __name__ == "__main__":
    main()
