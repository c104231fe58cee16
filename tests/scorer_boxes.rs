//! The benchmark scorers see their boxes end to end: `tools/convert_steps.py` output
//! (`tests/fixtures/scorer-boxes/*_steps.jsonl`, regenerated and compared by
//! `tools/tests/test_convert_boxes.py`) loaded by `StepDataset`, turned into `StepOutcome`s the way
//! `agent::scopemem::run_dataset` does, and scored by `score_steps_with`. Each prediction matches only
//! thanks to the step's box (it is beyond the distance threshold), or lies outside the box and does not.
//!
//! Where the verdict comes from: AITW and GUI-Odyssey steps reproduce a case of
//! `tests/fixtures/scorers/{aitw,odyssey}.json` whose oracle is `authors` (the authors' matching code
//! run by `tools/gen_scorer_fixtures.py`); the test checks that the converted reference and box equal
//! the case's. AndroidControl publishes no scorer of its own; its verdicts are worked out below from
//! the Qwen2.5-VL team's `check_click` (docs/EVAL.md, "AndroidControl").

mod common;

use std::path::{Path, PathBuf};

use recall::action::{parse_tool_call, Action, Platform};
use recall::agent::dataset::{parse_reference, EvalStep, StepDataset};
use recall::agent::eval::{score_steps_with, StepOutcome};
use recall::agent::scorers::Scorer;
use recall::error::Error;
use serde_json::{json, Value};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn dataset(name: &str) -> StepDataset {
    let path = root().join("scorer-boxes").join(name);
    let d = StepDataset::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    d.check_screenshots().expect("screenshots");
    d
}

fn step<'a>(d: &'a StepDataset, episode: &str, index: u32) -> &'a EvalStep {
    d.steps
        .iter()
        .find(|s| s.episode == episode && s.step == index)
        .unwrap_or_else(|| panic!("episode {episode} step {index}"))
}

fn response(args: &Value) -> String {
    format!(
        "<tool_call>\n{}\n</tool_call>",
        json!({"name": "mobile_use", "arguments": args})
    )
}

fn mobile(args: &Value) -> Action {
    parse_tool_call(
        &json!({"name": "mobile_use", "arguments": args}),
        Platform::Mobile,
    )
    .expect("action")
}

/// The outcome of `step` with `prediction` as both opinions; the box fields copied as `run_dataset` does.
fn outcome(step: &EvalStep, prediction: &Value) -> StepOutcome {
    StepOutcome {
        episode: step.episode.clone(),
        step: step.step,
        subset: step.subset.clone(),
        reference: step.reference.clone(),
        first: response(prediction),
        second: response(prediction),
        target_box: step.target_box,
        ui_annotations: step.ui_annotations.clone(),
        candidate_boxes: step.candidate_boxes.clone(),
    }
}

/// EM of `prediction` on `step` under `scorer`, with the step's boxes and without any.
fn em_with_and_without_boxes(step: &EvalStep, prediction: &Value, scorer: Scorer) -> (bool, bool) {
    let with = outcome(step, prediction);
    let without = StepOutcome {
        target_box: None,
        ui_annotations: Vec::new(),
        candidate_boxes: Vec::new(),
        ..with.clone()
    };
    let v = score_steps_with(&[with, without], Platform::Mobile, scorer).expect("score");
    assert_eq!(v[0].first, v[0].second);
    (v[0].first.em, v[1].first.em)
}

/// The `authors`-oracle case `id` of `tests/fixtures/scorers/{scorer}.json`.
fn authors_case(scorer: &str, id: &str) -> Value {
    let path = root().join(format!("scorers/{scorer}.json"));
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("fixture")).expect("json");
    let case = doc["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .find(|c| c["id"] == id)
        .unwrap_or_else(|| panic!("{scorer}: no case {id}"))
        .clone();
    assert_eq!(case["oracle"], "authors", "{scorer}/{id}");
    case
}

fn floats(v: &Value) -> Vec<[f64; 4]> {
    serde_json::from_value(v.clone()).expect("boxes")
}

/// Checks that `step` is the fixture case's reference and context, then that its verdict is the case's.
fn check_against_case(step: &EvalStep, scorer: Scorer, case: &Value) {
    let reference = parse_reference(&step.reference, Platform::Mobile).expect("reference");
    assert_eq!(reference, mobile(&case["reference"]), "{}", case["id"]);
    let ctx = &case["context"];
    if scorer == Scorer::Aitw {
        assert_eq!(
            step.ui_annotations,
            floats(&ctx["ui_annotations"]),
            "{}",
            case["id"]
        );
    } else {
        let b: [u32; 4] = serde_json::from_value(ctx["target_box"].clone()).expect("box");
        assert_eq!(step.target_box, Some(b), "{}", case["id"]);
    }
    let (with, without) = em_with_and_without_boxes(step, &case["predicted"], scorer);
    assert_eq!(
        with,
        case["expected"].as_bool().expect("expected"),
        "{}",
        case["id"]
    );
    assert!(
        !without,
        "{}: beyond the distance threshold, only the box can match",
        case["id"]
    );
}

#[test]
fn aitw_taps_match_inside_the_screens_annotation_boxes() {
    let d = dataset("aitw_steps.jsonl");
    assert_eq!(d.steps.len(), 3);
    // Both points inside the augmented box [0.4, 0.1, 0.05, 0.8], 0.70 apart: a match.
    check_against_case(
        step(&d, "3001", 0),
        Scorer::Aitw,
        &authors_case("aitw", "tap_same_box_far_apart"),
    );
    // The prediction in another box, 0.48 away: no match.
    check_against_case(
        step(&d, "3001", 1),
        Scorer::Aitw,
        &authors_case("aitw", "tap_different_boxes"),
    );
    // The terminate step carries no annotations (its source has none).
    assert!(step(&d, "3001", 2).ui_annotations.is_empty());
}

#[test]
fn odyssey_clicks_match_inside_the_sam2_box() {
    let d = dataset("odyssey_steps.jsonl");
    // sam2_bbox [400, 400, 601, 501] on 0-1000 holds exactly the grid points [400, 400, 600, 500].
    check_against_case(
        step(&d, "odyssey_boxes_1", 0),
        Scorer::Odyssey,
        &authors_case("odyssey", "click_in_sam2_box"),
    );
    check_against_case(
        step(&d, "odyssey_boxes_1", 1),
        Scorer::Odyssey,
        &authors_case("odyssey", "click_sam2_just_out"),
    );
    // GUI-Odyssey writes `sam2_bbox: []` on steps that are not clicks: no box.
    assert_eq!(step(&d, "odyssey_boxes_1", 2).target_box, None);
    assert_eq!(step(&d, "odyssey_boxes_1", 3).target_box, None);
}

#[test]
fn androidcontrol_clicks_match_inside_the_candidate_boxes() {
    let d = dataset("androidcontrol_steps.jsonl");
    // Episode 16426 carries the sample of QwenLM/Qwen3-VL#1155 (`step_check_pams`): click (283, 1586)
    // with candidate_bbox [53, 1287, 513, 2104] on 1080x2400; episode 20999 derives the same box from
    // its accessibility tree (the smallest node with positive area containing the point).
    let boxed = [
        (53.0, 1080.0),
        (1287.0, 2400.0),
        (513.0, 1080.0),
        (2104.0, 2400.0),
    ]
    .map(|(v, s)| v * 999.0 / s);
    for episode in ["16426", "20999"] {
        let s = step(&d, episode, 0);
        assert_eq!(s.candidate_boxes, vec![boxed], "{episode}");
        // The scorer's fractions: box x 0.0491-0.4750 enlarged 1.2x about 0.2620 -> 0.0065-0.5176,
        // y 0.5363-0.8767 -> 0.5022-0.9107; the reference (262, 660) is (0.2623, 0.6607).
        // (450, 560) = (0.4505, 0.5606): inside, 0.21 from the reference (> 0.04): a match.
        let inside = json!({"action": "click", "coordinate": [450, 560]});
        assert_eq!(
            em_with_and_without_boxes(s, &inside, Scorer::AndroidControl),
            (true, false)
        );
        // (600, 560) = (0.6006, 0.5606): right of 0.5176 and 0.35 away: no match.
        let outside = json!({"action": "click", "coordinate": [600, 560]});
        assert_eq!(
            em_with_and_without_boxes(s, &outside, Scorer::AndroidControl),
            (false, false)
        );
    }
    // An `open` reference is matched by a click on the app's icon (the first candidate box).
    let open = step(&d, "16426", 1);
    assert_eq!(open.candidate_boxes.len(), 1);
    let on_icon = json!({"action": "click", "coordinate": [200, 840]});
    assert_eq!(
        em_with_and_without_boxes(open, &on_icon, Scorer::AndroidControl),
        (true, false)
    );
    let elsewhere = json!({"action": "click", "coordinate": [600, 300]});
    assert_eq!(
        em_with_and_without_boxes(open, &elsewhere, Scorer::AndroidControl),
        (false, false)
    );
    // No boxes where the source has none.
    assert!(step(&d, "20999", 1).candidate_boxes.is_empty());
}

/// A one-line dataset with `extra` merged into a valid click step.
fn parse_line(extra: Value) -> Result<StepDataset, Error> {
    let mut line = json!({"episode": "e", "step": 0, "instruction": "tap", "platform": "mobile",
        "screenshots": ["s.png"], "history": [], "reference": {"action": "click", "coordinate": [500, 500]}});
    line.as_object_mut()
        .expect("object")
        .extend(extra.as_object().expect("object").clone());
    StepDataset::parse(&line.to_string(), Path::new("d.jsonl"), Path::new("."))
}

fn field_of(r: Result<StepDataset, Error>) -> String {
    match r {
        Err(Error::Json { field, .. }) => field,
        other => panic!("expected a field error, got {other:?}"),
    }
}

#[test]
fn box_fields_parse_and_bad_values_name_their_field() {
    let ok = parse_line(json!({"ui_annotations": [[0.1, 0.2, 0.3, 0.4]],
        "candidate_boxes": [[10, 20.5, 30, 40]]}))
    .expect("valid");
    assert_eq!(ok.steps[0].ui_annotations, vec![[0.1, 0.2, 0.3, 0.4]]);
    assert_eq!(ok.steps[0].candidate_boxes, vec![[10.0, 20.5, 30.0, 40.0]]);
    let empty = parse_line(json!({"ui_annotations": null, "candidate_boxes": []})).expect("valid");
    assert!(empty.steps[0].ui_annotations.is_empty() && empty.steps[0].candidate_boxes.is_empty());

    let cases = [
        (
            json!({"ui_annotations": [[0.1, 0.2, 0.3, 0.4], [0.1, 1.5, 0.3, 0.4]]}),
            "line 1: ui_annotations[1][1]",
        ),
        (
            json!({"ui_annotations": [[0.1, -0.2, 0.3, 0.4]]}),
            "line 1: ui_annotations[0][1]",
        ),
        (
            json!({"ui_annotations": [[0.1, 0.2, "0.3", 0.4]]}),
            "line 1: ui_annotations[0][2]",
        ),
        (
            json!({"ui_annotations": [[0.1, 0.2, 0.3]]}),
            "line 1: ui_annotations[0]",
        ),
        (
            json!({"ui_annotations": [0.1, 0.2, 0.3, 0.4]}),
            "line 1: ui_annotations[0]",
        ),
        (json!({"ui_annotations": {"y": 0.1}}), "line 1: ui_annotations"),
        (
            json!({"candidate_boxes": [[10, 20, 30, 1000]]}),
            "line 1: candidate_boxes[0][3]",
        ),
        (
            json!({"candidate_boxes": [[10, 20, 30, 40], [30, 20, 10, 40]]}),
            "line 1: candidate_boxes[1]",
        ),
        (
            json!({"candidate_boxes": [[10, 20, 30, null]]}),
            "line 1: candidate_boxes[0][3]",
        ),
        (json!({"candidate_boxes": "[]"}), "line 1: candidate_boxes"),
        (
            json!({"reference": {"action": "swipe", "coordinate": [1, 2], "coordinate2": [3, 400]},
                   "candidate_boxes": [[10, 20, 30, 40]]}),
            "line 1: candidate_boxes",
        ),
    ];
    for (extra, field) in cases {
        assert_eq!(field_of(parse_line(extra.clone())), field, "{extra}");
    }
    // Candidate boxes on an `open` reference, annotations on any reference.
    parse_line(json!({"reference": {"action": "open", "text": "Chrome"}, "candidate_boxes": [[1, 2, 3, 4]]}))
        .expect("open takes candidate boxes");
    parse_line(json!({"reference": {"action": "wait"}, "ui_annotations": [[0, 0, 1, 1]]}))
        .expect("annotations describe the screen");
}

/// The committed `*_steps.jsonl` are the converter's output, and its box rules hold
/// (tools/tests/test_convert_boxes.py; standard library and pytest, from `.ci/run`'s .venv-ci).
#[test]
fn the_converter_writes_the_committed_boxes() {
    common::run_pytest(
        "RECALL_OPENAI_PYTHON",
        "tools/tests/test_convert_boxes.py",
        env!("CARGO_BIN_EXE_recall"),
        "pytest (tools/tests/requirements.txt)",
    );
}
