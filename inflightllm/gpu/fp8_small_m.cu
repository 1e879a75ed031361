// FP8 GEMM for a few rows of activations (decode steps of 3-32 tokens): out[m, n] =
// (sum_k xq[m, k] * wq[n, k]) * xs[m] * ws[n] (+ bias[n]), e4m3 inputs with per-token and
// per-channel scales: quantization.fp8.linear's numbers (W8A8), as torch._scaled_mm computes them,
// for M <= 32. torch._scaled_mm's tiles are built for many rows: at 2-32 tokens a Llama-3-8B step
// costs as much as a 256-token one (one H100: 5.7 ms against a 3.0 ms read of the weights).
//
// Tensor cores (mma.sync m16n8k32 e4m3, sm_89+): a block owns 16 output channels (the mma's M)
// and its 8 warps split K; a warp's mma takes 8 tokens (the mma's N), MT of them for 8 * MT tokens.
// Each thread loads 16 contiguous bytes of its two weight rows (groupID, groupID + 8) and of its
// token's row at the same k: the mma's k order, permuted alike for A and B (logical k t*4 + j and
// 16 + t*4 + j are bytes j and 4 + j of the thread's 16), so one 16-byte load feeds two mmas.
// Each pair of mmas (64 k) starts from zero and is added to float32 accumulators: full float32
// accumulation, as cuBLASLt without fast accumulation. The 8 warps' sums meet in shared memory.
// Requires K % 64 == 0, 16-byte aligned rows; N and M are bounded by clamping (extra rows and
// tokens are computed from valid memory and not stored).
// to_f / from_f: gpu/pdl.cuh, prepended to this source when it is compiled (ops.py).

__device__ __forceinline__ void mma_e4m3_16x8x32(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                                 unsigned b0, unsigned b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
    __trap();  // the launcher refuses GPUs without FP8 tensor cores
#endif
}

constexpr int SMALL_M_WARPS = 8;

template <typename T, int MT>
__global__ void __launch_bounds__(32 * SMALL_M_WARPS) fp8_small_m_gemm(
        T* __restrict__ out, const unsigned char* __restrict__ x, const float* __restrict__ x_scale,
        const unsigned char* __restrict__ w, const float* __restrict__ w_scale, const T* __restrict__ bias,
        int M, int N, int K) {
    constexpr int U = MT == 4 ? 2 : 4;  // 64-k chunks a warp has in flight
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * 16;
    const uint4* wa = reinterpret_cast<const uint4*>(w + (long)min(n0 + g, N - 1) * K) + t;
    const uint4* wb = reinterpret_cast<const uint4*>(w + (long)min(n0 + g + 8, N - 1) * K) + t;
    const uint4* xr[MT];
#pragma unroll
    for (int j = 0; j < MT; ++j) xr[j] = reinterpret_cast<const uint4*>(x + (long)min(8 * j + g, M - 1) * K) + t;
    const int chunks = K / 64;
    float acc[MT][4];
#pragma unroll
    for (int j = 0; j < MT; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[j][i] = 0.0f;
    for (int c0 = warp; c0 < chunks; c0 += SMALL_M_WARPS * U) {
        uint4 a[U], b[U], xb[U][MT];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + SMALL_M_WARPS * u;
            if (c < chunks) {
                a[u] = __ldcs(wa + 4 * c);
                b[u] = __ldcs(wb + 4 * c);
#pragma unroll
                for (int j = 0; j < MT; ++j) xb[u][j] = __ldg(xr[j] + 4 * c);
            } else {
                a[u] = b[u] = make_uint4(0, 0, 0, 0);
#pragma unroll
                for (int j = 0; j < MT; ++j) xb[u][j] = make_uint4(0, 0, 0, 0);
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int j = 0; j < MT; ++j) {
                float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                mma_e4m3_16x8x32(d, a[u].x, b[u].x, a[u].y, b[u].y, xb[u][j].x, xb[u][j].y);
                mma_e4m3_16x8x32(d, a[u].z, b[u].z, a[u].w, b[u].w, xb[u][j].z, xb[u][j].w);
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[j][i] += d[i];
            }
    }
    // acc[j][i]: channel n0 + g (+ 8 for i >= 2), token 8 j + 2 t + (i & 1).
    __shared__ float partial[SMALL_M_WARPS][MT * 4][32];
#pragma unroll
    for (int j = 0; j < MT; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) partial[warp][4 * j + i][lane] = acc[j][i];
    __syncthreads();
    for (int idx = threadIdx.x; idx < MT * 4 * 32; idx += blockDim.x) {
        const int ji = idx >> 5, l = idx & 31;
        float sum = 0.0f;
#pragma unroll
        for (int v = 0; v < SMALL_M_WARPS; ++v) sum += partial[v][ji][l];
        const int j = ji >> 2, i = ji & 3;
        const int n = n0 + (l >> 2) + (i >= 2 ? 8 : 0);
        const int m = 8 * j + 2 * (l & 3) + (i & 1);
        if (n < N && m < M) {
            float value = sum * x_scale[m] * w_scale[n];
            if (bias != nullptr) value += to_f<T>(bias[n]);
            out[(long)m * N + n] = from_f<T>(value);
        }
    }
}
