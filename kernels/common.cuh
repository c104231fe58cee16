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
