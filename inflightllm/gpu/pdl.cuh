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
