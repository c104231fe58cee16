// Rotary embedding, rotate_half convention, per-row tables. CPU twin: ops::rope_head.
// The tables are the M-RoPE tables the model computes on the host (interleaved or chunked sections
// are already resolved there), so one kernel serves both Qwen3-VL and Qwen2.5-VL.
// v1: one thread per (row, head, i < d/2) pair. Perf plan: fuse with the q/k RMSNorm and the paged-KV
// write (one kernel per layer for q and k), reading the tables once per row.
#include "common.cuh"

struct RopeParams {
    const bf16 *x;      // [n, heads * d]
    const bf16 *cos;    // [n, d] (bf16: the tables are activations of the Backend trait, as in HF bf16)
    const bf16 *sin;    // [n, d]
    bf16 *out;          // [n, heads * d]
    long long n;
    int heads;
    int d;
};

extern "C" __global__ void rope_v1(const RopeParams p) {
    int half = p.d / 2;
    long long total = p.n * p.heads * half;
    for (long long t = blockIdx.x * (long long)blockDim.x + threadIdx.x; t < total; t += (long long)gridDim.x * blockDim.x) {
        int i = (int)(t % half);
        long long rh = t / half;
        int h = (int)(rh % p.heads);
        long long r = rh / p.heads;
        long long base = r * (long long)p.heads * p.d + (long long)h * p.d;
        const bf16 *c = p.cos + r * p.d, *s = p.sin + r * p.d;
        float a = ld(p.x, base + i), b = ld(p.x, base + i + half);
        // common.cuh's rope_* helpers, shared with qk_norm_rope_write_v1 (fused.cu).
        st(p.out, base + i, rope_first(a, b, ld(c, i), ld(s, i)));
        st(p.out, base + i + half, rope_second(a, b, ld(c, i + half), ld(s, i + half)));
    }
}
