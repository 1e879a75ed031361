"""inflightllm: an LLM serving engine for Triton Inference Server's Python backend."""

__version__ = "0.1.0"
