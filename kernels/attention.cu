// Attention: causal GQA over the paged KV pool (prefill and decode rows of a batch), split-K decode
// with a combine pass, and varlen non-causal attention within segments (vision towers).
// CPU twins: ops::paged_attention and ops::attention_segments (exact softmax; here the online form).
//
// v1 ("warp per query row and head"): one warp owns one (row, head[, split]); each lane holds up to
// four of the head's dimensions (d <= 128: 16/32 fixtures, 64/72/80 vision, 128 text), the running max
// m, the running sum l and the unnormalised output in f32 registers; keys stream through in order with
// one warp-shuffle dot product each (flash-style online softmax, no score matrix in memory).
// Decode: each row cuts its context into ceil(visible / chunk) splits (at most `splits`, the grid.y;
// from its own context only, so a row's result never depends on the others), each writes (acc, m, l)
// in f32, and
// attn_combine_v1 merges them (split-K). Prefill uses splits = 1 and writes bf16 directly.
// Perf plan (v2): Q tiles of 64 rows x K/V tiles of 64 keys staged in shared memory (cp.async / TMA),
// QK^T and PV on tensor cores (mma.sync bf16, then wgmma on sm_90a), causal tile skipping, and
// paged-block-aligned K/V tiles; keep v1 as the reference the v2 kernel is validated against.
#include "common.cuh"

#define MAX_PER_LANE 4 // d <= 128

struct PagedAttnParams {
    const bf16 *q;              // [rows, q_heads * d]
    const bf16 *k;              // [slots, kv_heads * d]
    const bf16 *v;              // [slots, kv_heads * d]
    const u32 *row_seq;         // [rows]: the row's sequence
    const u32 *row_visible;     // [rows]: keys the row attends to (its position + 1)
    const u32 *seq_table_start; // [seqs]: offset of the sequence's block table in `tables`
    const u32 *tables;          // all block tables, concatenated
    bf16 *out;                  // [rows, q_heads * d] (splits == 1)
    float *part;                // [rows * q_heads, splits, d + 2] (splits > 1): acc.., m, l
    int rows;
    int q_heads;
    int kv_heads;
    int d;
    int block_size;
    int splits;                 // grid.y: 1 (prefill: write bf16) or the most splits of any row
    int chunk;                  // decode: target keys per split (a row uses ceil(visible / chunk) splits)
    float scale;
};

struct SegAttnParams {
    const bf16 *q;          // [n, heads * d]
    const bf16 *k;
    const bf16 *v;
    const u32 *row_lo;      // [n]: first row of the row's segment
    const u32 *row_hi;      // [n]: one past its last row
    bf16 *out;
    int rows;
    int heads;
    int d;
    float scale;
};

struct CombineParams {
    const float *part;
    bf16 *out;
    int items;   // rows * q_heads
    int splits;
    int d;
};

// Online softmax over keys t0..t1 of one head; `slot(t)` maps a key index to a row of k/v.
template <typename Slot>
__device__ __forceinline__ void attend_warp(const bf16 *qp, const bf16 *k, const bf16 *v, long long stride,
                                            int col, int d, float scale, int t0, int t1, Slot slot,
                                            float &m, float &l, float (&acc)[MAX_PER_LANE]) {
    int lane = threadIdx.x % WARP;
    float qf[MAX_PER_LANE];
#pragma unroll
    for (int i = 0; i < MAX_PER_LANE; i++) {
        int c = lane + WARP * i;
        qf[i] = c < d ? ld(qp, c) : 0.f;
        acc[i] = 0.f;
    }
    m = NEG_INF;
    l = 0.f;
    for (int t = t0; t < t1; t++) {
        long long base = (long long)slot(t) * stride + col;
        float part = 0.f;
#pragma unroll
        for (int i = 0; i < MAX_PER_LANE; i++) {
            int c = lane + WARP * i;
            if (c < d) part += qf[i] * ld(k, base + c);
        }
        float s = warp_sum(part) * scale;
        float m_new = fmaxf(m, s);
        float corr = expf(m - m_new); // exp(-inf) = 0 on the first key
        float e = expf(s - m_new);
        l = l * corr + e;
#pragma unroll
        for (int i = 0; i < MAX_PER_LANE; i++) {
            int c = lane + WARP * i;
            if (c < d) acc[i] = acc[i] * corr + e * ld(v, base + c);
        }
        m = m_new;
    }
}

struct PagedSlot {
    const u32 *table;
    int block_size;
    __device__ __forceinline__ long long operator()(int t) const {
        return (long long)table[t / block_size] * block_size + t % block_size;
    }
};

struct DirectSlot {
    __device__ __forceinline__ long long operator()(int t) const { return t; }
};

extern "C" __global__ void paged_attention_v1(const PagedAttnParams p) {
    int warps = blockDim.x / WARP;
    int item = blockIdx.x * warps + threadIdx.x / WARP;
    int split = blockIdx.y;
    if (item >= p.rows * p.q_heads) return;
    int lane = threadIdx.x % WARP;
    int r = item / p.q_heads, h = item % p.q_heads;
    int kvh = h / (p.q_heads / p.kv_heads);
    int visible = (int)p.row_visible[r];
    // Decode: this row's own split count and length, from its context only (row independence).
    int row_splits = min(p.splits, max(1, (visible + p.chunk - 1) / p.chunk));
    int len = (visible + row_splits - 1) / row_splits;
    int t0 = p.splits == 1 ? 0 : min(visible, split * len);
    int t1 = p.splits == 1 ? visible : min(visible, (split + 1) * len);
    PagedSlot slot{p.tables + p.seq_table_start[p.row_seq[r]], p.block_size};
    const bf16 *qp = p.q + (long long)r * p.q_heads * p.d + (long long)h * p.d;
    float m, l, acc[MAX_PER_LANE];
    attend_warp(qp, p.k, p.v, (long long)p.kv_heads * p.d, kvh * p.d, p.d, p.scale, t0, t1 > t0 ? t1 : t0,
                slot, m, l, acc);
    if (p.splits == 1) {
        bf16 *o = p.out + (long long)r * p.q_heads * p.d + (long long)h * p.d;
#pragma unroll
        for (int i = 0; i < MAX_PER_LANE; i++) {
            int c = lane + WARP * i;
            if (c < p.d) st(o, c, acc[i] / l);
        }
    } else {
        float *o = p.part + ((long long)item * p.splits + split) * (p.d + 2);
#pragma unroll
        for (int i = 0; i < MAX_PER_LANE; i++) {
            int c = lane + WARP * i;
            if (c < p.d) o[c] = acc[i];
        }
        if (lane == 0) {
            o[p.d] = m;
            o[p.d + 1] = l;
        }
    }
}

// Merges the splits of one (row, head): M = max m_s, L = sum l_s e^(m_s - M), o = sum acc_s e^(m_s - M) / L.
// Splits past the row's context hold m = -inf, l = 0 and add nothing.
extern "C" __global__ void attn_combine_v1(const CombineParams p) {
    int warps = blockDim.x / WARP;
    int item = blockIdx.x * warps + threadIdx.x / WARP;
    if (item >= p.items) return;
    int lane = threadIdx.x % WARP;
    const float *base = p.part + (long long)item * p.splits * (p.d + 2);
    float M = NEG_INF;
    for (int s = 0; s < p.splits; s++) M = fmaxf(M, base[(long long)s * (p.d + 2) + p.d]);
    float L = 0.f;
    for (int s = 0; s < p.splits; s++) {
        const float *b = base + (long long)s * (p.d + 2);
        if (b[p.d + 1] > 0.f) L += b[p.d + 1] * expf(b[p.d] - M);
    }
    for (int c = lane; c < p.d; c += WARP) {
        float o = 0.f;
        for (int s = 0; s < p.splits; s++) {
            const float *b = base + (long long)s * (p.d + 2);
            if (b[p.d + 1] > 0.f) o += b[c] * expf(b[p.d] - M);
        }
        st(p.out, (long long)item * p.d + c, o / L);
    }
}

extern "C" __global__ void attention_segments_v1(const SegAttnParams p) {
    int warps = blockDim.x / WARP;
    int item = blockIdx.x * warps + threadIdx.x / WARP;
    if (item >= p.rows * p.heads) return;
    int lane = threadIdx.x % WARP;
    int r = item / p.heads, h = item % p.heads;
    long long stride = (long long)p.heads * p.d;
    const bf16 *qp = p.q + (long long)r * stride + (long long)h * p.d;
    float m, l, acc[MAX_PER_LANE];
    attend_warp(qp, p.k, p.v, stride, h * p.d, p.d, p.scale, (int)p.row_lo[r], (int)p.row_hi[r], DirectSlot{},
                m, l, acc);
    bf16 *o = p.out + (long long)r * stride + (long long)h * p.d;
#pragma unroll
    for (int i = 0; i < MAX_PER_LANE; i++) {
        int c = lane + WARP * i;
        if (c < p.d) st(o, c, acc[i] / l);
    }
}
