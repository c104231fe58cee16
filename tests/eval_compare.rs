//! `recall eval --compare A.json B.json`: keeps, repairs and harms of two systems on the same steps,
//! counted against how the fixture was built, and the paired advantage equal to the difference of
//! the two reports' EM with an episode-bootstrap interval around it.

use std::process::Command;

use recall::agent::action::Platform;
use recall::agent::eval::{evaluate, BootstrapConfig, StepOutcome};

fn click(x: u32, y: u32) -> String {
    format!(
        "Action: tap.\n<tool_call>\n{{\"name\": \"mobile_use\", \"arguments\": {{\"action\": \"click\", \"coordinate\": [{x}, {y}]}}}}\n</tool_call>"
    )
}

/// A system's outcomes: step `i` of episode `e` is answered right when `right(e, i)`.
fn outcomes(right: impl Fn(usize, usize) -> bool) -> Vec<StepOutcome> {
    let mut v = Vec::new();
    for e in 0..8 {
        for i in 0..6 {
            let (x, y) = (100 + 50 * i as u32, 200 + 60 * e as u32);
            let answer = if right(e, i) {
                click(x, y)
            } else {
                click(x + 300, y)
            };
            v.push(StepOutcome {
                episode: format!("ep{e}"),
                step: i as u32,
                subset: None,
                reference: click(x, y),
                first: answer.clone(),
                second: answer,
                target_box: None,
                ui_annotations: Vec::new(),
                candidate_boxes: Vec::new(),
            });
        }
    }
    v
}

#[test]
fn compare_counts_keeps_repairs_and_harms() {
    let a_right = |e: usize, i: usize| !(e + i).is_multiple_of(3);
    let b_right = |e: usize, i: usize| (e * 7 + i) % 4 != 1;
    let boot = BootstrapConfig {
        resamples: 200,
        ..BootstrapConfig::default()
    };
    let (a, b) = (
        evaluate(&outcomes(a_right), Platform::Mobile, boot).unwrap(),
        evaluate(&outcomes(b_right), Platform::Mobile, boot).unwrap(),
    );
    let tmp = tempfile::tempdir().unwrap();
    let (pa, pb, out) = (
        tmp.path().join("a.json"),
        tmp.path().join("b.json"),
        tmp.path().join("c.json"),
    );
    std::fs::write(&pa, a.to_json()).unwrap();
    std::fs::write(&pb, b.to_json()).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_recall"))
        .args([
            "eval",
            "--compare",
            pa.to_str().unwrap(),
            pb.to_str().unwrap(),
            "--bootstrap",
            "300",
        ])
        .args(["--json", out.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("| only B right |"));
    let c: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let (mut keeps, mut repairs, mut harms, mut neither) = (0, 0, 0, 0);
    for e in 0..8 {
        for i in 0..6 {
            match (a_right(e, i), b_right(e, i)) {
                (true, true) => keeps += 1,
                (false, true) => repairs += 1,
                (true, false) => harms += 1,
                (false, false) => neither += 1,
            }
        }
    }
    let n = &c["pairwise"];
    assert_eq!(
        (
            n["steps"].as_u64(),
            n["both_right"].as_u64(),
            n["only_b_right"].as_u64(),
            n["only_a_right"].as_u64(),
            n["neither"].as_u64()
        ),
        (Some(48), Some(keeps), Some(repairs), Some(harms), Some(neither)),
        "{c}"
    );
    let adv = c["advantage"].as_f64().unwrap();
    let want = b.overall.rates.em_second - a.overall.rates.em_second;
    assert!((adv - want).abs() < 1e-12, "{adv} vs {want}");
    assert!((adv - (repairs as f64 - harms as f64) / 48.0).abs() < 1e-12);
    let (lo, hi) = (
        c["interval"]["lo"].as_f64().unwrap(),
        c["interval"]["hi"].as_f64().unwrap(),
    );
    assert!(lo <= adv && adv <= hi && lo < hi, "[{lo}, {hi}] around {adv}");
    assert_eq!(c["episodes"], 8);
}

#[test]
fn compare_refuses_reports_it_cannot_pair() {
    let tmp = tempfile::tempdir().unwrap();
    let boot = BootstrapConfig {
        resamples: 0,
        ..BootstrapConfig::default()
    };
    let a = evaluate(&outcomes(|e, _| e % 2 == 0), Platform::Mobile, boot).unwrap();
    let pa = tmp.path().join("a.json");
    std::fs::write(&pa, a.to_json()).unwrap();
    let run = |b: &std::path::Path| {
        let o = Command::new(env!("CARGO_BIN_EXE_recall"))
            .args(["eval", "--compare", pa.to_str().unwrap(), b.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(!o.status.success());
        String::from_utf8_lossy(&o.stderr).into_owned()
    };
    // A report from before per-step verdicts existed.
    let mut old: serde_json::Value = serde_json::from_str(&a.to_json()).unwrap();
    old.as_object_mut().unwrap().remove("steps");
    let po = tmp.path().join("old.json");
    std::fs::write(&po, old.to_string()).unwrap();
    assert!(run(&po).contains("no per-step verdicts"));
    let pn = tmp.path().join("missing.json");
    assert!(run(&pn).contains("missing.json"));
    let pj = tmp.path().join("junk.json");
    std::fs::write(&pj, "{").unwrap();
    assert!(run(&pj).contains("not a `recall eval --json` report"));
    // Disjoint steps.
    let mut other: serde_json::Value = serde_json::from_str(&a.to_json()).unwrap();
    for s in other["steps"].as_array_mut().unwrap() {
        s["episode"] = serde_json::json!("elsewhere");
    }
    let pd = tmp.path().join("disjoint.json");
    std::fs::write(&pd, other.to_string()).unwrap();
    assert!(run(&pd).contains("share no (episode, step)"));
}

/// `--scorer` changes the rule of EM: AITW does not compare typed text (its authors' code matches
/// non-gesture actions on type alone), recall's rule does; a comparison across rules is refused.
#[test]
fn the_scorer_sets_the_rule_and_comparisons_stay_within_one() {
    use recall::agent::compare::compare;
    use recall::agent::eval::evaluate_with;
    use recall::agent::scorers::Scorer;
    let typed = |text: &str| {
        format!(
            "<tool_call>\n{{\"name\": \"mobile_use\", \"arguments\": {{\"action\": \"type\", \"text\": \"{text}\"}}}}\n</tool_call>"
        )
    };
    let steps: Vec<StepOutcome> = (0..4)
        .map(|i| StepOutcome {
            episode: format!("ep{i}"),
            step: 0,
            subset: None,
            reference: typed("hello"),
            first: typed("goodbye"),
            second: typed("goodbye"),
            target_box: None,
            ui_annotations: Vec::new(),
            candidate_boxes: Vec::new(),
        })
        .collect();
    let boot = BootstrapConfig {
        resamples: 0,
        ..BootstrapConfig::default()
    };
    let ours = evaluate_with(&steps, Platform::Mobile, boot, Scorer::Recall).unwrap();
    let aitw = evaluate_with(&steps, Platform::Mobile, boot, Scorer::Aitw).unwrap();
    assert_eq!(
        (ours.overall.rates.em_second, aitw.overall.rates.em_second),
        (0.0, 1.0)
    );
    assert_eq!((ours.scorer.as_str(), aitw.scorer.as_str()), ("recall", "aitw"));
    let err = compare(&ours, &aitw, ("a", "b"), boot).unwrap_err().to_string();
    assert!(err.contains("--scorer"), "{err}");
}
