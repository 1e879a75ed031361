"""KV-cache storage and attention behind one small interface.

`torch_ref` is the pure-torch CPU reference (exact; used by CI). A CUDA backend
(CuPy RawModule kernels for K/V writes and paged attention) plugs in beside it.
"""

from inflightllm.attention.base import AttentionBackend, AttentionMetadata, SequenceSlice
from inflightllm.attention.torch_ref import TorchReferenceAttention


def make_attention_backend(device: str, **kwargs) -> AttentionBackend:
    """The attention backend for a device kind ("cpu" or "gpu")."""
    if device == "cpu":
        return TorchReferenceAttention(**kwargs)
    raise NotImplementedError(
        f"no attention backend for device {device!r} yet: the CUDA backend arrives with the GPU work"
    )


__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "SequenceSlice",
    "TorchReferenceAttention",
    "make_attention_backend",
]
