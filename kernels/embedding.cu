// Row movement: embedding gather / gather_rows, image-embedding scatter (replace or accumulate), the
// interpolated (weighted) embedding of the vision towers, and the column split of a fused projection.
// CPU twins: CpuBackend::{embedding, gather_rows, scatter_rows, weighted_embedding, split_cols}. Indices are validated on the host before launch.
// v1: one block per output row, threads stride over columns. Perf plan: 16-byte vector copies.
#include "common.cuh"

struct GatherParams {
    const bf16 *src;   // [src_rows, cols]
    const u32 *index;  // [n]
    bf16 *out;         // [n, cols]
    int n;
    int cols;
};

struct SplitColsParams {
    const bf16 *src;   // [n, cols]
    bf16 *out;         // [n, width]: columns col0 .. col0 + width of src
    int n;
    int cols;
    int col0;
    int width;
};

struct ScatterParams {
    bf16 *dst;         // [dst_rows, cols]
    const u32 *index;  // [n]; distinct rows when accumulating (checked on the host)
    const bf16 *src;   // [n, cols]
    int n;
    int cols;
    int accumulate;
};

struct WeightedParams {
    const bf16 *table;    // [vocab, cols]
    const u32 *index;     // [rows * taps]
    const float *weights; // [rows * taps]
    bf16 *out;            // [rows, cols]
    int rows;
    int cols;
    int taps;
};

extern "C" __global__ void gather_rows_v1(const GatherParams p) {
    int r = blockIdx.x;
    if (r >= p.n) return;
    const bf16 *s = p.src + (long long)p.index[r] * p.cols;
    bf16 *o = p.out + (long long)r * p.cols;
    for (int c = threadIdx.x; c < p.cols; c += blockDim.x) o[c] = s[c];
}

// One part of a fused projection's output (q, k or v of one qkv GEMM): a strided copy, so the part
// is bitwise those columns. No index to stage, unlike a gather.
extern "C" __global__ void split_cols_v1(const SplitColsParams p) {
    int r = blockIdx.x;
    if (r >= p.n) return;
    const bf16 *s = p.src + (long long)r * p.cols + p.col0;
    bf16 *o = p.out + (long long)r * p.width;
    for (int c = threadIdx.x; c < p.width; c += blockDim.x) o[c] = s[c];
}

extern "C" __global__ void scatter_rows_v1(const ScatterParams p) {
    int r = blockIdx.x;
    if (r >= p.n) return;
    bf16 *d = p.dst + (long long)p.index[r] * p.cols;
    const bf16 *s = p.src + (long long)r * p.cols;
    for (int c = threadIdx.x; c < p.cols; c += blockDim.x) {
        if (p.accumulate) st(d, c, ld(d, c) + ld(s, c));
        else d[c] = s[c];
    }
}

// out[r] = sum_j w[r,j] * table[idx[r,j]], taps summed in order j = 0.. as on the CPU.
extern "C" __global__ void weighted_embedding_v1(const WeightedParams p) {
    int r = blockIdx.x;
    if (r >= p.rows) return;
    for (int c = threadIdx.x; c < p.cols; c += blockDim.x) {
        float acc = 0.f;
        for (int j = 0; j < p.taps; j++) {
            long long k = (long long)r * p.taps + j;
            acc += ld(p.table, (long long)p.index[k] * p.cols + c) * p.weights[k];
        }
        st(p.out, (long long)r * p.cols + c, acc);
    }
}
