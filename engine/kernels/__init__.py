"""Per-device kernel dispatch: layers call these functions, and the tensor's device picks the kernel.

Every device starts on the plain-PyTorch reference; a device-specific module (Triton on CUDA)
registers itself for the ops it accelerates and is tested against the reference.
"""

from __future__ import annotations

from types import ModuleType

import torch

from engine.kernels import reference

_BY_DEVICE: dict[str, dict[str, object]] = {}


def register(device_type: str, module: ModuleType, ops: list[str]) -> None:
    _BY_DEVICE.setdefault(device_type, {}).update({op: getattr(module, op) for op in ops})


def _kernel(op: str, tensor):
    return _BY_DEVICE.get(tensor.device.type, {}).get(op) or getattr(reference, op)


def linear(x, weight):
    return _kernel("linear", x)(x, weight)


def rms_norm(x, weight, eps, offset=0.0):
    return _kernel("rms_norm", x)(x, weight, eps, offset)


def causal_conv1d(x, conv_state, weight):
    return _kernel("causal_conv1d", x)(x, conv_state, weight)


def gated_delta_rule(q, k, v, g, beta, state):
    return _kernel("gated_delta_rule", q)(q, k, v, g, beta, state)


def causal_attention(q, k, v, scale):
    return _kernel("causal_attention", q)(q, k, v, scale)


def grouped_linear(x, weight, groups):
    """Rows of x [M, K] sorted into `groups` (engine/kernels/groups.py), each times its own expert of the
    stacked weight [S, N, K]: out[rows of g] = x[rows of g] @ weight[slot of g]^T; [M, N] in x's dtype."""
    return _kernel("grouped_linear", x)(x, weight, groups)


def _register_cuda_kernels() -> None:
    """SDPA attention (flash / memory-efficient: no score matrix over the whole context), and Triton kernels
    for NVIDIA cards where Triton is installed (absent is fine: the reference runs)."""
    from engine.kernels import sdpa_attention
    register("cuda", sdpa_attention, ["causal_attention"])
    try:
        from engine.kernels import triton_linear
    except ImportError:
        return
    register("cuda", triton_linear, ["linear", "grouped_linear"])


if torch.cuda.is_available():
    _register_cuda_kernels()
