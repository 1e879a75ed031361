"""The CUDA path of the engine: fused Llama model, GPU runner, batched GPU sampler.

Nothing here imports CuPy at module import time; the CPU engine never imports it.
"""
