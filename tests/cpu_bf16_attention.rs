//! `--cpu-bf16-attention` end to end: the tiny bf16 model with attention's products (and the
//! GEMM's, `--cpu-bf16-dot`) in bf16, against HF transformers' float32 computation on its weights
//! (tools/gen_fixtures.py), within the error bf16 inputs cost. Skipped (with a line on stderr) on
//! CPUs without AMX-BF16. The kernels' own checks (a row's bits alone and in a batch, the error
//! against the definition) are `attention::bf16`'s unit tests.
//!
//! This binary turns both process-wide switches on; it holds no test of the exact path.

mod common;

use std::path::Path;

use common::{fixture, max_abs_diff, Reference};
use recall::backend::cpu::gemm::{set_bf16_dot, Bf16Kernel};
use recall::backend::cpu::{bf16_attention, set_bf16_attention, CpuBackend};
use recall::engine::Pipeline;
use recall::tokenize::chat::parse_messages;

/// The bound of `tests/cpu_bf16_dot.rs` (whose GEMM-only mode measured 0.084 on this model, and
/// HF's own bf16 run 0.221): attention's bf16 products must not take the model past it.
#[test]
fn tiny_bf16_model_with_bf16_attention_stays_near_hf() {
    if !Bf16Kernel::Amx.available() {
        eprintln!("skipped: this CPU lacks AMX-BF16");
        return;
    }
    set_bf16_dot(true).expect("AMX-BF16 CPUs have AVX512-BF16");
    set_bf16_attention(true).expect("the CPU has AMX-BF16");
    assert!(bf16_attention());
    let dir = fixture("tiny-qwen3-vl-bf16");
    let p = Pipeline::load(CpuBackend, &dir, Some(&fixture("tiny-tokenizer/tokenizer.json"))).unwrap();
    let reference = Reference::load(&dir, "reference");
    for (i, prompt) in reference.prompts().iter().enumerate() {
        let messages = parse_messages(&prompt["messages"].to_string(), Path::new("fixture")).unwrap();
        let got = p.prompt_logits(&messages).unwrap();
        let (want, _) = reference.f32(&format!("p{i}.logits"));
        let err = max_abs_diff(&got.logits, &want);
        let spread = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        eprintln!("prompt {i}: logits max abs error {err} (largest |logit| {spread})");
        assert!(
            err <= 0.15,
            "prompt {i}: logits max abs error {err} with bf16 products"
        );
    }
}
