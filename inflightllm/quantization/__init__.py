"""Quantized weights, activations and KV cache (FP8 e4m3): the math, shared by the CPU
emulation and the GPU kernels' tests (`fp8`), and the checkpoint schemes that load as
published (`schemes`). docs/QUANTIZATION.md says what is supported and why."""
