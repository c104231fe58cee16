//! `recall episode run|eval --policy oracle` and the offline evaluation on the tiny model: the
//! oracle's choices against the utility labels `recall episode label` writes, its fallback, and the
//! evaluation's exact invariants (Recent-B has margin 0 and the same match rate as pass 1).

mod common;

use std::collections::{BTreeMap, HashMap};
use std::process::{Command, Output};

use common::fixture;
use serde_json::Value;

fn recall(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_recall"))
        .args(args)
        .env("RUST_LOG", "warn")
        .env("RECALL_BACKEND", "cpu")
        .output()
        .expect("the recall binary runs")
}

fn ok(o: &Output) -> String {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn model() -> String {
    fixture("tiny-qwen3-vl").to_str().unwrap().to_string()
}

fn episode() -> String {
    fixture("episode-sample").to_str().unwrap().to_string()
}

/// At B = 1 a wide oracle beam sees every pool event, so its choice is the pool singleton with the
/// highest label utility, or Recent-1 when that singleton scores below it.
#[test]
fn the_oracle_picks_the_best_labelled_singleton_or_falls_back() {
    let tmp = tempfile::tempdir().unwrap();
    let labels = tmp.path().join("labels.jsonl");
    let (m, e) = (model(), episode());
    ok(&recall(&[
        "episode",
        "label",
        "--model",
        &m,
        "--episode",
        &e,
        "--budgets",
        "1",
        "--out",
        labels.to_str().unwrap(),
    ]));
    let json = tmp.path().join("run.json");
    ok(&recall(&[
        "episode",
        "run",
        "--model",
        &m,
        "--episode",
        &e,
        "--budget",
        "1",
        "--policy",
        "oracle",
        "--oracle-beam",
        "64",
        "--max-tokens",
        "4",
        "--json",
        json.to_str().unwrap(),
    ]));
    let runs: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let mut q: BTreeMap<(u64, Vec<u64>), f64> = BTreeMap::new();
    let mut pools: HashMap<u64, Vec<u64>> = HashMap::new();
    for line in std::fs::read_to_string(&labels).unwrap().lines() {
        let v: Value = serde_json::from_str(line).unwrap();
        let t = v["t"].as_u64().unwrap();
        if v["kind"] == "decision" {
            // The pool: one event per screenshot, the most recent.
            let mut seen = HashMap::new();
            for ev in v["context"]["events"].as_array().unwrap() {
                seen.insert(
                    ev["image_hash"].as_str().unwrap().to_string(),
                    ev["step"].as_u64().unwrap(),
                );
            }
            pools.insert(t, seen.into_values().collect());
            continue;
        }
        let set: Vec<u64> = serde_json::from_value(v["set"].clone()).unwrap();
        q.insert((t, set), v["q"].as_f64().unwrap());
    }
    let mut reallocated = 0;
    for r in &runs {
        let t = r["t"].as_u64().unwrap();
        let chosen: Vec<u64> = serde_json::from_value(r["allocation"].clone()).unwrap();
        if t <= 2 {
            assert_eq!(chosen, (1..t).collect::<Vec<_>>(), "t={t}: no choice to make");
            continue;
        }
        let recent = q[&(t, vec![t - 1])];
        let (best, q_best) = pools[&t]
            .iter()
            .map(|&j| (j, q[&(t, vec![j])]))
            .max_by(|a, b| a.1.total_cmp(&b.1).then(b.0.cmp(&a.0)))
            .unwrap();
        let want = if q_best >= recent { vec![best] } else { vec![t - 1] };
        assert_eq!(
            chosen, want,
            "t={t}: Recent-1 {recent}, best singleton {best} at {q_best}"
        );
        reallocated += usize::from(chosen != vec![t - 1]);
    }
    assert!(
        reallocated > 0,
        "the fixture should make the oracle move at least once"
    );
}

/// The evaluation of Recent-B: every margin is exactly 0 and the policy's match rate is pass 1's;
/// the oracle's margins are never negative (it falls back to Recent-B). JSON, Markdown and the chart
/// are written.
#[test]
fn offline_evaluation_reports_matches_and_margins() {
    let tmp = tempfile::tempdir().unwrap();
    let (m, e) = (model(), episode());
    let eval = |policy: &str| {
        let out = tmp.path().join(policy);
        let stdout = ok(&recall(&[
            "episode",
            "eval",
            "--model",
            &m,
            "--episode",
            &e,
            "--budget",
            "1",
            "--policy",
            policy,
            "--max-tokens",
            "4",
            "--resamples",
            "200",
            "--out",
            out.to_str().unwrap(),
        ]));
        assert!(
            stdout.contains("mean log-likelihood margin over Recent-B"),
            "{stdout}"
        );
        assert!(std::fs::read_to_string(out.join("eval.md"))
            .unwrap()
            .contains("| full-action match |"));
        let png = image::open(out.join("margins.png")).unwrap();
        assert!(png.width() > 100 && png.height() > 100);
        let v: Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("eval.json")).unwrap()).unwrap();
        v
    };
    let recent = eval("recent");
    assert_eq!(recent["steps"], 6);
    assert_eq!(recent["reallocated"], 0);
    for row in recent["rows"].as_array().unwrap() {
        assert_eq!(row["margin"].as_f64().unwrap().to_bits(), 0f64.to_bits(), "{row}");
        assert_eq!(row["matches"], row["recent_matches"], "{row}");
    }
    assert_eq!(recent["match_gain"]["value"], 0.0);
    let oracle = eval("oracle");
    assert!(oracle["reallocated"].as_u64().unwrap() > 0);
    for row in oracle["rows"].as_array().unwrap() {
        assert!(row["margin"].as_f64().unwrap() >= 0.0, "{row}");
    }
    let ci = &oracle["mean_margin"]["interval"];
    let value = oracle["mean_margin"]["value"].as_f64().unwrap();
    assert!(value > 0.0);
    assert!(
        ci["lo"].as_f64().unwrap() <= value && value <= ci["hi"].as_f64().unwrap(),
        "{ci}"
    );
}

#[test]
fn an_unknown_policy_names_the_oracle_among_the_choices() {
    let o = recall(&[
        "episode",
        "run",
        "--model",
        &model(),
        "--episode",
        &episode(),
        "--policy",
        "nope",
    ]);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("oracle"),
        "the error lists the policies"
    );
}
