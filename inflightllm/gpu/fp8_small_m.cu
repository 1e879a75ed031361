// FP8 GEMM for a few rows of activations (decode steps of 2-32 tokens): out[m, n] =
// (sum_k xq[m, k] * wq[n, k]) * xs[m] * ws[n] (+ bias[n]), e4m3 inputs with per-token and
// per-channel scales: quantization.fp8.linear's numbers (W8A8), as torch._scaled_mm computes them,
// for M <= 32. torch._scaled_mm's tiles are built for many rows: at 2-32 tokens a Llama-3-8B step
// costs as much as a 256-token one (one H100: 5.7 ms against a 3.0 ms read of the weights).
//
// Tensor cores (mma.sync m16n8k32 e4m3, sm_89+): a block owns NT * 16 output channels (NT of the
// mma's M) and its 8 warps split K; a warp's mma takes 8 tokens (the mma's N), MT of them for 8 * MT tokens.
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

// Layouts (ops.FP8_SMALL_M_LAYOUTS): MT token tiles; NT channel tiles of 16 a block, so that a
// block's loads of the tokens' rows (from L2: every block reads all of x) feed NT * 16 channels;
// MINB the resident blocks an SM the registers are bounded for (0: ptxas chooses); U the 64-k
// chunks a warp has in flight (NT * U KiB of weights).
template <typename T, int MT, int NT, int MINB, int U>
__global__ void __launch_bounds__(32 * SMALL_M_WARPS, MINB) fp8_small_m_gemm(
        T* __restrict__ out, const unsigned char* __restrict__ x, const float* __restrict__ x_scale,
        const unsigned char* __restrict__ w, const float* __restrict__ w_scale, const T* __restrict__ bias,
        int M, int N, int K) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * 16 * NT;
    const uint4* wa[NT];
    const uint4* wb[NT];
#pragma unroll
    for (int r = 0; r < NT; ++r) {
        wa[r] = reinterpret_cast<const uint4*>(w + (long)min(n0 + 16 * r + g, N - 1) * K) + t;
        wb[r] = reinterpret_cast<const uint4*>(w + (long)min(n0 + 16 * r + g + 8, N - 1) * K) + t;
    }
    const uint4* xr[MT];
#pragma unroll
    for (int j = 0; j < MT; ++j) xr[j] = reinterpret_cast<const uint4*>(x + (long)min(8 * j + g, M - 1) * K) + t;
    const int chunks = K / 64;
    float acc[NT][MT][4];
#pragma unroll
    for (int r = 0; r < NT; ++r)
#pragma unroll
        for (int j = 0; j < MT; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[r][j][i] = 0.0f;
    for (int c0 = warp; c0 < chunks; c0 += SMALL_M_WARPS * U) {
        uint4 a[U][NT], b[U][NT], xb[U][MT];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + SMALL_M_WARPS * u;
            if (c < chunks) {
#pragma unroll
                for (int r = 0; r < NT; ++r) {
                    a[u][r] = __ldcs(wa[r] + 4 * c);
                    b[u][r] = __ldcs(wb[r] + 4 * c);
                }
#pragma unroll
                for (int j = 0; j < MT; ++j) xb[u][j] = __ldg(xr[j] + 4 * c);
            } else {
#pragma unroll
                for (int r = 0; r < NT; ++r) a[u][r] = b[u][r] = make_uint4(0, 0, 0, 0);
#pragma unroll
                for (int j = 0; j < MT; ++j) xb[u][j] = make_uint4(0, 0, 0, 0);
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int r = 0; r < NT; ++r)
#pragma unroll
                for (int j = 0; j < MT; ++j) {
                    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                    mma_e4m3_16x8x32(d, a[u][r].x, b[u][r].x, a[u][r].y, b[u][r].y, xb[u][j].x, xb[u][j].y);
                    mma_e4m3_16x8x32(d, a[u][r].z, b[u][r].z, a[u][r].w, b[u][r].w, xb[u][j].z, xb[u][j].w);
#pragma unroll
                    for (int i = 0; i < 4; ++i) acc[r][j][i] += d[i];
                }
    }
    // acc[r][j][i]: channel n0 + 16 r + g (+ 8 for i >= 2), token 8 j + 2 t + (i & 1).
    __shared__ float partial[SMALL_M_WARPS][NT * MT * 4][32];
#pragma unroll
    for (int r = 0; r < NT; ++r)
#pragma unroll
        for (int j = 0; j < MT; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) partial[warp][4 * (MT * r + j) + i][lane] = acc[r][j][i];
    __syncthreads();
    for (int idx = threadIdx.x; idx < NT * MT * 4 * 32; idx += blockDim.x) {
        const int rji = idx >> 5, l = idx & 31;
        float sum = 0.0f;
#pragma unroll
        for (int v = 0; v < SMALL_M_WARPS; ++v) sum += partial[v][rji][l];
        const int r = NT == 1 ? 0 : rji / (4 * MT), j = (rji >> 2) - MT * r, i = rji & 3;
        const int n = n0 + 16 * r + (l >> 2) + (i >= 2 ? 8 : 0);
        const int m = 8 * j + 2 * (l & 3) + (i & 1);
        if (n < N && m < M) {
            float value = sum * x_scale[m] * w_scale[n];
            if (bias != nullptr) value += to_f<T>(bias[n]);
            out[(long)m * N + n] = from_f<T>(value);
        }
    }
}
