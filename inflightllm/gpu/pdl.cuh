// Device side of programmatic dependent launch (inflightllm/gpu/pdl.py) and the device helpers
// shared by our kernels, prepended to layers.cu, fp8_small_m.cu, allreduce.cu and
// attention/cuda/kernels.cu when they are compiled (gpu/pdl.py, `with_pdl`); with the
// system-scope flag accesses of the cross-GPU kernels.
// pdl_trigger lets the next kernel's grid be scheduled once all of this grid's blocks run;
// pdl_wait returns when the previous kernel has completed and its writes are visible. A kernel
// that calls pdl_trigger calls pdl_wait before its first read of an earlier kernel's output
// and before it can exit. Both are no-ops without the launch attribute and below sm_90.
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// A flag store that publishes this thread's earlier writes to every GPU (release, system
// scope), and the load that sees them (acquire): the cross-GPU barriers of allreduce.cu
// and of the fused all-reduce in layers.cu.
__device__ __forceinline__ void st_release_sys(unsigned long long* address, unsigned long long value) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(address), "l"(value) : "memory");
}
__device__ __forceinline__ unsigned long long ld_acquire_sys(const unsigned long long* address) {
    unsigned long long value;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(address) : "memory");
    return value;
}

// float <-> the kernels' storage types (layers.cu, fp8_small_m.cu, attention/cuda/kernels.cu), rounding
// to nearest even.
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

// Hopper's asynchronous copies: an mbarrier that counts the bytes of cp.async.bulk (TMA)
// copies from global into shared memory (paged_decode_v6, silu_and_mul_fp8_tma). sm_90 and
// later only: elsewhere these trap, and the hosts take their kernels only there.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define SM90_ASM(...) asm volatile(__VA_ARGS__)
#else
#define SM90_ASM(...) __trap()
#endif
__device__ __forceinline__ void mbar_init(unsigned int bar, unsigned int count) {
    SM90_ASM("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_init_fence() { SM90_ASM("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ void mbar_expect_tx(unsigned int bar, unsigned int bytes) {
    SM90_ASM("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned int bar, unsigned int parity) {
    SM90_ASM("{\n .reg .pred p;\n WAIT_%=:\n"
             " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
             " @!p bra WAIT_%=;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global memory into shared
// memory by the TMA unit, counted on the mbarrier `bar`; fence_proxy_async orders the warps'
// reads of a slot (generic proxy, after a __syncthreads) before the copy engine's writes to it
__device__ __forceinline__ void bulk_copy(unsigned int dst, const void* src, unsigned int bytes, unsigned int bar) {
    SM90_ASM("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
             ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
__device__ __forceinline__ void fence_proxy_async() { SM90_ASM("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// e4m3 (FP8) conversions, for the FP8 KV cache (attention/cuda/kernels.cu) and FP8 weights and
// activations (layers.cu): sm_89+ converts two values per instruction (cvt ... e4m3x2); older
// GPUs take the same rounding (nearest even, saturating to +-448) by bit manipulation, so every
// module compiles, and runs, on any GPU.
__device__ __forceinline__ unsigned int e4m3_from_float_sw(float x) {
    if (x != x) return 0x7fu;  // NaN
    const unsigned int sign = (__float_as_uint(x) >> 24) & 0x80u;
    const float a = fminf(fabsf(x), 448.f);  // satfinite (infinities too)
    if (a < 0.015625f)  // below the smallest normal 2^-6: multiples of 2^-9 (8 = the smallest normal, 0x08)
        return sign | (unsigned int)rintf(a * 512.f);
    const unsigned int b = __float_as_uint(a);
    const unsigned int r = (b + 0x7ffffu + ((b >> 20) & 1u)) >> 20;  // exponent and 3 mantissa bits, nearest even
    return sign | (r - (120u << 3));                      // exponent bias 127 -> 7
}
__device__ __forceinline__ float e4m3_to_float_sw(unsigned int v) {
    const unsigned int e = (v >> 3) & 0xfu, m = v & 7u;
    float a;
    if (e == 0) a = (float)m * 0.001953125f;  // subnormal: m * 2^-9
    else if (e == 15 && m == 7) a = __int_as_float(0x7fc00000);
    else a = __uint_as_float(((e + 120u) << 23) | (m << 20));
    return (v & 0x80u) ? -a : a;
}
// two floats -> two e4m3 bytes, `lo` in the low byte (the lower address)
__device__ __forceinline__ unsigned int e4m3x2_from_float(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(r) : "f"(hi), "f"(lo));  // first source -> high byte
    return r;
#else
    return e4m3_from_float_sw(lo) | (e4m3_from_float_sw(hi) << 8);
#endif
}
// the two e4m3 bytes in the low 16 bits of w (low byte first) -> f[0], f[1]
__device__ __forceinline__ void e4m3x2_to_f(unsigned int w, float* f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned int h;
    const unsigned short x = (unsigned short)w;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(h) : "h"(x));  // low byte -> low half
    const float2 r = __half22float2(*reinterpret_cast<__half2*>(&h));
    f[0] = r.x; f[1] = r.y;
#else
    f[0] = e4m3_to_float_sw(w & 0xffu);
    f[1] = e4m3_to_float_sw((w >> 8) & 0xffu);
#endif
}
