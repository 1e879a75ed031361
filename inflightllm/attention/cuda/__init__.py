"""CUDA attention backend (kernels compiled at run time by CuPy/NVRTC; CuPy imported lazily)."""

from inflightllm.attention.cuda.backend import CudaAttentionMetadata, CudaPagedAttention

__all__ = ["CudaAttentionMetadata", "CudaPagedAttention"]
