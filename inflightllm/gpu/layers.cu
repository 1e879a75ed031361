// Fused elementwise kernels of the Llama block on the GPU (compiled by CuPy/NVRTC).
// Each follows the rounding of the torch ops it replaces (see inflightllm/models/llama.py):
// RMSNorm in float32 then cast, residual adds and RoPE products rounded to the storage
// type step by step, SiLU in float32. __fmul_rn/__fadd_rn keep the compiler from fusing
// products into FMAs, which would round differently from torch.
#include <cuda_fp16.h>
#include <cuda_bf16.h>

// to_f<T> / from_f<T> (float <-> the storage type) and pdl_trigger() / pdl_wait(): gpu/pdl.cuh,
// prepended to this source when it is compiled.

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
    pdl_trigger();
    pdl_wait();  // launched by PDL (ops.add_rms_norm): hidden and residual come from kernels before
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

// add_rms_norm with 16-byte loads and stores: VEC = 16 / sizeof(T) elements a chunk, up to
// ADD_NORM_NPT chunks a thread (held in registers), one block per token. The same rounding per
// element; the sum of squares is added up in another order (each thread's chunks, then the block).
#define ADD_NORM_NPT 4
template <typename T>
__global__ void add_rms_norm_vec(T* __restrict__ hidden_io, T* __restrict__ residual_io, const T* __restrict__ weight,
                                 float eps, int hidden) {
    constexpr int VEC = 16 / sizeof(T);
    pdl_trigger();
    pdl_wait();  // launched by PDL (ops.add_rms_norm): hidden and residual come from kernels before
    const long row = blockIdx.x;
    uint4* x = reinterpret_cast<uint4*>(hidden_io + row * hidden);
    uint4* r = reinterpret_cast<uint4*>(residual_io + row * hidden);
    const int chunks = hidden / VEC;
    float v[ADD_NORM_NPT][VEC];
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < ADD_NORM_NPT; ++j) {
        const int c = threadIdx.x + j * blockDim.x;
        if (c >= chunks) break;
        const uint4 rv = r[c], xv = x[c];
        const T* rt = reinterpret_cast<const T*>(&rv);
        const T* xt = reinterpret_cast<const T*>(&xv);
        uint4 out;
        T* ot = reinterpret_cast<T*>(&out);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
            v[j][i] = round_t<T>(__fadd_rn(to_f<T>(rt[i]), to_f<T>(xt[i])));
            ot[i] = from_f<T>(v[j][i]);
            sum += v[j][i] * v[j][i];
        }
        r[c] = out;
    }
    const float inv = rsqrtf(block_sum(sum) / hidden + eps);
    const uint4* w = reinterpret_cast<const uint4*>(weight);
#pragma unroll
    for (int j = 0; j < ADD_NORM_NPT; ++j) {
        const int c = threadIdx.x + j * blockDim.x;
        if (c >= chunks) break;
        const uint4 wv = w[c];
        const T* wt = reinterpret_cast<const T*>(&wv);
        uint4 out;
        T* ot = reinterpret_cast<T*>(&out);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
            const float normed = round_t<T>(__fmul_rn(v[j][i], inv));
            ot[i] = from_f<T>(__fmul_rn(to_f<T>(wt[i]), normed));
        }
        x[c] = out;
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

// rotary with 16-byte loads and stores: a thread takes VEC = 16 / sizeof(T) consecutive
// pairs (i, i + half) of one head, one block per token. The same arithmetic per element.
// Needs half % VEC == 0 and 16-byte aligned rows (ops.rotary checks).
template <typename T>
__global__ void rotary_vec(T* __restrict__ q, T* __restrict__ k, const long* __restrict__ positions,
                           const T* __restrict__ cos_sin, int num_heads, int num_kv_heads, int head_dim,
                           long q_stride, long k_stride) {
    constexpr int VEC = 16 / sizeof(T);
    const long token = blockIdx.x;
    const long pos = positions[token];
    const int half = head_dim / 2;
    const int per_head = half / VEC;
    const T* cache = cos_sin + pos * head_dim;
    const int items = (num_heads + num_kv_heads) * per_head;
    for (int p = threadIdx.x; p < items; p += blockDim.x) {
        const int head = p / per_head, i0 = (p - head * per_head) * VEC;
        T* x = (head < num_heads) ? q + token * q_stride + (long)head * head_dim
                                  : k + token * k_stride + (long)(head - num_heads) * head_dim;
        const uint4 cv = *reinterpret_cast<const uint4*>(cache + i0);
        const uint4 sv = *reinterpret_cast<const uint4*>(cache + half + i0);
        const uint4 av = *reinterpret_cast<const uint4*>(x + i0);
        const uint4 bv = *reinterpret_cast<const uint4*>(x + half + i0);
        const T* ct = reinterpret_cast<const T*>(&cv);
        const T* st = reinterpret_cast<const T*>(&sv);
        const T* at = reinterpret_cast<const T*>(&av);
        const T* bt = reinterpret_cast<const T*>(&bv);
        uint4 o1v, o2v;
        T* o1t = reinterpret_cast<T*>(&o1v);
        T* o2t = reinterpret_cast<T*>(&o2v);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
            const float c = to_f<T>(ct[i]), s = to_f<T>(st[i]);
            const float x1 = to_f<T>(at[i]), x2 = to_f<T>(bt[i]);
            o1t[i] = from_f<T>(__fadd_rn(round_t<T>(__fmul_rn(x1, c)), round_t<T>(__fmul_rn(-x2, s))));
            o2t[i] = from_f<T>(__fadd_rn(round_t<T>(__fmul_rn(x2, c)), round_t<T>(__fmul_rn(x1, s))));
        }
        *reinterpret_cast<uint4*>(x + i0) = o1v;
        *reinterpret_cast<uint4*>(x + half + i0) = o2v;
    }
}

// T(silu(g)) * u in float32, rounded as the unfused torch ops round (silu's output to T, the
// product correctly rounded): every SiLU*mul below rounds this to T.
template <typename T> __device__ __forceinline__ float silu_mul_f(float g, float u) {
    return __fmul_rn(round_t<T>(g / (1.0f + expf(-g))), u);
}

// out[t, j] = T(silu(gate[t, j])) * up[t, j], with gate_up[t] = [gate (width) | up (width)].
template <typename T>
__global__ void silu_and_mul(T* __restrict__ out, const T* __restrict__ gate_up, int width, long total) {
    for (long idx = blockIdx.x * (long)blockDim.x + threadIdx.x; idx < total; idx += (long)gridDim.x * blockDim.x) {
        const long row = idx / width;
        const int j = idx % width;
        const float g = to_f<T>(gate_up[row * 2 * width + j]);
        const float u = to_f<T>(gate_up[row * 2 * width + width + j]);
        out[idx] = from_f<T>(silu_mul_f<T>(g, u));
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
        os[i] = from_f<T>(silu_mul_f<T>(g, to_f<T>(us[i])));
    }
    *reinterpret_cast<uint4*>(out + row * (long)width + j0) = ov;
}

// ---- FP8 (e4m3) activation quantization for torch._scaled_mm --------------------------------
// Each kernel ends in a row of e4m3 values and the row's float32 scale amax / 448 (dynamic
// per-token quantization), with the rounding of inflightllm/quantization/fp8.py: the values are
// first rounded to T as the unfused ops would store them, then divided by the scale and
// converted round-to-nearest-even with saturation (torch's clamp to +-448 then cast). One
// block per row; the row is read again from L1/L2 instead of being held (rows are a few KiB).
#define FP8_MAX 448.0f
#define FP8_MIN_SCALE (1.0f / (448.0f * 512.0f))

// Block-wide max of one non-negative float per thread (blockDim.x a multiple of 32).
__device__ __forceinline__ float block_max(float value) {
    __shared__ float partial_max[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int offset = 16; offset > 0; offset >>= 1) value = fmaxf(value, __shfl_xor_sync(0xffffffff, value, offset));
    if (lane == 0) partial_max[warp] = value;
    __syncthreads();
    const int num_warps = blockDim.x >> 5;
    value = (threadIdx.x < num_warps) ? partial_max[threadIdx.x] : 0.0f;
    if (warp == 0) {
        for (int offset = 16; offset > 0; offset >>= 1) value = fmaxf(value, __shfl_xor_sync(0xffffffff, value, offset));
        if (lane == 0) partial_max[0] = value;
    }
    __syncthreads();
    const float total = partial_max[0];
    __syncthreads();
    return total;
}

// Two floats -> two e4m3 bytes (lo in the low byte), round to nearest even, saturating (one
// instruction on sm_89+, bit manipulation below: gpu/pdl.cuh).
__device__ __forceinline__ unsigned short e4m3x2(float lo, float hi) {
    return (unsigned short)e4m3x2_from_float(lo, hi);
}

// Quantize the `width` values value(i) of this block's row into q (e4m3 bytes) with scale
// amax / 448 written to *scale. width is even; value is called twice per element.
template <typename F>
__device__ __forceinline__ void quantize_row(unsigned char* __restrict__ q, float* __restrict__ scale, int width,
                                             F value) {
    float amax = 0.0f;
    for (int i = threadIdx.x; i < width; i += blockDim.x) amax = fmaxf(amax, fabsf(value(i)));
    const float s = fmaxf(__fdiv_rn(block_max(amax), FP8_MAX), FP8_MIN_SCALE);
    if (threadIdx.x == 0) *scale = s;
    unsigned short* q2 = reinterpret_cast<unsigned short*>(q);
    for (int p = threadIdx.x; p < width / 2; p += blockDim.x)
        q2[p] = e4m3x2(__fdiv_rn(value(2 * p), s), __fdiv_rn(value(2 * p + 1), s));
}

// q[t], scale[t] = quantize(x[t]).
template <typename T>
__global__ void quant_rows_fp8(unsigned char* __restrict__ q, float* __restrict__ scale, const T* __restrict__ x,
                               int width) {
    const long row = blockIdx.x;
    const T* xr = x + row * width;
    quantize_row(q + row * width, scale + row, width, [&](int i) { return to_f<T>(xr[i]); });
}

// residual[t] = T(residual[t] + delta[t]) (no add where delta is null);
// q[t], scale[t] = quantize(weight * rmsnorm(residual[t])): add_rms_norm / rms_norm, quantized.
template <typename T>
__global__ void add_rms_norm_fp8(unsigned char* __restrict__ q, float* __restrict__ scale,
                                 const T* __restrict__ delta, T* __restrict__ residual_io,
                                 const T* __restrict__ weight, float eps, int hidden) {
    const long row = blockIdx.x;
    T* r = residual_io + row * hidden;
    float sum = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float v = to_f<T>(r[i]);
        if (delta != nullptr) {
            v = round_t<T>(__fadd_rn(v, to_f<T>(delta[row * hidden + i])));
            r[i] = from_f<T>(v);
        }
        sum += v * v;
    }
    const float inv = rsqrtf(block_sum(sum) / hidden + eps);
    quantize_row(q + row * hidden, scale + row, hidden, [&](int i) {
        const float normed = round_t<T>(__fmul_rn(to_f<T>(r[i]), inv));
        return round_t<T>(__fmul_rn(to_f<T>(weight[i]), normed));
    });
}

// q[t], scale[t] = quantize(silu(gate[t]) * up[t]), gate_up[t] = [gate (width) | up (width)].
template <typename T>
__global__ void silu_and_mul_fp8(unsigned char* __restrict__ q, float* __restrict__ scale,
                                 const T* __restrict__ gate_up, int width) {
    const long row = blockIdx.x;
    const T* g = gate_up + row * 2 * (long)width;
    quantize_row(q + row * width, scale + row, width, [&](int i) {
        const float gv = to_f<T>(g[i]);
        return round_t<T>(silu_mul_f<T>(gv, to_f<T>(g[width + i])));
    });
}

// The same three with 16-byte loads (8 values of a 2-byte T a chunk), the row's values held in
// registers (at most FP8_NPT chunks a thread) between the amax and the quantization, 8-byte
// stores: one read of each input. Rows of whole 16-byte chunks, 16-byte aligned.
#define FP8_NPT 8

template <typename T>
__device__ __forceinline__ void store_e4m3x8(unsigned char* q, int c, const float* v, float s) {
    const unsigned int lo = e4m3x2(__fdiv_rn(v[0], s), __fdiv_rn(v[1], s)) |
                            ((unsigned int)e4m3x2(__fdiv_rn(v[2], s), __fdiv_rn(v[3], s)) << 16);
    const unsigned int hi = e4m3x2(__fdiv_rn(v[4], s), __fdiv_rn(v[5], s)) |
                            ((unsigned int)e4m3x2(__fdiv_rn(v[6], s), __fdiv_rn(v[7], s)) << 16);
    reinterpret_cast<uint2*>(q)[c] = make_uint2(lo, hi);
}

// v[j][0..7] of this thread's chunks -> e4m3 bytes of q's row, scale = block amax / 448.
template <typename T>
__device__ __forceinline__ void quantize_held(unsigned char* __restrict__ q, float* __restrict__ scale,
                                              float (&v)[FP8_NPT][8], int chunks) {
    float amax = 0.0f;
#pragma unroll
    for (int j = 0; j < FP8_NPT; ++j) {
        if (threadIdx.x + j * blockDim.x >= chunks) break;
#pragma unroll
        for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[j][i]));
    }
    const float s = fmaxf(__fdiv_rn(block_max(amax), FP8_MAX), FP8_MIN_SCALE);
    if (threadIdx.x == 0) *scale = s;
#pragma unroll
    for (int j = 0; j < FP8_NPT; ++j) {
        const int c = threadIdx.x + j * blockDim.x;
        if (c >= chunks) break;
        store_e4m3x8<T>(q, c, v[j], s);
    }
}

template <typename T>
__global__ void quant_rows_fp8_vec(unsigned char* __restrict__ q, float* __restrict__ scale,
                                   const T* __restrict__ x, int width) {
    const long row = blockIdx.x;
    const int chunks = width / 8;
    const uint4* xr = reinterpret_cast<const uint4*>(x + row * width);
    float v[FP8_NPT][8];
#pragma unroll
    for (int j = 0; j < FP8_NPT; ++j) {
        const int c = threadIdx.x + j * blockDim.x;
        if (c >= chunks) break;
        const uint4 xv = xr[c];
        const T* xt = reinterpret_cast<const T*>(&xv);
#pragma unroll
        for (int i = 0; i < 8; ++i) v[j][i] = to_f<T>(xt[i]);
    }
    quantize_held<T>(q + row * width, scale + row, v, chunks);
}

template <typename T>
__global__ void add_rms_norm_fp8_vec(unsigned char* __restrict__ q, float* __restrict__ scale,
                                     const T* __restrict__ delta, T* __restrict__ residual_io,
                                     const T* __restrict__ weight, float eps, int hidden) {
    const long row = blockIdx.x;
    const int chunks = hidden / 8;
    uint4* r = reinterpret_cast<uint4*>(residual_io + row * hidden);
    const uint4* d = delta != nullptr ? reinterpret_cast<const uint4*>(delta + row * hidden) : nullptr;
    float v[FP8_NPT][8];
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < FP8_NPT; ++j) {
        const int c = threadIdx.x + j * blockDim.x;
        if (c >= chunks) break;
        uint4 rv = r[c];
        T* rt = reinterpret_cast<T*>(&rv);
        if (d != nullptr) {
            const uint4 dv = d[c];
            const T* dt = reinterpret_cast<const T*>(&dv);
#pragma unroll
            for (int i = 0; i < 8; ++i) rt[i] = from_f<T>(__fadd_rn(to_f<T>(rt[i]), to_f<T>(dt[i])));
            r[c] = rv;
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) { v[j][i] = to_f<T>(rt[i]); sum += v[j][i] * v[j][i]; }
    }
    const float inv = rsqrtf(block_sum(sum) / hidden + eps);
    const uint4* w = reinterpret_cast<const uint4*>(weight);
#pragma unroll
    for (int j = 0; j < FP8_NPT; ++j) {
        const int c = threadIdx.x + j * blockDim.x;
        if (c >= chunks) break;
        const uint4 wv = w[c];
        const T* wt = reinterpret_cast<const T*>(&wv);
#pragma unroll
        for (int i = 0; i < 8; ++i)
            v[j][i] = round_t<T>(__fmul_rn(to_f<T>(wt[i]), round_t<T>(__fmul_rn(v[j][i], inv))));
    }
    quantize_held<T>(q + row * hidden, scale + row, v, chunks);
}

template <typename T>
__global__ void silu_and_mul_fp8_vec(unsigned char* __restrict__ q, float* __restrict__ scale,
                                     const T* __restrict__ gate_up, int width) {
    const long row = blockIdx.x;
    const int chunks = width / 8;
    const uint4* g = reinterpret_cast<const uint4*>(gate_up + row * 2 * (long)width);
    const uint4* u = g + chunks;
    float v[FP8_NPT][8];
#pragma unroll
    for (int j = 0; j < FP8_NPT; ++j) {
        const int c = threadIdx.x + j * blockDim.x;
        if (c >= chunks) break;
        const uint4 gv = g[c], uv = u[c];
        const T* gt = reinterpret_cast<const T*>(&gv);
        const T* ut = reinterpret_cast<const T*>(&uv);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const float gf = to_f<T>(gt[i]);
            v[j][i] = round_t<T>(silu_mul_f<T>(gf, to_f<T>(ut[i])));
        }
    }
    quantize_held<T>(q + row * width, scale + row, v, chunks);
}

// Version 2 of the three (the `_v2` kernels, ops.FP8_QUANT_V2): the same values, with every
// 16-byte load of the thread's chunks issued before any is used (predicated, not a loop that
// breaks, so that ptxas can hoist them: the version above waits for each chunk in turn), the
// finished values held packed in T (they are rounded to T already), and NPT, the chunks a thread
// holds at most, a template argument (4 where the launch allows) for fewer registers: at most 64
// (__launch_bounds__(1024)), two blocks of 448 threads a SM (a row of 14,336).
template <typename T> union Pack8 {
    uint4 u;
    T t[8];
};
template <typename T> __device__ __forceinline__ uint4 pack8_t(const float* v) {
    Pack8<T> p;
#pragma unroll
    for (int i = 0; i < 8; ++i) p.t[i] = from_f<T>(v[i]);
    return p.u;
}
template <typename T> __device__ __forceinline__ void unpack8_t(const uint4& u, float* v) {
    Pack8<T> p;
    p.u = u;
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = to_f<T>(p.t[i]);
}

// pv[j]: this thread's chunks (T-exact values), amax their largest magnitude -> q's row, scale
template <typename T, int NPT>
__device__ __forceinline__ void quantize_packed(unsigned char* __restrict__ q, float* __restrict__ scale,
                                                const uint4 (&pv)[NPT], float amax, int chunks) {
    const float s = fmaxf(__fdiv_rn(block_max(amax), FP8_MAX), FP8_MIN_SCALE);
    if (threadIdx.x == 0) *scale = s;
#pragma unroll
    for (int j = 0; j < NPT; ++j) {
        const int c = threadIdx.x + j * blockDim.x;
        if (c < chunks) {
            float v[8];
            unpack8_t<T>(pv[j], v);
            store_e4m3x8<T>(q, c, v, s);
        }
    }
}

template <typename T, int NPT>
__global__ void __launch_bounds__(1024) quant_rows_fp8_v2(unsigned char* __restrict__ q, float* __restrict__ scale,
                                  const T* __restrict__ x, int width) {
    const long row = blockIdx.x;
    const int chunks = width / 8;
    const uint4* xr = reinterpret_cast<const uint4*>(x + row * width);
    uint4 pv[NPT];
#pragma unroll
    for (int j = 0; j < NPT; ++j) {
        const int c = threadIdx.x + j * blockDim.x;
        pv[j] = c < chunks ? xr[c] : make_uint4(0u, 0u, 0u, 0u);
    }
    float amax = 0.0f;
#pragma unroll
    for (int j = 0; j < NPT; ++j) {
        float v[8];
        unpack8_t<T>(pv[j], v);  // (zeros past the row)
#pragma unroll
        for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
    }
    quantize_packed<T, NPT>(q + row * width, scale + row, pv, amax, chunks);
}

template <typename T, int NPT>
__global__ void __launch_bounds__(1024) add_rms_norm_fp8_v2(unsigned char* __restrict__ q, float* __restrict__ scale,
                                    const T* __restrict__ delta, T* __restrict__ residual_io,
                                    const T* __restrict__ weight, float eps, int hidden) {
    const long row = blockIdx.x;
    const int chunks = hidden / 8;
    uint4* r = reinterpret_cast<uint4*>(residual_io + row * hidden);
    const uint4* d = delta != nullptr ? reinterpret_cast<const uint4*>(delta + row * hidden) : nullptr;
    const uint4* w = reinterpret_cast<const uint4*>(weight);
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    uint4 rv[NPT], dv[NPT];
#pragma unroll
    for (int j = 0; j < NPT; ++j) {
        const int c = threadIdx.x + j * blockDim.x;
        rv[j] = c < chunks ? r[c] : zero;
        dv[j] = c < chunks && d != nullptr ? d[c] : zero;
    }
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < NPT; ++j) {
        const int c = threadIdx.x + j * blockDim.x;
        float v[8];
        unpack8_t<T>(rv[j], v);
        if (d != nullptr) {
            float dd[8];
            unpack8_t<T>(dv[j], dd);
#pragma unroll
            for (int i = 0; i < 8; ++i) v[i] = round_t<T>(__fadd_rn(v[i], dd[i]));
            rv[j] = pack8_t<T>(v);
            if (c < chunks) r[c] = rv[j];
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) sum += v[i] * v[i];
    }
    uint4 wv[NPT];  // the norm weight (the same for every row: from L2) after the sum
#pragma unroll
    for (int j = 0; j < NPT; ++j) {
        const int c = threadIdx.x + j * blockDim.x;
        wv[j] = c < chunks ? w[c] : zero;
    }
    const float inv = rsqrtf(block_sum(sum) / hidden + eps);
    float amax = 0.0f;
#pragma unroll
    for (int j = 0; j < NPT; ++j) {
        float v[8], wf[8];
        unpack8_t<T>(rv[j], v);
        unpack8_t<T>(wv[j], wf);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            v[i] = round_t<T>(__fmul_rn(wf[i], round_t<T>(__fmul_rn(v[i], inv))));
            amax = fmaxf(amax, fabsf(v[i]));
        }
        rv[j] = pack8_t<T>(v);
    }
    quantize_packed<T, NPT>(q + row * hidden, scale + row, rv, amax, chunks);
}

template <typename T, int NPT>
__global__ void __launch_bounds__(1024) silu_and_mul_fp8_v2(unsigned char* __restrict__ q, float* __restrict__ scale,
                                    const T* __restrict__ gate_up, int width) {
    const long row = blockIdx.x;
    const int chunks = width / 8;
    const uint4* g = reinterpret_cast<const uint4*>(gate_up + row * 2 * (long)width);
    const uint4* u = g + chunks;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    uint4 gv[NPT], uv[NPT];
#pragma unroll
    for (int j = 0; j < NPT; ++j) {
        const int c = threadIdx.x + j * blockDim.x;
        gv[j] = c < chunks ? g[c] : zero;
        uv[j] = c < chunks ? u[c] : zero;
    }
    float amax = 0.0f;
#pragma unroll
    for (int j = 0; j < NPT; ++j) {
        float gf[8], uf[8], v[8];
        unpack8_t<T>(gv[j], gf);
        unpack8_t<T>(uv[j], uf);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            v[i] = round_t<T>(silu_mul_f<T>(gf[i], uf[i]));
            amax = fmaxf(amax, fabsf(v[i]));  // (zeros past the row: silu(0) * 0)
        }
        gv[j] = pack8_t<T>(v);
    }
    quantize_packed<T, NPT>(q + row * width, scale + row, gv, amax, chunks);
}

// SiLU*mul version 3 (Hopper; ops.silu_and_mul_fp8 takes it there): the row's gate and up halves
// (contiguous, 2 x width x sizeof(T) bytes: 56 KiB at Llama-3-8B's 14,336) come into shared
// memory by one cp.async.bulk (TMA), so no load waits in registers, and a SM holds three rows
// while other blocks compute. Version 2 holds its row in registers (64 at most, with spills) and
// two blocks of 448 threads a SM load, compute and store in step (1.58 TB/s on an H100). The
// finished values, rounded to T, go back over the gate half; the values are version 2's.
template <typename T>
__global__ void __launch_bounds__(256) silu_and_mul_fp8_tma(unsigned char* __restrict__ q, float* __restrict__ scale,
                                                            const T* __restrict__ gate_up, int width) {
    extern __shared__ __align__(128) unsigned char tma_row[];
    __shared__ __align__(8) unsigned long long tma_full;
    const long row = blockIdx.x;
    const int chunks = width / 8;
    const unsigned int bar = (unsigned int)__cvta_generic_to_shared(&tma_full);
    if (threadIdx.x == 0) {
        const unsigned int bytes = 2u * (unsigned int)width * (unsigned int)sizeof(T);
        mbar_init(bar, 1);
        mbar_init_fence();
        mbar_expect_tx(bar, bytes);
        bulk_copy((unsigned int)__cvta_generic_to_shared(tma_row), gate_up + row * 2 * (long)width, bytes, bar);
    }
    __syncthreads();  // the barrier initialized before any thread waits on it
    mbar_wait(bar, 0);
    uint4* g = reinterpret_cast<uint4*>(tma_row);
    const uint4* u = g + chunks;
    float amax = 0.0f;
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
        float gf[8], uf[8], v[8];
        unpack8_t<T>(g[c], gf);
        unpack8_t<T>(u[c], uf);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            v[i] = round_t<T>(silu_mul_f<T>(gf[i], uf[i]));
            amax = fmaxf(amax, fabsf(v[i]));
        }
        g[c] = pack8_t<T>(v);  // read back by this thread only
    }
    const float s = fmaxf(__fdiv_rn(block_max(amax), FP8_MAX), FP8_MIN_SCALE);
    if (threadIdx.x == 0) scale[row] = s;
    unsigned char* qr = q + row * width;
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
        float v[8];
        unpack8_t<T>(g[c], v);
        store_e4m3x8<T>(qr, c, v, s);
    }
}

// ---- Small-batch decode kernels (M <= 8 tokens) ---------------------------------------------
// At batch 1-8 a decode step is a chain of weight GEMVs with small kernels between them, and
// inside a CUDA graph each small kernel costs a few microseconds of launch latency. These fold
// them into the GEMVs: the next GEMV's prologue does the residual add and RMSNorm (each block
// recomputes the normed rows of its M tokens into shared memory), the qkv GEMV's epilogue does
// RoPE, the gate/up GEMV's epilogue does SiLU*mul. One warp computes one "unit" (a row, or the
// row pair an epilogue needs) over the whole K: no split-K, no reduce kernel. Weights are read
// with 16-byte streaming loads. Intermediate values are rounded to T where the unfused torch
// path rounds them; the dot products' summation order differs from cuBLAS, so results are not
// bitwise those of the unfused path (within bf16 rounding).

__device__ __forceinline__ void unpack(const uint4& v, float* f, __nv_bfloat16) {
    const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) { const float2 t = __bfloat1622float2(p[i]); f[2 * i] = t.x; f[2 * i + 1] = t.y; }
}
__device__ __forceinline__ void unpack(const uint4& v, float* f, __half) {
    const __half2* p = reinterpret_cast<const __half2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) { const float2 t = __half22float2(p[i]); f[2 * i] = t.x; f[2 * i + 1] = t.y; }
}
__device__ __forceinline__ void unpack(const uint4& v, float* f, float) {
    f[0] = __uint_as_float(v.x); f[1] = __uint_as_float(v.y); f[2] = __uint_as_float(v.z); f[3] = __uint_as_float(v.w);
}

// FP8 weights (WT = unsigned char: e4m3 bytes): a chunk is the 8 bytes of the 8 weights that
// meet one 16-byte chunk of 16-bit activations, converted in registers (cvt f16x2.e4m3x2: exact),
// the row's channel scale applied to the finished dot product. More chunks in flight (U) than
// for 16-bit weights: the same bytes in flight per lane.
// FP8_GEMV_U: the FP8 chunks in flight a lane; SMALL_BLOCKS_M1: the resident blocks a SM that
// the one-token kernels' register budget is set for (__launch_bounds__). Both are defined by
// ops.small_gemv_defines (INFLIGHTLLM_FP8_GEMV_U and INFLIGHTLLM_SMALL_BLOCKS for benchmarks).
#ifndef FP8_GEMV_U
#define FP8_GEMV_U 8
#endif
#ifndef SMALL_BLOCKS_M1
#define SMALL_BLOCKS_M1 3
#endif
template <typename T, typename WT> struct WChunk { using type = uint4; static constexpr int U = 4; };
template <typename T> struct WChunk<T, unsigned char> { using type = uint2; static constexpr int U = FP8_GEMV_U; };
// int8 weights (WT = signed char: model.int8_lm_head, small_gemv only): the same 8-byte chunks.
template <typename T> struct WChunk<T, signed char> { using type = uint2; static constexpr int U = FP8_GEMV_U; };
template <typename WT> struct IsInt8 { static constexpr bool value = false; };
template <> struct IsInt8<signed char> { static constexpr bool value = true; };

__device__ __forceinline__ void unpack_e4m3x8(const uint2& v, float* f) {
    const unsigned int words[2] = {v.x, v.y};
#pragma unroll
    for (int k = 0; k < 2; ++k) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
        unsigned int lo, hi;
        asm("{ .reg .b16 a, b;\n\t mov.b32 {a, b}, %2;\n\t cvt.rn.f16x2.e4m3x2 %0, a;\n\t cvt.rn.f16x2.e4m3x2 %1, b; }"
            : "=r"(lo), "=r"(hi) : "r"(words[k]));
        const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&lo));
        const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&hi));
        f[4 * k] = a.x; f[4 * k + 1] = a.y; f[4 * k + 2] = b.x; f[4 * k + 3] = b.y;
#else  // the same values by bit manipulation (gpu/pdl.cuh)
        e4m3x2_to_f(words[k], f + 4 * k);
        e4m3x2_to_f(words[k] >> 16, f + 4 * k + 2);
#endif
    }
}
// 8 int8 weights to floats, exactly and without I2F (a quarter-rate conversion that would bound
// the GEMV below copy bandwidth): each byte, biased by 128 (xor 0x80), becomes the low mantissa
// byte of 2^23 (prmt), and 2^23 + 128 is subtracted (one FADD; every value is an integer < 2^24).
__device__ __forceinline__ void unpack_s8x8(const uint2& v, float* f) {
    const unsigned int words[2] = {v.x ^ 0x80808080u, v.y ^ 0x80808080u};
#pragma unroll
    for (int k = 0; k < 2; ++k)
#pragma unroll
        for (int i = 0; i < 4; ++i)
            f[4 * k + i] = __uint_as_float(__byte_perm(words[k], 0x4B000000u, 0x7540u + i)) - 8388736.0f;
}
template <typename T, typename WT> __device__ __forceinline__ void unpack_w(const uint4& v, float* f) { unpack(v, f, T()); }
template <typename T, typename WT> __device__ __forceinline__ void unpack_w(const uint2& v, float* f) {
    if constexpr (IsInt8<WT>::value) unpack_s8x8(v, f); else unpack_e4m3x8(v, f);
}
__device__ __forceinline__ void pin(uint4& w) { asm volatile("" : "+r"(w.x), "+r"(w.y), "+r"(w.z), "+r"(w.w)); }
__device__ __forceinline__ void pin(uint2& w) { asm volatile("" : "+r"(w.x), "+r"(w.y)); }

// The U x R weight chunks of a batch at chunk c (lane-strided by 32), streaming loads.
template <typename C, int R, int U, typename WT>
__device__ __forceinline__ void load_batch(C (&w)[U][R], const WT* const* rows, int c) {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
        for (int r = 0; r < R; ++r) w[u][r] = __ldcs(reinterpret_cast<const C*>(rows[r]) + c + 32 * u);
}

// Whether the lane's batch at chunk c is whole (the unrolled loop); the rest goes chunk by chunk.
template <int U>
__device__ __forceinline__ bool whole_batch(int c, int chunks) { return c + 32 * (U - 1) < chunks; }

// acc[r][m] += dot(W row r, x[m]) over this lane's 16-byte chunks (lane, lane + 32, ...);
// rows[r] point at the R weight rows, x at `count` rows of K values (shared or global memory).
// The caller has loaded the first batch into w (load_batch at c = lane, if whole_batch): the
// norm kernels issue it before their prologue so that memory is busy while they normalize.
template <typename T, int M, int R, int U, typename WT, typename C>
__device__ __forceinline__ void warp_dot(const WT* const* rows, const T* x, int count, int K, float (&acc)[R][M],
                                         C (&w)[U][R]) {
    constexpr int VEC = 16 / sizeof(T);
    const int lane = threadIdx.x & 31;
    const int chunks = K / VEC;
    int c = lane;
    for (bool first = true; whole_batch<U>(c, chunks); c += 32 * U, first = false) {
        if (!first) load_batch<C, R, U>(w, rows, c);
        // All U*R loads of the batch stay in flight together: without this, ptxas may
        // interleave each load with the FMAs of the one before.
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int r = 0; r < R; ++r) pin(w[u][r]);
#pragma unroll
        for (int u = 0; u < U; ++u) {
            float wf[R][VEC];
#pragma unroll
            for (int r = 0; r < R; ++r) unpack_w<T, WT>(w[u][r], wf[r]);
#pragma unroll
            for (int m = 0; m < M; ++m) {
                if (m >= count) break;
                const uint4 xv = *(reinterpret_cast<const uint4*>(x + (long)m * K) + c + 32 * u);
                float xf[VEC];
                unpack(xv, xf, T());
#pragma unroll
                for (int r = 0; r < R; ++r)
#pragma unroll
                    for (int i = 0; i < VEC; ++i) acc[r][m] = fmaf(wf[r][i], xf[i], acc[r][m]);
            }
        }
    }
    for (; c < chunks; c += 32) {
        float wf[R][VEC];
#pragma unroll
        for (int r = 0; r < R; ++r) unpack_w<T, WT>(__ldcs(reinterpret_cast<const C*>(rows[r]) + c), wf[r]);
#pragma unroll
        for (int m = 0; m < M; ++m) {
            if (m >= count) break;
            const uint4 xv = *(reinterpret_cast<const uint4*>(x + (long)m * K) + c);
            float xf[VEC];
            unpack(xv, xf, T());
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int i = 0; i < VEC; ++i) acc[r][m] = fmaf(wf[r][i], xf[i], acc[r][m]);
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m)
#pragma unroll
            for (int offset = 16; offset > 0; offset >>= 1)
                acc[r][m] += __shfl_xor_sync(0xffffffff, acc[r][m], offset);
}

// The first NPRE 16-byte chunks of the norm weight this thread normalizes with (chunk
// threadIdx.x + k * blockDim.x), loaded before pdl_wait: the weight is constant, so its load
// need not wait for the kernel before, and norm_prologue's second pass does not wait for it.
constexpr int NPRE = 2;  // hidden 4096 at 256 threads: all of them
template <typename T>
__device__ __forceinline__ void prefetch_norm_weight(uint4 (&wpre)[NPRE], const T* __restrict__ weight, int K) {
    const int chunks = K / (16 / (int)sizeof(T));
#pragma unroll
    for (int k = 0; k < NPRE; ++k) {
        const int c = threadIdx.x + k * blockDim.x;
        wpre[k] = c < chunks ? reinterpret_cast<const uint4*>(weight)[c] : make_uint4(0, 0, 0, 0);
    }
}

template <typename T>
__device__ __forceinline__ void normalize_chunk(uint4* xv, int c, const uint4& wv, float inv) {
    constexpr int VEC = 16 / sizeof(T);
    uint4 v = xv[c];
    T* vs = reinterpret_cast<T*>(&v);
    const T* ws = reinterpret_cast<const T*>(&wv);
#pragma unroll
    for (int i = 0; i < VEC; ++i)
        vs[i] = from_f<T>(__fmul_rn(to_f<T>(ws[i]), round_t<T>(__fmul_rn(to_f<T>(vs[i]), inv))));
    xv[c] = v;
}

// ---- The all-reduce fused into the small-batch GEMVs (tensor parallel) -----------------------
// Under tensor parallelism the o and down GEMVs give each rank a partial sum of the hidden
// rows, which must be summed over the ranks before the next norm. Instead of an all-reduce
// kernel after them (allreduce.cu), the GEMV does it (small_gemv with `fused`):
// - every block stores its rows straight into every rank's buffer (CUDA IPC over NVLink), in
//   this rank's region of slot (E + 1) % 2, E being this rank's count of calls so far (read
//   after pdl_wait). Each 8-byte store is an "LL" word, as in NCCL's low-latency protocol:
//   4 bytes of the row and the epoch E + 1, written at once, so a reader that sees the epoch
//   sees the data with it. No fence, no flag barrier;
// - the grid's last block to arrive (a local counter) polls every rank's words in its own
//   memory until they hold the epoch, sums them in rank order into `out`, as allreduce.cu's
//   kernel sums (the same bits on every rank, and the kernel's bits), and stores E + 1.
// So the wait for the other GPUs is one block's, at the GEMV's end, and the next kernel reads
// `out` as plain rows. A rank writes a slot again two calls later, once its call in between
// has ended, which needed every rank's words of that call, which each rank writes only after
// its own previous call (the one that reads the slot) has ended.
// Each rank's buffer is the custom all-reduce's (parallel/custom_all_reduce.py): at
// FUSED_HEADER the call count E (uint64) and the arrival counter (uint32); the slots from
// `slots`: [2][world][FUSED_SLOT_BYTES], FUSED_SLOT_BYTES of words for half as many bytes of rows.
#define FUSED_HEADER 768
#define FUSED_SLOT_BYTES (256 * 1024)

struct Fused {  // small_gemv takes it as five arguments (fused_bases, ...)
    const unsigned long long* bases;  // [world] the ranks' buffers as this process maps them; null: not fused
    const volatile int* abort;        // set by the host: stop waiting for a rank that is gone
    long long slots;                  // offset of the slots in every buffer
    int rank, world;
};

__device__ __forceinline__ unsigned long long* fused_header(const Fused& f) {
    return reinterpret_cast<unsigned long long*>(f.bases[f.rank] + FUSED_HEADER);
}

// Rank `of_rank`'s region of slot (epoch % 2) in rank r's buffer, as 8-byte words.
__device__ __forceinline__ unsigned long long* fused_words(const Fused& f, int r, unsigned long long epoch, int of_rank) {
    return reinterpret_cast<unsigned long long*>(
        f.bases[r] + f.slots + ((long long)(epoch & 1) * f.world + of_rank) * FUSED_SLOT_BYTES);
}

__device__ __forceinline__ void st_word_sys(unsigned long long* address, unsigned int data, unsigned long long epoch) {
    const unsigned long long word = ((unsigned long long)(unsigned int)epoch << 32) | data;
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(address), "l"(word) : "memory");
}

// 16 bytes of the ranks' rows (chunk `chunk` of the rows) summed in rank order (float), as
// allreduce.cu's kernel sums: 4 words of each rank, each polled until it holds `epoch`.
template <typename T>
__device__ __forceinline__ uint4 fused_sum(const Fused& f, unsigned long long epoch, long long chunk) {
    constexpr int VEC = 16 / sizeof(T);
    const unsigned int want = (unsigned int)epoch;
    float acc[VEC] = {};
    for (int r = 0; r < f.world; ++r) {
        const unsigned long long* words = fused_words(f, f.rank, epoch, r) + 4 * chunk;
        unsigned long long w[4];
        unsigned int spins = 0;
        for (;;) {
            asm volatile("ld.relaxed.sys.global.v2.u64 {%0, %1}, [%2];" : "=l"(w[0]), "=l"(w[1]) : "l"(words) : "memory");
            asm volatile("ld.relaxed.sys.global.v2.u64 {%0, %1}, [%2];" : "=l"(w[2]), "=l"(w[3]) : "l"(words + 2) : "memory");
            if ((unsigned int)(w[0] >> 32) == want && (unsigned int)(w[1] >> 32) == want &&
                (unsigned int)(w[2] >> 32) == want && (unsigned int)(w[3] >> 32) == want) break;
            if ((++spins & 1023u) == 0 && *f.abort) break;
        }
        uint4 v = make_uint4((unsigned int)w[0], (unsigned int)w[1], (unsigned int)w[2], (unsigned int)w[3]);
        const T* x = reinterpret_cast<const T*>(&v);
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[i] += to_f<T>(x[i]);
    }
    uint4 out;
    T* y = reinterpret_cast<T*>(&out);
#pragma unroll
    for (int i = 0; i < VEC; ++i) y[i] = from_f<T>(acc[i]);
    return out;
}

// Prologue of the fused norm GEMVs: xs[m] = weight * rmsnorm(r[m]) for the block's M tokens,
// with r = T(residual + delta) (delta may be null: r = residual). Block 0 writes r to
// residual_out (a different buffer from residual_in: other blocks still read the input).
// wpre: the thread's first norm weight chunks (prefetch_norm_weight).
template <typename T, int M>
__device__ __forceinline__ void norm_prologue(T* xs, const T* __restrict__ residual_in, const T* __restrict__ delta,
                                              T* __restrict__ residual_out, const T* __restrict__ weight,
                                              const uint4 (&wpre)[NPRE], float eps, int count, int K) {
    constexpr int VEC = 16 / sizeof(T);
    const int chunks = K / VEC;
    for (int m = 0; m < count; ++m) {
        const uint4* res = reinterpret_cast<const uint4*>(residual_in + (long)m * K);
        const uint4* del = reinterpret_cast<const uint4*>(delta + (long)m * K);
        uint4* xv = reinterpret_cast<uint4*>(xs + (long)m * K);
        float sum = 0.0f;
        for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
            uint4 rv = res[c];
            if (delta != nullptr) {
                const uint4 dv = del[c];
                T* rs = reinterpret_cast<T*>(&rv);
                const T* ds = reinterpret_cast<const T*>(&dv);
#pragma unroll
                for (int i = 0; i < VEC; ++i) rs[i] = from_f<T>(__fadd_rn(to_f<T>(rs[i]), to_f<T>(ds[i])));
                if (blockIdx.x == 0) reinterpret_cast<uint4*>(residual_out + (long)m * K)[c] = rv;
            }
            xv[c] = rv;  // the summed row, normalized in place below
            const T* rs = reinterpret_cast<const T*>(&rv);
#pragma unroll
            for (int i = 0; i < VEC; ++i) { const float v = to_f<T>(rs[i]); sum += v * v; }
        }
        const float inv = rsqrtf(block_sum(sum) / K + eps);
#pragma unroll
        for (int k = 0; k < NPRE; ++k) {
            const int c = threadIdx.x + k * blockDim.x;
            if (c < chunks) normalize_chunk<T>(xv, c, wpre[k], inv);
        }
        for (int c = threadIdx.x + NPRE * blockDim.x; c < chunks; c += blockDim.x)
            normalize_chunk<T>(xv, c, reinterpret_cast<const uint4*>(weight)[c], inv);
    }
    __syncthreads();
}

// qkv[m] = rope(W_qkv @ rmsnorm(residual_in[m] + delta[m]) + bias), one warp per row pair
// (i, i + head_dim/2) of a q, k or v head (RoPE rotates those two; v pairs are written as is);
// with a slot_mapping, k and v are written to the paged KV cache too.
// Dynamic shared memory: M * K * sizeof(T).
template <typename T, typename WT, int M>
__global__ void __launch_bounds__(256, M == 1 ? SMALL_BLOCKS_M1 : 2) qkv_norm_rope(
        T* __restrict__ qkv, const T* __restrict__ residual_in, const T* __restrict__ delta, T* __restrict__ residual_out,
        const T* __restrict__ norm_weight, const WT* __restrict__ W, const float* __restrict__ wscale,
        const T* __restrict__ bias,
        const long* __restrict__ positions, const T* __restrict__ cos_sin,
        const long* __restrict__ slot_mapping, T* __restrict__ key_cache, T* __restrict__ value_cache,
        int num_heads, int num_kv_heads, int head_dim, int count, int K, float eps) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* xs = reinterpret_cast<T*>(smem_raw);
    const int half = head_dim / 2;
    const int units = (num_heads + 2 * num_kv_heads) * half;
    const int unit = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int head = unit / half, i = unit % half;
    const long row1 = (long)head * head_dim + i, row2 = row1 + half;
    const WT* rows[2] = {W + row1 * K, W + row2 * K};
    constexpr int U = WChunk<T, WT>::U;
    typename WChunk<T, WT>::type w[U][2];
    if (unit < units && whole_batch<U>(threadIdx.x & 31, K / (16 / (int)sizeof(T))))
        load_batch<typename WChunk<T, WT>::type, 2, U>(w, rows, threadIdx.x & 31);
    uint4 wpre[NPRE];
    prefetch_norm_weight<T>(wpre, norm_weight, K);
    // The epilogue's inputs that no kernel of the step writes (the positions and slots were
    // uploaded before the step's first kernel): loaded before the wait, off the kernel's tail.
    const bool rotate = head < num_heads + num_kv_heads;
    float cos_m[M], sin_m[M];
    long slot_m[M];
#pragma unroll
    for (int m = 0; m < M; ++m) {
        cos_m[m] = 1.0f;
        sin_m[m] = 0.0f;
        slot_m[m] = -1;
        if (m >= count || unit >= units || (threadIdx.x & 31) != 0) continue;
        if (rotate) {
            const T* cache = cos_sin + positions[m] * head_dim;
            cos_m[m] = to_f<T>(cache[i]);
            sin_m[m] = to_f<T>(cache[half + i]);
        }
        if (slot_mapping != nullptr && head >= num_heads) slot_m[m] = slot_mapping[m];
    }
    pdl_trigger();
    pdl_wait();  // everything above is constant for the step; the residual and delta come from earlier kernels
    norm_prologue<T, M>(xs, residual_in, delta, residual_out, norm_weight, wpre, eps, count, K);
    if (unit >= units) return;
    float acc[2][M];
#pragma unroll
    for (int m = 0; m < M; ++m) { acc[0][m] = 0.0f; acc[1][m] = 0.0f; }
    warp_dot<T, M, 2, U>(rows, xs, count, K, acc, w);
    if ((threadIdx.x & 31) != 0) return;
    if (wscale != nullptr) {
        const float s1 = wscale[row1], s2 = wscale[row2];
#pragma unroll
        for (int m = 0; m < M; ++m) { acc[0][m] *= s1; acc[1][m] *= s2; }
    }
    const long width = (long)(num_heads + 2 * num_kv_heads) * head_dim;
#pragma unroll
    for (int m = 0; m < M; ++m) {
        if (m >= count) break;
        float x1 = acc[0][m], x2 = acc[1][m];
        if (bias != nullptr) { x1 += to_f<T>(bias[row1]); x2 += to_f<T>(bias[row2]); }
        x1 = round_t<T>(x1);
        x2 = round_t<T>(x2);
        if (rotate) {
            const float c = cos_m[m], s = sin_m[m];
            const float o1 = __fadd_rn(round_t<T>(__fmul_rn(x1, c)), round_t<T>(__fmul_rn(-x2, s)));
            const float o2 = __fadd_rn(round_t<T>(__fmul_rn(x2, c)), round_t<T>(__fmul_rn(x1, s)));
            x1 = o1;
            x2 = o2;
        }
        qkv[m * width + row1] = from_f<T>(x1);
        qkv[m * width + row2] = from_f<T>(x2);
        // k and v rows also go to the paged cache ([blocks, block_size, kv_heads, head_dim]) at
        // the token's slot (negative: padding, skipped), as reshape_and_cache would.
        if (slot_mapping != nullptr && head >= num_heads) {
            const long slot = slot_m[m];
            if (slot >= 0) {
                const int kv = head - num_heads;  // 0..2 kv_heads - 1: k heads, then v heads
                T* cache = kv < num_kv_heads ? key_cache : value_cache;
                const long base = (slot * num_kv_heads + kv % num_kv_heads) * head_dim + i;
                cache[base] = from_f<T>(x1);
                cache[base + half] = from_f<T>(x2);
            }
        }
    }
}

// act[m, j] = silu(gate_j . x[m]) * (up_j . x[m]) with x[m] = rmsnorm(residual_in[m] + delta[m]);
// W = [gate (inter rows) | up (inter rows)]; one warp per j. Dynamic shared memory: M * K * sizeof(T).
template <typename T, typename WT, int M>
__global__ void __launch_bounds__(256, M == 1 ? SMALL_BLOCKS_M1 : 2) gate_up_norm_silu(
        T* __restrict__ act, const T* __restrict__ residual_in, const T* __restrict__ delta, T* __restrict__ residual_out,
        const T* __restrict__ norm_weight, const WT* __restrict__ W, const float* __restrict__ wscale,
        const T* __restrict__ bias,
        int inter, int count, int K, float eps) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* xs = reinterpret_cast<T*>(smem_raw);
    const int j = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const WT* rows[2] = {W + (long)j * K, W + (long)(inter + j) * K};
    constexpr int U = WChunk<T, WT>::U;
    typename WChunk<T, WT>::type w[U][2];
    if (j < inter && whole_batch<U>(threadIdx.x & 31, K / (16 / (int)sizeof(T))))
        load_batch<typename WChunk<T, WT>::type, 2, U>(w, rows, threadIdx.x & 31);
    uint4 wpre[NPRE];
    prefetch_norm_weight<T>(wpre, norm_weight, K);
    pdl_trigger();
    pdl_wait();
    norm_prologue<T, M>(xs, residual_in, delta, residual_out, norm_weight, wpre, eps, count, K);
    if (j >= inter) return;
    float acc[2][M];
#pragma unroll
    for (int m = 0; m < M; ++m) { acc[0][m] = 0.0f; acc[1][m] = 0.0f; }
    warp_dot<T, M, 2, U>(rows, xs, count, K, acc, w);
    if ((threadIdx.x & 31) != 0) return;
    if (wscale != nullptr) {
        const float s1 = wscale[j], s2 = wscale[inter + j];
#pragma unroll
        for (int m = 0; m < M; ++m) { acc[0][m] *= s1; acc[1][m] *= s2; }
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
        if (m >= count) break;
        float g = acc[0][m], u = acc[1][m];
        if (bias != nullptr) { g += to_f<T>(bias[j]); u += to_f<T>(bias[inter + j]); }
        g = round_t<T>(g);
        u = round_t<T>(u);
        act[(long)m * inter + j] = from_f<T>(silu_mul_f<T>(g, u));
    }
}

// out[m] = W @ x[m] + bias, one warp per pair of output rows (n, n + 1): half as many warps
// as rows, so that the o and down GEMVs of an 8B model run in one wave of resident blocks;
// x read from global memory (L1-cached). With `fused` (bases not null), `out` gets the rows
// summed over the ranks ("The all-reduce fused into the small-batch GEMVs"; N even, and
// 2 * N * count * sizeof(T) bytes must fit a slot).
template <typename T, typename WT, int M>
__global__ void __launch_bounds__(256, M == 1 ? SMALL_BLOCKS_M1 : 2) small_gemv(
        T* __restrict__ out, const T* __restrict__ x, const WT* __restrict__ W, const float* __restrict__ wscale,
        const T* __restrict__ bias, int N, int count, int K,
        const unsigned long long* __restrict__ fused_bases, const volatile int* fused_abort, long long fused_slots,
        int fused_rank, int fused_world) {
    const Fused fused{fused_bases, fused_abort, fused_slots, fused_rank, fused_world};
    const int n = 2 * (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5));
    const bool active = n < N;
    pdl_trigger();
    const bool pair = n + 1 < N;
    const WT* rows[2] = {W + (long)(active ? n : 0) * K, W + (long)(pair ? n + 1 : (active ? n : 0)) * K};
    constexpr int U = WChunk<T, WT>::U;
    typename WChunk<T, WT>::type w[U][2];
    if (active && whole_batch<U>(threadIdx.x & 31, K / (16 / (int)sizeof(T))))
        load_batch<typename WChunk<T, WT>::type, 2, U>(w, rows, threadIdx.x & 31);
    pdl_wait();  // x comes from the kernel before
    if (!active && fused.bases == nullptr) return;
    float acc[2][M];
#pragma unroll
    for (int m = 0; m < M; ++m) { acc[0][m] = 0.0f; acc[1][m] = 0.0f; }
    if (active) warp_dot<T, M, 2, U>(rows, x, count, K, acc, w);
    if (active && wscale != nullptr) {
        const float s1 = wscale[n], s2 = wscale[pair ? n + 1 : n];
#pragma unroll
        for (int m = 0; m < M; ++m) { acc[0][m] *= s1; acc[1][m] *= s2; }
    }
    const unsigned long long epoch = fused.bases != nullptr ? fused_header(fused)[0] + 1 : 0;
    if (active && (threadIdx.x & 31) == 0) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
            if (m >= count) break;
            T v[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float value = acc[r][m];
                if (bias != nullptr && (r == 0 || pair)) value += to_f<T>(bias[n + r]);
                v[r] = from_f<T>(value);
            }
            if (fused.bases == nullptr) {
                out[(long)m * N + n] = v[0];
                if (pair) out[(long)m * N + n + 1] = v[1];
                continue;
            }
            // 4 bytes of the row per word: the pair (n even, N even) in one word for 2-byte
            // types, one value per word for float
            const long word = ((long)m * N + n) * (long)sizeof(T) / 4;
            unsigned int data[2];
            if (sizeof(T) == 2) {
                data[0] = *reinterpret_cast<const unsigned short*>(&v[0]);
                if (pair) data[0] |= (unsigned int)*reinterpret_cast<const unsigned short*>(&v[1]) << 16;
            } else {
                data[0] = *reinterpret_cast<const unsigned int*>(&v[0]);
                data[1] = *reinterpret_cast<const unsigned int*>(&v[1]);
            }
            for (int r = 0; r < fused.world; ++r) {
                unsigned long long* words = fused_words(fused, r, epoch, fused.rank) + word;
                st_word_sys(words, data[0], epoch);
                if (sizeof(T) == 4 && pair) st_word_sys(words + 1, data[1], epoch);
            }
        }
    }
    if (fused.bases == nullptr) return;
    // The grid's last block to arrive sums every rank's rows into `out`.
    __shared__ bool last;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned int* arrivals = reinterpret_cast<unsigned int*>(fused_header(fused) + 1);
        last = atomicAdd(arrivals, 1u) == gridDim.x - 1;
        if (last) *arrivals = 0;
    }
    __syncthreads();
    if (!last) return;
    const long long chunks = (long long)count * N * (long long)sizeof(T) / 16;
    for (long long c = threadIdx.x; c < chunks; c += blockDim.x)
        reinterpret_cast<uint4*>(out)[c] = fused_sum<T>(fused, epoch, c);
    if (threadIdx.x == 0) fused_header(fused)[0] = epoch;
}
