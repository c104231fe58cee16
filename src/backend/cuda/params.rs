//! Kernel parameter structs, one per kernel family, mirroring the C structs in `kernels/*.cu` field for
//! field (`#[repr(C)]`; pointers as `u64` device addresses first, then 64-bit counts, then 32-bit ints
//! and floats, so neither side has padding surprises). A kernel takes its struct by value.

use cudarc::driver::DeviceRepr;
use xxhash_rust::xxh64::Xxh64;

/// Parameters that can be hashed field by field into a step's launch trace (see `graph.rs`): a
/// replayed CUDA graph is valid only if every launch's parameters equal the recorded ones.
pub(super) trait Traced {
    fn trace(&self, h: &mut Xxh64);
}

macro_rules! params {
    ($($(#[$m:meta])* $name:ident { $($field:ident : $ty:ty),* $(,)? })*) => {$(
        $(#[$m])*
        #[repr(C)]
        #[derive(Debug, Clone, Copy)]
        pub(super) struct $name { $(pub $field: $ty),* }
        // SAFETY: plain old data of `#[repr(C)]` layout, identical to the C struct of the same name.
        unsafe impl DeviceRepr for $name {}
        impl Traced for $name {
            fn trace(&self, h: &mut Xxh64) {
                $(h.update(&self.$field.to_le_bytes());)*
            }
        }
    )*};
}

/// Lets other kernel families (e.g. `flash.rs`) declare their parameter structs the same way.
#[allow(unused_imports)]
pub(super) use params;

params! {
    /// elementwise.cu: scale_v1, gelu_v1.
    UnaryParams { x: u64, out: u64, n: i64, s: f32, kind: i32 }
    /// elementwise.cu: add_v1, silu_mul_v1.
    BinaryParams { a: u64, b: u64, out: u64, n: i64 }
    /// elementwise.cu: fill_u16_v1.
    FillParams { out: u64, n: i64, bits: u32 }
    /// elementwise.cu: fill_random_v1.
    FillRandomParams { out: u64, seed: u64, first: u64, n: i64, scale: f32, kind: i32 }
    /// embedding.cu: gather_rows_v1.
    GatherParams { src: u64, index: u64, out: u64, n: i32, cols: i32 }
    /// embedding.cu: split_cols_v1.
    SplitColsParams { src: u64, out: u64, n: i32, cols: i32, col0: i32, width: i32 }
    /// embedding.cu: scatter_rows_v1.
    ScatterParams { dst: u64, index: u64, src: u64, n: i32, cols: i32, accumulate: i32 }
    /// embedding.cu: weighted_embedding_v1.
    WeightedParams { table: u64, index: u64, weights: u64, out: u64, rows: i32, cols: i32, taps: i32 }
    /// norm.cu: rms_norm_v1.
    RmsNormParams { x: u64, w: u64, residual: u64, sum_out: u64, out: u64, groups: i64, g: i32, eps: f32 }
    /// norm.cu: layer_norm_v1.
    LayerNormParams { x: u64, w: u64, b: u64, out: u64, rows: i64, cols: i32, eps: f32 }
    /// rope.cu: rope_v1.
    RopeParams { x: u64, cos: u64, sin: u64, out: u64, n: i64, heads: i32, d: i32 }
    /// reduce.cu: log_softmax_gather_v1, argmax_v1.
    RowReduceParams { logits: u64, targets: u64, out_f32: u64, out_u32: u64, n: i64, vocab: i32 }
    /// attention.cu: paged_attention_v1.
    PagedAttnParams {
        q: u64, k: u64, v: u64, row_seq: u64, row_visible: u64, seq_table_start: u64, tables: u64,
        out: u64, part: u64,
        rows: i32, q_heads: i32, kv_heads: i32, d: i32, block_size: i32, splits: i32, chunk: i32,
        scale: f32,
    }
    /// attention.cu: attention_segments_v1.
    SegAttnParams { q: u64, k: u64, v: u64, row_lo: u64, row_hi: u64, out: u64, rows: i32, heads: i32, d: i32, scale: f32 }
    /// attention.cu: attn_combine_v1.
    CombineParams { part: u64, out: u64, items: i32, splits: i32, d: i32 }
}
