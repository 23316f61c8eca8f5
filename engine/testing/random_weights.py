"""Honest random weights for a checkpoint layout: every tensor drawn from its own random stream.

A layout is what a checkpoint's headers say, `{name: (safetensors dtype, shape)}`. Each tensor is filled
in blocks of rows, each block from a generator seeded by (seed, tensor, block), on all CPU threads at once,
so a full-size model is built in seconds and no two rows, experts or layers repeat one another.
Magnitudes follow each tensor's role so that activations stay in range: linear weights dequantise to about
unit variance over their inputs, norms sit near one, Gated DeltaNet decay parameters in their usual range.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from engine.checkpoint import normalise_key

DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "U8": torch.uint8,
    "F8_E4M3": torch.float8_e4m3fn,
    "I64": torch.int64,
    "I32": torch.int32,
}
BLOCK_ELEMENTS = 1 << 22  # elements a generator fills: small enough to spread a big tensor over every thread
E2M1_RMS = math.sqrt(sum(v * v for v in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)) / 8)
# Random bytes masked to E4M3 codes of magnitude at most 1.875 (exponent field below 8): never NaN.
FP8_WEIGHT_MASK = 0b1011_1111
# E4M3 codes of exponent field 6 or 7 with any mantissa: scales in [0.5, 1.875].
FP8_SCALE_BITS, FP8_SCALE_MASK = 0b0011_0000, 0b0000_1111


def _fp8_values(codes: torch.Tensor) -> torch.Tensor:
    return codes.view(torch.float8_e4m3fn).float()


_ALL_BYTES = torch.arange(256, dtype=torch.int32).to(torch.uint8)
FP8_WEIGHT_RMS = float(_fp8_values(_ALL_BYTES & FP8_WEIGHT_MASK).pow(2).mean().sqrt())  # random codes' RMS
NVFP4_BLOCK_SCALE_MEAN = float(_fp8_values((_ALL_BYTES & FP8_SCALE_MASK) | FP8_SCALE_BITS).mean())


def random_tensors(
    layout: dict[str, tuple[str, tuple[int, ...]]], zero_centred_norms: bool, seed: int = 0, threads: int | None = None
) -> dict[str, torch.Tensor]:
    """Tensors of `layout` with random values (names the engine skips, vision and MTP, are left out)."""
    tensors = {
        name: torch.empty(tuple(shape), dtype=DTYPES[dtype])
        for name, (dtype, shape) in layout.items()
        if normalise_key(name) is not None
    }
    fill_random(tensors, zero_centred_norms, seed, threads)
    return tensors


def fill_random(
    tensors: dict[str, torch.Tensor], zero_centred_norms: bool, seed: int = 0, threads: int | None = None
) -> None:
    """Fill `tensors` (checkpoint or transformers parameter names) in place with random values by role."""
    names = {dtype: name for name, dtype in DTYPES.items()}
    layout = {name: (names[t.dtype], tuple(t.shape)) for name, t in tensors.items()}
    jobs = []
    for index, (name, tensor) in enumerate(tensors.items()):
        flat = tensor.view(-1)
        fill = _filler(name, layout[name][0], layout[name][1], layout, zero_centred_norms)
        for block, begin in enumerate(range(0, max(flat.numel(), 1), BLOCK_ELEMENTS)):
            jobs.append((fill, flat[begin : begin + BLOCK_ELEMENTS], (seed, index, block)))
    with ThreadPoolExecutor(threads or os.cpu_count() or 1) as pool:
        list(pool.map(lambda job: job[0](job[1], _generator(job[2])), jobs))


def _generator(key: tuple[int, int, int]) -> torch.Generator:
    seed, tensor, block = key
    return torch.Generator().manual_seed((seed * 1_000_003 + tensor) * 1_000_003 + block)


def _filler(name: str, dtype: str, shape: tuple[int, ...], layout: dict, zero_centred: bool):
    """A function filling a flat block of `name` from a generator."""
    if dtype == "U8":  # packed E2M1 codes: every byte is two valid codes
        return _random_bytes
    if dtype == "F8_E4M3":
        if name.rpartition(".")[2] == "weight":
            return _fp8_weight
        return _fp8_scale  # an NVFP4 block scale
    role = name.rpartition(".")[2]
    if role in (
        "weight_scale",
        "weight_scale_2",
        "weight_scale_inv",
        "weight_global_scale",
        "input_scale",
        "input_global_scale",
    ):
        return _constant(_scale_value(name, role, layout))
    return _normal(*_plain_law(name, shape, zero_centred))


def _scale_value(name: str, role: str, layout: dict) -> float:
    """The scale that gives a quantised weight of `name` about 1/sqrt(inputs) per element."""
    module = name.rpartition(".")[0]
    weight = layout.get(f"{module}.weight") or layout.get(f"{module}.weight_packed")
    if weight is None or role.startswith("input"):
        return 1.0
    packed = weight[0] == "U8"
    inputs = weight[1][-1] * (2 if packed else 1)
    target = inputs**-0.5
    if packed:  # NVFP4: codes x block scale x global scale
        global_scale = target / (E2M1_RMS * NVFP4_BLOCK_SCALE_MEAN)
        return 1.0 / global_scale if role == "weight_global_scale" else global_scale
    return target / FP8_WEIGHT_RMS  # FP8: codes x scale (weight_scale and Qwen's weight_scale_inv multiply)


def _plain_law(name: str, shape: tuple[int, ...], zero_centred: bool) -> tuple[float, float]:
    """(mean, standard deviation) of a plain (unquantised) tensor by its role."""
    if name.endswith("A_log"):
        return 1.4, 0.6  # log of decay rates around 4
    if name.endswith("dt_bias"):
        return 1.0, 0.5
    if name.endswith("conv1d.weight"):
        return 0.0, 0.5
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        gated_norm = ".linear_attn.norm." in name  # the GDN output norm multiplies by its weight
        return (0.0 if zero_centred and not gated_norm else 1.0), 0.1
    if "embed_tokens" in name:
        return 0.0, 1.0
    if name.endswith("mlp.gate.weight"):
        return 0.0, 1.0  # routers: logits spread enough that top-k is decided
    inputs = shape[-1] if len(shape) >= 2 else 1
    scale = 2.0 if name.startswith("lm_head") else 1.0
    return 0.0, scale * inputs**-0.5


def _random_bytes(block: torch.Tensor, generator: torch.Generator) -> None:
    words = torch.empty(-(-block.numel() // 8), dtype=torch.int64).random_(generator=generator)
    block.copy_(words.view(torch.uint8)[: block.numel()])


def _fp8_weight(block: torch.Tensor, generator: torch.Generator) -> None:
    codes = torch.empty(block.numel(), dtype=torch.uint8)
    _random_bytes(codes, generator)
    block.view(torch.uint8).copy_(codes & FP8_WEIGHT_MASK)


def _fp8_scale(block: torch.Tensor, generator: torch.Generator) -> None:
    codes = torch.empty(block.numel(), dtype=torch.uint8)
    _random_bytes(codes, generator)
    block.view(torch.uint8).copy_((codes & FP8_SCALE_MASK) | FP8_SCALE_BITS)


def _constant(value: float):
    def fill(block: torch.Tensor, generator: torch.Generator) -> None:
        block.fill_(value)

    return fill


def _normal(mean: float, std: float):
    def fill(block: torch.Tensor, generator: torch.Generator) -> None:
        block.copy_(torch.randn(block.numel(), generator=generator) * std + mean)

    return fill
