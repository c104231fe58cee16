// Fused kernels: several ops of the Backend trait in one launch, each bitwise equal to the composition
// of the unfused kernels it replaces (tests/cuda_fused.rs checks exactly that).
//
// qk_norm_rope_write_v1: the attention block's step between the projections and the attention —
// per-head RMSNorm of q and k (Qwen3; optional), rotary embedding (rotate_half, per-row tables) and the
// write of the rotated k and of v into rows slots[r] of the paged KV pools — in place of
// rms_norm_v1 ×2, rope_v1 ×2 and scatter_rows_v1 ×2. CPU twin: the default
// Backend::qk_norm_rope_write (ops::rms_norm_group, ops::rope_head, scatter_rows).
//
// Bitwise equality with rms_norm_v1 -> rope_v1 -> scatter_rows_v1:
//  - one block per (row, head), blockDim as rms_norm_v1 gets for a group of d (d rounded up to whole
//    warps, at most 256: the host uses the same grid_rows()), so each thread sums the same elements
//    in the same order and block_sum reduces them the same way;
//  - the sum of squares, the inverse rms, the scaling and the rotation are common.cuh's rms_* and
//    rope_* helpers, the very code rms_norm_v1 and rope_v1 call (explicit-rounding intrinsics, so the
//    compiler cannot contract them differently here);
//  - the normalised head is rounded to bf16 (into shared memory) before the rotation reads it, as
//    rms_norm_v1's bf16 output is what rope_v1 reads; v is copied as bf16 bits.
// Slots must be distinct (checked on the host; duplicates take the unfused path, whose writes are
// ordered).
// Perf plan: one warp per head with 16-byte loads, several heads per block, the tables read once per row.
#include "common.cuh"

struct QkNormRopeParams {
    const bf16 *q;       // [n, q_heads * d]
    const bf16 *k;       // [n, kv_heads * d]
    const bf16 *v;       // [n, kv_heads * d]
    const bf16 *q_w;     // [d], or null: no q/k norms (then k_w is null too)
    const bf16 *k_w;     // [d], or null
    const bf16 *cos;     // [n, d]
    const bf16 *sin;     // [n, d]
    const u32 *slots;    // [n], distinct rows of the pools
    bf16 *q_out;         // [n, q_heads * d]
    bf16 *k_pool;        // [pool_rows, kv_heads * d]
    bf16 *v_pool;        // [pool_rows, kv_heads * d]
    long long n;
    int q_heads;
    int kv_heads;
    int d;               // even
    float eps;
};

// Block (r, h) for h < q_heads handles q head h of row r; for h >= q_heads, kv head h - q_heads of
// row r (k normalised, rotated and written to the k pool; v copied to the v pool).
// Dynamic shared memory: d bf16 (the normalised head).
extern "C" __global__ void qk_norm_rope_write_v1(const QkNormRopeParams p) {
    extern __shared__ bf16 xs[];
    __shared__ float scratch[32];
    int heads = p.q_heads + p.kv_heads;
    long long item = blockIdx.x;
    if (item >= p.n * heads) return;
    long long r = item / heads;
    int h = (int)(item % heads);
    bool is_q = h < p.q_heads;
    int kh = h - p.q_heads;
    int d = p.d;
    const bf16 *x, *w;
    bf16 *out;
    if (is_q) {
        x = p.q + (r * p.q_heads + h) * (long long)d;
        w = p.q_w;
        out = p.q_out + (r * p.q_heads + h) * (long long)d;
    } else {
        long long slot = p.slots[r];
        x = p.k + (r * p.kv_heads + kh) * (long long)d;
        w = p.k_w;
        out = p.k_pool + (slot * p.kv_heads + kh) * (long long)d;
    }
    // The same for the whole block, so block_sum's barriers are reached by every thread.
    if (w) {
        float ss = rms_sum_sq([&](int c) { return ld(x, c); }, d, scratch);
        float rinv = rms_inv(ss, d, p.eps);
        for (int c = threadIdx.x; c < d; c += blockDim.x) xs[c] = __float2bfloat16_rn(rms_apply(ld(w, c), ld(x, c), rinv));
    } else {
        for (int c = threadIdx.x; c < d; c += blockDim.x) xs[c] = x[c];
    }
    __syncthreads();
    int half = d / 2;
    const bf16 *cs = p.cos + r * d, *sn = p.sin + r * d;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float a = __bfloat162float(xs[i]), b = __bfloat162float(xs[i + half]);
        st(out, i, rope_first(a, b, ld(cs, i), ld(sn, i)));
        st(out, i + half, rope_second(a, b, ld(cs, i + half), ld(sn, i + half)));
    }
    if (!is_q) {
        long long off = (r * p.kv_heads + kh) * (long long)d;
        bf16 *vo = p.v_pool + ((long long)p.slots[r] * p.kv_heads + kh) * (long long)d;
        for (int c = threadIdx.x; c < d; c += blockDim.x) vo[c] = p.v[off + c];
    }
}
