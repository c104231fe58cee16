// RMSNorm (per group of g columns: the hidden norm and the per-head q/k norms), RMSNorm with a fused
// residual add, and LayerNorm. CPU twins: ops::rms_norm_group, ops::layer_norm_row.
// v1: one block of 128 threads per group (row); sums of squares in f32, tree-reduced across the block.
// Perf plan: one warp per group when g <= 256 (q/k norms, head_dim 128), 16-byte loads, and fusing
// the q/k norm with M-RoPE and the paged-KV write (needs a fused op in the Backend trait).
#include "common.cuh"

struct RmsNormParams {
    const bf16 *x;       // [groups, g]
    const bf16 *w;       // [g]
    const bf16 *residual;// [groups, g] or null (fused variant: x + residual is normalised)
    bf16 *sum_out;       // [groups, g] or null: receives x + residual (the new residual stream)
    bf16 *out;           // [groups, g]
    long long groups;
    int g;
    float eps;
};

struct LayerNormParams {
    const bf16 *x;
    const bf16 *w;
    const bf16 *b;
    bf16 *out;
    long long rows;
    int cols;
    float eps;
};

// HF order: w * (x * rsqrt(mean(x^2) + eps)); the CPU computes 1 / sqrt(), so do we.
// With a residual, the sum is rounded to bf16 first (it is stored as the residual stream in bf16),
// and the norm is taken of the rounded value, as the unfused add + rms_norm would.
extern "C" __global__ void rms_norm_v1(const RmsNormParams p) {
    __shared__ float scratch[32];
    long long grp = blockIdx.x;
    if (grp >= p.groups) return;
    const bf16 *x = p.x + grp * p.g;
    // The arithmetic is common.cuh's rms_* helpers, shared with qk_norm_rope_write_v1 (fused.cu).
    float ss = rms_sum_sq(
        [&](int c) {
            float v = ld(x, c);
            if (p.residual) {
                v = __bfloat162float(__float2bfloat16_rn(v + ld(p.residual, grp * p.g + c)));
                if (p.sum_out) st(p.sum_out, grp * p.g + c, v);
            }
            return v;
        },
        p.g, scratch);
    float r = rms_inv(ss, p.g, p.eps);
    for (int c = threadIdx.x; c < p.g; c += blockDim.x) {
        float v = ld(x, c);
        if (p.residual) v = __bfloat162float(__float2bfloat16_rn(v + ld(p.residual, grp * p.g + c)));
        st(p.out, grp * p.g + c, rms_apply(ld(p.w, c), v, r));
    }
}

// Mean first, then the variance of the centred values (two passes, as the CPU twin).
extern "C" __global__ void layer_norm_v1(const LayerNormParams p) {
    __shared__ float scratch[32];
    long long row = blockIdx.x;
    if (row >= p.rows) return;
    const bf16 *x = p.x + row * p.cols;
    float s = 0.f;
    for (int c = threadIdx.x; c < p.cols; c += blockDim.x) s += ld(x, c);
    float mean = block_sum(s, scratch) / (float)p.cols;
    float ss = 0.f;
    for (int c = threadIdx.x; c < p.cols; c += blockDim.x) {
        float d = ld(x, c) - mean;
        ss += d * d;
    }
    float r = 1.f / sqrtf(block_sum(ss, scratch) / (float)p.cols + p.eps);
    for (int c = threadIdx.x; c < p.cols; c += blockDim.x)
        st(p.out, row * p.cols + c, (ld(x, c) - mean) * r * ld(p.w, c) + ld(p.b, c));
}
