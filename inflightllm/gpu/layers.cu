// Fused elementwise kernels of the Llama block on the GPU (compiled by CuPy/NVRTC).
// Each follows the rounding of the torch ops it replaces (see inflightllm/models/llama.py):
// RMSNorm in float32 then cast, residual adds and RoPE products rounded to the storage
// type step by step, SiLU in float32. __fmul_rn/__fadd_rn keep the compiler from fusing
// products into FMAs, which would round differently from torch.
#include <cuda_fp16.h>
#include <cuda_bf16.h>

template <typename T> __device__ __forceinline__ float to_f(T v);
template <> __device__ __forceinline__ float to_f<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_f<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Round a float to T and back (the value torch would hold in a T tensor).
template <typename T> __device__ __forceinline__ float round_t(float v) { return to_f<T>(from_f<T>(v)); }

// Block-wide sum of one float per thread (blockDim.x a multiple of 32, at most 1024).
__device__ __forceinline__ float block_sum(float value) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffff, value, offset);
    if (lane == 0) partial[warp] = value;
    __syncthreads();
    const int num_warps = blockDim.x >> 5;
    value = (threadIdx.x < num_warps) ? partial[threadIdx.x] : 0.0f;
    if (warp == 0) {
        for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffff, value, offset);
        if (lane == 0) partial[0] = value;
    }
    __syncthreads();
    const float total = partial[0];
    __syncthreads();
    return total;
}

// out[t] = weight * T(x[t] * rsqrt(mean(x[t]^2) + eps)); one block per token.
template <typename T>
__global__ void rms_norm(T* __restrict__ out, const T* __restrict__ input, const T* __restrict__ weight,
                         float eps, int hidden) {
    const long row = blockIdx.x;
    const T* x = input + row * hidden;
    float sum = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) { float v = to_f<T>(x[i]); sum += v * v; }
    const float inv = rsqrtf(block_sum(sum) / hidden + eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        const float normed = round_t<T>(__fmul_rn(to_f<T>(x[i]), inv));
        out[row * hidden + i] = from_f<T>(__fmul_rn(to_f<T>(weight[i]), normed));
    }
}

// residual[t] = T(residual[t] + hidden[t]); hidden[t] = rms_norm(residual[t]); one block per token.
// The summed row is kept in shared memory (hidden * 4 bytes, dynamic).
template <typename T>
__global__ void add_rms_norm(T* __restrict__ hidden_io, T* __restrict__ residual_io, const T* __restrict__ weight,
                             float eps, int hidden) {
    extern __shared__ float row_values[];
    const long row = blockIdx.x;
    T* x = hidden_io + row * hidden;
    T* r = residual_io + row * hidden;
    float sum = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        const float v = round_t<T>(__fadd_rn(to_f<T>(r[i]), to_f<T>(x[i])));
        r[i] = from_f<T>(v);
        row_values[i] = v;
        sum += v * v;
    }
    const float inv = rsqrtf(block_sum(sum) / hidden + eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        const float normed = round_t<T>(__fmul_rn(row_values[i], inv));
        x[i] = from_f<T>(__fmul_rn(to_f<T>(weight[i]), normed));
    }
}

// Rotary embedding (rotate-half / NeoX layout) applied in place to q and k of each token.
// q: [num_tokens, q_stride] with num_heads heads of head_dim at offset 0; k likewise at its
// own base pointer (q and k may be views into one fused qkv row). cos_sin: [max_pos, head_dim]
// rows of cos (first half) and sin (second half), already rounded to T as transformers does.
template <typename T>
__global__ void rotary(T* __restrict__ q, T* __restrict__ k, const long* __restrict__ positions,
                       const T* __restrict__ cos_sin, int num_heads, int num_kv_heads, int head_dim,
                       long q_stride, long k_stride) {
    const long token = blockIdx.x;
    const long pos = positions[token];
    const int half = head_dim / 2;
    const T* cache = cos_sin + pos * head_dim;
    const int pairs_q = num_heads * half;
    const int pairs = (num_heads + num_kv_heads) * half;
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        T* base;
        int idx;
        if (p < pairs_q) { base = q + token * q_stride; idx = p; }
        else { base = k + token * k_stride; idx = p - pairs_q; }
        const int head = idx / half, i = idx % half;
        T* x = base + head * head_dim;
        const float c = to_f<T>(cache[i]), s = to_f<T>(cache[half + i]);
        const float x1 = to_f<T>(x[i]), x2 = to_f<T>(x[i + half]);
        // out1 = x1*cos + (-x2)*sin ; out2 = x2*cos + x1*sin, each product rounded to T.
        const float o1 = __fadd_rn(round_t<T>(__fmul_rn(x1, c)), round_t<T>(__fmul_rn(-x2, s)));
        const float o2 = __fadd_rn(round_t<T>(__fmul_rn(x2, c)), round_t<T>(__fmul_rn(x1, s)));
        x[i] = from_f<T>(o1);
        x[i + half] = from_f<T>(o2);
    }
}

// out[t, j] = T(silu(gate[t, j])) * up[t, j], with gate_up[t] = [gate (width) | up (width)].
template <typename T>
__global__ void silu_and_mul(T* __restrict__ out, const T* __restrict__ gate_up, int width, long total) {
    for (long idx = blockIdx.x * (long)blockDim.x + threadIdx.x; idx < total; idx += (long)gridDim.x * blockDim.x) {
        const long row = idx / width;
        const int j = idx % width;
        const float g = to_f<T>(gate_up[row * 2 * width + j]);
        const float u = to_f<T>(gate_up[row * 2 * width + width + j]);
        const float act = round_t<T>(g / (1.0f + expf(-g)));
        out[idx] = from_f<T>(__fmul_rn(act, u));
    }
}

// The same, VEC = 16 / sizeof(T) elements per thread with 16-byte loads and stores, one grid row
// per token (no 64-bit division per element). Needs width % VEC == 0 and 16-byte aligned rows.
template <typename T>
__global__ void silu_and_mul_vec(T* __restrict__ out, const T* __restrict__ gate_up, int width) {
    constexpr int VEC = 16 / sizeof(T);
    const long row = blockIdx.y;
    const int j0 = (blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (j0 >= width) return;
    const T* g_row = gate_up + row * 2 * (long)width;
    uint4 gv = *reinterpret_cast<const uint4*>(g_row + j0);
    uint4 uv = *reinterpret_cast<const uint4*>(g_row + width + j0);
    const T* gs = reinterpret_cast<const T*>(&gv);
    const T* us = reinterpret_cast<const T*>(&uv);
    uint4 ov;
    T* os = reinterpret_cast<T*>(&ov);
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
        const float g = to_f<T>(gs[i]);
        const float act = round_t<T>(g / (1.0f + expf(-g)));
        os[i] = from_f<T>(__fmul_rn(act, to_f<T>(us[i])));
    }
    *reinterpret_cast<uint4*>(out + row * (long)width + j0) = ov;
}
