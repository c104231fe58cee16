//! The text decoder against HF transformers (tools/gen_fixtures.py): chat rendering + tokenization
//! give HF's input ids; every layer's output, the full logits, 16 greedy tokens and teacher-forced
//! log-probs match within 1e-4.

mod common;

use std::path::Path;

use common::{fixture, max_abs_diff, Reference};
use recall::backend::{cpu::CpuBackend, Backend};
use recall::engine::{generate, score, GenerateParams, Pipeline, PromptInput};
use recall::model::{LogitsFor, Positions};
use recall::tokenize::chat::parse_messages;

const TOL: f32 = 1e-4;

/// Checks every prompt of `<model_dir>/<stem>` against the model loaded from `model_dir`.
fn check_model(model_dir: &Path, reference_dir: &Path, stem: &str) {
    let p = Pipeline::load(
        CpuBackend,
        model_dir,
        Some(&fixture("tiny-tokenizer/tokenizer.json")),
    )
    .expect("fixture model loads");
    let reference = Reference::load(reference_dir, stem);
    for (i, prompt) in reference.prompts().iter().enumerate() {
        let name = prompt["name"].as_str().unwrap();
        let messages = parse_messages(&prompt["messages"].to_string(), Path::new("fixture")).unwrap();
        let ids = p.prepare(&messages, true).unwrap().ids;
        assert_eq!(
            ids,
            reference.ids(&format!("p{i}.input_ids")),
            "{name}: input ids differ from HF"
        );
        check_forward(&p, &reference, i, name, &ids);
        check_greedy(&p, &reference, i, name, &ids);
        check_score(&p, prompt, name, &ids);
    }
}

fn check_forward(p: &Pipeline<CpuBackend>, reference: &Reference, i: usize, name: &str, ids: &[u32]) {
    let be = &p.backend;
    let text = &p.model.text;
    let mut cache = text.new_cache(be, ids.len()).unwrap();
    let out = text
        .forward(
            be,
            ids,
            &Positions::text(0, ids.len()),
            None,
            &[],
            &mut cache,
            LogitsFor::All,
            true,
        )
        .unwrap();
    // hidden.0 is the embedding output, hidden.{l+1} the output of decoder layer l.
    for (l, h) in out.hidden_states.iter().enumerate() {
        let (want, _) = reference.f32(&format!("p{i}.hidden.{l}"));
        let err = max_abs_diff(&be.download(h).unwrap(), &want);
        let what = if l == 0 {
            "embeddings".to_string()
        } else {
            format!("decoder layer {}", l - 1)
        };
        assert!(
            err <= TOL,
            "{name}: {what} diverges from HF (max abs error {err})"
        );
    }
    let (want, shape) = reference.f32(&format!("p{i}.logits"));
    assert_eq!(be.dims(&out.logits), (shape[0], shape[1]), "{name}: logits shape");
    let err = max_abs_diff(&be.download(&out.logits).unwrap(), &want);
    assert!(err <= TOL, "{name}: logits max abs error {err}");
}

fn check_greedy(p: &Pipeline<CpuBackend>, reference: &Reference, i: usize, name: &str, ids: &[u32]) {
    let want = reference.ids(&format!("p{i}.greedy"));
    // HF generated with min_new_tokens = 16, i.e. with end-of-sequence suppressed.
    let params = GenerateParams {
        max_tokens: want.len(),
        eos_token_ids: vec![],
        stop_strings: vec![],
    };
    let got = generate(&p.backend, &p.model.text, &PromptInput::text(ids), &params, None).unwrap();
    assert_eq!(got.tokens, want, "{name}: greedy tokens differ from HF");
}

fn check_score(p: &Pipeline<CpuBackend>, prompt: &serde_json::Value, name: &str, ids: &[u32]) {
    let target = prompt["target"].as_str().unwrap();
    let target_ids: Vec<u32> = serde_json::from_value(prompt["target_ids"].clone()).unwrap();
    assert_eq!(
        p.tokenizer.encode(target).unwrap(),
        target_ids,
        "{name}: target ids"
    );
    let s = score(&p.backend, &p.model.text, &PromptInput::text(ids), &target_ids).unwrap();
    let want: Vec<f32> = serde_json::from_value(prompt["target_logprobs"].clone()).unwrap();
    assert!(
        max_abs_diff(&s.token_logprobs, &want) <= TOL,
        "{name}: token log-probs {:?} vs {want:?}",
        s.token_logprobs
    );
    let sum = prompt["target_logprob_sum"].as_f64().unwrap();
    let mean = prompt["target_logprob_mean"].as_f64().unwrap();
    assert!(
        (s.sum_logprob - sum).abs() <= 1e-4 * want.len() as f64,
        "{name}: sum {} vs {sum}",
        s.sum_logprob
    );
    assert!(
        (s.mean_logprob - mean).abs() <= 1e-4,
        "{name}: mean {} vs {mean}",
        s.mean_logprob
    );
}

#[test]
fn qwen3_vl_text_matches_hf() {
    let dir = fixture("tiny-qwen3-vl");
    check_model(&dir, &dir, "reference");
}

#[test]
fn qwen2_5_vl_text_matches_hf() {
    let dir = fixture("tiny-qwen2.5-vl");
    check_model(&dir, &dir, "reference");
}

#[test]
fn bf16_weights_match_hf_on_rounded_weights() {
    let dir = fixture("tiny-qwen3-vl-bf16");
    check_model(&dir, &dir, "reference");
}

/// head_dim 64 (the shape the CUDA v2/flash paths take; tests/cuda_graphs.rs replays it on a GPU).
#[test]
fn head_dim_64_matches_hf_on_rounded_weights() {
    let dir = fixture("tiny-qwen3-vl-d64");
    check_model(&dir, &dir, "reference");
}

#[test]
fn sharded_checkpoint_gives_identical_logits() {
    let single = Pipeline::load(CpuBackend, &fixture("tiny-qwen3-vl"), None).unwrap();
    let sharded = Pipeline::load(
        CpuBackend,
        &fixture("tiny-qwen3-vl-sharded"),
        Some(&fixture("tiny-qwen3-vl/tokenizer.json")),
    )
    .unwrap();
    let reference = Reference::load(&fixture("tiny-qwen3-vl"), "reference");
    for prompt in reference.prompts() {
        let messages = parse_messages(&prompt["messages"].to_string(), Path::new("fixture")).unwrap();
        let a = single.prompt_logits(&messages).unwrap();
        let b = sharded.prompt_logits(&messages).unwrap();
        assert_eq!(a.input_ids, b.input_ids);
        assert!(
            a.logits == b.logits,
            "sharded logits differ from single-file logits"
        );
    }
    // The sharded model also matches HF on its own.
    check_model(
        &fixture("tiny-qwen3-vl-sharded"),
        &fixture("tiny-qwen3-vl"),
        "reference",
    );
}
