// Decode attention v2: split-K paged attention for batches of decode rows (one new token per sequence),
// on tensor cores, one block per (row, kv head, split) serving every q head of the GQA group, so each K/V
// element is read from global memory once per group (v1 reads it once per q head). Host side:
// src/backend/cuda/decode.rs; the partials are merged by attn_combine_v1 (attention.cu). CPU twin:
// ops::paged_attention (exact softmax; here the online form).
//
// Work split. grid = (rows * kv_heads, splits), block = 4 warps. A row cuts its context into
// row_splits = min(splits, ceil(visible / chunk)) splits of `len` keys (ceil(visible / row_splits)
// rounded up to 16), from its own context only: its result never depends on the other rows or on
// grid.y (with CUDA graphs grid.y is fixed at the maximum while contexts grow; splits past the row's
// context write m = -inf, l = 0 and exit). Inside a split the 4 warps take 16-key tiles round-robin
// (warp w: tiles w, w + 4, ...). Tiles start at multiples of 16 and the block size is a multiple of 16,
// so the 16 keys of a tile are consecutive slots of one pool block: one table lookup per tile. Each warp
// prefetches its next tile into L2 (prefetch.global.L2, no registers), so the loads of that tile hit L2;
// NVRTC's scheduler issues the V loads after the QK mma, so without it a tile would wait on DRAM twice.
//
// Per tile and warp, with mma.sync.m16n8k16 bf16 -> f32 (M = q heads of the group, padded to 8 or 16):
//   S = Q K^T   2 n-tiles of 8 keys x D/16 k-steps; Q's A fragments stay in registers for the whole
//               split; K's B fragments come straight from global memory with 16-byte loads;
//   softmax     online, base 2 (scale * log2 e folded into one multiply), keys past the split masked
//               to -inf; the running max is shared by the 4 lanes of a head (2 shuffles per tile);
//   O += P V    P re-used from the S accumulators as the A operand (converted to bf16; l sums the
//               rounded P that multiplies V), V's B fragments built from 16-byte global loads with one
//               byte-permute per register; D/8 n-tiles.
// Then l is summed over the 4 lanes of each head, the 4 warps' (O, m, l) are merged in shared memory in
// warp order, and the block writes one (acc, m, l) partial per (row, q head, split) in v1's f32 layout
// [rows * q_heads, splits, D + 2] (m converted to natural-log units), which attn_combine_v1 merges.
//
// Fragment layouts (PTX ISA, mma.m16n8k16 bf16; lane = g * 4 + t; registers pack two bf16, lower k in the
// low half): A a0 (row g, k 2t..2t+1) a1 (row g+8, same k) a2 (row g, k 2t+8..) a3 (row g+8, k 2t+8..);
// B b0 (k 2t..2t+1, col g) b1 (k 2t+8.., col g); C c0 c1 (row g, cols 2t, 2t+1) c2 c3 (row g+8, same).
// A dot product may visit the head dims in any order, as long as Q and K agree; an output may be laid
// out in any order, as long as the write-back knows it. The layouts below use that freedom so that every
// global load is 16 bytes and every load instruction of a warp reads whole 32-byte sectors:
//   QK:  lane (g, t) loads key g of the n-tile at 16-byte chunks 4j + t (j < D/32): the 4 lanes of a key
//        read 64 contiguous bytes per instruction. Chunk 4j + t's words w0..w3 are b0, b1 of k-step 2j
//        and b0, b1 of k-step 2j + 1 (physical dims 8(4j+t) + {0,1 | 2,3 | 4,5 | 6,7} for logical k
//        {2t | 2t+8} of those k-steps). Q's A fragments use the same map with row = head g (and g + 8).
//   PV:  k = key of the tile (identity), so a0 a2 = P of keys 2t..2t+1 and 8+2t..8+2t+1 = the S
//        accumulators c0c1 of n-tiles 0 and 1 (a1 a3 = c2c3, heads g + 8). Output n-tile nt, col n is
//        dim 8(n + 8(nt / 8)) + nt % 8: lane (g, t) loads keys 2t, 2t+1, 2t+8, 2t+9 at chunks g + 8i
//        (8 lanes read 128 contiguous bytes of one key per instruction) and byte-permutes word pairs of
//        two keys into b0 = (V[2t][dim], V[2t+1][dim]), b1 = (V[2t+8][dim], V[2t+9][dim]). The
//        accumulator c0 c1 of n-tile nt then holds head g at dims of chunks 2t + 8(nt / 8) and
//        2t + 1 + 8(nt / 8), element nt % 8.
// Keys past the split (in its last tile) are never read from the pool: their lanes load the tile's last
// valid key instead (the pool beyond a context may hold anything, NaN included, and 0 * NaN would poison
// O), and their scores are masked to -inf, so P is exactly 0 for them.
//
// Determinism: a block's arithmetic depends only on its row's q, keys and split (fixed tile order per
// warp, fixed shuffle order, warps merged in index order); an mma output element depends only on its
// own A row, B column and C element, so the padding heads never touch real ones.
//
// Instantiations: D = 64 and 128; G = q_heads / kv_heads <= 8 (M padded to 8: a1 = a3 = 0, c2 c3
// discarded) or <= 16 (full m16). Registers per thread at D = 128, G <= 8: Q 16, O 32, K + V loads 64.
#include "common.cuh"

#define DEC_WARPS 4
#define DEC_TILE 16
#define DEC_LN2 0.69314718055994530942f

struct DecodeV2Params {
    const bf16 *q;          // [rows, q_heads * D]
    const bf16 *k;          // [slots, kv_heads * D]
    const bf16 *v;          // [slots, kv_heads * D]
    const u32 *row_visible; // [rows]: keys the row attends to (its context length)
    const u32 *row_table;   // [rows]: offset of the row's block table in `tables`
    const u32 *tables;      // all block tables, concatenated
    float *part;            // [rows * q_heads, splits, D + 2]: acc.., m, l
    int rows;
    int q_heads;
    int kv_heads;
    int block_size;         // a multiple of DEC_TILE
    int splits;             // grid.y
    int chunk;              // target keys per split (a row uses ceil(visible / chunk) splits)
    float scale_log2;       // log2(e) / sqrt(D)
};

// D += A B (m16n8k16, bf16 inputs, f32 accumulators).
__device__ __forceinline__ void dec_mma(float &d0, float &d1, float &d2, float &d3, u32 a0, u32 a1, u32 a2,
                                        u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint4 dec_ld16(const bf16 *p) { return __ldg(reinterpret_cast<const uint4 *>(p)); }

__device__ __forceinline__ void dec_prefetch_l2(const bf16 *p) {
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}

__device__ __forceinline__ u32 dec_word(const uint4 &w, int i) {
    return i == 0 ? w.x : i == 1 ? w.y : i == 2 ? w.z : w.w;
}

// Two floats as packed bf16 (lo in the low half), and the sum of the two rounded values.
__device__ __forceinline__ u32 dec_pack(float lo, float hi, float &sum) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    sum += __low2float(h) + __high2float(h);
    return *reinterpret_cast<u32 *>(&h);
}

// Q's A fragments of one head (zeros when the head is padding): k-steps 2j and 2j + 1 from chunk 4j + t.
template <int KS>
__device__ __forceinline__ void dec_load_q(const bf16 *head, bool real, int t, u32 (&f)[KS][2]) {
#pragma unroll
    for (int j = 0; j < KS / 2; j++) {
        uint4 w = real ? dec_ld16(head + (4 * j + t) * 8) : make_uint4(0, 0, 0, 0);
        f[2 * j][0] = w.x;
        f[2 * j][1] = w.y;
        f[2 * j + 1][0] = w.z;
        f[2 * j + 1][1] = w.w;
    }
}

// Online-softmax update of one head's scores in this tile (4 per lane, already scaled and masked):
// returns the correction factor of the old state and packs P as bf16 (keys 2t..2t+1, 8+2t..8+2t+1).
__device__ __forceinline__ float dec_softmax(float s00, float s01, float s10, float s11, float &m, float &l,
                                             u32 &p0, u32 &p1) {
    float mx = fmaxf(fmaxf(s00, s01), fmaxf(s10, s11));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    // The tile's first key is always valid, so mx and m_new are finite; exp2(-inf) = 0 on the first tile.
    float m_new = fmaxf(m, mx);
    float corr = exp2f(m - m_new);
    float sum = 0.f;
    p0 = dec_pack(exp2f(s00 - m_new), exp2f(s01 - m_new), sum);
    p1 = dec_pack(exp2f(s10 - m_new), exp2f(s11 - m_new), sum);
    l = l * corr + sum;
    m = m_new;
    return corr;
}

template <int D, bool FULL>
__device__ __forceinline__ void paged_decode_v2(const DecodeV2Params &p) {
    constexpr int KS = D / 16;        // k-steps of S = Q K^T
    constexpr int JQ = D / 32;        // K chunks per lane per key (chunks 4j + t)
    constexpr int NT = D / 8;         // n-tiles of O = P V
    constexpr int VC = D / 64;        // V chunks per lane per key (chunks g + 8i)
    constexpr int MR = FULL ? 16 : 8; // q heads a block holds
    constexpr int SO = D + 4;         // merge-buffer row (padded against bank conflicts)
    __shared__ float s_o[DEC_WARPS][MR][SO];
    __shared__ float s_m[DEC_WARPS][MR];
    __shared__ float s_l[DEC_WARPS][MR];

    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int g = lane >> 2, t = lane & 3;
    const int r = blockIdx.x / p.kv_heads, kvh = blockIdx.x % p.kv_heads, split = blockIdx.y;
    const int G = p.q_heads / p.kv_heads;
    // This row's splits and this split's keys [t0, t1), from the row's own context only.
    const int visible = (int)p.row_visible[r];
    const int row_splits = min(p.splits, max(1, (visible + p.chunk - 1) / p.chunk));
    const int len = ((visible + row_splits - 1) / row_splits + DEC_TILE - 1) / DEC_TILE * DEC_TILE;
    const int t0 = min(visible, split * len), t1 = min(visible, t0 + len);
    const long long head_stride = (long long)p.splits * (D + 2); // between q heads in `part`
    float *part = p.part + ((long long)r * p.q_heads + (long long)kvh * G) * head_stride + (long long)split * (D + 2);
    if (t0 >= t1) {
        for (int h = threadIdx.x; h < G; h += blockDim.x) {
            part[h * head_stride + D] = NEG_INF;
            part[h * head_stride + D + 1] = 0.f;
        }
        return;
    }

    const bf16 *qg = p.q + ((long long)r * p.q_heads + (long long)kvh * G) * D;
    u32 qa[KS][2], qb[KS][2];
    dec_load_q<KS>(qg + g * D, g < G, t, qa);
    if (FULL) dec_load_q<KS>(qg + (g + 8) * D, g + 8 < G, t, qb);

    float o[NT][4];
#pragma unroll
    for (int n = 0; n < NT; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;

    const u32 *table = p.tables + p.row_table[r];
    const long long stride = (long long)p.kv_heads * D;
    const bf16 *kb = p.k + (long long)kvh * D, *vb = p.v + (long long)kvh * D;
    const int ntiles = (t1 - t0 + DEC_TILE - 1) / DEC_TILE;
    // First pool slot of a tile starting at key tk (a multiple of 16: its 16 slots are consecutive).
    auto slot_of = [&](int tk) { return (long long)table[tk / p.block_size] * p.block_size + tk % p.block_size; };
    long long slot0 = warp < ntiles ? slot_of(t0 + warp * DEC_TILE) : 0;
    for (int tile = warp; tile < ntiles; tile += DEC_WARPS) {
        const int tk = t0 + tile * DEC_TILE;
        const int valid = min(DEC_TILE, t1 - tk);
        // Prefetch this warp's next tile into L2 (lanes 0-15: K of key lane, 16-31: V of key lane - 16),
        // so that its loads, issued one iteration later, hit L2 instead of waiting on DRAM.
        long long next_slot = 0;
        if (tile + DEC_WARPS < ntiles) {
            next_slot = slot_of(tk + DEC_WARPS * DEC_TILE);
            const bf16 *row = (lane < 16 ? kb : vb) + (next_slot + (lane & 15)) * stride;
#pragma unroll
            for (int c = 0; c < D * 2 / 128; c++) dec_prefetch_l2(row + c * 64);
        }
        // Keys past the split read the tile's last valid key instead (finite data; masked below).
        const bf16 *kt = kb + slot0 * stride, *vt = vb + slot0 * stride;
        // K: key g of n-tile 0 and key 8 + g of n-tile 1, chunks 4j + t.
        uint4 kw[2][JQ];
#pragma unroll
        for (int n = 0; n < 2; n++) {
            const bf16 *kp = kt + min(8 * n + g, valid - 1) * stride;
#pragma unroll
            for (int j = 0; j < JQ; j++) kw[n][j] = dec_ld16(kp + (4 * j + t) * 8);
        }
        // V: keys 2t, 2t+1, 2t+8, 2t+9, chunks g + 8i.
        uint4 vw[4][VC];
#pragma unroll
        for (int x = 0; x < 4; x++) {
            const bf16 *vp = vt + min(2 * t + (x & 1) + 8 * (x >> 1), valid - 1) * stride;
#pragma unroll
            for (int i = 0; i < VC; i++) vw[x][i] = dec_ld16(vp + (g + 8 * i) * 8);
        }

        // S = Q K^T: s[n] = heads g (0, 1) and g + 8 (2, 3) x keys 8n + 2t, 8n + 2t + 1.
        float s[2][4];
#pragma unroll
        for (int n = 0; n < 2; n++) {
            s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
            for (int j = 0; j < JQ; j++) {
                dec_mma(s[n][0], s[n][1], s[n][2], s[n][3], qa[2 * j][0], FULL ? qb[2 * j][0] : 0u, qa[2 * j][1],
                        FULL ? qb[2 * j][1] : 0u, kw[n][j].x, kw[n][j].y);
                dec_mma(s[n][0], s[n][1], s[n][2], s[n][3], qa[2 * j + 1][0], FULL ? qb[2 * j + 1][0] : 0u,
                        qa[2 * j + 1][1], FULL ? qb[2 * j + 1][1] : 0u, kw[n][j].z, kw[n][j].w);
            }
#pragma unroll
            for (int e = 0; e < 4; e++) s[n][e] = 8 * n + 2 * t + (e & 1) < valid ? s[n][e] * p.scale_log2 : NEG_INF;
        }

        u32 pa0, pa1 = 0u, pa2, pa3 = 0u;
        const float c0 = dec_softmax(s[0][0], s[0][1], s[1][0], s[1][1], m0, l0, pa0, pa2);
        float c1 = 1.f;
        if (FULL) c1 = dec_softmax(s[0][2], s[0][3], s[1][2], s[1][3], m1, l1, pa1, pa3);

        // O = O * corr + P V. Once the running maxima settle, corr is exactly 1 for every head of the
        // warp and the rescale is skipped (multiplying by 1 changes no bit, so this is only a shortcut).
        if (__any_sync(0xffffffffu, c0 != 1.f || c1 != 1.f)) {
#pragma unroll
            for (int n = 0; n < NT; n++) {
                o[n][0] *= c0;
                o[n][1] *= c0;
                if (FULL) {
                    o[n][2] *= c1;
                    o[n][3] *= c1;
                }
            }
        }
#pragma unroll
        for (int n = 0; n < NT; n++) {
            const int i = n / 8, e = n % 8;
            const u32 sel = (e & 1) ? 0x7632u : 0x5410u;
            const u32 b0 = __byte_perm(dec_word(vw[0][i], e / 2), dec_word(vw[1][i], e / 2), sel);
            const u32 b1 = __byte_perm(dec_word(vw[2][i], e / 2), dec_word(vw[3][i], e / 2), sel);
            if (FULL) {
                dec_mma(o[n][0], o[n][1], o[n][2], o[n][3], pa0, pa1, pa2, pa3, b0, b1);
            } else {
                float d2 = 0.f, d3 = 0.f; // padding heads: discarded
                dec_mma(o[n][0], o[n][1], d2, d3, pa0, 0u, pa2, 0u, b0, b1);
            }
        }
        slot0 = next_slot;
    }

    // Each head's l over its 4 lanes (fixed order), then this warp's state into shared memory.
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    if (FULL) {
        l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
        l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    }
#pragma unroll
    for (int n = 0; n < NT; n++) {
        const int dim0 = (2 * t + 8 * (n / 8)) * 8 + n % 8, dim1 = dim0 + 8;
        s_o[warp][g][dim0] = o[n][0];
        s_o[warp][g][dim1] = o[n][1];
        if (FULL) {
            s_o[warp][g + 8][dim0] = o[n][2];
            s_o[warp][g + 8][dim1] = o[n][3];
        }
    }
    if (t == 0) {
        s_m[warp][g] = m0;
        s_l[warp][g] = l0;
        if (FULL) {
            s_m[warp][g + 8] = m1;
            s_l[warp][g + 8] = l1;
        }
    }
    __syncthreads();

    // Merge the warps in order (a warp without keys holds l = 0 and adds nothing); write the partial.
    for (int idx = threadIdx.x; idx < G * D; idx += blockDim.x) {
        const int h = idx / D, c = idx % D;
        float M = NEG_INF;
#pragma unroll
        for (int w = 0; w < DEC_WARPS; w++) M = fmaxf(M, s_m[w][h]);
        float acc = 0.f, L = 0.f;
#pragma unroll
        for (int w = 0; w < DEC_WARPS; w++) {
            if (s_l[w][h] > 0.f) {
                const float f = exp2f(s_m[w][h] - M);
                acc += s_o[w][h][c] * f;
                L += s_l[w][h] * f;
            }
        }
        float *out = part + h * head_stride;
        out[c] = acc;
        if (c == 0) {
            out[D] = M * DEC_LN2;
            out[D + 1] = L;
        }
    }
}

#define DEC_KERNEL(NAME, D, FULL)                                                                              \
    extern "C" __global__ void __launch_bounds__(DEC_WARPS * WARP) NAME(const DecodeV2Params p) {              \
        paged_decode_v2<D, FULL>(p);                                                                           \
    }

DEC_KERNEL(paged_decode_v2_d128, 128, false)
DEC_KERNEL(paged_decode_v2_d128_g16, 128, true)
DEC_KERNEL(paged_decode_v2_d64, 64, false)
DEC_KERNEL(paged_decode_v2_d64_g16, 64, true)
