//! Benchmark scorers (`recall::agent::scorers`) against `tests/fixtures/scorers/*.json`, whose expected
//! verdicts `tools/gen_scorer_fixtures.py` took from the benchmark authors' own matching code (AITW,
//! GUI-Odyssey) or from the re-expressed AndroidControl rule; and the `recall` scorer against today's
//! `equivalent` / `exact_match`.

use std::path::PathBuf;

use recall::agent::action::{equivalent, parse_response, parse_tool_call, Action, Platform};
use recall::agent::eval::exact_match;
use recall::agent::scorers::{ScoreContext, Scorer};
use serde_json::{json, Value};

fn fixture(name: &str) -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("tests/fixtures/scorers/{name}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn mobile(args: &Value) -> Action {
    parse_tool_call(
        &json!({"name": "mobile_use", "arguments": args}),
        Platform::Mobile,
    )
    .unwrap_or_else(|e| panic!("{args}: {e}"))
}

fn boxes(v: &Value) -> Vec<[f64; 4]> {
    v.as_array()
        .map(|list| {
            list.iter()
                .map(|b| {
                    let b: Vec<f64> = b
                        .as_array()
                        .expect("box")
                        .iter()
                        .map(|x| x.as_f64().expect("number"))
                        .collect();
                    [b[0], b[1], b[2], b[3]]
                })
                .collect()
        })
        .unwrap_or_default()
}

fn context(v: &Value) -> ScoreContext {
    let target_box = v.get("target_box").and_then(Value::as_array).map(|b| {
        let b: Vec<u32> = b.iter().map(|x| x.as_u64().expect("grid value") as u32).collect();
        [b[0], b[1], b[2], b[3]]
    });
    ScoreContext {
        target_box,
        candidate_boxes: boxes(&v["candidate_boxes"]),
        ui_annotations: boxes(&v["ui_annotations"]),
    }
}

struct Case {
    id: String,
    predicted: Action,
    reference: Action,
    context: ScoreContext,
    expected: bool,
    oracle: String,
}

fn cases(name: &str) -> Vec<Case> {
    let doc = fixture(name);
    assert_eq!(doc["scorer"], name);
    assert!(
        doc["source"].as_str().is_some_and(|s| !s.is_empty()),
        "{name}: no source"
    );
    doc["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| {
            let id = c["id"].as_str().expect("id").to_string();
            assert!(
                c["why"].as_str().is_some_and(|s| !s.is_empty()),
                "{name}/{id}: no why"
            );
            Case {
                predicted: mobile(&c["predicted"]),
                reference: mobile(&c["reference"]),
                context: context(&c["context"]),
                expected: c["expected"].as_bool().expect("expected"),
                oracle: c["oracle"].as_str().expect("oracle").to_string(),
                id,
            }
        })
        .collect()
}

fn check(name: &str, scorer: Scorer, oracle: &str) {
    let all = cases(name);
    assert!(all.len() >= 30, "{name}: only {} cases", all.len());
    let from_oracle = all.iter().filter(|c| c.oracle == oracle).count();
    assert!(
        from_oracle >= 30,
        "{name}: only {from_oracle} cases from `{oracle}`"
    );
    assert!(all.iter().all(|c| c.oracle == oracle || c.oracle == "mapping"));
    assert!(all.iter().any(|c| c.expected) && all.iter().any(|c| !c.expected));
    let failures: Vec<String> = all
        .iter()
        .filter(|c| scorer.matches(&c.predicted, &c.reference, &c.context) != c.expected)
        .map(|c| format!("{}/{} (expected {}, oracle {})", name, c.id, c.expected, c.oracle))
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} cases differ:\n{}",
        failures.len(),
        all.len(),
        failures.join("\n")
    );
}

#[test]
fn aitw_matches_the_authors_code() {
    check("aitw", Scorer::Aitw, "authors");
}

#[test]
fn odyssey_matches_the_authors_code() {
    check("odyssey", Scorer::Odyssey, "authors");
}

#[test]
fn androidcontrol_matches_the_reexpressed_rule() {
    check("androidcontrol", Scorer::AndroidControl, "re-expression");
}

/// Every fixture pair in both orders, plus desktop pairs: `recall` with an empty context is `equivalent`.
#[test]
fn recall_scorer_is_equivalent() {
    let mut pairs: Vec<(Action, Action)> = Vec::new();
    for name in ["aitw", "androidcontrol", "odyssey"] {
        for c in cases(name) {
            pairs.push((c.predicted.clone(), c.reference.clone()));
            pairs.push((c.reference, c.predicted));
        }
    }
    let desktop = |args: Value| {
        parse_tool_call(
            &json!({"name": "computer_use", "arguments": args}),
            Platform::Desktop,
        )
        .unwrap()
    };
    let d = [
        desktop(json!({"action": "click", "coordinate": [100, 100]})),
        desktop(json!({"action": "left_click", "coordinate": [125, 75]})),
        desktop(json!({"action": "left_click", "coordinate": [126, 100]})),
        desktop(json!({"action": "type", "text": "Hello"})),
        desktop(json!({"action": "type", "text": "hello"})),
        desktop(json!({"action": "scroll", "pixels": 5})),
        desktop(json!({"action": "scroll", "pixels": 300, "coordinate": [1, 1]})),
        desktop(json!({"action": "key", "keys": ["Ctrl", "S"]})),
        desktop(json!({"action": "key", "keys": ["ctrl", "s"]})),
        desktop(json!({"action": "terminate", "status": "failure"})),
        desktop(json!({"action": "terminate"})),
    ];
    for a in &d {
        for b in &d {
            pairs.push((a.clone(), b.clone()));
        }
    }
    let m = mobile(&json!({"action": "click", "coordinate": [100, 100]}));
    pairs.push((m.clone(), d[0].clone()));
    pairs.push((d[0].clone(), m));

    let ctx = ScoreContext::default();
    let (mut agree, mut matched) = (0, 0);
    for (p, r) in &pairs {
        let expected = equivalent(r, p, r.platform);
        assert_eq!(Scorer::Recall.matches(p, r, &ctx), expected, "{p:?} vs {r:?}");
        agree += 1;
        matched += usize::from(expected);
    }
    assert!(
        agree > 250 && matched > 20 && matched < agree,
        "{agree} pairs, {matched} equivalent"
    );
}

/// With a target box, `recall` widens exactly as the step evaluation's `exact_match` does.
#[test]
fn recall_scorer_uses_the_target_box_like_exact_match() {
    let reference = mobile(&json!({"action": "click", "coordinate": [500, 500]}));
    let points = [
        [500, 500],
        [520, 515],
        [560, 500],
        [600, 550],
        [601, 500],
        [399, 450],
    ];
    let ctx = ScoreContext {
        target_box: Some([400, 450, 600, 550]),
        ..ScoreContext::default()
    };
    for p in points {
        for action in ["click", "long_press"] {
            let predicted = mobile(&json!({"action": action, "coordinate": p}));
            assert_eq!(
                Scorer::Recall.matches(&predicted, &reference, &ctx),
                exact_match(&reference, &predicted, ctx.target_box, Platform::Mobile),
                "{action} {p:?}"
            );
        }
    }
    let inside = mobile(&json!({"action": "click", "coordinate": [600, 550]}));
    assert!(Scorer::Recall.matches(&inside, &reference, &ctx));
    assert!(!Scorer::Recall.matches(&inside, &reference, &ScoreContext::default()));
}

#[test]
fn names_round_trip_and_unknown_names_are_errors() {
    for scorer in Scorer::ALL {
        assert_eq!(scorer.name().parse::<Scorer>(), Ok(scorer));
        assert_eq!(scorer.to_string(), scorer.name());
    }
    assert_eq!(Scorer::default(), Scorer::Recall);
    for bad in ["", "AITW", "android_control", "gui-odyssey", " recall"] {
        let err = bad.parse::<Scorer>().unwrap_err();
        assert_eq!(err.0, bad);
        assert!(
            err.to_string().contains("recall, aitw, androidcontrol, odyssey"),
            "{err}"
        );
    }
}

/// The benchmarks are mobile: desktop actions (and mixed pairs) never match under their scorers.
#[test]
fn benchmark_scorers_reject_desktop_actions() {
    let desktop = |r: &str| parse_response(r, Platform::Desktop).unwrap();
    let a = desktop(
        r#"<tool_call>{"name": "computer_use", "arguments": {"action": "left_click", "coordinate": [5, 5]}}</tool_call>"#,
    );
    let t = desktop(
        r#"<tool_call>{"name": "computer_use", "arguments": {"action": "type", "text": "x"}}</tool_call>"#,
    );
    let m = mobile(&json!({"action": "click", "coordinate": [5, 5]}));
    let ctx = ScoreContext::default();
    for scorer in [Scorer::Aitw, Scorer::AndroidControl, Scorer::Odyssey] {
        assert!(!scorer.matches(&a, &a, &ctx), "{scorer}");
        assert!(!scorer.matches(&t, &t, &ctx), "{scorer}");
        assert!(
            !scorer.matches(&a, &m, &ctx) && !scorer.matches(&m, &a, &ctx),
            "{scorer}"
        );
        assert!(scorer.matches(&m, &m, &ctx), "{scorer}");
    }
    assert!(Scorer::Recall.matches(&a, &a, &ctx));
}

/// Degenerate contexts are values, not panics: empty, inverted or non-finite boxes.
#[test]
fn odd_contexts_do_not_panic() {
    let p = mobile(&json!({"action": "click", "coordinate": [10, 10]}));
    let r = mobile(&json!({"action": "click", "coordinate": [900, 900]}));
    let open = mobile(&json!({"action": "open", "text": "Clock"}));
    let ctx = ScoreContext {
        target_box: Some([600, 600, 100, 100]),
        candidate_boxes: vec![[f64::NAN, 0.0, f64::INFINITY, 5.0], [600.0, 600.0, 100.0, 100.0]],
        ui_annotations: vec![[f64::NAN, f64::NAN, 1.0, 1.0], [-5.0, -5.0, -1.0, 3.0]],
    };
    for scorer in Scorer::ALL {
        assert!(!scorer.matches(&p, &r, &ctx), "{scorer}");
        let _ = scorer.matches(&p, &open, &ctx);
    }
}
