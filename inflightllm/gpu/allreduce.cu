// One-shot all-reduce over GPUs of one host that can read each other's memory (NVLink P2P),
// for the small all-reduces of tensor-parallel decode (inflightllm/parallel/custom_all_reduce.py).
// pdl.cuh (pdl_trigger, pdl_wait, the flag accesses) is prepended when this is compiled.
//
// Each rank owns one buffer, mapped into every rank's address space (CUDA IPC):
//   [flags: GRID x MAX_RANKS uint64][counters: GRID uint64][fused header at 768][pad to 1 KiB]
//   [slot 0][slot 1][the fused all-reduce's slots (layers.cu)]
// `bases[r]` is rank r's buffer as this process sees it. Every launch has GRID blocks; block b
// takes a fixed share of the vectors. Block b of every rank, per call:
//   1. copies its share of `input` into its own slot (epoch % 2),
//   2. barrier: tells every rank "block b reached epoch e" (flags[b][rank] = e in their buffer)
//      and waits until every rank has told it the same,
//   3. sums its share over the ranks' slots in rank order (every rank gets the same bits) into
//      `output` (may be `input`).
// The epoch is block b's counter + 1; every launch has all GRID blocks, so all blocks of a rank
// count the same calls and agree on the slot. A rank writes a slot again two calls later, only
// after the barrier of the call in between, which every rank enters only after finishing (its
// pdl_wait) the call before it: nobody still reads the slot then. A rank that never arrives
// (dead) leaves the others spinning until `abort` (host memory mapped into the GPU) is set.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#define AR_GRID 8
#define AR_MAX_RANKS 8
#define AR_THREADS 512
#define AR_HEADER_BYTES 1024

// st_release_sys, ld_acquire_sys: pdl.cuh.

template <typename T>
__device__ __forceinline__ void add_vector(float* acc, const uint4& v) {
    const T* x = reinterpret_cast<const T*>(&v);
#pragma unroll
    for (int i = 0; i < 16 / (int)sizeof(T); ++i) acc[i] += static_cast<float>(x[i]);
}

template <>
__device__ __forceinline__ void add_vector<float>(float* acc, const uint4& v) {
    const float* x = reinterpret_cast<const float*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[i] += x[i];
}

template <typename T>
__device__ __forceinline__ uint4 pack_vector(const float* acc) {
    uint4 out;
    T* y = reinterpret_cast<T*>(&out);
#pragma unroll
    for (int i = 0; i < 16 / (int)sizeof(T); ++i) y[i] = static_cast<T>(acc[i]);
    return out;
}

// input/output: `vectors` 16-byte vectors (may alias); bases: [world] buffer addresses.
template <typename T>
__global__ void __launch_bounds__(AR_THREADS) one_shot_all_reduce(
    const uint4* input, uint4* output, const unsigned long long* __restrict__ bases, const volatile int* abort,
    int rank, int world, long long vectors, long long slot_bytes) {
    pdl_trigger();
    const int b = blockIdx.x;
    const long long share = (vectors + AR_GRID - 1) / AR_GRID;
    const long long begin = min(vectors, share * b);
    const long long end = min(vectors, begin + share);
    unsigned char* own = reinterpret_cast<unsigned char*>(bases[rank]);
    unsigned long long* counters = reinterpret_cast<unsigned long long*>(own) + AR_GRID * AR_MAX_RANKS;
    pdl_wait();  // the input is the previous kernel's output; the previous call has ended
    const unsigned long long epoch = counters[b] + 1;
    const long long slot = AR_HEADER_BYTES + (long long)(epoch & 1) * slot_bytes;
    uint4* own_slot = reinterpret_cast<uint4*>(own + slot);
    for (long long i = begin + threadIdx.x; i < end; i += blockDim.x) own_slot[i] = input[i];
    __syncthreads();
    if (threadIdx.x < world) {
        unsigned long long* peer_flags = reinterpret_cast<unsigned long long*>(bases[threadIdx.x]);
        __threadfence_system();
        st_release_sys(peer_flags + b * AR_MAX_RANKS + rank, epoch);
        const unsigned long long* mine = reinterpret_cast<const unsigned long long*>(own) + b * AR_MAX_RANKS + threadIdx.x;
        unsigned int spins = 0;
        while (ld_acquire_sys(mine) < epoch) {
            if ((++spins & 1023u) == 0 && *abort) break;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) counters[b] = epoch;
    for (long long i = begin + threadIdx.x; i < end; i += blockDim.x) {
        float acc[16 / sizeof(T)] = {};
        for (int r = 0; r < world; ++r) {
            const uint4* slot_r = reinterpret_cast<const uint4*>(reinterpret_cast<const unsigned char*>(bases[r]) + slot);
            add_vector<T>(acc, __ldcg(slot_r + i));
        }
        output[i] = pack_vector<T>(acc);
    }
}

template __global__ void one_shot_all_reduce<float>(const uint4*, uint4*, const unsigned long long*, const volatile int*, int, int, long long, long long);
template __global__ void one_shot_all_reduce<__half>(const uint4*, uint4*, const unsigned long long*, const volatile int*, int, int, long long, long long);
template __global__ void one_shot_all_reduce<__nv_bfloat16>(const uint4*, uint4*, const unsigned long long*, const volatile int*, int, int, long long, long long);
