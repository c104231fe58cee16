//! The `recall` binary end to end on the tiny fixture model: `logits` writes HF's logits, `score`
//! prints HF's log-probs, `generate` runs, and bad input fails with a message instead of a panic.

mod common;

use std::process::{Command, Output};

use common::{fixture, max_abs_diff, Reference};

fn recall(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_recall"))
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("the recall binary runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn logits_and_score_match_hf() {
    let model = fixture("tiny-qwen2.5-vl");
    let reference = Reference::load(&model, "reference");
    let tmp = tempfile::tempdir().unwrap();
    let prompt = &reference.prompts()[1];
    let messages = tmp.path().join("messages.json");
    std::fs::write(&messages, prompt["messages"].to_string()).unwrap();
    let out = tmp.path().join("logits.safetensors");
    let o = recall(&[
        "logits",
        "--model",
        model.to_str().unwrap(),
        "--messages",
        messages.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));

    let bytes = std::fs::read(&out).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let ids = st.tensor("input_ids").unwrap();
    assert_eq!(ids.dtype(), safetensors::Dtype::I64);
    let ids: Vec<u32> = ids
        .data()
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32)
        .collect();
    assert_eq!(ids, reference.ids("p1.input_ids"));
    let logits = st.tensor("logits").unwrap();
    let (want, shape) = reference.f32("p1.logits");
    assert_eq!(logits.shape(), &shape[..]);
    let got: Vec<f32> = logits
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert!(max_abs_diff(&got, &want) <= 1e-4);

    let o = recall(&[
        "score",
        "--model",
        model.to_str().unwrap(),
        "--messages",
        messages.to_str().unwrap(),
        "--target",
        prompt["target"].as_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let want = prompt["target_logprob_sum"].as_f64().unwrap();
    assert!(
        (v["sum_logprob"].as_f64().unwrap() - want).abs() < 1e-3,
        "{v} vs {want}"
    );
}

#[test]
fn generate_runs_and_reports() {
    let model = fixture("tiny-qwen3-vl");
    let o = recall(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "Hello",
        "--max-tokens",
        "5",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let n = v["tokens"].as_array().unwrap().len();
    assert!((1..=5).contains(&n), "{v}");
}

#[test]
fn bad_input_fails_cleanly() {
    let model = fixture("tiny-qwen3-vl");
    let tmp = tempfile::tempdir().unwrap();
    let bad = tmp.path().join("bad.json");
    std::fs::write(&bad, r#"[{"role": "user", "content": [{"type": "text"}]}]"#).unwrap();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["generate", "--model", "/nonexistent/model", "--prompt", "x"],
            "/nonexistent/model",
        ),
        (
            vec![
                "score",
                "--model",
                model.to_str().unwrap(),
                "--messages",
                bad.to_str().unwrap(),
                "--target",
                "x",
            ],
            "messages[0].content[0].text",
        ),
        (
            vec![
                "logits",
                "--model",
                model.to_str().unwrap(),
                "--messages",
                "/nonexistent.json",
                "--out",
                "/tmp/x",
            ],
            "/nonexistent.json",
        ),
    ];
    for (args, needle) in cases {
        let o = recall(&args);
        let err = stderr(&o);
        assert!(!o.status.success(), "{args:?} should fail");
        assert!(err.contains(needle), "{args:?}: stderr lacks {needle:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    }
}
