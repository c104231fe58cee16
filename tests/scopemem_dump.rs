//! `recall scopemem dump` writes exactly what serving computes before the encoder: for the same
//! steps, its a0 (text and tokens), p0, H0, encoder fields and the token ids the encoder embeds equal
//! those `recall scopemem run` served with, for both placements; the ids are the actor tokenizer's
//! encoding of the fields cut to the encoder's positions (the start of a0 and the task, the end of the
//! summary and the recent actions).

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
    for placement in ["prepend", "append"] {
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
            "1,2,3",
            "--max-tokens",
            "6",
            "--placement",
            placement,
        ]);
        assert!(
            served.status.success(),
            "{}",
            String::from_utf8_lossy(&served.stderr)
        );
        let served = lines(&String::from_utf8_lossy(&served.stdout));
        let out = tmp.path().join(format!("dump-{placement}.jsonl"));
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
            "1,2,3",
            "--max-tokens",
            "6",
            "--placement",
            placement,
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
