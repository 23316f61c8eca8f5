"""Routed experts on the CPU, computed exactly from the host expert records (engine/kernels/record_layout.py).

`CpuExpertKernel(layout).run(records, x, expert_ids, expert_weights, on_cpu)` gives the weighted sum of the
chosen experts' SwiGLU outputs for the assignments marked `on_cpu`, reading each expert's weights where its
record lies, in the checkpoint's format (NVFP4 ModelOpt and compressed-tensors, FP8 per-tensor/per-row and
block-scaled, bf16/fp16/fp32): nothing is re-quantised, activations stay float32, and the result matches
dequantise-then-matmul in float32 up to float32 rounding.

The kernels are numba functions compiled on the user's machine (cached on disk after the first call). They
run with the GIL released, so a Python thread can compute experts beside GPU work. A call runs one parallel
region whose threads take (expert, block of rows) items from atomic counters, gate_up then down, then blocks of
tokens to sum, as the CPU share's threads do for each layer of a decode step (cpu_share.py). Decoding is arithmetic
that LLVM vectorises: E2M1 codes are decoded to signed int8 over whole rows, then an NVFP4 row is computed with
one block of 16 inputs per vector lane, so each E4M3 block scale multiplies a lane and no per-block horizontal
sum is needed (the inputs are laid out block-lane order once per token to match). Without numba, a plain
PyTorch version with the same interface computes the same numbers, slower.

The modules, bottom up: cpu (numba and the CPU's vector features), pool (thread counts), meta (a record's
layout as the kernels' int64 fields), llvm and bf16_dots (IR for decoding and the AVX512-BF16 dots), rows (row
kernels), atomics, scheduler (work items from atomic counters), fallback (PyTorch) and kernel (CpuExpertKernel).
"""

from engine.kernels.cpu_experts.cpu import bf16_dot_supported, numba
from engine.kernels.cpu_experts.kernel import CpuExpertKernel
from engine.kernels.cpu_experts.pool import default_threads, numba_threads, set_threads, threads

__all__ = [
    "CpuExpertKernel",
    "bf16_dot_supported",
    "default_threads",
    "numba",
    "numba_threads",
    "set_threads",
    "threads",
]
