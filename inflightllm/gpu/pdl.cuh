// Device side of programmatic dependent launch (inflightllm/gpu/pdl.py), prepended to
// layers.cu, allreduce.cu and attention/cuda/kernels.cu when they are compiled (gpu/pdl.py,
// `with_pdl`); with the system-scope flag accesses of the cross-GPU kernels.
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
