// Row reductions over the vocabulary: log-softmax gathered at a target (scoring) and argmax (greedy).
// CPU twins: ops::log_softmax_at (normaliser summed in f64) and ops::argmax (first maximum).
// v1: one block of 256 threads per row. Perf plan: fuse into the lm_head epilogue for decode.
#include "common.cuh"

struct RowReduceParams {
    const bf16 *logits;  // [n, vocab]
    const u32 *targets;  // [n] (log_softmax_gather only)
    float *out_f32;      // [n] (log_softmax_gather)
    u32 *out_u32;        // [n] (argmax)
    long long n;
    int vocab;
};

extern "C" __global__ void log_softmax_gather_v1(const RowReduceParams p) {
    __shared__ float scratch[32];
    __shared__ double scratch64[32];
    long long r = blockIdx.x;
    if (r >= p.n) return;
    const bf16 *x = p.logits + r * p.vocab;
    float m = NEG_INF;
    for (int c = threadIdx.x; c < p.vocab; c += blockDim.x) m = fmaxf(m, ld(x, c));
    m = block_max(m, scratch);
    double s = 0.0;
    for (int c = threadIdx.x; c < p.vocab; c += blockDim.x) s += exp((double)(ld(x, c) - m));
    s = block_sum_f64(s, scratch64);
    if (threadIdx.x == 0) p.out_f32[r] = (float)((double)(ld(x, p.targets[r]) - m) - log(s));
}

// First index of the maximum over the non-NaN entries (numpy's nanargmax); a row of NaN gives 0.
// CPU twin: ops::argmax, the same rule.
extern "C" __global__ void argmax_v1(const RowReduceParams p) {
    __shared__ float sv[32];
    __shared__ int si[32];
    long long r = blockIdx.x;
    if (r >= p.n) return;
    const bf16 *x = p.logits + r * p.vocab;
    float bv = NEG_INF;
    int bi = 0x7fffffff;
    for (int c = threadIdx.x; c < p.vocab; c += blockDim.x) {
        float v = ld(x, c);
        // Strided ascending: keeps this thread's first maximum; its first non-NaN entry counts even
        // when it is -inf (v == v is false only for NaN).
        if (v > bv || (bi == 0x7fffffff && v == v)) { bv = v; bi = c; }
    }
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, nw = blockDim.x / WARP;
    for (int o = WARP / 2; o > 0; o /= 2) {
        float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
    }
    if (lane == 0) { sv[warp] = bv; si[warp] = bi; }
    __syncthreads();
    if (warp == 0) {
        bv = lane < nw ? sv[lane] : NEG_INF;
        bi = lane < nw ? si[lane] : 0x7fffffff;
        for (int o = WARP / 2; o > 0; o /= 2) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        if (lane == 0) p.out_u32[r] = bi == 0x7fffffff ? 0u : (u32)bi;
    }
}
