"""The box fields of tools/convert_steps.py (`target_box`, `ui_annotations`, `candidate_boxes`; docs/EVAL.md).

* The committed samples in tests/fixtures/scorer-boxes/ are exactly the converter's output (tests/scorer_boxes.rs
  scores them through the dataset loader and ScoreContext).
* GUI-Odyssey's `sam2_bbox` becomes the grid box holding exactly the grid points the authors' `click_matching`
  accepts (a grid point g is g * 1000 / 999 on their 0-1000 scale).
* AITW annotations keep their values; AndroidControl boxes come from `step_check_pams` or the accessibility tree.

Run: .venv-ci/bin/python -m pytest tools/tests/test_convert_boxes.py (standard library only, besides pytest).
"""

import json
import os
import shutil
import sys
from fractions import Fraction
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import convert_steps as cs  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "scorer-boxes"
RUNS = [  # (source, inputs and options relative to the fixture directory, output)
    ("aitw", ["aitw_seeclick.json", "--images-dir", "images"], "aitw_steps.jsonl"),
    ("androidcontrol", ["androidcontrol.json"], "androidcontrol_steps.jsonl"),
    ("odyssey", ["odyssey/ep_boxes.json", "--screenshots", "images"], "odyssey_steps.jsonl"),
]


def lines(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("source,args,out", RUNS)
def test_committed_samples_are_the_converters_output(tmp_path, source, args, out):
    # Same layout in a scratch copy, so the relative screenshot paths come out the same.
    work = tmp_path / "scorer-boxes"
    shutil.copytree(FIXTURES, work, ignore=shutil.ignore_patterns("*_steps.jsonl"))
    cwd = os.getcwd()
    os.chdir(work)
    try:
        assert cs.main([source, *args, "--out", out]) == 0
    finally:
        os.chdir(cwd)
    assert lines(work / out) == lines(FIXTURES / out)


def authors_accept(g, lo, hi):
    """GUI-Odyssey's `x1 <= pred <= x2` for grid value g, i.e. pred = g * 1000 / 999 (exact)."""
    return Fraction(lo) <= Fraction(g) * 1000 / 999 <= Fraction(hi)


@pytest.mark.parametrize("sam2", [
    [400, 400, 601, 501], [0, 0, 1000, 1000], [123.4, 0.5, 876.6, 999.9], [999, 1, 1000, 2], [-5, 3, 1200, 4],
])
def test_sam2_box_keeps_exactly_the_points_the_authors_accept(sam2):
    box = cs.sam2_to_grid(sam2)
    for axis in (0, 1):
        kept = {g for g in range(1000) if box and box[axis] <= g <= box[axis + 2]}
        assert kept == {g for g in range(1000) if authors_accept(g, sam2[axis], sam2[axis + 2])}, (sam2, axis)


def test_sam2_box_narrower_than_a_grid_unit_is_no_box():
    assert cs.sam2_to_grid([500.6, 500.6, 500.9, 500.9]) is None  # no grid point maps inside
    with pytest.raises(cs.ConvertError):
        cs.sam2_to_grid([1, 2, 3])


def test_aitw_annotations_are_rows_with_unchanged_values():
    flat = [0.4, 0.1, 0.05, 0.8, 0.85, 0.3, 0.1, 0.4]
    assert cs.annotation_rows(flat) == [[0.4, 0.1, 0.05, 0.8], [0.85, 0.3, 0.1, 0.4]]
    assert cs.annotation_rows([[0.4, 0.1, 0.05, 0.8]]) == [[0.4, 0.1, 0.05, 0.8]]  # already reshaped dumps
    assert cs.annotation_rows(None) == []
    for bad in ([0.1, 0.2, 0.3], [[0.1, 0.2, 0.3, 1.5]], [[0.1, 0.2, 0.3]], [0.1, 0.2, 0.3, True]):
        with pytest.raises(cs.ConvertError):
            cs.annotation_rows(bad)


def test_raw_aitw_records_carry_their_annotations(tmp_path):
    rec = {"episode_id": "9", "step_id": 0, "goal_info": "tap", "results/action_type": 4,
           "results/yx_touch": [0.42, 0.5], "results/yx_lift": [0.42, 0.5], "results/type_action": "",
           "image/ui_annotations_positions": [0.4, 0.1, 0.05, 0.8], "image_path": "s0.png"}
    path = tmp_path / "raw.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    (_, _, _, steps), = cs.aitw_episodes(path, tmp_path)
    _, args, boxes, _ = steps[0]
    assert args == {"action": "click", "coordinate": [500, 420]}
    assert boxes == {"target_box": [99, 399, 900, 450], "ui_annotations": [[0.4, 0.1, 0.05, 0.8]]}


def episode(**extra):
    return {"episode_id": 1, "goal": "g", "screenshots": ["a.png", "b.png"], "screenshot_widths": [1000, 1000],
            "screenshot_heights": [2000, 2000], "actions": ['{"action_type":"click","x":100,"y":200}'], **extra}


def candidate_boxes(tmp_path, ep):
    path = tmp_path / "ep.json"
    path.write_text(json.dumps(ep))
    (_, _, _, steps), = cs.androidcontrol_episodes(path)
    return steps[0][2]["candidate_boxes"]


def test_androidcontrol_boxes_from_the_preprocessed_check_pams(tmp_path):
    # Pixels over the screen size times 999; one copy of the scorer also accepts a bare box.
    ep = episode(step_check_pams=[{"action": "click", "candidate_bbox": [0, 400, 500, 2200]}])
    assert candidate_boxes(tmp_path, ep) == [[0.0, 199.8, 499.5, 999.0]]  # clamped to the screen
    ep = episode(step_check_pams=[{"action": "open", "candidate_bbox": [[0, 0, 10, 10]]}])
    with pytest.raises(cs.ConvertError, match="not the step's"):
        candidate_boxes(tmp_path, ep)


def test_androidcontrol_boxes_from_the_accessibility_tree(tmp_path):
    node = lambda l, t, r, b: {"bounds_in_screen": {"left": l, "top": t, "right": r, "bottom": b}}  # noqa: E731
    forest = {"windows": [{"tree": {"nodes": [node(0, 0, 1000, 2000), node(50, 150, 300, 250),
                                              node(100, 200, 100, 300), node(400, 150, 600, 250)]}}]}
    ep = episode(accessibility_trees=[forest, {"windows": []}])
    assert candidate_boxes(tmp_path, ep) == [[49.95, 74.925, 299.7, 124.875]]  # zero-width node skipped
    ep = episode(accessibility_trees=[forest, {}], actions=['{"action_type":"open_app","app_name":"Clock"}'])
    assert candidate_boxes(tmp_path, ep) == []  # the tree cannot tell which icon is the app's
