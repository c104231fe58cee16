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
