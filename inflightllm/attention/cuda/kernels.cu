// Paged attention kernels for inflightllm (compiled at run time by CuPy RawModule / NVRTC).
//
// Cache layout (per layer): K and V each [num_blocks, block_size, num_kv_heads, D], contiguous;
// a token's slot is block * block_size + offset, its row starts at (slot * num_kv_heads + kvh) * D.
// Block sizes are powers of two (passed as log2). All accumulation is fp32.
//
// Kernels:
//   reshape_and_cache<VT>          new K/V rows -> cache slots (VT = uint4 for 16-byte copies)
//   reshape_and_cache_fp8<T, N>    the same into an FP8 cache: K / k_scale, V / v_scale as e4m3
//   gather_kv                      paged K/V of the prefill sequences -> packed rows (flash path)
//   gather_kv_fp8<T>               the same from an FP8 cache, dequantized (e4m3 * scale -> T)
//   paged_decode_v2<T, D, MAXG[, CT]>    flash-decoding: one block per (kv head, head group, seq,
//                                  split), register online softmax, no barriers in the token loop;
//                                  CT = fp8e4m3: reads an FP8 cache (CT defaults to T)
//   paged_decode_v4<T, D, MAXG, S[, CT]> version 2 with its K/V loads pipelined S - 1 tiles ahead
//                                  by cp.async into shared memory (the default where unsplit)
//   paged_decode_v5<T, D, fp8e4m3>  flash-decoding of an FP8 cache on tensor cores (mma.sync in
//                                  f16; the default for an FP8 cache with fp16 / bf16 queries)
//   paged_decode_v6<T, D, fp8e4m3>  version 5's scoring, the cache read a page at a time into
//                                  shared memory by cp.async.bulk (TMA), every kv head a block
//   paged_decode<T, D, MAXG>       flash-decoding, first version (shared-memory logits per chunk)
//   decode_reduce<T, D>            combines the splits (decode_reduce_v1: the first version)
//   prefill_fma<T, D>              prefill / chunked prefill, plain FMA (fp32 path)
//   prefill_mma<T, D>              prefill / chunked prefill, mma.sync m16n8k16 tensor cores (fp16/bf16)

#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef long long i64;
typedef unsigned int u32;

#define FULL_MASK 0xffffffffu

// pdl_trigger() and pdl_wait(): inflightllm/gpu/pdl.cuh, prepended to this source when it is
// compiled; the decode kernels call both first (they are launched by PDL, gpu/pdl.py).

__device__ __forceinline__ float neg_inf() { return __int_as_float((int)0xff800000u); }

// ---------------------------------------------------------------------------------------------
// Conversions: to_f<T> / from_f<T> (gpu/pdl.cuh, prepended to this source when it is compiled)

// 16 bytes -> 16/sizeof(T) floats
template <typename T> __device__ __forceinline__ void unpack16(const uint4& u, float* f);
template <> __device__ __forceinline__ void unpack16<float>(const uint4& u, float* f) {
    f[0] = __uint_as_float(u.x); f[1] = __uint_as_float(u.y);
    f[2] = __uint_as_float(u.z); f[3] = __uint_as_float(u.w);
}
__device__ __forceinline__ void bf16x2_to_f(u32 w, float* f) {
    f[0] = __uint_as_float(w << 16);
    f[1] = __uint_as_float(w & 0xffff0000u);
}
template <> __device__ __forceinline__ void unpack16<__nv_bfloat16>(const uint4& u, float* f) {
    bf16x2_to_f(u.x, f); bf16x2_to_f(u.y, f + 2); bf16x2_to_f(u.z, f + 4); bf16x2_to_f(u.w, f + 6);
}
__device__ __forceinline__ void h2_to_f(u32 w, float* f) {
    __half2 h = *reinterpret_cast<__half2*>(&w);
    float2 r = __half22float2(h);
    f[0] = r.x; f[1] = r.y;
}
template <> __device__ __forceinline__ void unpack16<__half>(const uint4& u, float* f) {
    h2_to_f(u.x, f); h2_to_f(u.y, f + 2); h2_to_f(u.z, f + 4); h2_to_f(u.w, f + 6);
}

// two floats -> packed 2 x 16-bit (low half = first)
template <typename T> __device__ __forceinline__ u32 pack2(float lo, float hi);
template <> __device__ __forceinline__ u32 pack2<__nv_bfloat16>(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<u32*>(&v);
}
template <> __device__ __forceinline__ u32 pack2<__half>(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<u32*>(&v);
}

// ---------------------------------------------------------------------------------------------
// FP8 KV cache (engine.kv_cache_dtype fp8). The cache holds e4m3fn bytes of K / k_scale and
// V / v_scale (one scale pair per layer), as inflightllm.attention.torch_ref's does: x / scale
// in float32 (IEEE division, no fast-math), saturated to +-448, rounded to nearest even. Every
// e4m3 value is exactly a half, so reading is exact before the scale: the decode kernels fold
// k_scale into the query (ops.paged_decode) and v_scale into their output, gather_kv_fp8
// multiplies each value in float32 and rounds to T (the reference's arithmetic). sm_89+
// converts two values per instruction (cvt ... e4m3x2); older GPUs take the same rounding
// by bit manipulation (gpu/pdl.cuh, shared with layers.cu).
struct fp8e4m3 { unsigned char bits; };

// (e4m3_from_float_sw, e4m3_to_float_sw, e4m3x2_from_float, e4m3x2_to_f: gpu/pdl.cuh)

// N e4m3 bytes (one vector load) -> N floats
template <int N> struct Fp8Vec;
template <> struct Fp8Vec<8> {
    typedef uint2 type;
    static __device__ __forceinline__ void unpack(const uint2& u, float* f) {
        e4m3x2_to_f(u.x, f); e4m3x2_to_f(u.x >> 16, f + 2);
        e4m3x2_to_f(u.y, f + 4); e4m3x2_to_f(u.y >> 16, f + 6);
    }
};
template <> struct Fp8Vec<4> {
    typedef unsigned int type;
    static __device__ __forceinline__ void unpack(const unsigned int& u, float* f) {
        e4m3x2_to_f(u, f); e4m3x2_to_f(u >> 16, f + 2);
    }
};

// What a decode thread loads of a K/V row: the cache elements of 16 / sizeof(T) query
// elements (its slice), as one vector of BYTES bytes, and their floats. CT == T: 16 bytes.
template <typename T, typename CT> struct CacheSlice {
    typedef uint4 type;
    static constexpr int BYTES = 16;
    static __device__ __forceinline__ void unpack(const uint4& u, float* f) { unpack16<T>(u, f); }
};
template <typename T> struct CacheSlice<T, fp8e4m3> {
    static constexpr int BYTES = 16 / sizeof(T);
    typedef typename Fp8Vec<BYTES>::type type;
    static __device__ __forceinline__ void unpack(const type& u, float* f) { Fp8Vec<BYTES>::unpack(u, f); }
};

// 8 consecutive T (16-byte aligned) -> floats, and back (rounded to nearest)
template <typename T> __device__ __forceinline__ void load8(const T* p, float* f) {
    unpack16<T>(*reinterpret_cast<const uint4*>(p), f);
}
template <> __device__ __forceinline__ void load8<float>(const float* p, float* f) {
    unpack16<float>(reinterpret_cast<const uint4*>(p)[0], f);
    unpack16<float>(reinterpret_cast<const uint4*>(p)[1], f + 4);
}
template <typename T> __device__ __forceinline__ void store8(T* p, const float* f) {
    *reinterpret_cast<uint4*>(p) = make_uint4(pack2<T>(f[0], f[1]), pack2<T>(f[2], f[3]),
                                              pack2<T>(f[4], f[5]), pack2<T>(f[6], f[7]));
}
template <> __device__ __forceinline__ void store8<float>(float* p, const float* f) {
    reinterpret_cast<float4*>(p)[0] = make_float4(f[0], f[1], f[2], f[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(f[4], f[5], f[6], f[7]);
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// ---------------------------------------------------------------------------------------------
// reshape_and_cache: key/value [num_tokens, kvh, D] (strides in VT units, last dim contiguous)
// -> caches at slot_mapping[token] (skipped when < 0). row_vt = D * sizeof(T) / sizeof(VT).
template <typename VT>
__global__ void reshape_and_cache(const VT* __restrict__ key, const VT* __restrict__ value,
                                  VT* __restrict__ key_cache, VT* __restrict__ value_cache,
                                  const i64* __restrict__ slot_mapping,
                                  i64 k_stok, i64 k_shead, i64 v_stok, i64 v_shead,
                                  int num_kv_heads, int row_vt) {
    const int tok = blockIdx.x;
    const i64 slot = slot_mapping[tok];
    if (slot < 0) return;
    const int n = num_kv_heads * row_vt;
    const VT* kp = key + (i64)tok * k_stok;
    const VT* vp = value + (i64)tok * v_stok;
    VT* kd = key_cache + slot * n;
    VT* vd = value_cache + slot * n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int h = i / row_vt;
        const int d = i - h * row_vt;
        kd[i] = kp[h * k_shead + d];
        vd[i] = vp[h * v_shead + d];
    }
}

// reshape_and_cache_fp8: the same into an FP8 cache (bytes), quantized with the layer's scales.
// key/value [num_tokens, kvh, head_dim] (strides in elements, last dim contiguous); N elements
// a thread: 8 (16-byte aligned rows and strides: one or two 16-byte loads, one 8-byte store) or 1.
template <typename T, int N>
__global__ void reshape_and_cache_fp8(const T* __restrict__ key, const T* __restrict__ value,
                                      unsigned char* __restrict__ key_cache, unsigned char* __restrict__ value_cache,
                                      const i64* __restrict__ slot_mapping,
                                      i64 k_stok, i64 k_shead, i64 v_stok, i64 v_shead,
                                      int num_kv_heads, int head_dim, float k_scale, float v_scale) {
    const int tok = blockIdx.x;
    const i64 slot = slot_mapping[tok];
    if (slot < 0) return;
    const int row_n = head_dim / N;
    const int n = num_kv_heads * row_n;
    const T* kp = key + (i64)tok * k_stok;
    const T* vp = value + (i64)tok * v_stok;
    unsigned char* kd = key_cache + slot * num_kv_heads * head_dim;
    unsigned char* vd = value_cache + slot * num_kv_heads * head_dim;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int h = i / row_n;
        const int d = (i - h * row_n) * N;
        if constexpr (N == 8) {
            float kf[8], vf[8];
            load8<T>(kp + h * k_shead + d, kf);
            load8<T>(vp + h * v_shead + d, vf);
            u32 kq[4], vq[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                kq[j] = e4m3x2_from_float(kf[2 * j] / k_scale, kf[2 * j + 1] / k_scale);
                vq[j] = e4m3x2_from_float(vf[2 * j] / v_scale, vf[2 * j + 1] / v_scale);
            }
            *reinterpret_cast<uint2*>(kd + h * head_dim + d) = make_uint2(kq[0] | (kq[1] << 16), kq[2] | (kq[3] << 16));
            *reinterpret_cast<uint2*>(vd + h * head_dim + d) = make_uint2(vq[0] | (vq[1] << 16), vq[2] | (vq[3] << 16));
        } else {
            kd[h * head_dim + d] = (unsigned char)e4m3x2_from_float(to_f<T>(kp[h * k_shead + d]) / k_scale, 0.f);
            vd[h * head_dim + d] = (unsigned char)e4m3x2_from_float(to_f<T>(vp[h * v_shead + d]) / v_scale, 0.f);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// gather_kv: rows 0..ctx-1 of each prefill sequence p (seq = num_decodes + p) -> packed
// [cu_k[p] + row]. row_vec = num_kv_heads * D * sizeof(T) / 16. grid (ceil(max_ctx/32), num_prefills).
__global__ void gather_kv(const uint4* __restrict__ key_cache, const uint4* __restrict__ value_cache,
                          uint4* __restrict__ key_out, uint4* __restrict__ value_out,
                          const int* __restrict__ block_tables, int bt_stride,
                          const int* __restrict__ context_lens, const int* __restrict__ cu_k,
                          int num_decodes, int bs_shift, int row_vec) {
    const int p = blockIdx.y;
    const int seq = num_decodes + p;
    const int ctx = context_lens[seq];
    const i64 dst0 = cu_k[p];
    const int r0 = blockIdx.x * 32;
    if (r0 >= ctx) return;
    const int bs_mask = (1 << bs_shift) - 1;
    const int* bt = block_tables + (i64)seq * bt_stride;
    for (int i = threadIdx.x; i < 32 * row_vec; i += blockDim.x) {
        const int r = r0 + i / row_vec;
        const int c = i % row_vec;
        if (r < ctx) {
            const i64 slot = ((i64)bt[r >> bs_shift] << bs_shift) + (r & bs_mask);
            key_out[(dst0 + r) * row_vec + c] = key_cache[slot * row_vec + c];
            value_out[(dst0 + r) * row_vec + c] = value_cache[slot * row_vec + c];
        }
    }
}

// gather_kv_fp8: gather_kv from an FP8 cache, each value dequantized (e4m3 * scale in float32,
// rounded to T). row_vec = num_kv_heads * D / 8 (8-byte pieces of a cache row).
template <typename T>
__global__ void gather_kv_fp8(const uint2* __restrict__ key_cache, const uint2* __restrict__ value_cache,
                              T* __restrict__ key_out, T* __restrict__ value_out,
                              const int* __restrict__ block_tables, int bt_stride,
                              const int* __restrict__ context_lens, const int* __restrict__ cu_k,
                              int num_decodes, int bs_shift, int row_vec, float k_scale, float v_scale) {
    const int p = blockIdx.y;
    const int seq = num_decodes + p;
    const int ctx = context_lens[seq];
    const i64 dst0 = cu_k[p];
    const int r0 = blockIdx.x * 32;
    if (r0 >= ctx) return;
    const int bs_mask = (1 << bs_shift) - 1;
    const int* bt = block_tables + (i64)seq * bt_stride;
    for (int i = threadIdx.x; i < 32 * row_vec; i += blockDim.x) {
        const int r = r0 + i / row_vec;
        const int c = i % row_vec;
        if (r < ctx) {
            const i64 slot = ((i64)bt[r >> bs_shift] << bs_shift) + (r & bs_mask);
            float kf[8], vf[8];
            Fp8Vec<8>::unpack(key_cache[slot * row_vec + c], kf);
            Fp8Vec<8>::unpack(value_cache[slot * row_vec + c], vf);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                kf[j] *= k_scale;
                vf[j] *= v_scale;
            }
            store8<T>(key_out + ((dst0 + r) * row_vec + c) * 8, kf);
            store8<T>(value_out + ((dst0 + r) * row_vec + c) * 8, vf);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Flash-decoding. grid (num_kv_heads * groups_per_kv, num_decodes, Z), DEC_THREADS threads.
// Each block: up to MAXG query heads of one GQA group (K/V read once for all of them), one
// sequence, one split of its attended range [start, ctx) (start = ctx - window with a window).
// Z == 1: writes the normalised output directly. Z > 1: writes the unnormalised partial
// output + running max (log2 domain) + sum per split; decode_reduce combines them.
#define DEC_THREADS 128
#define DEC_WARPS 4
#define DEC_CHUNK 256
#define DEC_UNROLL 4

// An empty split (or a context of 0): zeros to the output (Z == 1), else a neutral partial
// (max -inf, sum 0, partial output 0) so that decode_reduce can combine splits unconditionally.
template <typename T, int D>
__device__ __forceinline__ void decode_empty_split(T* out, float* part_out, float* part_m, float* part_l,
                                                   int seq, int num_heads, int head0, int ng, int split,
                                                   int Z, int tid) {
    if (Z == 1) {
        for (int i = tid; i < ng * D; i += DEC_THREADS)
            out[((i64)seq * num_heads + head0) * D + i] = from_f<T>(0.f);
        return;
    }
    for (int i = tid; i < ng * D; i += DEC_THREADS) {
        const int g = i / D;
        const i64 hrow = (i64)seq * num_heads + head0 + g;
        part_out[(hrow * Z + split) * D + (i - g * D)] = 0.f;
    }
    if (tid < ng) {
        const i64 idx = ((i64)seq * num_heads + head0 + tid) * Z + split;
        part_m[idx] = neg_inf();
        part_l[idx] = 0.f;
    }
}

template <typename T, int D, int MAXG>
__global__ void __launch_bounds__(DEC_THREADS)
paged_decode(const T* __restrict__ q, i64 q_stok, i64 q_shead,
             const T* __restrict__ key_cache, const T* __restrict__ value_cache,
             const int* __restrict__ block_tables, int bt_stride,
             const int* __restrict__ context_lens,
             T* __restrict__ out,
             float* __restrict__ part_out, float* __restrict__ part_m, float* __restrict__ part_l,
             int num_heads, int num_kv_heads, int group, int groups_per_kv,
             int bs_shift, int window, float scale_log2) {
    pdl_trigger();
    pdl_wait();
    constexpr int VEC = 16 / sizeof(T);
    constexpr int TPK = D / VEC;            // threads per key row
    constexpr int KPI = DEC_THREADS / TPK;  // key rows per block iteration
    constexpr int SBUF = (MAXG * DEC_CHUNK > DEC_WARPS * MAXG * D) ? MAXG * DEC_CHUNK : DEC_WARPS * MAXG * D;
    static_assert(TPK <= 32 && (32 % TPK) == 0, "head_dim / dtype");

    __shared__ float s_buf[SBUF];
    __shared__ int s_bt[DEC_CHUNK + 1];
    __shared__ float s_m[MAXG], s_l[MAXG], s_corr[MAXG];

    const int kvh = blockIdx.x / groups_per_kv;
    const int hg = blockIdx.x - kvh * groups_per_kv;
    const int g0 = hg * MAXG;
    const int ng = min(MAXG, group - g0);
    const int head0 = kvh * group + g0;
    const int seq = blockIdx.y;
    const int split = blockIdx.z;
    const int Z = gridDim.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int piece = tid % TPK, kg = tid / TPK;
    const bool direct = (Z == 1);

    const int ctx = context_lens[seq];
    const int start = (window > 0) ? max(0, ctx - window) : 0;
    const int n = ctx - start;
    int per = (n + Z - 1) / Z;
    per = (per + 31) & ~31;
    const int r0 = start + split * per;
    const int r1 = min(ctx, r0 + per);

    if (r0 >= r1) {  // empty split (or ctx == 0)
        decode_empty_split<T, D>(out, part_out, part_m, part_l, seq, num_heads, head0, ng, split, Z, tid);
        return;
    }

    // query slice of this thread, pre-scaled into the log2 domain
    float qr[MAXG][VEC];
#pragma unroll
    for (int g = 0; g < MAXG; ++g) {
        if (g < ng) {
            const T* qp = q + (i64)seq * q_stok + (i64)(head0 + g) * q_shead + piece * VEC;
            uint4 u = *reinterpret_cast<const uint4*>(qp);
            unpack16<T>(u, qr[g]);
#pragma unroll
            for (int i = 0; i < VEC; ++i) qr[g][i] *= scale_log2;
        } else {
#pragma unroll
            for (int i = 0; i < VEC; ++i) qr[g][i] = 0.f;
        }
    }
    float acc[MAXG][VEC];
#pragma unroll
    for (int g = 0; g < MAXG; ++g)
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[g][i] = 0.f;
    if (tid < MAXG) { s_m[tid] = neg_inf(); s_l[tid] = 0.f; }

    const int bs_mask = (1 << bs_shift) - 1;
    const int* bt = block_tables + (i64)seq * bt_stride;
    const i64 row_stride = (i64)num_kv_heads * D;
    const T* kbase = key_cache + (i64)kvh * D + piece * VEC;
    const T* vbase = value_cache + (i64)kvh * D + piece * VEC;

    for (int c0 = r0; c0 < r1; c0 += DEC_CHUNK) {
        const int c1 = min(r1, c0 + DEC_CHUNK);
        const int cn = c1 - c0;
        const int b0 = c0 >> bs_shift;
        const int nb = ((c1 - 1) >> bs_shift) - b0 + 1;
        for (int i = tid; i < nb; i += DEC_THREADS) s_bt[i] = bt[b0 + i];
        __syncthreads();

        // phase A: logits of this chunk
        for (int tb = 0; tb < cn; tb += KPI * DEC_UNROLL) {
            uint4 kv[DEC_UNROLL];
#pragma unroll
            for (int u = 0; u < DEC_UNROLL; ++u) {
                const int tt = tb + u * KPI + kg;
                if (tt < cn) {
                    const int pos = c0 + tt;
                    const i64 slot = ((i64)s_bt[(pos >> bs_shift) - b0] << bs_shift) + (pos & bs_mask);
                    kv[u] = __ldg(reinterpret_cast<const uint4*>(kbase + slot * row_stride));
                } else {
                    kv[u] = make_uint4(0u, 0u, 0u, 0u);
                }
            }
#pragma unroll
            for (int u = 0; u < DEC_UNROLL; ++u) {
                const int tt = tb + u * KPI + kg;
                float kf[VEC];
                unpack16<T>(kv[u], kf);
#pragma unroll
                for (int g = 0; g < MAXG; ++g) {
                    float s = 0.f;
#pragma unroll
                    for (int i = 0; i < VEC; ++i) s = fmaf(qr[g][i], kf[i], s);
#pragma unroll
                    for (int o = TPK / 2; o > 0; o >>= 1) s += __shfl_xor_sync(FULL_MASK, s, o);
                    if (piece == 0 && tt < cn && g < ng) s_buf[g * DEC_CHUNK + tt] = s;
                }
            }
        }
        __syncthreads();

        // phase B: online softmax bookkeeping, one warp per head
        for (int g = warp; g < ng; g += DEC_WARPS) {
            float mx = neg_inf();
            for (int i = lane; i < cn; i += 32) mx = fmaxf(mx, s_buf[g * DEC_CHUNK + i]);
            mx = warp_max(mx);
            const float m_old = s_m[g];
            const float m_new = fmaxf(m_old, mx);
            float sum = 0.f;
            for (int i = lane; i < cn; i += 32) {
                const float p = exp2f(s_buf[g * DEC_CHUNK + i] - m_new);
                s_buf[g * DEC_CHUNK + i] = p;
                sum += p;
            }
            sum = warp_sum(sum);
            if (lane == 0) {
                const float corr = exp2f(m_old - m_new);
                s_corr[g] = corr;
                s_l[g] = s_l[g] * corr + sum;
                s_m[g] = m_new;
            }
        }
        __syncthreads();

        // phase C: accumulate P V
#pragma unroll
        for (int g = 0; g < MAXG; ++g) {
            const float c = (g < ng) ? s_corr[g] : 1.f;
#pragma unroll
            for (int i = 0; i < VEC; ++i) acc[g][i] *= c;
        }
        for (int tb = 0; tb < cn; tb += KPI * DEC_UNROLL) {
            uint4 vv[DEC_UNROLL];
#pragma unroll
            for (int u = 0; u < DEC_UNROLL; ++u) {
                const int tt = tb + u * KPI + kg;
                if (tt < cn) {
                    const int pos = c0 + tt;
                    const i64 slot = ((i64)s_bt[(pos >> bs_shift) - b0] << bs_shift) + (pos & bs_mask);
                    vv[u] = __ldg(reinterpret_cast<const uint4*>(vbase + slot * row_stride));
                } else {
                    vv[u] = make_uint4(0u, 0u, 0u, 0u);
                }
            }
#pragma unroll
            for (int u = 0; u < DEC_UNROLL; ++u) {
                const int tt = tb + u * KPI + kg;
                if (tt < cn) {
                    float vf[VEC];
                    unpack16<T>(vv[u], vf);
#pragma unroll
                    for (int g = 0; g < MAXG; ++g) {
                        if (g < ng) {
                            const float p = s_buf[g * DEC_CHUNK + tt];
#pragma unroll
                            for (int i = 0; i < VEC; ++i) acc[g][i] = fmaf(p, vf[i], acc[g][i]);
                        }
                    }
                }
            }
        }
        __syncthreads();
    }

    // reduce the key groups: inside the warp by shuffles, across warps through shared memory
#pragma unroll
    for (int g = 0; g < MAXG; ++g)
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
            float v = acc[g][i];
#pragma unroll
            for (int o = TPK; o < 32; o <<= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
            acc[g][i] = v;
        }
    if (lane < TPK) {
#pragma unroll
        for (int g = 0; g < MAXG; ++g)
            if (g < ng) {
#pragma unroll
                for (int i = 0; i < VEC; ++i) s_buf[(warp * MAXG + g) * D + piece * VEC + i] = acc[g][i];
            }
    }
    __syncthreads();
    for (int idx = tid; idx < ng * D; idx += DEC_THREADS) {
        const int g = idx / D;
        const int d = idx - g * D;
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < DEC_WARPS; ++w) v += s_buf[(w * MAXG + g) * D + d];
        const i64 hrow = (i64)seq * num_heads + head0 + g;
        if (direct) {
            out[hrow * D + d] = from_f<T>(v / s_l[g]);
        } else {
            part_out[(hrow * Z + split) * D + d] = v;
            if (d == 0) {
                part_m[hrow * Z + split] = s_m[g];
                part_l[hrow * Z + split] = s_l[g];
            }
        }
    }
}

// The first reduce (used with paged_decode "v1"): each thread walks the splits itself.
template <typename T, int D>
__global__ void __launch_bounds__(D)
decode_reduce_v1(const float* __restrict__ part_out, const float* __restrict__ part_m,
                 const float* __restrict__ part_l, T* __restrict__ out, int num_heads, int Z) {
    pdl_trigger();
    pdl_wait();
    const int head = blockIdx.x, seq = blockIdx.y, d = threadIdx.x;
    const i64 hrow = (i64)seq * num_heads + head;
    const float* pm = part_m + hrow * Z;
    const float* pl = part_l + hrow * Z;
    float M = neg_inf();
    for (int i = 0; i < Z; ++i) M = fmaxf(M, pm[i]);
    float acc = 0.f, L = 0.f;
    for (int i = 0; i < Z; ++i) {
        const float l = pl[i];
        if (l > 0.f) {
            const float w = exp2f(pm[i] - M);
            L = fmaf(w, l, L);
            acc = fmaf(w, part_out[(hrow * Z + i) * D + d], acc);
        }
    }
    out[hrow * D + d] = from_f<T>(L > 0.f ? acc / L : 0.f);
}

// The splits of paged_decode_v2 that hold tokens, shared with its decode_reduce: a context of n
// tokens in the grid's Z splits takes ceil(n / Z) tokens per split, rounded up to 32 and to at
// least `min_split` (a short context is one split, or a few: each block then walks more tokens,
// but the launch has fewer busy blocks and the reduce has fewer, or no, partials to merge).
// Returns the tokens per split; *active = the splits that get tokens (0 when n == 0).
__device__ __forceinline__ int decode_split_tokens(int n, int Z, int min_split, int* active) {
    int per = (n + Z - 1) / Z;
    per = (per + 31) & ~31;
    per = max(per, min_split);
    *active = (n + per - 1) / per;
    return per;
}

// This block's split of a decode's keys: the context (its last `window` tokens with a sliding
// window) in the grid's Z splits of decode_split_tokens. min_split < 0 (cascade decode,
// ops.paged_decode_partials): |min_split| tokens, and the partials (unnormalised output, max,
// sum) are written even for a single split. Sets *per (tokens a split), *active (the splits that
// get keys: a split at or past it has none) and *direct (the only split: it writes the
// normalised output itself, no partials); returns the split's first key r0 (its keys: [r0,
// min(ctx, r0 + *per))). Shared by paged_decode_v2 / v4, v5 and v6.
__device__ __forceinline__ int decode_split_keys(int ctx, int window, int Z, int min_split, int split, int* per,
                                                 int* active, bool* direct) {
    const int start = (window > 0) ? max(0, ctx - window) : 0;
    *per = decode_split_tokens(ctx - start, Z, min_split < 0 ? -min_split : min_split, active);
    *direct = *active == 1 && min_split > 0;
    return start + split * *per;
}

// grid (num_heads, num_decodes), D threads. Z <= RED_MAXZ. Weights of the splits first (in
// shared memory), then each thread sums its dimension over the splits with independent loads.
// Only the sequence's active splits (decode_split_tokens) are merged; with one, paged_decode_v2
// has written the output itself and this block has nothing to do. Right after the wait every
// thread loads its first split's max and sum and its first RED_PRE partial outputs at once, so
// that the block waits for L2 once instead of three times (a batch-1 step waits for this
// kernel in each layer); the sums are taken in the same order as before.
#define RED_MAXZ 1024
#define RED_PRE 8
template <typename T, int D>
__global__ void __launch_bounds__(D)
decode_reduce(const float* __restrict__ part_out, const float* __restrict__ part_m,
              const float* __restrict__ part_l, T* __restrict__ out, int num_heads, int Z,
              const int* __restrict__ context_lens, int window, int min_split) {
    pdl_trigger();
    constexpr int NW = D / 32;
    __shared__ float s_w[RED_MAXZ];
    __shared__ float s_r[NW];
    const int head = blockIdx.x, seq = blockIdx.y, d = threadIdx.x;
    const int lane = d & 31, warp = d >> 5;
    const i64 hrow = (i64)seq * num_heads + head;
    const int ctx = context_lens[seq];  // uploaded before the step's first kernel: read before the wait
    const int n = ctx - ((window > 0) ? max(0, ctx - window) : 0);
    int active;
    decode_split_tokens(n, Z, min_split, &active);
    pdl_wait();  // the partials come from the decode kernel
    if (active <= 1) return;
    const float* pm = part_m + hrow * Z;
    const float* pl = part_l + hrow * Z;
    const float* po = part_out + hrow * Z * D + d;
    const float m_first = d < active ? pm[d] : neg_inf();
    const float l_first = d < active ? pl[d] : 0.f;
    float po_first[RED_PRE];
#pragma unroll
    for (int i = 0; i < RED_PRE; ++i) po_first[i] = i < active ? po[(i64)i * D] : 0.f;
    float mx = m_first;
    for (int i = d + D; i < active; i += D) mx = fmaxf(mx, pm[i]);
    mx = warp_max(mx);
    if (lane == 0) s_r[warp] = mx;
    __syncthreads();
    float M = s_r[0];
#pragma unroll
    for (int w = 1; w < NW; ++w) M = fmaxf(M, s_r[w]);
    const float M_use = (M == neg_inf()) ? 0.f : M;
    float ls = 0.f;
    for (int i = d; i < active; i += D) {
        const float l = i == d ? l_first : pl[i];
        const float w = (l > 0.f) ? exp2f((i == d ? m_first : pm[i]) - M_use) : 0.f;
        s_w[i] = w;
        ls = fmaf(w, l, ls);
    }
    ls = warp_sum(ls);
    __syncthreads();  // s_r reads done, s_w written
    if (lane == 0) s_r[warp] = ls;
    __syncthreads();
    float L = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) L += s_r[w];
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < RED_PRE; ++i)
        if (i < active) acc = fmaf(s_w[i], po_first[i], acc);
#pragma unroll 8
    for (int i = RED_PRE; i < active; ++i) acc = fmaf(s_w[i], po[(i64)i * D], acc);
    out[hrow * D + d] = from_f<T>(L > 0.f ? acc / L : 0.f);
}

// ---------------------------------------------------------------------------------------------
// Flash-decoding, version 2: the same grid and outputs as paged_decode, but no shared-memory
// logits and no barriers in the token loop. Each group of TPK threads (one 16-byte slice of a
// K/V row each) walks its tokens U at a time: K and V of U tokens are loaded together (2U
// 16-byte loads in flight per thread), scores are reduced inside the group by shuffles, and the
// group keeps its own running max / sum / output (online softmax, rescaled once per U tokens).
// The groups are merged at the end (shuffles inside a warp, shared memory across warps).
//
// Version 4 (paged_decode_v4<..., STAGES>) is version 2 with its loads pipelined: a thread's
// 2U slices of a tile (KPI * U tokens) go by cp.async into the thread's own slots of a ring of
// STAGES tiles in dynamic shared memory, STAGES - 1 tiles ahead of the one it scores. In
// version 2 a block has one tile of loads in flight and none while it scores, so a block that
// walks many tokens (a long split, or an unsplit context at a large batch) waits for memory
// once per tile. Every thread reads back only what it copied itself, so the ring needs no
// barrier; the scoring is the same code (decode_tile), so v4's output has v2's bits.
#define DEC2_CHUNK 1024  // tokens per refresh of the block-table slice in shared memory

// cp.async of 16 bytes into shared memory (paged_decode_v4, prefill_mma); with `src_bytes`,
// only that many are read and the rest are zeros (0: a tile's tail).
__device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 r;
    asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }\n" : "=r"(r) : "l"(p));
    return r;
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(smem)), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ void cp_async16_zfill(u32 smem, const void* gmem, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem), "r"(src_bytes));
}
// cp.async of a decode slice of SB bytes (16: the .cg copy above; 8 and 4, an FP8 cache's
// slices, exist only as .ca, through L1)
template <int SB> __device__ __forceinline__ void cp_async_slice_zfill(u32 smem, const void* gmem, int src_bytes);
template <> __device__ __forceinline__ void cp_async_slice_zfill<16>(u32 smem, const void* gmem, int src_bytes) {
    cp_async16_zfill(smem, gmem, src_bytes);
}
template <> __device__ __forceinline__ void cp_async_slice_zfill<8>(u32 smem, const void* gmem, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(smem), "l"(gmem), "r"(src_bytes));
}
template <> __device__ __forceinline__ void cp_async_slice_zfill<4>(u32 smem, const void* gmem, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem), "l"(gmem), "r"(src_bytes));
}

// One tile of a key group: the U tokens t0 + u * KPI (K slices kv[u], V slices vv[u]; zeros past
// cn) scored against the group's queries and folded into its running max m, sum l and output acc.
// CT: the cache's element type (T, or fp8e4m3: the slices are e4m3 bytes, scales applied outside).
template <typename T, typename CT, int MAXG, int U, int VEC, int TPK, int KPI, typename LT>
__device__ __forceinline__ void decode_tile(const LT (&kv)[U], const LT (&vv)[U], int t0, int cn,
                                            const float (&qr)[MAXG][VEC], float (&m)[MAXG], float (&l)[MAXG],
                                            float (&acc)[MAXG][VEC]) {
    float s[U][MAXG];
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const bool valid = t0 + u * KPI < cn;
        float kf[VEC];
        CacheSlice<T, CT>::unpack(kv[u], kf);
#pragma unroll
        for (int g = 0; g < MAXG; ++g) {
            float x = 0.f;
#pragma unroll
            for (int i = 0; i < VEC; ++i) x = fmaf(qr[g][i], kf[i], x);
#pragma unroll
            for (int o = TPK / 2; o > 0; o >>= 1) x += __shfl_xor_sync(FULL_MASK, x, o);
            s[u][g] = valid ? x : neg_inf();
        }
    }
#pragma unroll
    for (int g = 0; g < MAXG; ++g) {
        float mx = s[0][g];
#pragma unroll
        for (int u = 1; u < U; ++u) mx = fmaxf(mx, s[u][g]);
        const float m_new = fmaxf(m[g], mx);
        const float m_use = (m_new == neg_inf()) ? 0.f : m_new;
        const float corr = exp2f(m[g] - m_use);
        m[g] = m_new;
        float lsum = l[g] * corr;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            s[u][g] = exp2f(s[u][g] - m_use);
            lsum += s[u][g];
        }
        l[g] = lsum;
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[g][i] *= corr;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
        float vf[VEC];
        CacheSlice<T, CT>::unpack(vv[u], vf);
#pragma unroll
        for (int g = 0; g < MAXG; ++g)
#pragma unroll
            for (int i = 0; i < VEC; ++i) acc[g][i] = fmaf(s[u][g], vf[i], acc[g][i]);
    }
}

__device__ constexpr int decode_u(int maxg) { return maxg >= 8 ? 2 : 4; }

// The last step of a decode block: its warps' (max, sum, unnormalised output) of `ng` query heads,
// s_ml [(warp * ROWS + g) * 2 + {0, 1}] and s_red [(warp * ROWS + g) * D + d], merged; times
// v_scale when SCALE (an FP8 cache); the normalised output when `direct` (the only split), else
// the split's partials. hrow0: the first head's row (seq * num_heads + its head). With HW kv heads
// a block (paged_decode_v5), head h (< heads, the block's live ones) merges warps h, h + HW, ...
// (WARPS of them) into rows hrow0 + h * head_stride + g.
template <typename T, int D, int WARPS, int ROWS, bool SCALE, int HW = 1>
__device__ __forceinline__ void decode_merge_warps(const float* s_red, const float* s_ml, int ng, int tid,
                                                   float v_scale, bool direct, T* out, float* part_out,
                                                   float* part_m, float* part_l, i64 hrow0, int Z, int split,
                                                   int heads = 1, int head_stride = 0) {
    for (int idx = tid; idx < HW * ng * D; idx += DEC_THREADS) {
        const int h = HW == 1 ? 0 : idx / (ng * D);
        const int g = (idx - h * ng * D) / D;
        const int d = idx - (h * ng + g) * D;
        if (HW > 1 && h >= heads) break;  // (h only grows)
        float M = neg_inf();
#pragma unroll
        for (int k = 0; k < WARPS; ++k) M = fmaxf(M, s_ml[((h + HW * k) * ROWS + g) * 2]);
        const float M_use = (M == neg_inf()) ? 0.f : M;
        float L = 0.f, v = 0.f;
#pragma unroll
        for (int k = 0; k < WARPS; ++k) {
            const int w = h + HW * k;
            const float wt = exp2f(s_ml[(w * ROWS + g) * 2] - M_use);
            L = fmaf(wt, s_ml[(w * ROWS + g) * 2 + 1], L);
            v = fmaf(wt, s_red[(w * ROWS + g) * D + d], v);
        }
        if constexpr (SCALE) v *= v_scale;
        const i64 hrow = hrow0 + (i64)h * head_stride + g;
        if (direct) {
            out[hrow * D + d] = from_f<T>(v / L);
        } else {
            part_out[(hrow * Z + split) * D + d] = v;
            if (d == 0) {
                part_m[hrow * Z + split] = M;
                part_l[hrow * Z + split] = L;
            }
        }
    }
}

// The body of versions 2 (STAGES == 0: loads into registers) and 4 (STAGES >= 2: the ring
// `ring`, which also holds s_red / s_ml once the tokens are done).
//
// It calls pdl_wait itself, once its context length and first block-table slice are in: those
// are uploaded before the step's first kernel, so a block launched early by PDL reads them while
// the kernel before drains (split 0 without a window reads the slice together with the length).
// The query and the K/V cache are read after the wait. (Loading the first K/V tiles before the
// wait too, all but the newest row, which the kernel before writes, gave wrong tokens in
// tests/gpu/test_gpu_engine.py::test_fp32_small_batch_kernels_equal_transformers on three
// machines, for a reason not found: docs/PERFORMANCE.md, "seventh pass".)
//
// CT: the cache's element type: T, or fp8e4m3 (an FP8 cache: each thread's slice of a row is
// VEC bytes instead of 16, the same elements; scale_log2 carries k_scale, and the output is
// multiplied by v_scale, which an unquantized cache ignores).
template <typename T, typename CT, int D, int MAXG, int STAGES>
__device__ __forceinline__ void paged_decode_body(
    const T* __restrict__ q, i64 q_stok, i64 q_shead, const CT* __restrict__ key_cache,
    const CT* __restrict__ value_cache, const int* __restrict__ block_tables, int bt_stride,
    const int* __restrict__ context_lens, T* __restrict__ out, float* __restrict__ part_out,
    float* __restrict__ part_m, float* __restrict__ part_l, int num_heads, int num_kv_heads, int group,
    int groups_per_kv, int bs_shift, int window, float scale_log2, int min_split, float v_scale, float* s_red,
    float* s_ml, uint4* ring) {
    typedef typename CacheSlice<T, CT>::type LT;  // a thread's K or V slice: uint4 (CT == T), uint2 or u32
    constexpr int SB = CacheSlice<T, CT>::BYTES;
    constexpr bool FP8 = sizeof(CT) == 1;
    constexpr int VEC = 16 / sizeof(T);
    constexpr int TPK = D / VEC;
    constexpr int KPI = DEC_THREADS / TPK;
    constexpr int U = decode_u(MAXG);
    constexpr int TILE = KPI * U;
    static_assert(TPK <= 32 && (32 % TPK) == 0, "head_dim / dtype");
    static_assert(STAGES == 0 || STAGES >= 2, "a ring of at least two tiles");

    __shared__ int s_bt[DEC2_CHUNK + 1];

    const int kvh = blockIdx.x / groups_per_kv;
    const int hg = blockIdx.x - kvh * groups_per_kv;
    const int g0 = hg * MAXG;
    const int ng = min(MAXG, group - g0);
    const int head0 = kvh * group + g0;
    const int seq = blockIdx.y;
    const int split = blockIdx.z;
    const int Z = gridDim.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int piece = tid % TPK, kg = tid / TPK;

    const int* bt = block_tables + (i64)seq * bt_stride;
    // Split 0 without a window starts at token 0, so its first block-table slice is known before
    // the context length: its entries are loaded together with it, not after it.
    const int spec_n = min(bt_stride, min(DEC_THREADS, DEC2_CHUNK >> bs_shift));
    const bool spec = window == 0 && split == 0;
    const int spec_entry = (spec && tid < spec_n) ? bt[tid] : 0;
    const int ctx = context_lens[seq];
    int per, active;
    bool direct;
    const int r0 = decode_split_keys(ctx, window, Z, min_split, split, &per, &active, &direct);
    if (split >= active) {  // no tokens here: decode_reduce merges only the active splits
        pdl_wait();
        if (split == 0 && min_split > 0)  // an empty context: zeros (decode_reduce skips it as a single
            // split); partials mode leaves the caller's initial (-inf, 0, 0) partials
            decode_empty_split<T, D>(out, part_out, part_m, part_l, seq, num_heads, head0, ng, split, 1, tid);
        return;
    }
    const int r1 = min(ctx, r0 + per);

    // The block-table slice of tokens [c0, min(r1, c0 + DEC2_CHUNK)) into s_bt; the first one
    // before the wait.
    auto load_slice = [&](int c0) {
        const int b0 = c0 >> bs_shift;
        const int nb = ((min(r1, c0 + DEC2_CHUNK) - 1) >> bs_shift) - b0 + 1;
        __syncthreads();  // the previous slice is no longer read
        if (spec && c0 == 0 && nb <= spec_n) {
            if (tid < nb) s_bt[tid] = spec_entry;
        } else {
            for (int i = tid; i < nb; i += DEC_THREADS) s_bt[i] = bt[b0 + i];
        }
        __syncthreads();
    };
    load_slice(r0);
    pdl_wait();  // the query and this step's K/V row come from the kernels before

    float qr[MAXG][VEC];
#pragma unroll
    for (int g = 0; g < MAXG; ++g) {
        if (g < ng) {
            const T* qp = q + (i64)seq * q_stok + (i64)(head0 + g) * q_shead + piece * VEC;
            uint4 u = *reinterpret_cast<const uint4*>(qp);
            unpack16<T>(u, qr[g]);
#pragma unroll
            for (int i = 0; i < VEC; ++i) qr[g][i] *= scale_log2;
        } else {
#pragma unroll
            for (int i = 0; i < VEC; ++i) qr[g][i] = 0.f;
        }
    }
    float m[MAXG], l[MAXG], acc[MAXG][VEC];
#pragma unroll
    for (int g = 0; g < MAXG; ++g) {
        m[g] = neg_inf();
        l[g] = 0.f;
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[g][i] = 0.f;
    }

    const int bs_mask = (1 << bs_shift) - 1;
    const i64 row_stride = (i64)num_kv_heads * D;
    const CT* kbase = key_cache + (i64)kvh * D + piece * VEC;
    const CT* vbase = value_cache + (i64)kvh * D + piece * VEC;

    for (int c0 = r0; c0 < r1; c0 += DEC2_CHUNK) {
        const int c1 = min(r1, c0 + DEC2_CHUNK);
        const int cn = c1 - c0;
        const int b0 = c0 >> bs_shift;
        if (c0 != r0) load_slice(c0);

        if constexpr (STAGES == 0) {
            for (int tb = 0; tb < cn; tb += TILE) {
                LT kv[U], vv[U];
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const int tt = tb + u * KPI + kg;
                    if (tt < cn) {
                        const int pos = c0 + tt;
                        const i64 off = (((i64)s_bt[(pos >> bs_shift) - b0] << bs_shift) + (pos & bs_mask)) * row_stride;
                        kv[u] = __ldg(reinterpret_cast<const LT*>(kbase + off));
                        vv[u] = __ldg(reinterpret_cast<const LT*>(vbase + off));
                    } else {
                        kv[u] = LT{};
                        vv[u] = LT{};
                    }
                }
                decode_tile<T, CT, MAXG, U, VEC, TPK, KPI>(kv, vv, tb + kg, cn, qr, m, l, acc);
            }
        } else {
            // the thread's slot j (0..2U-1: K of tokens u, then V) of stage st: lring[(st * 2U + j) * DEC_THREADS + tid]
            LT* lring = reinterpret_cast<LT*>(ring);
            const u32 my = (u32)__cvta_generic_to_shared(lring + tid);
            const int ntiles = (cn + TILE - 1) / TILE;
            auto issue = [&](int t) {
                const u32 base = my + (u32)((t % STAGES) * 2 * U * DEC_THREADS * SB);
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const int tt = t * TILE + u * KPI + kg;
                    i64 off = 0;
                    int bytes = 0;
                    if (tt < cn) {
                        const int pos = c0 + tt;
                        off = (((i64)s_bt[(pos >> bs_shift) - b0] << bs_shift) + (pos & bs_mask)) * row_stride;
                        bytes = SB;
                    }
                    cp_async_slice_zfill<SB>(base + (u32)(u * DEC_THREADS * SB), kbase + off, bytes);
                    cp_async_slice_zfill<SB>(base + (u32)((U + u) * DEC_THREADS * SB), vbase + off, bytes);
                }
            };
#pragma unroll
            for (int t = 0; t < STAGES - 1; ++t) {
                if (t < ntiles) issue(t);
                cp_async_commit();
            }
            for (int t = 0; t < ntiles; ++t) {
                // the stage of tile t + STAGES - 1 is the one this thread scored last round
                if (t + STAGES - 1 < ntiles) issue(t + STAGES - 1);
                cp_async_commit();
                cp_async_wait<STAGES - 1>();  // tile t has landed
                const LT* slot = lring + (t % STAGES) * 2 * U * DEC_THREADS + tid;
                LT kv[U], vv[U];
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    kv[u] = slot[u * DEC_THREADS];
                    vv[u] = slot[(U + u) * DEC_THREADS];
                }
                decode_tile<T, CT, MAXG, U, VEC, TPK, KPI>(kv, vv, t * TILE + kg, cn, qr, m, l, acc);
            }
        }
    }

    // merge the key groups of each warp (lanes piece, piece + TPK, ...)
#pragma unroll
    for (int g = 0; g < MAXG; ++g) {
        float M = m[g];
#pragma unroll
        for (int o = TPK; o < 32; o <<= 1) M = fmaxf(M, __shfl_xor_sync(FULL_MASK, M, o));
        const float M_use = (M == neg_inf()) ? 0.f : M;
        const float w = exp2f(m[g] - M_use);
        float lw = l[g] * w;
#pragma unroll
        for (int o = TPK; o < 32; o <<= 1) lw += __shfl_xor_sync(FULL_MASK, lw, o);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
            float a = acc[g][i] * w;
#pragma unroll
            for (int o = TPK; o < 32; o <<= 1) a += __shfl_xor_sync(FULL_MASK, a, o);
            acc[g][i] = a;
        }
        m[g] = M;
        l[g] = lw;
    }
    if constexpr (STAGES != 0) __syncthreads();  // s_red / s_ml overlay the ring other threads read
    if (lane < TPK) {
#pragma unroll
        for (int g = 0; g < MAXG; ++g)
            if (g < ng) {
#pragma unroll
                for (int i = 0; i < VEC; ++i) s_red[(warp * MAXG + g) * D + piece * VEC + i] = acc[g][i];
                if (piece == 0) {
                    s_ml[(warp * MAXG + g) * 2] = m[g];
                    s_ml[(warp * MAXG + g) * 2 + 1] = l[g];
                }
            }
    }
    __syncthreads();
    decode_merge_warps<T, D, DEC_WARPS, MAXG, FP8>(s_red, s_ml, ng, tid, v_scale, direct, out, part_out, part_m, part_l,
                                                   (i64)seq * num_heads + head0, Z, split);
}

// v_scale: the FP8 cache's value scale (ignored when CT == T).
#define PAGED_DECODE_PARAMS                                                                                  \
    const T *__restrict__ q, i64 q_stok, i64 q_shead, const CT *__restrict__ key_cache,                     \
        const CT *__restrict__ value_cache, const int *__restrict__ block_tables, int bt_stride,            \
        const int *__restrict__ context_lens, T *__restrict__ out, float *__restrict__ part_out,            \
        float *__restrict__ part_m, float *__restrict__ part_l, int num_heads, int num_kv_heads, int group, \
        int groups_per_kv, int bs_shift, int window, float scale_log2, int min_split, float v_scale
#define PAGED_DECODE_ARGS                                                                                   \
    q, q_stok, q_shead, key_cache, value_cache, block_tables, bt_stride, context_lens, out, part_out, part_m, \
        part_l, num_heads, num_kv_heads, group, groups_per_kv, bs_shift, window, scale_log2, min_split, v_scale

template <typename T, int D, int MAXG, typename CT = T>
__global__ void __launch_bounds__(DEC_THREADS, (MAXG >= 8 ? 3 : 4)) paged_decode_v2(PAGED_DECODE_PARAMS) {
    pdl_trigger();  // pdl_wait: in the body, after the loads that need not wait
    __shared__ float s_red[DEC_WARPS * MAXG * D];
    __shared__ float s_ml[DEC_WARPS * MAXG * 2];
    paged_decode_body<T, CT, D, MAXG, 0>(PAGED_DECODE_ARGS, s_red, s_ml, nullptr);
}

// Dynamic shared memory: max(the ring, s_red + s_ml) bytes (ops.decode_dynamic_smem).
template <typename T, int D, int MAXG, int STAGES, typename CT = T>
__global__ void __launch_bounds__(DEC_THREADS, (MAXG >= 8 ? 3 : 4)) paged_decode_v4(PAGED_DECODE_PARAMS) {
    pdl_trigger();  // pdl_wait: in the body, after the loads that need not wait
    extern __shared__ uint4 dec_ring[];
    float* s_red = reinterpret_cast<float*>(dec_ring);
    paged_decode_body<T, CT, D, MAXG, STAGES>(PAGED_DECODE_ARGS, s_red, s_red + DEC_WARPS * MAXG * D, dec_ring);
}

// ---------------------------------------------------------------------------------------------
// Prefill / chunked prefill, FMA path. grid (ceil(max_query_len / PF_QT), num_heads, num_prefills),
// 128 threads; warp w owns query rows 4w..4w+3 of the tile; lane j scores key j of a 32-key tile.
#define PF_QT 16
#define PF_KT 32

template <typename T, int D>
__global__ void __launch_bounds__(128)
prefill_fma(const T* __restrict__ q, i64 q_stok, i64 q_shead,
            const T* __restrict__ key_cache, const T* __restrict__ value_cache,
            const int* __restrict__ block_tables, int bt_stride,
            const int* __restrict__ context_lens, const int* __restrict__ query_start_loc,
            T* __restrict__ out, int num_decodes, int num_heads, int num_kv_heads,
            int bs_shift, int window, float scale_log2) {
    constexpr int DPL = D / 32;
    __shared__ float sQ[PF_QT][D];
    __shared__ float sK[PF_KT][D + 1];
    __shared__ float sV[PF_KT][D];

    const int seq = num_decodes + blockIdx.z;
    const int head = blockIdx.y;
    const int kvh = head / (num_heads / num_kv_heads);
    const int qs = query_start_loc[seq];
    const int ql = query_start_loc[seq + 1] - qs;
    const int ctx = context_lens[seq];
    const int m0 = blockIdx.x * PF_QT;
    if (m0 >= ql) return;
    const int first = ctx - ql;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

    for (int idx = tid; idx < PF_QT * D; idx += 128) {
        const int r = idx / D, d = idx - (idx / D) * D;
        float v = 0.f;
        if (m0 + r < ql) v = to_f<T>(q[(i64)(qs + m0 + r) * q_stok + (i64)head * q_shead + d]) * scale_log2;
        sQ[r][d] = v;
    }
    const int qpos_lo = first + m0;
    const int qpos_hi = first + min(ql, m0 + PF_QT) - 1;
    const int kend = qpos_hi + 1;
    const int kbeg = (window > 0) ? max(0, qpos_lo - window + 1) : 0;
    const int bs_mask = (1 << bs_shift) - 1;
    const int* bt = block_tables + (i64)seq * bt_stride;

    float acc[4][DPL], m[4], l[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        m[r] = neg_inf(); l[r] = 0.f;
#pragma unroll
        for (int i = 0; i < DPL; ++i) acc[r][i] = 0.f;
    }

    for (int k0 = kbeg; k0 < kend; k0 += PF_KT) {
        __syncthreads();
        for (int idx = tid; idx < PF_KT * D; idx += 128) {
            const int j = idx / D, d = idx - (idx / D) * D;
            const int pos = k0 + j;
            float kv = 0.f, vv = 0.f;
            if (pos < kend) {
                const i64 slot = ((i64)bt[pos >> bs_shift] << bs_shift) + (pos & bs_mask);
                const i64 a = (slot * num_kv_heads + kvh) * D + d;
                kv = to_f<T>(key_cache[a]);
                vv = to_f<T>(value_cache[a]);
            }
            sK[j][d] = kv;
            sV[j][d] = vv;
        }
        __syncthreads();
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int row = warp * 4 + r;
            const int qpos = first + m0 + row;
            float s = 0.f;
#pragma unroll 8
            for (int d = 0; d < D; ++d) s = fmaf(sQ[row][d], sK[lane][d], s);
            const int pos = k0 + lane;
            const bool valid = pos < kend && pos <= qpos && (window <= 0 || pos > qpos - window);
            s = valid ? s : neg_inf();
            const float m_new = fmaxf(m[r], warp_max(s));
            const float m_use = (m_new == neg_inf()) ? 0.f : m_new;
            const float p = exp2f(s - m_use);
            const float corr = exp2f(m[r] - m_use);
            l[r] = l[r] * corr + warp_sum(p);
            m[r] = m_new;
#pragma unroll
            for (int i = 0; i < DPL; ++i) acc[r][i] *= corr;
#pragma unroll 4
            for (int j = 0; j < PF_KT; ++j) {
                const float pj = __shfl_sync(FULL_MASK, p, j);
#pragma unroll
                for (int i = 0; i < DPL; ++i) acc[r][i] = fmaf(pj, sV[j][lane + 32 * i], acc[r][i]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const int row = warp * 4 + r;
        if (m0 + row < ql) {
            const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
            T* op = out + ((i64)(qs + m0 + row) * num_heads + head) * D;
#pragma unroll
            for (int i = 0; i < DPL; ++i) op[lane + 32 * i] = from_f<T>(acc[r][i] * inv);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Prefill / chunked prefill on tensor cores (fp16 / bf16), flash-attention-2 style.
// grid (ceil(max_query_len / 64), num_heads, num_prefills), 128 threads (4 warps x 16 query rows).
// Q tile in registers (A fragments); K and V tiles of 64 keys read from the paged cache through the
// block table with cp.async into shared memory (K double-buffered against V); S = Q K^T and
// O += P V with mma.sync.m16n8k16 (fp32 accumulate); online softmax in fp32 registers.
#define PM_M 64
#define PM_N 64

template <typename T> __device__ __forceinline__ void mma16816(float* c, const u32* a, u32 b0, u32 b1);
template <> __device__ __forceinline__ void mma16816<__nv_bfloat16>(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> __device__ __forceinline__ void mma16816<__half>(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32* r, const void* smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(smem)));
}

// The online-softmax step of a 16-row mma tile (prefill_mma, cascade_prefix_mma): a lane's
// scores s[nt][0..1] (row g) and s[nt][2..3] (row g + 8), in log2 units and masked to -inf, whose
// maxima over the lane are mx0 / mx1, become their weights; the rows' running max and sum
// advance and the output o is rescaled.
template <int NT, int DT>
__device__ __forceinline__ void mma_tile_softmax(float (&s)[NT][4], float (&o)[DT][4], float mx0, float mx1,
                                                 float& mrow0, float& mrow1, float& lrow0, float& lrow1) {
    mx0 = fmaxf(mx0, __shfl_xor_sync(FULL_MASK, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(FULL_MASK, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(FULL_MASK, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(FULL_MASK, mx1, 2));
    const float mn0 = fmaxf(mrow0, mx0), mn1 = fmaxf(mrow1, mx1);
    const float mu0 = (mn0 == neg_inf()) ? 0.f : mn0;
    const float mu1 = (mn1 == neg_inf()) ? 0.f : mn1;
    const float corr0 = exp2f(mrow0 - mu0), corr1 = exp2f(mrow1 - mu1);
    mrow0 = mn0; mrow1 = mn1;
    float ls0 = 0.f, ls1 = 0.f;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        s[nt][0] = exp2f(s[nt][0] - mu0);
        s[nt][1] = exp2f(s[nt][1] - mu0);
        s[nt][2] = exp2f(s[nt][2] - mu1);
        s[nt][3] = exp2f(s[nt][3] - mu1);
        ls0 += s[nt][0] + s[nt][1];
        ls1 += s[nt][2] + s[nt][3];
    }
    lrow0 = lrow0 * corr0 + ls0;
    lrow1 = lrow1 * corr1 + ls1;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
        o[dt][0] *= corr0; o[dt][1] *= corr0;
        o[dt][2] *= corr1; o[dt][3] *= corr1;
    }
}

// S = Q K^T for a 16-row mma tile: the query's A fragments qf times the K tile of NK keys in
// shared memory (rows of LDS elements); lane (g, t4) of the fragment layout.
template <typename T, int D, int NK, int LDS>
__device__ __forceinline__ void mma_tile_scores(const u32 (&qf)[D / 16][4], const T* sK, int g, int t4,
                                                float (&s)[NK / 8][4]) {
#pragma unroll
    for (int nt = 0; nt < NK / 8; ++nt) {
        s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            const u32 b0 = *reinterpret_cast<const u32*>(&sK[(nt * 8 + g) * LDS + kk * 16 + 2 * t4]);
            const u32 b1 = *reinterpret_cast<const u32*>(&sK[(nt * 8 + g) * LDS + kk * 16 + 8 + 2 * t4]);
            mma16816<T>(s[nt], qf[kk], b0, b1);
        }
    }
}

// O += P V for a 16-row mma tile: the weights s (mma_tile_softmax's, as A fragments in T) times
// the V tile of NK keys in shared memory (rows of LDS elements), its B fragments by ldmatrix.trans.
template <typename T, int D, int NK, int LDS>
__device__ __forceinline__ void mma_tile_pv(const float (&s)[NK / 8][4], const T* sV, int lane, float (&o)[D / 8][4]) {
#pragma unroll
    for (int kk = 0; kk < NK / 16; ++kk) {
        u32 a[4];
        a[0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
        a[1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
        a[2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        a[3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
        const int mi = lane >> 3, rr = lane & 7;
        const T* vrow = &sV[(kk * 16 + (mi & 1) * 8 + rr) * LDS + (mi >> 1) * 8];
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
            u32 b[4];
            ldmatrix_x4_trans(b, vrow + dp * 16);
            mma16816<T>(o[2 * dp], a, b[0], b[1]);
            mma16816<T>(o[2 * dp + 1], a, b[2], b[3]);
        }
    }
}

template <typename T, int D>
__global__ void __launch_bounds__(128)
prefill_mma(const T* __restrict__ q, i64 q_stok, i64 q_shead,
            const T* __restrict__ key_cache, const T* __restrict__ value_cache,
            const int* __restrict__ block_tables, int bt_stride,
            const int* __restrict__ context_lens, const int* __restrict__ query_start_loc,
            T* __restrict__ out, int num_decodes, int num_heads, int num_kv_heads,
            int bs_shift, int window, float scale_log2) {
    constexpr int LDS = D + 8;  // padded row (elements): conflict-free fragment loads / ldmatrix
    constexpr int CPR = D / 8;  // 16-byte chunks per row
    __shared__ __align__(16) T sK[PM_N * LDS];  // holds the Q tile first
    __shared__ __align__(16) T sV[PM_N * LDS];

    const int seq = num_decodes + blockIdx.z;
    const int head = blockIdx.y;
    const int kvh = head / (num_heads / num_kv_heads);
    const int qs = query_start_loc[seq];
    const int ql = query_start_loc[seq + 1] - qs;
    const int ctx = context_lens[seq];
    const int m0 = (gridDim.x - 1 - blockIdx.x) * PM_M;  // heaviest (latest) tiles first
    if (m0 >= ql) return;
    const int first = ctx - ql;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t4 = lane & 3;
    const int wr = warp * 16;

    // Q tile -> shared -> A fragments
    for (int c = tid; c < PM_M * CPR; c += 128) {
        const int r = c / CPR, p = c - (c / CPR) * CPR;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (m0 + r < ql)
            v = *reinterpret_cast<const uint4*>(q + (i64)(qs + m0 + r) * q_stok + (i64)head * q_shead + p * 8);
        *reinterpret_cast<uint4*>(&sK[r * LDS + p * 8]) = v;
    }
    __syncthreads();
    u32 qf[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        qf[kk][0] = *reinterpret_cast<const u32*>(&sK[(wr + g) * LDS + kk * 16 + 2 * t4]);
        qf[kk][1] = *reinterpret_cast<const u32*>(&sK[(wr + g + 8) * LDS + kk * 16 + 2 * t4]);
        qf[kk][2] = *reinterpret_cast<const u32*>(&sK[(wr + g) * LDS + kk * 16 + 8 + 2 * t4]);
        qf[kk][3] = *reinterpret_cast<const u32*>(&sK[(wr + g + 8) * LDS + kk * 16 + 8 + 2 * t4]);
    }
    __syncthreads();

    const int qpos_lo = first + m0;
    const int qpos_hi = first + min(ql, m0 + PM_M) - 1;
    const int kend = qpos_hi + 1;
    const int kbeg = (window > 0) ? max(0, qpos_lo - window + 1) : 0;
    const int ntiles = (kend - kbeg + PM_N - 1) / PM_N;
    const int bs_mask = (1 << bs_shift) - 1;
    const int* bt = block_tables + (i64)seq * bt_stride;
    const i64 row_stride = (i64)num_kv_heads * D;

    auto load_tile = [&](T* dst, const T* cache, int k0) {
        for (int c = tid; c < PM_N * CPR; c += 128) {
            const int r = c / CPR, p = c - (c / CPR) * CPR;
            const int pos = k0 + r;
            T* d = dst + r * LDS + p * 8;
            if (pos < kend) {
                const i64 slot = ((i64)bt[pos >> bs_shift] << bs_shift) + (pos & bs_mask);
                cp_async16(d, cache + slot * row_stride + (i64)kvh * D + p * 8);
            } else {
                *reinterpret_cast<uint4*>(d) = make_uint4(0u, 0u, 0u, 0u);
            }
        }
    };

    float o[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float mrow0 = neg_inf(), mrow1 = neg_inf(), lrow0 = 0.f, lrow1 = 0.f;
    const int qp0 = first + m0 + wr + g;
    const int qp1 = qp0 + 8;

    load_tile(sK, key_cache, kbeg);
    cp_async_commit();
    for (int it = 0; it < ntiles; ++it) {
        const int k0 = kbeg + it * PM_N;
        load_tile(sV, value_cache, k0);
        cp_async_commit();
        cp_async_wait<1>();  // K(it) has landed
        __syncthreads();

        float s[PM_N / 8][4];
        mma_tile_scores<T, D, PM_N, LDS>(qf, sK, g, t4, s);
        __syncthreads();  // every warp is done with sK
        if (it + 1 < ntiles) load_tile(sK, key_cache, k0 + PM_N);
        cp_async_commit();  // possibly empty group: keeps the wait counts uniform

        const bool need_mask = (k0 + PM_N - 1 > qpos_lo) || (window > 0 && k0 <= qpos_hi - window);
        float mx0 = neg_inf(), mx1 = neg_inf();
#pragma unroll
        for (int nt = 0; nt < PM_N / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float v = s[nt][e] * scale_log2;
                if (need_mask) {
                    const int col = k0 + nt * 8 + 2 * t4 + (e & 1);
                    const int qp = (e < 2) ? qp0 : qp1;
                    const bool valid = col <= qp && (window <= 0 || col > qp - window);
                    v = valid ? v : neg_inf();
                }
                s[nt][e] = v;
            }
            mx0 = fmaxf(mx0, fmaxf(s[nt][0], s[nt][1]));
            mx1 = fmaxf(mx1, fmaxf(s[nt][2], s[nt][3]));
        }
        mma_tile_softmax<PM_N / 8, D / 8>(s, o, mx0, mx1, mrow0, mrow1, lrow0, lrow1);

        cp_async_wait<1>();  // V(it) has landed (only K(it+1) may be in flight)
        __syncthreads();
        mma_tile_pv<T, D, PM_N, LDS>(s, sV, lane, o);
        __syncthreads();  // every warp is done with sV
    }
    cp_async_wait<0>();

    lrow0 += __shfl_xor_sync(FULL_MASK, lrow0, 1);
    lrow0 += __shfl_xor_sync(FULL_MASK, lrow0, 2);
    lrow1 += __shfl_xor_sync(FULL_MASK, lrow1, 1);
    lrow1 += __shfl_xor_sync(FULL_MASK, lrow1, 2);
    const float inv0 = lrow0 > 0.f ? 1.f / lrow0 : 0.f;
    const float inv1 = lrow1 > 0.f ? 1.f / lrow1 : 0.f;
    const int row0 = m0 + wr + g, row1 = row0 + 8;
    if (row0 < ql) {
        T* op = out + ((i64)(qs + row0) * num_heads + head) * D + 2 * t4;
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt)
            *reinterpret_cast<u32*>(op + dt * 8) = pack2<T>(o[dt][0] * inv0, o[dt][1] * inv0);
    }
    if (row1 < ql) {
        T* op = out + ((i64)(qs + row1) * num_heads + head) * D + 2 * t4;
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt)
            *reinterpret_cast<u32*>(op + dt * 8) = pack2<T>(o[dt][2] * inv1, o[dt][3] * inv1);
    }
}

// ---------------------------------------------------------------------------------------------
// Cascade decode's shared-prefix pass on tensor cores (fp16 / bf16 caches): prefill_mma's tiles,
// with the query rows of one (group, kv head) being the query heads of that kv head of every
// sequence of the group (width x group rows, packed by the caller: q [G, kvh, R, D]), attending
// the group's whole prefix (no causal mask: every key before prefix_lens[g] counts). Writes the
// normalised output in fp32 and its log-sum-exp in log2 units of the scaled scores, per split of
// the prefix (`splits` runs of whole 64-key tiles, for more blocks than G x kvh alone gives):
// o_out [G, kvh, splits, R, D], lse_out [G, kvh, splits, R] (an empty split: 0 and -inf), merged
// with each other and with the sequences' own blocks by the caller (ops.merge_partials, sum 1).
// grid (ceil(R / rows a block), num_kv_heads, G * splits), 64 or 128 threads (2 or 4 warps x 16
// rows: 64 when R <= 32, so that no warp idles and twice the blocks fit a SM).
template <typename T, int D>
__global__ void __launch_bounds__(128)
cascade_prefix_mma(const T* __restrict__ q, const T* __restrict__ key_cache, const T* __restrict__ value_cache,
                   const int* __restrict__ block_tables, int bt_stride, const int* __restrict__ prefix_lens,
                   float* __restrict__ o_out, float* __restrict__ lse_out, int rows, int num_kv_heads,
                   int bs_shift, float scale_log2, int splits) {
    constexpr int LDS = D + 8;
    constexpr int CPR = D / 8;
    __shared__ __align__(16) T sK[PM_N * LDS];  // holds the Q tile first
    __shared__ __align__(16) T sV[PM_N * LDS];

    const int grp = blockIdx.z / splits;
    const int split = blockIdx.z - grp * splits;
    const int kvh = blockIdx.y;
    const int nthreads = blockDim.x;           // 64 or 128: 2 or 4 warps of 16 query rows
    const int rows_per_block = (nthreads >> 5) * 16;
    const int m0 = blockIdx.x * rows_per_block;
    const int kend = prefix_lens[grp];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t4 = lane & 3;
    const int wr = warp * 16;
    const i64 qbase = ((i64)grp * num_kv_heads + kvh) * rows;  // this (group, kv head)'s first row

    for (int c = tid; c < rows_per_block * CPR; c += nthreads) {
        const int r = c / CPR, p = c - (c / CPR) * CPR;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (m0 + r < rows) v = *reinterpret_cast<const uint4*>(q + (qbase + m0 + r) * D + p * 8);
        *reinterpret_cast<uint4*>(&sK[r * LDS + p * 8]) = v;
    }
    __syncthreads();
    u32 qf[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        qf[kk][0] = *reinterpret_cast<const u32*>(&sK[(wr + g) * LDS + kk * 16 + 2 * t4]);
        qf[kk][1] = *reinterpret_cast<const u32*>(&sK[(wr + g + 8) * LDS + kk * 16 + 2 * t4]);
        qf[kk][2] = *reinterpret_cast<const u32*>(&sK[(wr + g) * LDS + kk * 16 + 8 + 2 * t4]);
        qf[kk][3] = *reinterpret_cast<const u32*>(&sK[(wr + g + 8) * LDS + kk * 16 + 8 + 2 * t4]);
    }
    __syncthreads();

    const int all_tiles = (kend + PM_N - 1) / PM_N;
    const int per_split = (all_tiles + splits - 1) / splits;
    const int tile0 = split * per_split;
    const int ntiles = max(0, min(all_tiles, tile0 + per_split) - tile0);
    const int kbase = tile0 * PM_N;  // this split's first key
    const int bs_mask = (1 << bs_shift) - 1;
    const int* bt = block_tables + (i64)grp * bt_stride;
    const i64 row_stride = (i64)num_kv_heads * D;

    auto load_tile = [&](T* dst, const T* cache, int k0) {
        for (int c = tid; c < PM_N * CPR; c += nthreads) {
            const int r = c / CPR, p = c - (c / CPR) * CPR;
            const int pos = k0 + r;
            T* d = dst + r * LDS + p * 8;
            if (pos < kend) {
                const i64 slot = ((i64)bt[pos >> bs_shift] << bs_shift) + (pos & bs_mask);
                cp_async16(d, cache + slot * row_stride + (i64)kvh * D + p * 8);
            } else {
                *reinterpret_cast<uint4*>(d) = make_uint4(0u, 0u, 0u, 0u);
            }
        }
    };

    float o[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float mrow0 = neg_inf(), mrow1 = neg_inf(), lrow0 = 0.f, lrow1 = 0.f;

    // A warp whose 16 rows are all past `rows` (width x group < 64: e.g. 8 sequences x 4
    // heads fill two warps) loads its share of each tile and syncs, but computes nothing.
    const bool active = m0 + wr < rows;
    if (ntiles > 0) load_tile(sK, key_cache, kbase);
    cp_async_commit();
    for (int it = 0; it < ntiles; ++it) {
        const int k0 = kbase + it * PM_N;
        load_tile(sV, value_cache, k0);
        cp_async_commit();
        cp_async_wait<1>();  // K(it) has landed
        __syncthreads();

        float s[PM_N / 8][4];
        if (active) {
            mma_tile_scores<T, D, PM_N, LDS>(qf, sK, g, t4, s);
        }
        __syncthreads();  // every warp is done with sK
        if (it + 1 < ntiles) load_tile(sK, key_cache, k0 + PM_N);
        cp_async_commit();

        if (active) {
            const bool need_mask = k0 + PM_N > kend;  // the last tile's keys past the prefix
            float mx0 = neg_inf(), mx1 = neg_inf();
#pragma unroll
            for (int nt = 0; nt < PM_N / 8; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float v = s[nt][e] * scale_log2;
                    if (need_mask && k0 + nt * 8 + 2 * t4 + (e & 1) >= kend) v = neg_inf();
                    s[nt][e] = v;
                }
                mx0 = fmaxf(mx0, fmaxf(s[nt][0], s[nt][1]));
                mx1 = fmaxf(mx1, fmaxf(s[nt][2], s[nt][3]));
            }
            mma_tile_softmax<PM_N / 8, D / 8>(s, o, mx0, mx1, mrow0, mrow1, lrow0, lrow1);
        }

        cp_async_wait<1>();  // V(it) has landed
        __syncthreads();
        if (active) {
            mma_tile_pv<T, D, PM_N, LDS>(s, sV, lane, o);
        }
        __syncthreads();  // every warp is done with sV
    }
    cp_async_wait<0>();

    lrow0 += __shfl_xor_sync(FULL_MASK, lrow0, 1);
    lrow0 += __shfl_xor_sync(FULL_MASK, lrow0, 2);
    lrow1 += __shfl_xor_sync(FULL_MASK, lrow1, 1);
    lrow1 += __shfl_xor_sync(FULL_MASK, lrow1, 2);
    const float inv0 = lrow0 > 0.f ? 1.f / lrow0 : 0.f;
    const float inv1 = lrow1 > 0.f ? 1.f / lrow1 : 0.f;
    const int row0 = m0 + wr + g, row1 = row0 + 8;
    const i64 obase = (((i64)grp * num_kv_heads + kvh) * splits + split) * rows;  // this split's first row
    if (row0 < rows) {
        float* op = o_out + (obase + row0) * D + 2 * t4;
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt)
            *reinterpret_cast<float2*>(op + dt * 8) = make_float2(o[dt][0] * inv0, o[dt][1] * inv0);
        if (t4 == 0) lse_out[obase + row0] = lrow0 > 0.f ? mrow0 + __log2f(lrow0) : neg_inf();
    }
    if (row1 < rows) {
        float* op = o_out + (obase + row1) * D + 2 * t4;
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt)
            *reinterpret_cast<float2*>(op + dt * 8) = make_float2(o[dt][2] * inv1, o[dt][3] * inv1);
        if (t4 == 0) lse_out[obase + row1] = lrow1 > 0.f ? mrow1 + __log2f(lrow1) : neg_inf();
    }
}

// ---------------------------------------------------------------------------------------------
// Cascade decode's merge: each decode's attention output from the partials of its group's
// shared prefix (prefix_slot[d]: its place among the groups' width members; none_slot: in no
// group) and of its own blocks after it, as flash-decoding's reduce merges splits. A partial
// is (o, m, l): sum_j 2^(s_j - m) v_j, its max m in log2 units and sum l; a normalised one
// (cascade_prefix_mma: o divided by l, m its log-sum-exp) has no l array (p_l null: l = 1).
// An empty partial (m = -inf) weighs nothing; no partial at all gives zeros.
// Prefix partial of (group gi, kv head kv, split z, member row r = j * group + head in group):
// index ((gi * num_kv_heads + kv) * p_splits * R) + r * p_row_stride + z * p_split_stride,
// R = width * group (cascade_prefix_mma: [G, kvh, S, R]: row stride 1, split stride R; the
// decode kernel's partials [G, kvh * R, S]: row stride S, split stride 1). Suffix partials
// [nd, H, s_splits]. Outputs out [nd, H, D] in T.
// grid (num_heads, num_decodes), D threads (one output element each).
template <typename T, int D>
__global__ void __launch_bounds__(D)
cascade_merge(const float* __restrict__ p_o, const float* __restrict__ p_m, const float* __restrict__ p_l,
              int p_splits, int p_row_stride, int p_split_stride, const i64* __restrict__ prefix_slot,
              i64 none_slot, int width, int group, int num_kv_heads,
              const float* __restrict__ s_o, const float* __restrict__ s_m, const float* __restrict__ s_l,
              int s_splits, T* __restrict__ out, int num_heads) {
    const int h = blockIdx.x, d = blockIdx.y, t = threadIdx.x;
    const i64 slot = prefix_slot[d];
    int nprefix = 0;
    i64 pbase = 0;
    if (slot < none_slot) {
        const int gi = (int)(slot / width), j = (int)(slot - (i64)gi * width);
        const int kv = h / group, r = j * group + (h - kv * group);
        pbase = ((i64)gi * num_kv_heads + kv) * p_splits * ((i64)width * group) + (i64)r * p_row_stride;
        nprefix = p_splits;
    }
    const i64 sbase = ((i64)d * num_heads + h) * s_splits;
    float mx = neg_inf();
    for (int z = 0; z < nprefix; ++z) {
        const i64 i = pbase + (i64)z * p_split_stride;
        if (p_l == nullptr || p_l[i] > 0.f) mx = fmaxf(mx, p_m[i]);
    }
    for (int z = 0; z < s_splits; ++z)
        if (s_l[sbase + z] > 0.f) mx = fmaxf(mx, s_m[sbase + z]);
    float num = 0.f, den = 0.f;
    if (mx != neg_inf()) {
        for (int z = 0; z < nprefix; ++z) {
            const i64 i = pbase + (i64)z * p_split_stride;
            const float l = p_l == nullptr ? 1.f : p_l[i];
            if (l > 0.f && p_m[i] != neg_inf()) {
                const float w = exp2f(p_m[i] - mx);
                num += w * p_o[i * D + t];
                den += w * l;
            }
        }
        for (int z = 0; z < s_splits; ++z) {
            const i64 i = sbase + z;
            if (s_l[i] > 0.f) {
                const float w = exp2f(s_m[i] - mx);
                num += w * s_o[i * D + t];
                den += w * s_l[i];
            }
        }
    }
    out[((i64)d * num_heads + h) * D + t] = from_f<T>(den > 0.f ? num / den : 0.f);
}

// ---------------------------------------------------------------------------------------------
// paged_decode_v5<T, D, HW[, CT]>: flash-decoding of an FP8 cache on tensor cores. Versions 2 and 4
// score an FP8 cache on CUDA cores: at half the bytes of a 16-bit cache they are bound by the
// e4m3 conversions and the dot products (0.90x bf16's time at 256 x 2,048), not by memory.
// Here each warp scores 32-key tiles with mma.sync.m16n8k16 in f16 (e4m3 converts to f16
// exactly, two values an instruction): S = Q K^T with up to 8 query heads of a kv head as rows
// 0..7 of A (rows 8..15 zero), then O^T += V^T P^T, whose B fragment (P^T) is S's accumulator
// as it stands, so that no accumulator row is wasted on the output. The K and V rows go from
// global memory straight into the registers of the fragments that use them (no shared memory):
// the contraction index of S is permuted so that lane (g, t) holds bytes [t D/4, (t + 1) D/4)
// of its key rows (two 16-byte loads), and the rows of O^T so that it holds bytes
// [g D/16, (g + 1) D/16) and [(g + 8) D/16, (g + 9) D/16) of its value rows; __byte_perm pairs
// two keys' bytes for V^T's A fragment. The query is converted to f16 after its scale
// (scale_log2, which carries k_scale); P is f16 in [0, 1]; the output is multiplied by v_scale.
// A block's 4 warps serve HW kv heads of a sequence (warp w: kv head w % HW), the KW = 4 / HW
// warps of a head taking tiles w / HW, w / HW + KW, ... of the split: with HW = 4 the warps read
// the 4 heads' rows of the same tokens at about the same time (512 contiguous bytes of each
// token's row rather than 128 scattered ones). A tile's block-table entries come in one load by
// the warp's lanes, a tile ahead, and reach the lanes that need them by shuffle. Grid
// (ceil(kv heads / HW) x head groups, decodes, splits), splits, partials and decode_reduce as
// version 2 (groups of more than 8 heads: warps of 8 heads, ops.decode_group_split).
#define DM_WARPS 4
#define DM_KEYS 32

__device__ __forceinline__ u32 e4m3x2_to_h2(u32 w) {  // the low 16 bits: two e4m3 (low byte -> low half)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    u32 h;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(h) : "h"((unsigned short)w));
    return h;
#else
    float f[2];
    e4m3x2_to_f(w, f);
    return pack2<__half>(f[0], f[1]);
#endif
}

// N bytes of a row, in one or two vector loads (zeros when !valid)
template <int N> struct RowBytes;
template <> struct RowBytes<32> {
    uint4 v[2];
    __device__ __forceinline__ void load(const unsigned char* p, bool valid) {
        v[0] = valid ? __ldg(reinterpret_cast<const uint4*>(p)) : make_uint4(0u, 0u, 0u, 0u);
        v[1] = valid ? __ldg(reinterpret_cast<const uint4*>(p) + 1) : make_uint4(0u, 0u, 0u, 0u);
    }
    __device__ __forceinline__ u32 word(int i) const { return reinterpret_cast<const u32*>(v)[i]; }
    __device__ __forceinline__ void lds(const unsigned char* p) {  // from shared memory (v6)
        v[0] = *reinterpret_cast<const uint4*>(p);
        v[1] = *reinterpret_cast<const uint4*>(p + 16);
    }
    __device__ __forceinline__ void zero() { v[0] = v[1] = make_uint4(0u, 0u, 0u, 0u); }
};
template <> struct RowBytes<16> {
    uint4 v;
    __device__ __forceinline__ void load(const unsigned char* p, bool valid) {
        v = valid ? __ldg(reinterpret_cast<const uint4*>(p)) : make_uint4(0u, 0u, 0u, 0u);
    }
    __device__ __forceinline__ u32 word(int i) const { return reinterpret_cast<const u32*>(&v)[i]; }
    __device__ __forceinline__ void lds(const unsigned char* p) { v = *reinterpret_cast<const uint4*>(p); }
    __device__ __forceinline__ void zero() { v = make_uint4(0u, 0u, 0u, 0u); }
};
template <> struct RowBytes<8> {
    uint2 v;
    __device__ __forceinline__ void load(const unsigned char* p, bool valid) {
        v = valid ? __ldg(reinterpret_cast<const uint2*>(p)) : make_uint2(0u, 0u);
    }
    __device__ __forceinline__ u32 word(int i) const { return i ? v.y : v.x; }
    __device__ __forceinline__ void lds(const unsigned char* p) { v = *reinterpret_cast<const uint2*>(p); }
    __device__ __forceinline__ void zero() { v = make_uint2(0u, 0u); }
};
template <> struct RowBytes<4> {
    u32 v;
    __device__ __forceinline__ void load(const unsigned char* p, bool valid) {
        v = valid ? __ldg(reinterpret_cast<const unsigned int*>(p)) : 0u;
    }
    __device__ __forceinline__ u32 word(int) const { return v; }
    __device__ __forceinline__ void lds(const unsigned char* p) { v = *reinterpret_cast<const u32*>(p); }
    __device__ __forceinline__ void zero() { v = 0u; }
};

// The pieces paged_decode_v5 and v6 share. dm_query: the A fragments of Q for row gr (rows
// 8..15 zero): k index 2t + e <-> d = t KB + 4s + e and 2t + 8 + e <-> d = t KB + 4s + 2 + e (the
// K B fragments use the same map), scaled (scale_log2) and in f16; qp: the lane's first element
// (null: a zero row).
template <typename T, int KB>
__device__ __forceinline__ void dm_query(u32 (&qa)[KB / 4][4], const T* qp, float scale_log2) {
    float f[KB];
    if (qp != nullptr) {
#pragma unroll
        for (int i = 0; i < KB; i += 8) load8<T>(qp + i, f + i);
    } else {
#pragma unroll
        for (int i = 0; i < KB; ++i) f[i] = 0.f;
    }
#pragma unroll
    for (int s = 0; s < KB / 4; ++s) {
        qa[s][0] = pack2<__half>(f[4 * s] * scale_log2, f[4 * s + 1] * scale_log2);
        qa[s][2] = pack2<__half>(f[4 * s + 2] * scale_log2, f[4 * s + 3] * scale_log2);
        qa[s][1] = qa[s][3] = 0u;
    }
}

// The online softmax over a tile's scores sc[j][0..1] (head gr, masked keys already -inf; at
// least one key of the tile live): the running max mr and this lane's sum lr updated, sc
// replaced by its weights, O^T's columns (heads 2t, 2t + 1) rescaled.
template <int NT, int MT>
__device__ __forceinline__ void dm_softmax(float (&sc)[NT][4], float& mr, float& lr, float (&o)[MT][4], int t) {
    float tm = neg_inf();
#pragma unroll
    for (int j = 0; j < NT; ++j) tm = fmaxf(tm, fmaxf(sc[j][0], sc[j][1]));
    tm = fmaxf(tm, __shfl_xor_sync(FULL_MASK, tm, 1));
    tm = fmaxf(tm, __shfl_xor_sync(FULL_MASK, tm, 2));
    const float mn = fmaxf(mr, tm);  // finite: a key of the tile is live
    const float alpha = exp2f(mr - mn);
    mr = mn;
    lr *= alpha;
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            sc[j][e] = exp2f(sc[j][e] - mn);
            lr += sc[j][e];
        }
    // O^T's columns are heads 2t, 2t + 1: their rescale comes from the lanes of those rows
    const float a0 = __shfl_sync(FULL_MASK, alpha, 8 * t), a1 = __shfl_sync(FULL_MASK, alpha, 8 * t + 4);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        o[mt][0] *= a0; o[mt][1] *= a1;
        o[mt][2] *= a0; o[mt][3] *= a1;
    }
}

// O^T += V^T P^T over 16 keys: P^T's B fragment is S's accumulator (sc0, sc1: the two n-tiles);
// lo[e] / hi[e]: the lane's value bytes gr MT.. / (gr + 8) MT.. of keys 2t + {0, 1, 8, 9} (e)
template <int MT, typename VR>
__device__ __forceinline__ void dm_pv(float (&o)[MT][4], const float* sc0, const float* sc1, const VR* lo,
                                      const VR* hi) {
    const u32 pb0 = pack2<__half>(sc0[0], sc0[1]);
    const u32 pb1 = pack2<__half>(sc1[0], sc1[1]);
#pragma unroll
    for (int mt = 0; mt < MT; mt += 2) {
        const int w = mt >> 2;
        const u32 sel = (mt & 2) ? 0x7362u : 0x5140u;  // byte b of two keys, then byte b + 1
        const u32 x0 = __byte_perm(lo[0].word(w), lo[1].word(w), sel);  // rows gr, keys 2t, 2t + 1
        const u32 x1 = __byte_perm(hi[0].word(w), hi[1].word(w), sel);  // rows gr + 8
        const u32 x2 = __byte_perm(lo[2].word(w), lo[3].word(w), sel);  // rows gr, keys + 8
        const u32 x3 = __byte_perm(hi[2].word(w), hi[3].word(w), sel);
        const u32 a[4] = {e4m3x2_to_h2(x0), e4m3x2_to_h2(x1), e4m3x2_to_h2(x2), e4m3x2_to_h2(x3)};
        mma16816<__half>(o[mt], a, pb0, pb1);
        const u32 b[4] = {e4m3x2_to_h2(x0 >> 16), e4m3x2_to_h2(x1 >> 16), e4m3x2_to_h2(x2 >> 16),
                          e4m3x2_to_h2(x3 >> 16)};
        mma16816<__half>(o[mt + 1], b, pb0, pb1);
    }
}

template <typename T, int D, int HW, typename CT = fp8e4m3>
__global__ void __launch_bounds__(DEC_THREADS, 3) paged_decode_v5(PAGED_DECODE_PARAMS) {
    pdl_trigger();
    static_assert(sizeof(CT) == 1, "an FP8 cache");
    static_assert(D == 64 || D == 128, "head_dim");
    static_assert(HW == 1 || HW == 2 || HW == 4, "kv heads a block");
    constexpr int KW = DM_WARPS / HW;  // warps that share a kv head's keys (tiles kp, kp + KW, ...)
    constexpr int R = 8;              // query heads a warp
    constexpr int KB = D / 4;         // bytes of a key row a lane holds
    constexpr int MT = D / 16;        // m-tiles of O^T; a lane holds MT bytes of a value row twice
    constexpr int KS = D / 16;        // k-steps of S = Q K^T
    constexpr int NT = DM_KEYS / 8;   // n-tiles of S in a tile (8 keys each)
    __shared__ float s_red[DM_WARPS * R * D];
    __shared__ float s_ml[DM_WARPS * R * 2];

    // blockIdx.x: (HW kv heads kq HW.., head group hg); warp: kv head kq HW + warp % HW, key phase warp / HW
    const int kq = blockIdx.x / groups_per_kv;
    const int hg = blockIdx.x - kq * groups_per_kv;
    const int g0 = hg * R;
    const int ng = min(R, group - g0);
    const int seq = blockIdx.y;
    const int split = blockIdx.z;
    const int Z = gridDim.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gr = lane >> 2, t = lane & 3;
    const int kvh = kq * HW + warp % HW, kp = warp / HW;
    const bool live = kvh < num_kv_heads;  // (the last block's spare warps: no head)
    const int head0 = kvh * group + g0;

    const int* bt = block_tables + (i64)seq * bt_stride;
    const int ctx = context_lens[seq];
    int per, active;
    bool direct;
    const int r0 = decode_split_keys(ctx, window, Z, min_split, split, &per, &active, &direct);
    if (split >= active) {
        pdl_wait();
        if (split == 0 && min_split > 0)
            for (int h = 0; h < HW && kq * HW + h < num_kv_heads; ++h)
                decode_empty_split<T, D>(out, part_out, part_m, part_l, seq, num_heads, (kq * HW + h) * group + g0,
                                         ng, split, 1, tid);
        return;
    }
    const int r1 = live ? min(ctx, r0 + per) : r0;  // a spare warp walks no keys

    // a tile's block-table entries: lane i holds the one of the tile's i-th block (32 keys span
    // at most 32 blocks); the first before the wait (the tables come before the step's kernels)
    auto bt_entry = [&](int k0) -> int {
        if (k0 >= r1) return 0;
        const int b0 = k0 >> bs_shift;
        const int b1 = (min(k0 + DM_KEYS, r1) - 1) >> bs_shift;
        return (b0 + lane <= b1) ? __ldg(bt + b0 + lane) : 0;
    };
    constexpr int STRIDE = KW * DM_KEYS;
    int k0 = r0 + kp * DM_KEYS;
    int bte = bt_entry(k0);
    pdl_wait();  // the query and this step's K/V row come from the kernels before

    // A fragments of Q (row gr; rows 8..15 zero): k index 2t + e <-> d = t KB + 4s + e and
    // 2t + 8 + e <-> d = t KB + 4s + 2 + e (K's B fragments below use the same map)
    u32 qa[KS][4];
    dm_query<T, KB>(qa, (gr < ng && live) ? q + (i64)seq * q_stok + (i64)(head0 + gr) * q_shead + t * KB : nullptr,
                    scale_log2);

    // O^T: o[mt][e] row d = gr MT + mt (e = 0, 1) or (gr + 8) MT + mt (e = 2, 3), column (head) 2t + (e & 1)
    float o[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.f;
    float mr = neg_inf(), lr = 0.f;  // head gr's running max (log2 units) and this lane's part of its sum
    const i64 row_stride = (i64)num_kv_heads * D;
    const unsigned char* kbase = reinterpret_cast<const unsigned char*>(key_cache) + (i64)kvh * D + t * KB;
    const unsigned char* vbase = reinterpret_cast<const unsigned char*>(value_cache) + (i64)kvh * D + gr * MT;
    const int bs_mask = (1 << bs_shift) - 1;

    // Software pipeline: tile i + 1's K rows load while tile i's softmax and P V run, its V rows
    // while tile i + 1's scores run; its block-table entries come a tile earlier still.
    RowBytes<KB> kr[NT];
    RowBytes<MT> vlo[NT / 2][4], vhi[NT / 2][4];
    // the lane of `entries` (a tile's block-table entries, bt_entry) that holds key's block
    auto row_off = [&](int entries, int tile, int key) -> i64 {
        const int blk = __shfl_sync(FULL_MASK, entries, ((key >> bs_shift) - (tile >> bs_shift)) & 31);
        return (((i64)blk << bs_shift) + (key & bs_mask)) * row_stride;
    };
    // K rows tile + 8j + gr; V rows tile + 16 s2 + 2t + {0, 1, 8, 9}, bytes gr MT.. and (gr + 8) MT..
    auto load_k = [&](int entries, int tile) {
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const int key = tile + 8 * j + gr;
            kr[j].load(kbase + row_off(entries, tile, min(key, r1 - 1)), key < r1);
        }
    };
    auto load_v = [&](int entries, int tile) {
#pragma unroll
        for (int s2 = 0; s2 < NT / 2; ++s2)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = tile + 16 * s2 + 2 * t + (e & 1) + 8 * (e >> 1);
                const unsigned char* p = vbase + row_off(entries, tile, min(key, r1 - 1));
                vlo[s2][e].load(p, key < r1);
                vhi[s2][e].load(p + 8 * MT, key < r1);
            }
    };
    if (k0 < r1) {
        load_k(bte, k0);
        load_v(bte, k0);
    }
    bte = bt_entry(k0 + STRIDE);  // the next tile's entries

    for (; k0 < r1; k0 += STRIDE) {
        const int kn = k0 + STRIDE;  // the next tile (bte holds its entries)
        // S = Q K^T: sc[j][0..1] = head gr, keys k0 + 8j + 2t + {0, 1} (sc[j][2..3]: zero rows)
        float sc[NT][4];
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
#pragma unroll
            for (int s = 0; s < KS; ++s) {
                const u32 w = kr[j].word(s);
                mma16816<__half>(sc[j], qa[s], e4m3x2_to_h2(w), e4m3x2_to_h2(w >> 16));
            }
        }
        if (kn < r1) load_k(bte, kn);
        // keys past the split: -inf
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e)
                if (k0 + 8 * j + 2 * t + e >= r1) sc[j][e] = neg_inf();
        dm_softmax<NT, MT>(sc, mr, lr, o, t);  // key k0 is in the split
        // O^T += V^T P^T over keys 16 s2 .. 16 s2 + 15
#pragma unroll
        for (int s2 = 0; s2 < NT / 2; ++s2) dm_pv<MT>(o, sc[2 * s2], sc[2 * s2 + 1], vlo[s2], vhi[s2]);
        if (kn < r1) load_v(bte, kn);
        bte = bt_entry(kn + STRIDE);
    }

    // the quad's parts of the sum; then the warps' (m, l, O) through shared memory
    lr += __shfl_xor_sync(FULL_MASK, lr, 1);
    lr += __shfl_xor_sync(FULL_MASK, lr, 2);
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const int h = 2 * t + e;
        if (h < ng && live) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                s_red[(warp * R + h) * D + gr * MT + mt] = o[mt][e];
                s_red[(warp * R + h) * D + (gr + 8) * MT + mt] = o[mt][2 + e];
            }
        }
    }
    if (t == 0 && gr < ng && live) {
        s_ml[(warp * R + gr) * 2] = mr;
        s_ml[(warp * R + gr) * 2 + 1] = lr;
    }
    __syncthreads();
    // the KW warps of each kv head: warps h, h + HW, ...
    decode_merge_warps<T, D, KW, R, true, HW>(s_red, s_ml, ng, tid, v_scale, direct, out, part_out, part_m, part_l,
                                              (i64)seq * num_heads + kq * HW * group + g0, Z, split,
                                              num_kv_heads - kq * HW, group);
}

// ---------------------------------------------------------------------------------------------
// paged_decode_v6<T, D[, CT]>: paged_decode_v5's tensor-core scoring with the cache read a page
// at a time by the copy engine. A block (V6_WARPS warps) serves every kv head of a sequence and
// split (warp w: kv head w; heads past the model's idle), so a page of the cache, block_size
// tokens x num_kv_heads x D bytes of K and as many of V, contiguous, is the block's whole need
// for those tokens: one thread sends it by cp.async.bulk (the TMA unit) into a ring of
// V6_STAGES pages in dynamic shared memory, V6_STAGES - 1 pages in flight while one is scored,
// each page's arrival counted by an mbarrier. No K/V bytes pass through registers before use
// (v5 holds a tile ahead in 64 registers a thread and runs at 3 blocks of 4 warps a SM: 18 %
// occupancy, DRAM 65 % busy on an H200); here the bytes in flight a SM are the ring's. A warp
// scores 16-key sub-tiles of a page from shared memory: K rows 8j + gr, bytes [t D/4, (t + 1)
// D/4); V rows 2t + {0, 1, 8, 9}, bytes [gr D/16, ..) and [(gr + 8) D/16, ..), as v5 (keys
// outside [r0, r1) masked, their V bytes zeroed: a page's unused slots hold anything). The
// ring's slot is reused after a __syncthreads (every warp done with it). One warp a kv head:
// each warp's (m, l, O) is its heads' result, written from registers. Grid (head groups of 8,
// decodes, splits), splits, partials and decode_reduce as v2. ops.decode_dynamic_smem sizes the
// ring: V6_STAGES x 2 pages.
#ifndef V6_STAGES
#define V6_STAGES 3
#endif
#define V6_WARPS 8

// (mbar_*, bulk_copy and fence_proxy_async: gpu/pdl.cuh; sm_90 and later, the host takes v6 only there)

template <typename T, int D, typename CT = fp8e4m3>
__global__ void __launch_bounds__(V6_WARPS * 32, 2) paged_decode_v6(PAGED_DECODE_PARAMS) {
    pdl_trigger();
    static_assert(sizeof(CT) == 1, "an FP8 cache");
    static_assert(D == 64 || D == 128, "head_dim");
    constexpr int R = 8;        // query heads a warp
    constexpr int KB = D / 4;   // bytes of a key row a lane holds
    constexpr int MT = D / 16;  // m-tiles of O^T
    constexpr int KS = D / 16;  // k-steps of S = Q K^T
    extern __shared__ __align__(128) unsigned char v6_ring[];
    __shared__ __align__(8) unsigned long long v6_full[V6_STAGES];

    const int hg = blockIdx.x;
    const int g0 = hg * R;
    const int ng = min(R, group - g0);
    const int seq = blockIdx.y;
    const int split = blockIdx.z;
    const int Z = gridDim.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gr = lane >> 2, t = lane & 3;
    const int kvh = warp;
    const bool live = kvh < num_kv_heads;
    const int head0 = kvh * group + g0;

    const int* bt = block_tables + (i64)seq * bt_stride;
    const int ctx = context_lens[seq];
    int per, active;
    bool direct;
    const int r0 = decode_split_keys(ctx, window, Z, min_split, split, &per, &active, &direct);
    if (split >= active) {
        pdl_wait();
        if (split == 0 && min_split > 0 && tid < DEC_THREADS)
            for (int h = 0; h < num_kv_heads; ++h)
                decode_empty_split<T, D>(out, part_out, part_m, part_l, seq, num_heads, h * group + g0, ng, split, 1,
                                         tid);
        return;
    }
    const int r1 = min(ctx, r0 + per);
    const int bs = 1 << bs_shift;
    const int p0 = r0 >> bs_shift;                        // the split's first page (of the sequence)
    const int np = ((r1 - 1) >> bs_shift) - p0 + 1;       // and its pages
    const u32 page_bytes = (u32)bs * num_kv_heads * D;    // of K, and of V
    const u32 ring = smem_u32(v6_ring);
    const u32 full0 = smem_u32(v6_full);
    if (tid == 0) {
        for (int s = 0; s < V6_STAGES; ++s) mbar_init(full0 + 8 * s, 1);
        mbar_init_fence();
    }
    // page i's block-table entry, read before the wait (the tables come before the step's kernels)
    const int first_entry = (tid == 0) ? __ldg(bt + p0) : 0;
    __syncthreads();
    pdl_wait();  // the query and this step's K/V row come from the kernels before

    // page i of the split into ring slot i % V6_STAGES (thread 0)
    auto send = [&](int i, int entry) {
        const int s = i % V6_STAGES;
        const u32 bar = full0 + 8 * s;
        const u32 dst = ring + 2u * page_bytes * s;
        mbar_expect_tx(bar, 2u * page_bytes);
        bulk_copy(dst, reinterpret_cast<const unsigned char*>(key_cache) + (i64)entry * page_bytes, page_bytes, bar);
        bulk_copy(dst + page_bytes, reinterpret_cast<const unsigned char*>(value_cache) + (i64)entry * page_bytes,
                  page_bytes, bar);
    };
    // thread 0 holds the entry of the next page to send, loaded a page ahead (its load's wait
    // would otherwise hold warp 0, and at the next barrier every warp)
    int next_entry = 0;
    if (tid == 0) {
        send(0, first_entry);
        for (int i = 1; i < V6_STAGES - 1 && i < np; ++i) send(i, __ldg(bt + p0 + i));
        if (V6_STAGES - 1 < np) next_entry = __ldg(bt + p0 + V6_STAGES - 1);
    }

    // A fragments of Q (row gr; rows 8..15 zero), as v5
    u32 qa[KS][4];
    dm_query<T, KB>(qa, (gr < ng && live) ? q + (i64)seq * q_stok + (i64)(head0 + gr) * q_shead + t * KB : nullptr,
                    scale_log2);
    float o[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.f;
    float mr = neg_inf(), lr = 0.f;
    const int row_bytes = num_kv_heads * D;  // a token's row of the page (every kv head)
    const int koff = kvh * D + t * KB;       // this lane's bytes of a key row
    const int voff = kvh * D + gr * MT;      // and of a value row (then + 8 MT)

    for (int i = 0; i < np; ++i) {
        if (i > 0) __syncthreads();  // every warp is done with page i - 1: its slot is free
        if (tid == 0 && i + V6_STAGES - 1 < np) {
            fence_proxy_async();
            send(i + V6_STAGES - 1, next_entry);
            if (i + V6_STAGES < np) next_entry = __ldg(bt + p0 + i + V6_STAGES);
        }
        const int s = i % V6_STAGES;
        mbar_wait(full0 + 8 * s, (u32)((i / V6_STAGES) & 1));
        if (!live) continue;
        const unsigned char* kp = v6_ring + 2u * page_bytes * s;
        const unsigned char* vp = kp + page_bytes;
        const int pk0 = (p0 + i) << bs_shift;  // the page's first key
        for (int sub = 0; sub < bs; sub += 16) {
            const int kb = pk0 + sub;  // keys kb .. kb + 15
            if (kb + 16 <= r0 || kb >= r1) continue;  // (uniform over the warp)
            // S = Q K^T: sc[j][0..1] = head gr, keys kb + 8j + 2t + {0, 1}
            float sc[2][4];
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                RowBytes<KB> kr;
                kr.lds(kp + (sub + 8 * j + gr) * row_bytes + koff);
                sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
#pragma unroll
                for (int st = 0; st < KS; ++st) {
                    const u32 w = kr.word(st);
                    mma16816<__half>(sc[j], qa[st], e4m3x2_to_h2(w), e4m3x2_to_h2(w >> 16));
                }
            }
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int key = kb + 8 * j + 2 * t + e;
                    if (key < r0 || key >= r1) sc[j][e] = neg_inf();
                }
            dm_softmax<2, MT>(sc, mr, lr, o, t);  // a key of the sub-tile is in the split
            // V rows kb + 2t + {0, 1, 8, 9} (e), bytes gr MT.. and (gr + 8) MT..; zero outside the split
            RowBytes<MT> vlo[4], vhi[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int kl = sub + 2 * t + (e & 1) + 8 * (e >> 1);
                const unsigned char* p = vp + kl * row_bytes + voff;
                vlo[e].lds(p);
                vhi[e].lds(p + 8 * MT);
                const int key = pk0 + kl;
                if (key < r0 || key >= r1) {
                    vlo[e].zero();
                    vhi[e].zero();
                }
            }
            dm_pv<MT>(o, sc[0], sc[1], vlo, vhi);
        }
    }
    if (!live) return;
    // the quad's parts of the sum; head h = 2t + (e & 1)'s max and sum from lane 4h (row gr = h)
    lr += __shfl_xor_sync(FULL_MASK, lr, 1);
    lr += __shfl_xor_sync(FULL_MASK, lr, 2);
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const int h = 2 * t + e;
        const float m = __shfl_sync(FULL_MASK, mr, 4 * h);
        const float l = __shfl_sync(FULL_MASK, lr, 4 * h);
        if (h >= ng) continue;
        const i64 hrow = (i64)seq * num_heads + head0 + h;
        if (direct) {
            const float f = l > 0.f ? v_scale / l : 0.f;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                out[hrow * D + gr * MT + mt] = from_f<T>(o[mt][e] * f);
                out[hrow * D + (gr + 8) * MT + mt] = from_f<T>(o[mt][2 + e] * f);
            }
        } else {
            float* po = part_out + (hrow * Z + split) * D;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                po[gr * MT + mt] = o[mt][e] * v_scale;
                po[(gr + 8) * MT + mt] = o[mt][2 + e] * v_scale;
            }
            if (gr == 0) {
                part_m[hrow * Z + split] = m;
                part_l[hrow * Z + split] = l;
            }
        }
    }
}
