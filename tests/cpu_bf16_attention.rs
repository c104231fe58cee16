//! `--cpu-bf16-attention` end to end: the tiny bf16 model with attention's products (and the
//! GEMM's, `--cpu-bf16-dot`) in bf16, against HF transformers' float32 computation on its weights
//! (tools/gen_fixtures.py), within the error bf16 inputs cost. Skipped (with a line on stderr) on
//! CPUs without AMX-BF16. The kernels' own checks (a row's bits alone and in a batch, the error
//! against the definition) are `attention::bf16`'s unit tests.
//!
//! This binary turns both process-wide switches on; it holds no test of the exact path.

mod common;

use common::assert_tiny_bf16_model_near_hf;
use recall::backend::cpu::gemm::{set_bf16_dot, Bf16Kernel};
use recall::backend::cpu::{bf16_attention, set_bf16_attention};

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
    assert_tiny_bf16_model_near_hf(0.15, "bf16 products");
}
