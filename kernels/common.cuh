// Shared helpers of every kernel file. The Rust side (src/backend/cuda/nvrtc.rs) pastes this header in
// place of `#include "common.cuh"` before handing a file to NVRTC, so each .cu is one translation unit.
//
// Conventions: activations and weights are bf16 (`bf16`), arithmetic and every reduction in f32;
// each kernel takes one `#[repr(C)]` parameter struct mirrored in src/backend/cuda/params.rs (pointers
// first as 64-bit, then 32-bit ints and floats) so the two sides cannot drift argument by argument.
#pragma once
#include <cuda_bf16.h>

typedef __nv_bfloat16 bf16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define WARP 32
#define NEG_INF (-__int_as_float(0x7f800000))

__device__ __forceinline__ float ld(const bf16 *p, long long i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void st(bf16 *p, long long i, float v) { p[i] = __float2bfloat16_rn(v); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = WARP / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ double warp_sum_f64(double v) {
#pragma unroll
    for (int o = WARP / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = WARP / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `scratch` holds 32 floats of shared memory; the function synchronises before reusing it.
__device__ __forceinline__ float block_sum(float v, float *scratch) {
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, nw = blockDim.x / WARP;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nw ? scratch[lane] : 0.f;
    return warp_sum(v);
}

__device__ __forceinline__ double block_sum_f64(double v, double *scratch) {
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, nw = blockDim.x / WARP;
    v = warp_sum_f64(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nw ? scratch[lane] : 0.0;
    return warp_sum_f64(v);
}

__device__ __forceinline__ float block_max(float v, float *scratch) {
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, nw = blockDim.x / WARP;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nw ? scratch[lane] : NEG_INF;
    return warp_max(v);
}

// ---- Arithmetic that several kernels must reproduce bit for bit: rms_norm_v1 and rope_v1, and the
// fused qk_norm_rope_write_v1 (fused.cu), whose results must equal the rms_norm -> rope composition.
// Where the compiler may contract a multiply and an add into one FMA (its choice depends on the
// surrounding code), the operation is spelled with explicit-rounding intrinsics, so every caller gets
// the same bits whatever it is inlined into. The forms chosen are the ones NVRTC 13.0 generated for
// the plain expressions in rms_norm_v1 and rope_v1 (sm_90 SASS), so those kernels' results are unchanged.

// Sum of squares of one RMSNorm group of `g` values, `load(c)` for c < g, each thread striding over
// the group by blockDim.x, then reduced across the block (every thread gets the total).
template <class Load>
__device__ __forceinline__ float rms_sum_sq(Load load, int g, float *scratch) {
    float ss = 0.f;
    for (int c = threadIdx.x; c < g; c += blockDim.x) {
        float v = load(c);
        ss = __fmaf_rn(v, v, ss);
    }
    return block_sum(ss, scratch);
}

// 1 / rms of the group from its sum of squares (the CPU computes 1 / sqrt(), so do we).
__device__ __forceinline__ float rms_inv(float ss, int g, float eps) { return 1.f / sqrtf(ss / (float)g + eps); }

// HF order: w * (x * r); the caller rounds to bf16.
__device__ __forceinline__ float rms_apply(float w, float x, float r) { return __fmul_rn(w, __fmul_rn(x, r)); }

// Rotary embedding (rotate_half) of the pair a = x[i], b = x[i + d/2]: the first half gets
// a·cos[i] − b·sin[i], the second b·cos[i + d/2] + a·sin[i + d/2]; the caller rounds to bf16.
__device__ __forceinline__ float rope_first(float a, float b, float c, float s) {
    return __fmaf_rn(a, c, -__fmul_rn(b, s));
}
__device__ __forceinline__ float rope_second(float a, float b, float c, float s) {
    return __fmaf_rn(b, c, __fmul_rn(a, s));
}
