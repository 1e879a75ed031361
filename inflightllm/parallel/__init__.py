"""Tensor parallelism: one engine over N ranks (rank 0 in the engine's process, ranks
1..N-1 worker processes it starts and owns). See docs/PARALLEL.md.

- `group`: the process groups (NCCL on GPU, gloo on CPU; a gloo group for control
  messages) and the collectives the sharded models call.
- `shard`: column/row/vocab-parallel sharding of the CPU model (`models/llama.py`).
- `runner`: the rank-local runner (CPU reference or CUDA) over a sharded model.
- `tp_runner`: `TensorParallelRunner`, the runner wrapper rank 0's engine drives.
- `worker`: `python -m inflightllm.parallel.worker`, the process of ranks 1..N-1.
"""
