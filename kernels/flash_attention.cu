// Tensor-core attention (FlashAttention-2 style) for prefill over the paged KV pool, and the same kernel
// in non-causal "segments" mode for the vision towers. Host side: src/backend/cuda/flash.rs. CPU twins:
// ops::paged_attention and ops::attention_segments (exact softmax; here the online form).
//
// Work split. One block = one q head x one "q tile" of up to 64 consecutive rows of ONE sequence (or
// segment), 4 warps x 16 rows. The host cuts every sequence into q tiles and stages one record per tile
// (first q row, rows, position of the first row, keys visible to the last row, block-table offset or
// first key row); grid = (tiles, q_heads), tiles sorted longest first so the causal tail does not
// straggle. Why one sequence per tile: all rows of a tile then share one key range and one block
// table, so K/V can be staged once per block and fed to tensor cores.
//
// Per key tile (64 keys, staged in shared memory with 16-byte cp.async copies, zero-filled past the
// tile's last visible key and past head_dim):
//   S = Q K^T   mma.m16n8k16 bf16 -> f32: per warp 16 rows x 64 keys = 8 n-tiles x DP/16 k-steps;
//   mask        keys >= the row's visible count become -inf (causal diagonal, tile tail);
//   softmax     FA2 online form in registers, base 2 (scale * log2 e folded into one multiply):
//               m' = max(m, rowmax S); corr = 2^(m - m'); P = 2^(S - m'); l = l corr + rowsum P;
//               O = O corr;
//   O += P V    P is re-used straight from the S accumulators as the A operand (an m16n8 C fragment
//               pair has exactly the register layout of an m16k16 A fragment), converted to bf16;
//               V's B fragments come from ldmatrix.trans (V is [key][dim] in shared memory, B wants
//               [k = key][n = dim] column-major).
// After the last tile each row is divided by l (summed across the 4 lanes that share a row).
// l sums the bf16-rounded P that actually multiplies V, so the weights applied sum to exactly 1.
//
// Pipeline. Shared memory holds two stages of K + V tiles. Key tile i is copied into stage i % 2 with
// cp.async (16 bytes per copy, src-size 0 for the zero fill) while the block computes tile i - 1 on
// the other stage; one commit group per tile. Per tile: wait for the own copies of tile i
// (cp.async.wait_group 0), __syncthreads (everyone's copies are visible, and every warp has finished
// tile i - 1, so its stage is free), issue the copies of tile i + 1 into that stage, compute tile i.
// One barrier per key tile. Q goes through stage 1's K buffer before the loop (copied together with
// tile 0, which lands in stage 0; stage 1 is not written before the first barrier of the loop) and
// then lives in registers. The block-table lookups of tile i + 1 (one per warp and row, handed to the
// copying lanes by shuffle) are made before that barrier, so their latency hides behind it. The
// pipeline changes when and where K/V land, never which values the mma sees or in which order: every
// row's arithmetic is that of flash_attention_v1 (below), bit for bit.
//
// Row contract (a row's result must not depend on the other rows of the call, so that chunked prefill
// and prefix reuse are exact). Three design rules keep each row's arithmetic a function of its own
// position and its sequence's keys only:
//   1. Key tiles are aligned to key index 0 in steps of 64 for every row, whatever q tile it lands in
//      and however the prompt was chunked: row r always sees tiles [0,64), [64,128), ... in that order.
//   2. A key tile that is entirely masked for a row leaves its state bitwise unchanged: its max does not
//      move, so corr is exactly 1 (chosen explicitly, not computed), every P is exactly +0 (2^-inf), l
//      gains +0, and the tensor cores add products that are all zero to O (the operands staged for
//      masked keys are finite: real keys of the same sequence, or zero fill). Whole warps skip such
//      tiles; within a warp the row relies on mma adding exact zeros, which is UNVERIFIED on hardware
//      (tests/cuda_flash.rs checks chunked == unchunked bitwise).
//   3. Every reduction runs in a fixed order per row (k-steps in order, quad shuffles xor 1 then 2),
//      and an mma output element depends only on its own A row, B column and C element.
// So the tiles a row sees beyond its own last visible key (there because later rows of its q tile need
// them) change nothing, and the result equals that of the same row computed alone.
//
// Fragment layouts of mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 (PTX ISA "Matrix Fragments
// for mma.m16n8k16 with floating point type"; lane = threadIdx % 32, g = lane >> 2, t = lane & 3; each
// 32-bit A/B register packs two bf16, the lower k index in the low half):
//   A 16x16 (row-major): a0 (row g, k 2t..2t+1)  a1 (row g+8, k 2t..)  a2 (row g, k 2t+8..)  a3 (row g+8, k 2t+8..)
//   B 16x8  (k x n):     b0 (k 2t..2t+1, n g)    b1 (k 2t+8..2t+9, n g)
//   C 16x8  f32:         c0 c1 (row g, n 2t, 2t+1)  c2 c3 (row g+8, n 2t, 2t+1)
// ldmatrix.x4 (non-trans) hands lane l, from each of its 4 8x8 b16 matrices, row l / 4, elements 2(l%4)
// and 2(l%4)+1 (the lower column in the low half); lane l addresses row l % 8 of matrix l / 8.
// Q: A fragments, one ldmatrix.x4 per k-step kk: matrices (rows r0..+7, cols 16kk..+7), (rows r0+8..+15,
//    same cols), (rows r0..+7, cols 16kk+8..), (rows r0+8.., cols 16kk+8..) are exactly a0 a1 a2 a3;
//    read once and kept in registers.
// K: B fragments of S = Q K^T are K[key 8j+g][dim 16kk+2t..] (b0) and [.. 16kk+8+2t..] (b1): row g of
//    the 8x8 matrix (keys 8j.., dims 16kk..) resp. (keys 8j.., dims 16kk+8..). One ldmatrix.x4 gives b0 b1
//    of n-tiles j = 2jp and 2jp + 1 of one k-step (the same values the v1 kernel reads with two 32-bit
//    loads per n-tile). Rows are padded by 8 bf16 (16 bytes): the row stride is an odd multiple of 16
//    bytes for every DP that is a multiple of 16, so the 8 rows of each matrix hit 8 distinct 16-byte
//    bank groups (no conflicts), and rows stay 16-byte aligned for cp.async.
// P: S n-tiles 2kk and 2kk+1 (c0c1 / c2c3) are the a0 a2 / a1 a3 of PV's k-step kk (keys 16kk..16kk+15).
// V: ldmatrix.x4.trans; lanes 0-15 address V rows 16kk+0..15 at dim block 8jd, lanes 16-31 the same
//    rows at block 8(jd+1); registers 0,1 are b0,b1 of dim tile jd and 2,3 those of jd+1.
//
// Head dims: DP = head_dim rounded up to 16 (the mma k), template-instantiated for DP = 16..128 in
// steps of 16; the padding columns are zero in shared memory and never written out. Shared memory
// (dynamic): 2 stages x (K + V) x 64 x (DP + 8) bf16 = 69,632 bytes at DP = 128, so the host raises
// CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES at load time (flash.rs: configure, smem_bytes, which
// must equal flash_smem_bytes below). Registers per thread at DP = 128: Q 32, O 64, S 32 (+ P 16).
//
// flash_attention_v1_d* (compiled only with FLASH_ATTENTION_V1 defined; flash.rs builds that module on
// demand for tests) is the kernel before the pipeline: synchronous 16-byte loads into one K + V stage
// (static shared memory), Q staged through the K buffer, K fragments by 32-bit shared loads. It is the
// bitwise reference of tests/cuda_flash.rs.
//
// Not yet done (perf plan): GQA packing of the q heads of one kv head into a tile (decode), split-K
// for long decode rows, wgmma/TMA on sm_90a.
#include "common.cuh"

#define FA_ROWS 64  // q rows per block
#define FA_THREADS 128 // 4 warps x 16 rows
#define FA_KEYS 64  // keys per K/V tile
#define FA_PAD 8    // bf16 padding per shared-memory row
#define FA_META 5   // u32 fields per tile record
#define FA_STAGES 2 // K/V stages in shared memory (pipelined kernel)

struct FlashParams {
    const bf16 *q;      // [rows, q_heads * d]
    const bf16 *k;      // paged: [slots, kv_heads * d]; segments: [rows, heads * d]
    const bf16 *v;
    bf16 *out;          // [rows, q_heads * d]
    const u32 *tiles;   // [n_tiles, FA_META]: q_row, rows, pos0, kv_len, kv_base
    const u32 *tables;  // paged: all block tables, concatenated
    int n_tiles;
    int q_heads;
    int kv_heads;
    int d;
    int block_size;     // paged: tokens per block; 0: keys are rows kv_base + key (segments)
    int causal;         // 1: row i sees keys 0..=pos0 + i; 0: every row sees keys 0..kv_len
    float scale_log2;   // log2(e) / sqrt(d)
};

struct FlashTile {
    int q_row;   // first row of q / out
    int rows;    // rows in this tile (1..64)
    int pos0;    // position (key index) of the first row
    int kv_len;  // keys visible to the tile's last row
    int kv_base; // offset of the block table in `tables` (paged) or first key row (segments)
};

__device__ __forceinline__ FlashTile read_tile(const u32 *tiles, int i) {
    const u32 *t = tiles + (long long)i * FA_META;
    return FlashTile{(int)t[0], (int)t[1], (int)t[2], (int)t[3], (int)t[4]};
}

// Keys visible to tile row `r` (padding rows past the tile's end behave like its last row).
__device__ __forceinline__ int row_visible(const FlashTile &tile, int r, int causal) {
    if (!causal || r >= tile.rows) return tile.kv_len;
    return min(tile.pos0 + r + 1, tile.kv_len);
}

// Row of q for tile row r.
struct QRow {
    int first;
    __device__ __forceinline__ long long operator()(int r) const { return first + r; }
};

// Row of k / v for key `key0 + r` of a tile: through the block table, or contiguous from kv_base.
struct KvRow {
    const u32 *table;
    int block_size;
    int base;
    int key0;
    __device__ __forceinline__ long long operator()(int r) const {
        int key = key0 + r;
        if (block_size == 0) return (long long)base + key;
        return (long long)table[key / block_size] * block_size + key % block_size;
    }
};

__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi); // .x (lo) in the low 16 bits
    return *reinterpret_cast<u32 *>(&v);
}

__device__ __forceinline__ float bf16_lo(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(u32 v) { return __uint_as_float(v & 0xffff0000u); }

// c += a * b on tensor cores (16x16 bf16 A, 16x8 bf16 B, 16x8 f32 C).
__device__ __forceinline__ void mma_bf16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four transposed 8x8 b16 matrices; lane l supplies the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const bf16 *p) {
    u32 addr = (u32)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// Four 8x8 b16 matrices, not transposed: lane l gets row l / 4, elements 2(l%4), 2(l%4)+1 of each;
// lane l supplies the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const bf16 *p) {
    u32 addr = (u32)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// Online-softmax step for the thread's two rows (h = 0: row g, h = 1: row g + 8): masks keys at or past
// vis[h], updates m and l, returns the rescale factor of O in corr and P as bf16 A fragments in pa.
__device__ __forceinline__ void softmax_step(float (&s)[8][4], u32 (&pa)[4][4], float (&m)[2], float (&l)[2],
                                             float (&corr)[2], int key0, const int (&vis)[2], float scale_log2,
                                             int t) {
    float mx[2] = {m[0], m[1]};
#pragma unroll
    for (int j = 0; j < 8; j++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int key = key0 + 8 * j + 2 * t + (e & 1);
            float x = key < vis[e >> 1] ? s[j][e] * scale_log2 : NEG_INF;
            s[j][e] = x;
            mx[e >> 1] = fmaxf(mx[e >> 1], x);
        }
    }
    float base[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
        base[h] = mx[h] == NEG_INF ? 0.f : mx[h]; // no key seen yet: keep 2^(x - base) finite
        corr[h] = mx[h] == m[h] ? 1.f : exp2f(m[h] - base[h]);
        m[h] = mx[h];
    }
    float sum[2] = {0.f, 0.f};
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int j = 2 * kk + half;
            u32 top = pack_bf16(exp2f(s[j][0] - base[0]), exp2f(s[j][1] - base[0]));
            u32 bot = pack_bf16(exp2f(s[j][2] - base[1]), exp2f(s[j][3] - base[1]));
            pa[kk][2 * half] = top;     // a0 / a2: row g
            pa[kk][2 * half + 1] = bot; // a1 / a3: row g + 8
            sum[0] += bf16_lo(top) + bf16_hi(top);
            sum[1] += bf16_lo(bot) + bf16_hi(bot);
        }
    }
    l[0] = l[0] * corr[0] + sum[0];
    l[1] = l[1] * corr[1] + sum[1];
}

// O = O corr + P V for the warp's rows over the 64 keys staged in sv.
template <int DP>
__device__ __forceinline__ void accumulate_pv(float (&o)[DP / 8][4], const u32 (&pa)[4][4], const float (&corr)[2],
                                              const bf16 (*sv)[DP + FA_PAD], int lane) {
#pragma unroll
    for (int jd = 0; jd < DP / 8; jd++) {
        o[jd][0] *= corr[0];
        o[jd][1] *= corr[0];
        o[jd][2] *= corr[1];
        o[jd][3] *= corr[1];
    }
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
#pragma unroll
        for (int jd = 0; jd < DP / 8; jd += 2) {
            u32 b[4];
            ldmatrix_x4_trans(b, &sv[16 * kk + (lane & 15)][8 * (jd + (lane >> 4))]);
            mma_bf16(o[jd], pa[kk], b[0], b[1]);
            mma_bf16(o[jd + 1], pa[kk], b[2], b[3]);
        }
    }
}

// Writes the warp's finished rows: O / l, bf16, columns < d, rows < tile.rows.
template <int DP>
__device__ __forceinline__ void store_rows(const FlashParams &p, const FlashTile &tile, int head, int r0,
                                           float (&o)[DP / 8][4], float (&l)[2], int g, int t) {
    long long stride = (long long)p.q_heads * p.d;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
        int r = r0 + g + 8 * h;
        if (r >= tile.rows) continue;
        bf16 *row = p.out + (tile.q_row + r) * stride + (long long)head * p.d;
#pragma unroll
        for (int jd = 0; jd < DP / 8; jd++) {
            int c = 8 * jd + 2 * t;
            if (c < p.d)
                *reinterpret_cast<u32 *>(row + c) = pack_bf16(o[jd][2 * h] / l[h], o[jd][2 * h + 1] / l[h]);
        }
    }
}

#ifndef FLASH_ATTENTION_V1

// ---- The pipelined kernel (flash_attention_d*).

// Dynamic shared memory of one block in bytes; flash.rs (smem_bytes) launches with the same amount.
template <int DP> __device__ constexpr int flash_smem_bytes() { return FA_STAGES * 2 * FA_KEYS * (DP + FA_PAD) * 2; }
static_assert(flash_smem_bytes<128>() == 69632, "flash.rs smem_bytes(128)");

// 16 bytes global -> shared, asynchronously; with fill false nothing is read and the 16 bytes are
// zeroed (src-size 0). `src` must be a global address even then (the caller passes a valid one).
__device__ __forceinline__ void cp_async_16(bf16 *dst, const bf16 *src, bool fill) {
    u32 addr = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(src), "r"(fill ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's most recent commit groups are pending.
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Copy layout of a 64-row x DP tile in 16-byte chunks: W threads per row (DP/8 rounded up to a power of
// two, so the layout is affine in k), 128 / W rows per pass, N passes; the thread's chunk k is row
// threadIdx.x / W + k 128 / W, column 8 (threadIdx.x % W); chunks at columns >= DP do not exist (their
// threads idle). Every chunk of the tile belongs to exactly one (thread, k); warp w copies rows
// w 32/W + i + k 128/W (i < 32/W), the same 16 rows for K, V and Q.
template <int DP> struct Chunks {
    static constexpr int W = DP <= 16 ? 2 : DP <= 32 ? 4 : DP <= 64 ? 8 : 16;
    static constexpr int N = FA_KEYS * W / FA_THREADS;
    static constexpr int RPW = WARP / W; // rows per warp and pass
    static_assert(W * 8 >= DP && W * 4 < DP && N * RPW == 16, "copy layout");
};
template <int DP> __device__ __forceinline__ int chunk_row(int k) {
    return threadIdx.x / Chunks<DP>::W + k * (FA_THREADS / Chunks<DP>::W);
}
template <int DP> __device__ __forceinline__ int chunk_col() { return threadIdx.x % Chunks<DP>::W * 8; }

// Q rows of the tile (rows >= n and columns >= d zero) into dst, asynchronously.
template <int DP>
__device__ __forceinline__ void copy_q(bf16 (*dst)[DP + FA_PAD], const bf16 *q, long long stride, int col0,
                                       int d, int n, int first) {
    const int c = chunk_col<DP>();
    if (c >= DP) return;
#pragma unroll
    for (int k = 0; k < Chunks<DP>::N; k++) {
        const int r = chunk_row<DP>(k);
        const bool in = r < n && c < d;
        cp_async_16(&dst[r][c], in ? q + (first + r) * stride + col0 + c : q, in);
    }
}

// The k / v rows of the thread's chunks of the key tile (-1 for tile rows >= n). One lookup per (warp,
// row): lane j < 16 resolves the warp's j-th row (through the block table when paged), and the W lanes
// that copy that row take it by shuffle. Meant to run ahead of the barrier that precedes the copies,
// so the block-table latency hides behind it.
template <int DP>
__device__ __forceinline__ void kv_rows(int (&rows)[Chunks<DP>::N], const KvRow &row_of, int n) {
    constexpr int W = Chunks<DP>::W, RPW = Chunks<DP>::RPW;
    const int lane = threadIdx.x % WARP;
    // lane j looks up row (warp's first row) + j % RPW + (j / RPW) 128 / W, i.e. chunk_row(j / RPW)
    // of the lanes j % RPW * W .. + W - 1.
    const int r = threadIdx.x / WARP * RPW + lane % RPW + lane / RPW * (FA_THREADS / W);
    const int mine = lane < 16 && r < n ? (int)row_of(r) : -1;
#pragma unroll
    for (int k = 0; k < Chunks<DP>::N; k++) rows[k] = __shfl_sync(0xffffffffu, mine, k * RPW + lane / W);
}

// K and V of one key tile into one stage, asynchronously (rows -1 and columns >= d zero-filled).
template <int DP>
__device__ __forceinline__ void copy_kv(bf16 (*sk)[DP + FA_PAD], bf16 (*sv)[DP + FA_PAD], const FlashParams &p,
                                        long long stride, int col0, const int (&rows)[Chunks<DP>::N]) {
    const int c = chunk_col<DP>();
    if (c >= DP) return;
#pragma unroll
    for (int k = 0; k < Chunks<DP>::N; k++) {
        const int r = chunk_row<DP>(k);
        const bool in = rows[k] >= 0 && c < p.d;
        const long long off = in ? rows[k] * stride + col0 + c : 0;
        cp_async_16(&sk[r][c], p.k + off, in);
        cp_async_16(&sv[r][c], p.v + off, in);
    }
}

// The warp's Q rows r0..r0+15 as A fragments, one ldmatrix.x4 per 16-column k-step.
template <int DP>
__device__ __forceinline__ void load_q_frags(u32 (&qf)[DP / 16][4], const bf16 (*s)[DP + FA_PAD], int r0,
                                             int lane) {
#pragma unroll
    for (int kk = 0; kk < DP / 16; kk++) ldmatrix_x4(qf[kk], &s[r0 + (lane & 15)][16 * kk + 8 * (lane >> 4)]);
}

// S[16 rows, 64 keys] = Q K^T for the warp's rows; n-tile j holds keys 8j..8j+7. Per k-step, n-tiles in
// order 0..7 (the v1 order); B fragments of n-tiles 2jp, 2jp+1 from one ldmatrix.x4: lanes 0-7 address
// keys 16jp+0..7 at dims 16kk.. (b0 of 2jp), 8-15 the same keys at 16kk+8.. (b1), 16-31 keys 16jp+8..15.
template <int DP>
__device__ __forceinline__ void scores(float (&s)[8][4], const u32 (&qf)[DP / 16][4], const bf16 (*sk)[DP + FA_PAD],
                                       int lane) {
#pragma unroll
    for (int j = 0; j < 8; j++) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < DP / 16; kk++) {
#pragma unroll
        for (int jp = 0; jp < 4; jp++) {
            u32 b[4];
            ldmatrix_x4(b, &sk[16 * jp + (lane & 7) + 8 * (lane >> 4)][16 * kk + 8 * ((lane >> 3) & 1)]);
            mma_bf16(s[2 * jp], qf[kk], b[0], b[1]);
            mma_bf16(s[2 * jp + 1], qf[kk], b[2], b[3]);
        }
    }
}

extern __shared__ __align__(16) unsigned char flash_smem[];

template <int DP>
__device__ __forceinline__ void flash_attention(const FlashParams &p) {
    typedef bf16 Row[DP + FA_PAD];
    Row *const smem = reinterpret_cast<Row *>(flash_smem); // [stage][K, V][FA_KEYS]
    const FlashTile tile = read_tile(p.tiles, blockIdx.x);
    const int head = blockIdx.y, kv_head = head / (p.q_heads / p.kv_heads);
    const int lane = threadIdx.x % WARP, g = lane >> 2, t = lane & 3;
    const int r0 = threadIdx.x / WARP * 16; // the warp's first tile row
    const bool active = r0 < tile.rows;
    const long long kv_stride = (long long)p.kv_heads * p.d;
    const int kv_col = kv_head * p.d;
    const u32 *table = p.block_size > 0 ? p.tables + tile.kv_base : nullptr;

    // Prologue: Q into stage 1's K buffer (group 1), key tile 0 into stage 0 (group 2).
    copy_q<DP>(smem + 2 * FA_KEYS, p.q, (long long)p.q_heads * p.d, head * p.d, p.d, tile.rows, tile.q_row);
    cp_async_commit();
    int rows[Chunks<DP>::N];
    kv_rows<DP>(rows, KvRow{table, p.block_size, tile.kv_base, 0}, min(FA_KEYS, tile.kv_len));
    copy_kv<DP>(smem, smem + FA_KEYS, p, kv_stride, kv_col, rows);
    cp_async_commit();
    cp_async_wait<1>(); // Q has landed (groups complete in order)
    __syncthreads();
    u32 qf[DP / 16][4];
    load_q_frags<DP>(qf, smem + 2 * FA_KEYS, r0, lane);
    const int vis[2] = {row_visible(tile, r0 + g, p.causal), row_visible(tile, r0 + g + 8, p.causal)};
    const int warp_vis = row_visible(tile, min(r0 + 15, tile.rows - 1), p.causal); // keys its last row sees

    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    float o[DP / 8][4];
#pragma unroll
    for (int jd = 0; jd < DP / 8; jd++) o[jd][0] = o[jd][1] = o[jd][2] = o[jd][3] = 0.f;
    for (int key0 = 0, stage = 0; key0 < tile.kv_len; key0 += FA_KEYS, stage ^= 1) {
        // Rows of the next tile (none past the last tile: n <= 0), ahead of the barrier.
        const int next = key0 + FA_KEYS;
        kv_rows<DP>(rows, KvRow{table, p.block_size, tile.kv_base, next}, min(FA_KEYS, tile.kv_len - next));
        cp_async_wait<0>(); // this thread's copies of tile key0
        __syncthreads();    // everyone's copies visible; every warp is done with tile key0 - 64 (or Q)
        if (next < tile.kv_len) {
            Row *const nk = smem + 2 * (stage ^ 1) * FA_KEYS;
            copy_kv<DP>(nk, nk + FA_KEYS, p, kv_stride, kv_col, rows);
            cp_async_commit();
        }
        if (!active || key0 >= warp_vis) continue; // fully masked for the whole warp: state unchanged
        const Row *const sk = smem + 2 * stage * FA_KEYS;
        float s[8][4], corr[2];
        u32 pa[4][4];
        scores<DP>(s, qf, sk, lane);
        softmax_step(s, pa, m, l, corr, key0, vis, p.scale_log2, t);
        accumulate_pv<DP>(o, pa, corr, sk + FA_KEYS, lane);
    }
    cp_async_wait<0>(); // nothing is pending here (the last tile issues no copies); kept for safety
    if (active) store_rows<DP>(p, tile, head, r0, o, l, g, t);
}

// Blocks per SM the register allocation must allow (ptxas -v, NVRTC 13.0, sm_90): DP <= 80 fits 128
// registers (4 blocks = 16 warps; d80 spills two 4-byte values, stored before the key loop and
// reloaded once per key tile), DP >= 96 fits 168 (3 blocks, which is also what 228 KB of shared memory
// holds at DP = 128) without spills.
#define FA_MIN_BLOCKS(DP) ((DP) <= 80 ? 4 : 3)

#define FLASH_KERNEL(DP)                                                                      \
    extern "C" __global__ void __launch_bounds__(FA_THREADS, FA_MIN_BLOCKS(DP))               \
        flash_attention_d##DP(const FlashParams p) {                                          \
        flash_attention<DP>(p);                                                               \
    }

FLASH_KERNEL(16)
FLASH_KERNEL(32)
FLASH_KERNEL(48)
FLASH_KERNEL(64)
FLASH_KERNEL(80)
FLASH_KERNEL(96)
FLASH_KERNEL(112)
FLASH_KERNEL(128)

#else // FLASH_ATTENTION_V1

// ---- The reference kernel (flash_attention_v1_d*): the kernel before the pipeline, unchanged.

// Copies 64 rows x DP columns (16 bytes per thread and step) into shared memory; rows >= n and
// columns >= d are zero-filled. Row starts are 16-byte aligned: d and the strides are multiples of 8.
template <int DP, typename RowOf>
__device__ __forceinline__ void load_tile(bf16 (*dst)[DP + FA_PAD], const bf16 *src, long long stride,
                                          int col0, int d, int n, RowOf row_of) {
    constexpr int CHUNKS = DP / 8;
    for (int i = threadIdx.x; i < FA_KEYS * CHUNKS; i += blockDim.x) {
        int r = i / CHUNKS, c = (i % CHUNKS) * 8;
        uint4 val = make_uint4(0u, 0u, 0u, 0u);
        if (r < n && c < d) val = __ldg(reinterpret_cast<const uint4 *>(src + row_of(r) * stride + col0 + c));
        *reinterpret_cast<uint4 *>(&dst[r][c]) = val;
    }
}

__device__ __forceinline__ u32 lds_u32(const bf16 *p) { return *reinterpret_cast<const u32 *>(p); }

// The warp's Q rows r0..r0+15 as A fragments, one per 16-column k-step.
template <int DP>
__device__ __forceinline__ void load_q_frags_v1(u32 (&qf)[DP / 16][4], bf16 (*s)[DP + FA_PAD], int r0, int g,
                                                int t) {
#pragma unroll
    for (int kk = 0; kk < DP / 16; kk++) {
        int c = 16 * kk + 2 * t;
        qf[kk][0] = lds_u32(&s[r0 + g][c]);
        qf[kk][1] = lds_u32(&s[r0 + g + 8][c]);
        qf[kk][2] = lds_u32(&s[r0 + g][c + 8]);
        qf[kk][3] = lds_u32(&s[r0 + g + 8][c + 8]);
    }
}

// S[16 rows, 64 keys] = Q K^T for the warp's rows; n-tile j holds keys 8j..8j+7.
template <int DP>
__device__ __forceinline__ void scores_v1(float (&s)[8][4], const u32 (&qf)[DP / 16][4], bf16 (*sk)[DP + FA_PAD],
                                          int g, int t) {
#pragma unroll
    for (int j = 0; j < 8; j++) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < DP / 16; kk++) {
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const bf16 *kp = &sk[8 * j + g][16 * kk + 2 * t];
            mma_bf16(s[j], qf[kk], lds_u32(kp), lds_u32(kp + 8));
        }
    }
}

template <int DP>
__device__ __forceinline__ void flash_attention_v1(const FlashParams &p) {
    __shared__ __align__(16) bf16 sk[FA_KEYS][DP + FA_PAD];
    __shared__ __align__(16) bf16 sv[FA_KEYS][DP + FA_PAD];
    const FlashTile tile = read_tile(p.tiles, blockIdx.x);
    const int head = blockIdx.y, kv_head = head / (p.q_heads / p.kv_heads);
    const int lane = threadIdx.x % WARP, g = lane >> 2, t = lane & 3;
    const int r0 = threadIdx.x / WARP * 16; // the warp's first tile row
    const bool active = r0 < tile.rows;
    const long long kv_stride = (long long)p.kv_heads * p.d;

    // Q goes through the K buffer once and then lives in registers.
    load_tile<DP>(sk, p.q, (long long)p.q_heads * p.d, head * p.d, p.d, tile.rows, QRow{tile.q_row});
    __syncthreads();
    u32 qf[DP / 16][4];
    load_q_frags_v1<DP>(qf, sk, r0, g, t);
    const int vis[2] = {row_visible(tile, r0 + g, p.causal), row_visible(tile, r0 + g + 8, p.causal)};
    const int warp_vis = row_visible(tile, min(r0 + 15, tile.rows - 1), p.causal); // keys its last row sees

    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    float o[DP / 8][4];
#pragma unroll
    for (int jd = 0; jd < DP / 8; jd++) o[jd][0] = o[jd][1] = o[jd][2] = o[jd][3] = 0.f;
    const u32 *table = p.block_size > 0 ? p.tables + tile.kv_base : nullptr;
    for (int key0 = 0; key0 < tile.kv_len; key0 += FA_KEYS) {
        __syncthreads(); // every warp is done with the previous tile (or with Q)
        KvRow rows{table, p.block_size, tile.kv_base, key0};
        int n = min(FA_KEYS, tile.kv_len - key0);
        load_tile<DP>(sk, p.k, kv_stride, kv_head * p.d, p.d, n, rows);
        load_tile<DP>(sv, p.v, kv_stride, kv_head * p.d, p.d, n, rows);
        __syncthreads();
        if (!active || key0 >= warp_vis) continue; // fully masked for the whole warp: state unchanged
        float s[8][4], corr[2];
        u32 pa[4][4];
        scores_v1<DP>(s, qf, sk, g, t);
        softmax_step(s, pa, m, l, corr, key0, vis, p.scale_log2, t);
        accumulate_pv<DP>(o, pa, corr, sv, lane);
    }
    if (active) store_rows<DP>(p, tile, head, r0, o, l, g, t);
}

#define FLASH_KERNEL_V1(DP)                                                                                    \
    extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_attention_v1_d##DP(const FlashParams p) { \
        flash_attention_v1<DP>(p);                                                                             \
    }

FLASH_KERNEL_V1(16)
FLASH_KERNEL_V1(32)
FLASH_KERNEL_V1(48)
FLASH_KERNEL_V1(64)
FLASH_KERNEL_V1(80)
FLASH_KERNEL_V1(96)
FLASH_KERNEL_V1(112)
FLASH_KERNEL_V1(128)

#endif // FLASH_ATTENTION_V1
