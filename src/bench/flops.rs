//! FLOP and byte counts from the config, the floors of the measurements (docs/BENCH.md): what the
//! decoder, its attention and the vision tower must compute, and the K/V a decode step reads.

use crate::model::{Family, GridThw, TextConfig, VisionConfig};

/// Decoder GEMM FLOPs per token (q, k, v, o, gate, up, down in every layer).
fn decoder_gemm_flops(t: &TextConfig) -> f64 {
    let (h, d) = (t.hidden_size as f64, t.head_dim as f64);
    let qd = t.num_attention_heads as f64 * d;
    let kvd = t.num_key_value_heads as f64 * d;
    let i = t.intermediate_size as f64;
    2.0 * (h * qd + 2.0 * h * kvd + qd * h + 3.0 * h * i) * t.num_hidden_layers as f64
}

/// Causal attention FLOPs (QKᵀ and PV) of `n` new tokens after `start` cached ones.
fn attention_flops(t: &TextConfig, start: usize, n: usize) -> f64 {
    let qd = (t.num_attention_heads * t.head_dim) as f64;
    let (s, n) = (start as f64, n as f64);
    let keys = n * s + n * (n + 1.0) / 2.0;
    4.0 * qd * keys * t.num_hidden_layers as f64
}

/// FLOPs of a prefill of `n` tokens after `start` cached ones, with logits for one row.
pub(super) fn prefill_flops(t: &TextConfig, start: usize, n: usize) -> f64 {
    decoder_gemm_flops(t) * n as f64
        + attention_flops(t, start, n)
        + 2.0 * (t.hidden_size * t.vocab_size) as f64
}

/// FLOPs of the vision tower on one image (GEMMs, attention, mergers). Qwen2.5-VL's windowed blocks
/// are counted with windows of `window_size / patch_size` patches a side.
pub(super) fn vision_flops(v: &VisionConfig, family: Family, grid: GridThw) -> f64 {
    let [t, h, w] = grid;
    let n = (t * h * w) as f64;
    let (d, i) = (v.hidden_size as f64, v.intermediate_size as f64);
    let m = (v.hidden_size * v.merge_unit()) as f64;
    let frame = (h * w) as f64;
    let full_attn = 4.0 * d * t as f64 * frame * frame;
    let mut f = 2.0 * n * v.patch_dim() as f64 * d;
    let mlp = if family == Family::Qwen3Vl { 2.0 } else { 3.0 };
    for b in 0..v.depth {
        f += 2.0 * n * (4.0 * d * d + mlp * d * i);
        f += if family == Family::Qwen25Vl && !v.fullatt_block_indexes.contains(&b) {
            let side = (v.window_size / v.patch_size.max(1)).max(1) as f64;
            4.0 * d * n * (side * side).min(frame)
        } else {
            full_attn
        };
    }
    let mergers = 1 + if family == Family::Qwen3Vl {
        v.deepstack_visual_indexes.len()
    } else {
        0
    };
    let tokens = n / v.merge_unit() as f64;
    f + mergers as f64 * 2.0 * tokens * (m * m + m * v.out_hidden_size as f64)
}

/// K/V bytes of one token of context, all layers.
pub(super) fn kv_bytes_per_token(t: &TextConfig, elem: usize) -> f64 {
    (2 * t.num_hidden_layers * t.num_key_value_heads * t.head_dim * elem) as f64
}
