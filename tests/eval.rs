//! Step-level evaluation: repairs/harms accounting, macro vs micro averages, trajectory bootstrap, the
//! step dataset loader and the converters' sample outputs (`tests/fixtures/eval/`).

use std::path::{Path, PathBuf};

use recall::agent::action::{parse_response, Platform};
use recall::agent::dataset::StepDataset;
use recall::agent::eval::{evaluate, exact_match, BootstrapConfig, EvalReport, Rates, StepOutcome};
use recall::Error;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/eval")
        .join(name)
}

fn click(x: u32, y: u32) -> String {
    format!(
        "Action: Tap.\n<tool_call>\n{{\"name\": \"mobile_use\", \"arguments\": {{\"action\": \"click\", \
         \"coordinate\": [{x}, {y}]}}}}\n</tool_call>"
    )
}

fn long_press(x: u32, y: u32) -> String {
    format!(
        "<tool_call>{{\"name\": \"mobile_use\", \"arguments\": {{\"action\": \"long_press\", \"coordinate\": \
         [{x}, {y}]}}}}</tool_call>"
    )
}

/// How an opinion relates to a click reference at (x, y).
#[derive(Clone, Copy, Debug)]
enum Kind {
    Exact,     // the reference point: EM, TM
    Near,      // (+15, +20), distance exactly 25: EM, TM
    Far,       // (+10, +24), distance 26: TM only
    InBox,     // (+80, 0): outside the tolerance, inside the step's target box: EM, TM
    OtherType, // long_press at the reference point: neither
    Garbage,   // unparseable: neither, counted
}
use Kind::*;

fn opinion(kind: Kind, x: u32, y: u32) -> String {
    match kind {
        Exact => click(x, y),
        Near => click(x + 15, y + 20),
        Far => click(x + 10, y + 24),
        InBox => click(x + 80, y),
        OtherType => long_press(x, y),
        Garbage => {
            "Action: Tap the button.\n<tool_call>{\"name\": \"mobile_use\", \"arguments\": ".to_string()
        }
    }
}

/// (first, second, count): 20 right→right, 7 repairs, 3 harms, 10 wrong→wrong.
const PLAN: [(Kind, Kind, usize); 14] = [
    (Exact, Exact, 8),
    (Near, Exact, 6),
    (InBox, Near, 4),
    (Exact, InBox, 2),
    (Far, Exact, 3),
    (Garbage, Near, 2),
    (OtherType, Exact, 2),
    (Exact, Far, 1),
    (Near, Garbage, 1),
    (Exact, OtherType, 1),
    (Far, Far, 4),
    (Garbage, Garbage, 2),
    (OtherType, Far, 2),
    (Far, OtherType, 2),
];

/// 40 steps, shuffled with a fixed seed, 5 per episode over 8 episodes; every step has a target box
/// that holds the reference and InBox points but not Far or Near ones.
fn synthetic(subset: Option<&str>) -> Vec<StepOutcome> {
    let mut plan: Vec<(Kind, Kind)> = PLAN
        .iter()
        .flat_map(|&(a, b, n)| std::iter::repeat_n((a, b), n))
        .collect();
    assert_eq!(plan.len(), 40);
    fastrand::Rng::with_seed(7).shuffle(&mut plan);
    plan.iter()
        .enumerate()
        .map(|(i, &(a, b))| {
            let (x, y) = (200 + 10 * i as u32, 300 + 5 * i as u32);
            StepOutcome {
                episode: format!("ep{}", i / 5),
                step: (i % 5) as u32,
                subset: subset.map(str::to_string),
                reference: click(x, y),
                first: opinion(a, x, y),
                second: opinion(b, x, y),
                target_box: Some([x - 5, y - 5, x + 100, y + 5]), // holds InBox, not Far or Near
                ui_annotations: Vec::new(),
                candidate_boxes: Vec::new(),
            }
        })
        .collect()
}

fn no_bootstrap() -> BootstrapConfig {
    BootstrapConfig {
        resamples: 0,
        ..BootstrapConfig::default()
    }
}

#[test]
fn repairs_and_harms_on_known_counts() {
    let steps = synthetic(None);
    let r = evaluate(&steps, Platform::Mobile, no_bootstrap()).unwrap();
    let c = r.overall.counts;
    assert_eq!(c.steps, 40);
    assert_eq!(r.overall.episodes, 8);
    assert_eq!((c.repairs, c.harms), (7, 3));
    assert_eq!((c.em_first, c.em_second), (23, 27));
    assert_eq!((c.tm_first, c.tm_second), (32, 34));
    assert_eq!((c.unparseable_first, c.unparseable_second), (4, 3));
    assert_eq!(r.overall.rates.delta_acc, 4.0 / 40.0);
    assert_eq!(r.overall.rates.delta_acc, (7.0 - 3.0) / 40.0);
    assert!((r.overall.rates.em_second - r.overall.rates.em_first - 0.1).abs() < 1e-12);
    assert_eq!(r.overall.repair_rate, Some(7.0 / 17.0));
    assert_eq!(r.overall.harm_rate, Some(3.0 / 23.0));
    assert!(r.overall.intervals.is_none() && r.macro_avg.intervals.is_none());
    // One subset (None): it, the macro average and the total agree.
    assert_eq!(r.subsets.len(), 1);
    assert_eq!(r.subsets[0].subset, None);
    assert_eq!(r.subsets[0].counts, c);
    assert_eq!(r.macro_avg.rates, r.overall.rates);

    // Without the boxes the 6 InBox opinions (4 first, 2 second) are wrong: 4 fewer a0-right (those
    // steps become repairs), 2 fewer a1-right (harms of steps whose a0 is Exact).
    let unboxed: Vec<StepOutcome> = steps
        .iter()
        .map(|s| StepOutcome {
            target_box: None,
            ..s.clone()
        })
        .collect();
    let u = evaluate(&unboxed, Platform::Mobile, no_bootstrap())
        .unwrap()
        .overall
        .counts;
    assert_eq!((u.em_first, u.em_second), (19, 25));
    assert_eq!((u.repairs, u.harms), (11, 5));
    assert_eq!((u.tm_first, u.tm_second), (32, 34));
}

#[test]
fn target_box_needs_the_same_action_type() {
    let p = |r: &str| parse_response(r, Platform::Mobile).unwrap();
    let reference = p(&click(500, 500));
    let bx = Some([400, 450, 600, 550]);
    assert!(exact_match(
        &reference,
        &p(&click(590, 540)),
        bx,
        Platform::Mobile
    ));
    assert!(exact_match(
        &reference,
        &p(&click(600, 550)),
        bx,
        Platform::Mobile
    )); // edges inclusive
    assert!(!exact_match(
        &reference,
        &p(&click(601, 550)),
        bx,
        Platform::Mobile
    ));
    assert!(!exact_match(
        &reference,
        &p(&click(590, 540)),
        None,
        Platform::Mobile
    ));
    assert!(!exact_match(
        &reference,
        &p(&long_press(500, 500)),
        bx,
        Platform::Mobile
    ));
}

#[test]
fn macro_and_micro_averages_differ_on_unequal_subsets() {
    // Subset "a": 2 episodes × 5 steps, a1 right on 8, a0 right on 6 (R 2, H 0).
    // Subset "b": 6 episodes × 5 steps, a1 right on 15, a0 right on 18 (R 0, H 3).
    let mut steps = Vec::new();
    for i in 0..40u32 {
        let (subset, k) = if i < 10 { ("a", i) } else { ("b", i - 10) };
        let (x, y) = (100 + 5 * i, 700);
        let (first_ok, second_ok) = if subset == "a" {
            (k < 6, k < 8)
        } else {
            (k < 18, k < 15)
        };
        let pick = |ok: bool| if ok { click(x, y) } else { click(x + 50, y) };
        steps.push(StepOutcome {
            episode: format!("{subset}{}", k / 5),
            step: k % 5,
            subset: Some(subset.to_string()),
            reference: click(x, y),
            first: pick(first_ok),
            second: pick(second_ok),
            target_box: None,
            ui_annotations: Vec::new(),
            candidate_boxes: Vec::new(),
        });
    }
    let r = evaluate(&steps, Platform::Mobile, no_bootstrap()).unwrap();
    let names: Vec<_> = r.subsets.iter().map(|g| g.subset.clone().unwrap()).collect();
    assert_eq!(names, ["a", "b"]);
    let (a, b) = (&r.subsets[0], &r.subsets[1]);
    assert_eq!(
        (a.episodes, a.counts.steps, b.episodes, b.counts.steps),
        (2, 10, 6, 30)
    );
    assert_eq!((a.rates.em_second, b.rates.em_second), (0.8, 0.5));
    assert_eq!((a.rates.delta_acc, b.rates.delta_acc), (0.2, -0.1));
    assert_eq!(r.macro_avg.subsets, 2);
    assert_eq!(r.macro_avg.rates.em_second, (0.8 + 0.5) / 2.0);
    assert_eq!(r.macro_avg.rates.em_first, (0.6 + 0.6) / 2.0);
    assert_eq!(r.macro_avg.rates.delta_acc, (0.2 + -0.1) / 2.0);
    assert_eq!(r.overall.rates.em_second, 23.0 / 40.0);
    assert_eq!(r.overall.rates.delta_acc, (2.0 - 3.0) / 40.0);
    assert_ne!(r.macro_avg.rates.em_second, r.overall.rates.em_second);
}

fn all_intervals(r: &EvalReport) -> Vec<(String, Rates, [recall::agent::eval::Interval; 5])> {
    let ci = |c: &recall::agent::eval::RateIntervals| {
        [c.em_first, c.em_second, c.tm_first, c.tm_second, c.delta_acc]
    };
    let mut out = vec![
        (
            "overall".to_string(),
            r.overall.rates,
            ci(r.overall.intervals.as_ref().unwrap()),
        ),
        (
            "macro".to_string(),
            r.macro_avg.rates,
            ci(r.macro_avg.intervals.as_ref().unwrap()),
        ),
    ];
    for g in &r.subsets {
        out.push((
            format!("{:?}", g.subset),
            g.rates,
            ci(g.intervals.as_ref().unwrap()),
        ));
    }
    out
}

fn two_subsets() -> Vec<StepOutcome> {
    let mut steps = synthetic(Some("general"));
    let more: Vec<StepOutcome> = synthetic(Some("install"))
        .into_iter()
        .take(25)
        .map(|mut s| {
            s.episode = format!("i-{}", s.episode);
            s
        })
        .collect();
    steps.extend(more);
    steps
}

#[test]
fn bootstrap_intervals_contain_the_point_and_are_seeded() {
    let steps = two_subsets();
    let cfg = BootstrapConfig {
        resamples: 1000,
        seed: 42,
        confidence: 0.95,
    };
    let r = evaluate(&steps, Platform::Mobile, cfg).unwrap();
    for (name, rates, cis) in all_intervals(&r) {
        let points = [
            rates.em_first,
            rates.em_second,
            rates.tm_first,
            rates.tm_second,
            rates.delta_acc,
        ];
        for (p, ci) in points.iter().zip(cis) {
            assert!(ci.lo <= ci.hi, "{name}: {ci:?}");
            assert!(ci.contains(*p), "{name}: {p} not in {ci:?}");
        }
    }
    // The synthetic data vary between episodes, so the intervals have width.
    let o = r.overall.intervals.unwrap();
    assert!(o.em_first.hi > o.em_first.lo && o.delta_acc.hi > o.delta_acc.lo);

    // Deterministic for a seed, different for another.
    let again = evaluate(&steps, Platform::Mobile, cfg).unwrap();
    assert_eq!(again, r);
    assert_eq!(again.to_json(), r.to_json());
    let other = evaluate(&steps, Platform::Mobile, BootstrapConfig { seed: 43, ..cfg }).unwrap();
    assert_ne!(other.overall.intervals, r.overall.intervals);
    // The order of the outcomes does not matter.
    let mut reversed = steps.clone();
    reversed.reverse();
    assert_eq!(evaluate(&reversed, Platform::Mobile, cfg).unwrap(), r);
}

#[test]
fn bootstrap_collapses_when_all_episodes_are_identical() {
    // 8 episodes per subset with identical outcomes step for step (mixed right/wrong inside each).
    let base = synthetic(None);
    let template: Vec<&StepOutcome> = base.iter().take(5).collect();
    let mut steps = Vec::new();
    for (subset, episodes) in [("x", 8), ("y", 3)] {
        for e in 0..episodes {
            for t in &template {
                steps.push(StepOutcome {
                    episode: format!("{subset}{e}"),
                    subset: Some(subset.to_string()),
                    ..(*t).clone()
                });
            }
        }
    }
    let r = evaluate(&steps, Platform::Mobile, BootstrapConfig::default()).unwrap();
    for (name, rates, cis) in all_intervals(&r) {
        let points = [
            rates.em_first,
            rates.em_second,
            rates.tm_first,
            rates.tm_second,
            rates.delta_acc,
        ];
        for (p, ci) in points.iter().zip(cis) {
            assert_eq!((ci.lo, ci.hi), (*p, *p), "{name}");
        }
    }
}

#[test]
fn evaluate_rejects_bad_input() {
    let ok = synthetic(None);
    assert!(evaluate(&[], Platform::Mobile, no_bootstrap()).is_err());
    let mut dup = ok.clone();
    dup[1].episode = dup[0].episode.clone();
    dup[1].step = dup[0].step;
    assert!(format!(
        "{}",
        evaluate(&dup, Platform::Mobile, no_bootstrap()).unwrap_err()
    )
    .contains("twice"));
    let mut bad_ref = ok.clone();
    bad_ref[3].reference = "<tool_call>{\"name\": \"mobile_use\"}</tool_call>".into();
    let e = evaluate(&bad_ref, Platform::Mobile, no_bootstrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("reference does not parse"), "{e}");
    let mut bad_box = ok.clone();
    bad_box[0].reference = "{\"action\": \"wait\"}".into();
    assert!(evaluate(&bad_box, Platform::Mobile, no_bootstrap()).is_err());
    let cfg = BootstrapConfig {
        confidence: 1.0,
        ..BootstrapConfig::default()
    };
    assert!(evaluate(&ok, Platform::Mobile, cfg).is_err());
    // Mobile responses evaluated as desktop do not parse: the references are rejected.
    assert!(evaluate(&ok, Platform::Desktop, no_bootstrap()).is_err());
}

#[test]
fn report_renders_json_and_markdown() {
    let r = evaluate(&two_subsets(), Platform::Mobile, BootstrapConfig::default()).unwrap();
    let v: serde_json::Value = serde_json::from_str(&r.to_json()).unwrap();
    assert_eq!(v["overall"]["counts"]["steps"], 65);
    assert_eq!(v["subsets"][1]["subset"], "install");
    assert_eq!(v["macro_avg"]["subsets"], 2);
    assert!(v["overall"]["intervals"]["delta_acc"]["lo"].is_number());
    let back: EvalReport = serde_json::from_str(&r.to_json()).unwrap();
    assert_eq!(back.overall.counts, r.overall.counts);

    let md = r.to_markdown();
    assert!(md.contains("| Subset | Episodes | N | EM a0 | EM a1 | TM a0 | TM a1 | R | H | ΔAcc (pp) |"));
    assert!(md.contains("| general | 8 | 40 | 57.50 ["), "{md}");
    assert!(md.contains("| **Macro** (2 subsets) |"));
    assert!(md.contains("| **All** | 13 | 65 |"));
    assert!(md.contains("| 7 | 3 | 10.00 ["), "{md}");
    let plain = evaluate(&two_subsets(), Platform::Mobile, no_bootstrap())
        .unwrap()
        .to_markdown();
    assert!(
        plain.contains("| general | 8 | 40 | 57.50 | 67.50 | 80.00 | 85.00 | 7 | 3 | 10.00 | 4/3 |"),
        "{plain}"
    );
}

// ---------------------------------------------------------------------------------------------- dataset

const GOOD: &str = r#"{"episode": "e1", "step": 0, "instruction": "Open Clock.", "platform": "mobile", "screenshots": ["s0.png"], "history": [], "reference": "Action: Open Clock.\n<tool_call>\n{\"name\": \"mobile_use\", \"arguments\": {\"action\": \"open\", \"text\": \"Clock\"}}\n</tool_call>"}
{"episode": 7, "step": 1, "subset": "general", "instruction": "Open Clock.", "platform": "mobile", "screenshots": ["s0.png", "/abs/s1.png"], "history": ["Open Clock."], "reference": {"action": "click", "coordinate": [500, 300]}, "target_box": [400, 270, 600, 330], "meta": {"k": 1}}

{"episode": "e1", "step": 1, "subset": null, "instruction": "Open Clock.", "platform": "mobile", "screenshots": ["s1.png"], "history": ["x"], "reference": {"name": "mobile_use", "arguments": {"action": "terminate", "status": "success"}}}
"#;

const DESKTOP: &str = r#"{"episode": "e9", "step": 0, "instruction": "x", "platform": "desktop", "screenshots": ["a.png"], "history": [], "reference": {"action": "wait"}}"#;

fn parse(text: &str) -> recall::Result<StepDataset> {
    StepDataset::parse(text, Path::new("steps.jsonl"), Path::new("/data"))
}

#[test]
fn dataset_loads_all_reference_forms() {
    let d = parse(GOOD).unwrap();
    assert_eq!(d.platform, Platform::Mobile);
    assert_eq!(d.steps.len(), 3);
    assert_eq!(d.episodes(), 2);
    let s = &d.steps[1];
    assert_eq!((s.line, s.episode.as_str(), s.step), (2, "7", 1));
    assert_eq!(s.subset.as_deref(), Some("general"));
    assert_eq!(
        s.screenshots,
        [PathBuf::from("/data/s0.png"), PathBuf::from("/abs/s1.png")]
    );
    assert_eq!(s.target_box, Some([400, 270, 600, 330]));
    assert_eq!(s.meta["k"], 1);
    assert_eq!(d.steps[2].line, 4); // the blank line is skipped but counted
    assert_eq!(d.steps[2].subset, None);
    for s in &d.steps {
        assert!(recall::agent::dataset::parse_reference(&s.reference, Platform::Mobile).is_ok());
    }
    // The references evaluate as right against themselves.
    let outcomes: Vec<StepOutcome> = d
        .steps
        .iter()
        .map(|s| StepOutcome {
            episode: s.episode.clone(),
            step: s.step,
            subset: s.subset.clone(),
            reference: s.reference.clone(),
            first: s.reference.clone(),
            second: s.reference.clone(),
            target_box: s.target_box,
            ui_annotations: s.ui_annotations.clone(),
            candidate_boxes: s.candidate_boxes.clone(),
        })
        .collect();
    let r = evaluate(&outcomes, d.platform, no_bootstrap()).unwrap();
    assert_eq!((r.overall.rates.em_first, r.overall.rates.tm_second), (1.0, 1.0));
}

fn field_of(e: Error) -> String {
    match e {
        Error::Json { field, message, .. } => format!("{field} | {message}"),
        other => panic!("expected Error::Json, got {other}"),
    }
}

/// Replaces line `n` (1-based) of GOOD with `line`.
fn with_line(n: usize, line: &str) -> String {
    let mut lines: Vec<&str> = GOOD.lines().collect();
    lines[n - 1] = line;
    lines.join("\n")
}

#[test]
fn dataset_errors_name_the_line_and_field() {
    let first = GOOD.lines().next().unwrap();
    let cases: Vec<(String, &str)> = vec![
        (with_line(4, "{\"episode\": \"e1\", \"step\": 1,"), "line 4 |"),
        (with_line(2, "[1, 2]"), "line 2: (line)"),
        (
            with_line(1, &first.replace("\"instruction\": \"Open Clock.\", ", "")),
            "line 1: instruction | missing",
        ),
        (
            with_line(
                1,
                &first.replace("\"platform\": \"mobile\"", "\"platform\": \"ios\""),
            ),
            "line 1: platform",
        ),
        (
            with_line(1, &first.replace("\"step\": 0", "\"step\": -1")),
            "line 1: step",
        ),
        (
            with_line(1, &first.replace("\"history\": []", "\"history\": [\"a\"]")),
            "line 1: history",
        ),
        (
            with_line(1, &first.replace("[\"s0.png\"]", "[\"s0.png\", \"s1.png\"]")),
            "line 1: screenshots",
        ),
        (
            with_line(1, &first.replace("[\"s0.png\"]", "[]")),
            "line 1: screenshots",
        ),
        (
            with_line(1, &first.replace("[\"s0.png\"]", "[\"\"]")),
            "line 1: screenshots[0]",
        ),
        (
            with_line(1, &first.replace("\"history\"", "\"histories\": [], \"history\"")),
            "line 1: histories",
        ),
        (
            with_line(1, &first.replace("\\\"open\\\"", "\\\"opne\\\"")),
            "line 1: reference",
        ),
        (
            with_line(
                1,
                &first.replace("\"history\": []", "\"history\": [], \"target_box\": [0, 0, 5, 5]"),
            ),
            "line 1: target_box",
        ),
        (
            GOOD.replace("[400, 270, 600, 330]", "[400, 270, 600, 1000]"),
            "line 2: target_box[3]",
        ),
        (
            GOOD.replace("[400, 270, 600, 330]", "[600, 270, 400, 330]"),
            "line 2: target_box",
        ),
        (
            GOOD.replace("[400, 270, 600, 330]", "[400, 270]"),
            "line 2: target_box",
        ),
        (
            GOOD.replace("\"subset\": \"general\"", "\"subset\": \"\""),
            "line 2: subset",
        ),
        (
            GOOD.replace("\"episode\": 7", "\"episode\": \"e1\""),
            "line 4: step | episode `e1` step 1 already appears on line 2",
        ),
        (
            with_line(4, DESKTOP),
            "line 4: platform | `desktop` differs from `mobile` on line 1",
        ),
        (String::from("\n\n"), "(file) | no steps"),
    ];
    for (text, want) in cases {
        let got = field_of(parse(&text).unwrap_err());
        assert!(
            got.starts_with(want) || got.contains(want),
            "want `{want}`, got `{got}`"
        );
    }
}

#[test]
fn dataset_file_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("steps.jsonl");
    std::fs::write(&path, GOOD).unwrap();
    let d = StepDataset::load(&path).unwrap();
    assert_eq!(d.steps[0].screenshots[0], dir.path().join("s0.png"));
    let e = field_of(d.check_screenshots().unwrap_err());
    assert!(e.starts_with("line 1: screenshots[0]"), "{e}");
    assert!(matches!(
        StepDataset::load(&dir.path().join("missing.jsonl")),
        Err(Error::Io { .. })
    ));
}

// ---------------------------------------------------------------------------------------------- converters

#[test]
fn converter_samples_load() {
    let load = |name: &str| {
        let d = StepDataset::load(&fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        d.check_screenshots().unwrap();
        assert_eq!(d.platform, Platform::Mobile);
        d
    };
    let ac = load("androidcontrol_steps.jsonl");
    assert_eq!((ac.steps.len(), ac.episodes()), (7, 1));
    assert_eq!(ac.steps[0].episode, "20471");
    let names: Vec<String> = ac
        .steps
        .iter()
        .map(|s| {
            parse_response(&s.reference, Platform::Mobile)
                .unwrap()
                .name()
                .to_string()
        })
        .collect();
    assert_eq!(
        names,
        [
            "open",
            "click",
            "swipe",
            "long_press",
            "type",
            "system_button",
            "wait"
        ]
    );
    // (540, 2100) on 1080×2400 -> round(540·999/1079), round(2100·999/2399); (1079, 0) -> (999, 0).
    assert!(
        ac.steps[1].reference.contains("[500, 874]"),
        "{}",
        ac.steps[1].reference
    );
    assert!(ac.steps[3].reference.contains("[999, 0]"));
    assert!(ac.steps[2]
        .reference
        .contains("\"coordinate\": [500, 799], \"coordinate2\": [500, 200]"));
    assert_eq!(ac.steps[6].screenshots.len(), 3);
    assert_eq!(ac.steps[6].history.len(), 6);

    let od = load("odyssey_steps.jsonl");
    let steps: Vec<u32> = od.steps.iter().map(|s| s.step).collect();
    assert_eq!(steps, [0, 1, 2, 4, 5]); // step 3 (KEY_APPSELECT -> Menu) has no canonical action
    assert_eq!(od.steps[3].history.len(), 4);
    assert!(od.steps[3].history[3].contains("\"Menu\""));

    let aitw = load("aitw_steps.jsonl");
    assert_eq!((aitw.steps.len(), aitw.episodes()), (8, 2));
    let subsets: Vec<&str> = aitw.steps.iter().map(|s| s.subset.as_deref().unwrap()).collect();
    assert_eq!(
        subsets,
        ["general"; 5]
            .iter()
            .chain(&["webshopping"; 3])
            .copied()
            .collect::<Vec<_>>()
    );
    assert_eq!(aitw.steps[1].target_box, Some([99, 49, 900, 150]));
    assert_eq!(aitw.steps[6].target_box, None); // the tap is in no annotation box
    let raw = load("aitw_raw_steps.jsonl");
    assert_eq!(raw.steps.len(), 3);
    assert_eq!(raw.steps[1].target_box, Some([699, 149, 900, 250]));
    assert!(raw.steps[0]
        .reference
        .contains("[799, 500], \"coordinate2\": [200, 500]"));

    // A perfect agent scores 100% on every sample, target boxes included.
    for d in [&ac, &od, &aitw, &raw] {
        let outcomes: Vec<StepOutcome> = d
            .steps
            .iter()
            .map(|s| StepOutcome {
                episode: s.episode.clone(),
                step: s.step,
                subset: s.subset.clone(),
                reference: s.reference.clone(),
                first: s.reference.clone(),
                second: s.reference.clone(),
                target_box: s.target_box,
                ui_annotations: s.ui_annotations.clone(),
                candidate_boxes: s.candidate_boxes.clone(),
            })
            .collect();
        let r = evaluate(&outcomes, d.platform, BootstrapConfig::default()).unwrap();
        assert_eq!(r.overall.rates.em_second, 1.0);
        assert_eq!(r.overall.counts.repairs + r.overall.counts.harms, 0);
    }
}
