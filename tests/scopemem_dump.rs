//! `recall scopemem dump` writes exactly what serving computes before the encoder: for the same
//! steps, its a0 (text and tokens), p0, H0, encoder fields and the token ids the encoder embeds equal
//! those `recall scopemem run` served with, for both placements and both context layouts; the ids are
//! the actor tokenizer's encoding of the fields cut to the encoder's positions (the start of a0 and
//! the task, the end of the summary and the recent actions). The paper layout holds the task, the
//! last three steps and the latest three screenshots of the dataset step, the current one last.

mod common;

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

fn lines(text: &str) -> Vec<Value> {
    text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

#[test]
fn the_dump_is_what_serving_computes() {
    let (model, dataset, encoder) = (
        fixture("tiny-qwen3-vl"),
        fixture("eval/aitw_steps.jsonl"),
        fixture("scopemem/encoder"),
    );
    let (m, d, enc) = (
        model.to_str().unwrap(),
        dataset.to_str().unwrap(),
        encoder.to_str().unwrap(),
    );
    let tmp = tempfile::tempdir().unwrap();
    let tokenizer = recall::tokenize::Tokenizer::from_file(&model.join("tokenizer.json")).unwrap();
    for (placement, context) in [
        ("prepend", "gui-owl"),
        ("append", "gui-owl"),
        ("prepend", "paper"),
    ] {
        let served = recall(&[
            "scopemem",
            "run",
            "--model",
            m,
            "--dataset",
            d,
            "--encoder",
            enc,
            "--lines",
            "1,2,5",
            "--max-tokens",
            "6",
            "--placement",
            placement,
            "--context",
            context,
        ]);
        assert!(
            served.status.success(),
            "{}",
            String::from_utf8_lossy(&served.stderr)
        );
        let served = lines(&String::from_utf8_lossy(&served.stdout));
        let out = tmp.path().join(format!("dump-{placement}-{context}.jsonl"));
        let o = recall(&[
            "scopemem",
            "dump",
            "--model",
            m,
            "--dataset",
            d,
            "--encoder",
            enc,
            "--lines",
            "1,2,5",
            "--max-tokens",
            "6",
            "--placement",
            placement,
            "--context",
            context,
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let dumped = lines(&std::fs::read_to_string(&out).unwrap());
        assert_eq!(dumped.len(), 3);
        let max = dumped[0]["max_positions"].as_u64().unwrap() as usize;
        for (row, dump) in served.iter().zip(&dumped) {
            let ctx = &row["opinions"]["context"];
            for key in ["first", "first_tokens", "p0", "h0", "fields", "ids"] {
                assert_eq!(
                    ctx[key], dump[key],
                    "{placement} line {}: `{key}` differs",
                    dump["line"]
                );
            }
            assert_eq!(row["opinions"]["first"], dump["first"]);
            assert_eq!(row["outcome"]["reference"], dump["reference"]);
            assert_eq!(dump["placement"], placement);
            assert_eq!(dump["layout"], context);
            if context == "paper" {
                check_paper_layout(&dataset, dump);
            }
            // The ids are the tokenizer's, cut as documented.
            for (field, keep_first) in [
                ("first_opinion", true),
                ("task", true),
                ("summary", false),
                ("recent_actions", false),
            ] {
                let all = tokenizer.encode(dump["fields"][field].as_str().unwrap()).unwrap();
                let want: Vec<u32> = if all.len() <= max {
                    all
                } else if keep_first {
                    all[..max].to_vec()
                } else {
                    all[all.len() - max..].to_vec()
                };
                let got: Vec<u32> = serde_json::from_value(dump["ids"][field].clone()).unwrap();
                assert_eq!(got, want, "field {field}");
            }
            assert!(dump["messages"].as_array().is_some_and(|m| !m.is_empty()));
            assert_eq!(dump["action_types"].as_array().unwrap().len(), 10);
        }
    }
}

/// The paper's context (ScopeMem §3.1) for the dataset step of a dump line: a system turn and one
/// user turn with the task, `Step{i}:` lines for the last three steps only (global numbers), and the
/// latest three screenshots, the current one last.
fn check_paper_layout(dataset: &std::path::Path, dump: &Value) {
    let line = dump["line"].as_u64().unwrap() as usize;
    let text = std::fs::read_to_string(dataset).unwrap();
    let step: Value = serde_json::from_str(text.lines().nth(line - 1).unwrap()).unwrap();
    let history = step["history"].as_array().unwrap();
    let shots: Vec<&str> = step["screenshots"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap())
        .collect();
    let messages = dump["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 2, "line {line}: system + one user turn");
    assert_eq!(messages[0]["role"], "system");
    let content = messages[1]["content"].as_array().unwrap();
    let text = content[0]["text"].as_str().unwrap();
    assert!(text.contains(step["instruction"].as_str().unwrap()));
    let steps: Vec<&str> = text.lines().filter(|l| l.starts_with("Step")).collect();
    let n = history.len();
    assert_eq!(steps.len(), n.min(3), "line {line}: {text}");
    for (k, l) in steps.iter().enumerate() {
        assert!(
            l.starts_with(&format!("Step{}: ", n - steps.len() + k + 1)),
            "{l}"
        );
    }
    if n == 0 {
        assert!(text.ends_with("No previous action."));
    }
    let images: Vec<&str> = content[1..]
        .iter()
        .map(|c| c["image"].as_str().or(c["image_url"]["url"].as_str()).unwrap())
        .collect();
    let want = &shots[shots.len().saturating_sub(3)..];
    assert_eq!(images.len(), want.len(), "line {line}");
    for (got, want) in images.iter().zip(want) {
        assert!(got.ends_with(want), "line {line}: {got} is not {want}");
    }
}
