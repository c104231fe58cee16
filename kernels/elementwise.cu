// Elementwise ops. CPU twins: CpuBackend::{scale, add, silu_mul, gelu} and ops::gelu_{tanh,erf}.
// v1: one thread per element, grid-stride loop. Perf plan: 16-byte (8 x bf16) vector accesses, and
// fusing these into the GEMM epilogues (SwiGLU into gate/up, residual add into o_proj/down_proj).
#include "common.cuh"

struct UnaryParams {
    const bf16 *x;
    bf16 *out;
    long long n;
    float s;
    int kind; // gelu: 0 tanh, 1 erf
};

struct BinaryParams {
    const bf16 *a;
    const bf16 *b;
    bf16 *out;
    long long n;
};

struct FillParams {
    unsigned short *out;
    long long n;
    unsigned int bits;
};

extern "C" __global__ void scale_v1(const UnaryParams p) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < p.n; i += (long long)gridDim.x * blockDim.x)
        st(p.out, i, ld(p.x, i) * p.s);
}

extern "C" __global__ void add_v1(const BinaryParams p) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < p.n; i += (long long)gridDim.x * blockDim.x)
        st(p.out, i, ld(p.a, i) + ld(p.b, i));
}

// silu(g) * u = g / (1 + exp(-g)) * u, in the CPU's order.
extern "C" __global__ void silu_mul_v1(const BinaryParams p) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < p.n; i += (long long)gridDim.x * blockDim.x) {
        float g = ld(p.a, i);
        st(p.out, i, g / (1.f + expf(-g)) * ld(p.b, i));
    }
}

extern "C" __global__ void gelu_v1(const UnaryParams p) {
    const float k = 0.7978845608028654f; // sqrt(2/pi)
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < p.n; i += (long long)gridDim.x * blockDim.x) {
        float x = ld(p.x, i), y;
        if (p.kind == 0) {
            y = 0.5f * x * (1.f + tanhf(k * (x + 0.044715f * x * x * x)));
        } else {
            y = (float)(0.5 * (double)x * (1.0 + erf((double)x * 0.7071067811865476)));
        }
        st(p.out, i, y);
    }
}

// Fills n 16-bit words with `bits` (poisoning outputs with NaN in tests; zero-fill elsewhere).
extern "C" __global__ void fill_u16_v1(const FillParams p) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < p.n; i += (long long)gridDim.x * blockDim.x)
        p.out[i] = (unsigned short)p.bits;
}

struct FillRandomParams {
    bf16 *out;
    u64 seed;
    u64 first; // index of out[0] in the generated sequence (a slice of a bigger tensor)
    long long n;
    float scale;
    int kind; // 0 zeros, 1 ones, 2 uniform in [-scale, scale)
};

// SplitMix64's output function; identical to splitmix64 in src/model/loader.rs.
__device__ __forceinline__ u64 splitmix64(u64 x) {
    u64 z = x + 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// Synthetic weights (benchmarks): element i is Fill::value(first + i) of src/model/loader.rs, bit for
// bit. The steps before the last multiply are exact in f32; the explicit-rounding intrinsics keep the
// compiler from contracting them into an FMA, so the one rounding is the same as on the CPU.
extern "C" __global__ void fill_random_v1(const FillRandomParams p) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < p.n; i += (long long)gridDim.x * blockDim.x) {
        float v = p.kind == 1 ? 1.f : 0.f;
        if (p.kind == 2) {
            u64 idx = p.first + (u64)i;
            float u = (float)(splitmix64(p.seed ^ (idx * 0x9e3779b97f4a7c15ull)) >> 40);
            float sym = __fadd_rn(__fmul_rn(__fmul_rn(u, 1.f / 16777216.f), 2.f), -1.f);
            v = __fmul_rn(sym, p.scale);
        }
        p.out[i] = __float2bfloat16_rn(v);
    }
}
