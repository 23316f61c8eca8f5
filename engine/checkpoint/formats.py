"""Weight formats, the one place that knows how each stored layout decodes to numbers.

A StoredWeight keeps the checkpoint's own tensors (views of the memory-mapped files) and
decodes them per use, so a 4-bit expert costs 4 bits of host RAM until it is computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DENSE = "dense"
FP8_TENSOR = "fp8_tensor"  # float8_e4m3fn weight, scalar (or per-output-channel) weight_scale that multiplies
FP8_BLOCK = "fp8_block"  # float8_e4m3fn weight, weight_scale_inv per block (bf16 in Qwen's -FP8 repos, or float32)
# ModelOpt: uint8 packed E2M1, fp8 scale per 16 inputs, weight_scale_2 that multiplies: a scalar in checkpoints,
# one per output row once fuse_rows has joined weights of different global scales (gate and up).
NVFP4 = "nvfp4"
NVFP4_CT = "nvfp4_ct"  # compressed-tensors: same packing, weight_global_scale that divides

NVFP4_GROUP = 16
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# E2M1 magnitudes of codes 0..7; bit 3 of a code is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Activation scales of W4A4/W8A8 exports: we compute weight-only, so they are not needed.
IGNORED_ROLES = frozenset({"input_scale", "input_global_scale", "k_scale", "v_scale"})


@dataclass
class StoredWeight:
    """A linear weight (or a stack of expert weights) in its checkpoint format."""

    format: str
    tensors: dict[str, torch.Tensor]
    shape: tuple[int, ...]  # logical (..., out_features, in_features)
    name: str
    block_size: tuple[int, int] = (128, 128)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return DECODERS[self.format](self).to(dtype)

    def select(self, index: int) -> StoredWeight:
        """Expert `index` of a stacked [E, out, in] weight; scalar scales are shared by all experts."""
        experts = self.shape[0]
        picked = {role: (t[index] if t.dim() >= 1 and t.shape[0] == experts else t) for role, t in self.tensors.items()}
        return StoredWeight(self.format, picked, self.shape[1:], f"{self.name}[{index}]", self.block_size)

    def to(self, device: torch.device | str) -> StoredWeight:
        moved = {role: t.to(device) for role, t in self.tensors.items()}
        return StoredWeight(self.format, moved, self.shape, self.name, self.block_size)


def detect_format(name: str, tensors: dict[str, torch.Tensor]) -> tuple[str, tuple[int, ...]]:
    """(format, logical shape) from which tensors a module stores; ValueError when no known format fits."""
    roles = set(tensors) - IGNORED_ROLES
    if roles == {"weight_packed", "weight_scale", "weight_global_scale"}:
        packed = tensors["weight_packed"]
        return NVFP4_CT, (*packed.shape[:-1], packed.shape[-1] * 2)
    weight = tensors.get("weight")
    if weight is None:
        raise ValueError(f"{name} has tensors {sorted(roles)} but no weight")
    if roles == {"weight"} and weight.is_floating_point() and weight.dtype not in FP8_DTYPES:
        return DENSE, tuple(weight.shape)
    if roles == {"weight", "weight_scale", "weight_scale_2"} and weight.dtype == torch.uint8:
        return NVFP4, (*weight.shape[:-1], weight.shape[-1] * 2)
    if weight.dtype in FP8_DTYPES and roles == {"weight", "weight_scale_inv"}:
        return FP8_BLOCK, tuple(weight.shape)
    if weight.dtype in FP8_DTYPES and roles == {"weight", "weight_scale"}:
        return FP8_TENSOR, tuple(weight.shape)
    raise ValueError(
        f"{name} stores {', '.join(f'{r} ({tensors[r].dtype})' for r in sorted(roles))}, "
        f"which is no weight format MoE Desk knows (bf16/fp16/fp32, FP8 block or per-tensor, NVFP4)"
    )


def check_scales(weight: StoredWeight) -> None:
    """ValueError when the scale tensors do not fit the weight's shape."""
    out_features, in_features = weight.shape[-2:]
    lead = weight.shape[:-2]
    if weight.format in (NVFP4, NVFP4_CT):
        expected = (*lead, out_features, in_features // NVFP4_GROUP)
        if in_features % NVFP4_GROUP or tuple(weight.tensors["weight_scale"].shape) != expected:
            raise ValueError(
                f"{weight.name}: NVFP4 weight_scale has shape {list(weight.tensors['weight_scale'].shape)}, "
                f"expected {list(expected)} (one scale per {NVFP4_GROUP} inputs)"
            )
    elif weight.format == FP8_BLOCK:
        rows, cols = weight.block_size
        expected = (*lead, -(-out_features // rows), -(-in_features // cols))
        if tuple(weight.tensors["weight_scale_inv"].shape) != expected:
            raise ValueError(
                f"{weight.name}: FP8 weight_scale_inv has shape "
                f"{list(weight.tensors['weight_scale_inv'].shape)}, expected {list(expected)} "
                f"for {rows}x{cols} blocks"
            )
    elif weight.format == FP8_TENSOR:
        scale = weight.tensors["weight_scale"]
        if scale.numel() not in (1, out_features):
            raise ValueError(
                f"{weight.name}: FP8 weight_scale has {scale.numel()} values, "
                f"expected 1 (per tensor) or {out_features} (per output channel)"
            )


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n/2] -> float32 [..., n]; element 2i is the low nibble, 2i+1 the high nibble."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2).long()
    return table[codes]


def _dense(w: StoredWeight) -> torch.Tensor:
    return w.tensors["weight"]


def _fp8_tensor(w: StoredWeight) -> torch.Tensor:
    scale = w.tensors["weight_scale"].float()
    if scale.numel() > 1:
        scale = scale.reshape(*w.shape[:-1], 1)
    return w.tensors["weight"].float() * scale


def _fp8_block(w: StoredWeight) -> torch.Tensor:
    rows, cols = w.block_size
    out_features, in_features = w.shape[-2:]
    scale = w.tensors["weight_scale_inv"].float()
    scale = scale.repeat_interleave(rows, dim=-2)[..., :out_features, :]
    scale = scale.repeat_interleave(cols, dim=-1)[..., :in_features]
    return w.tensors["weight"].float() * scale


def _nvfp4_values(packed: torch.Tensor, block_scale: torch.Tensor) -> torch.Tensor:
    values = unpack_e2m1(packed)
    return values * block_scale.float().repeat_interleave(NVFP4_GROUP, dim=-1)


def _nvfp4(w: StoredWeight) -> torch.Tensor:
    scale_2 = w.tensors["weight_scale_2"].float()
    if scale_2.numel() > 1:  # one per output row
        scale_2 = scale_2.reshape(*w.shape[:-1], 1)
    return _nvfp4_values(w.tensors["weight"], w.tensors["weight_scale"]) * scale_2


def _nvfp4_ct(w: StoredWeight) -> torch.Tensor:
    return (
        _nvfp4_values(w.tensors["weight_packed"], w.tensors["weight_scale"]) / w.tensors["weight_global_scale"].float()
    )


DECODERS = {DENSE: _dense, FP8_TENSOR: _fp8_tensor, FP8_BLOCK: _fp8_block, NVFP4: _nvfp4, NVFP4_CT: _nvfp4_ct}


def fuse_rows(weights: list[StoredWeight], name: str) -> StoredWeight:
    """One weight whose output rows are those of `weights` in order (gate and up into gate_up), in a form the
    grouped expert kernels take: NVFP4 with one multiplying global scale per row (compressed-tensors' dividing
    scale becomes its reciprocal), FP8 per-tensor with one scale per row, dense and FP8 block as they are."""
    formats = {w.format for w in weights}
    if len(formats) != 1 or len({w.shape[-1] for w in weights}) != 1:
        raise ValueError(f"{name}: cannot join {', '.join(f'{w.name} ({w.format} {list(w.shape)})' for w in weights)}")
    fmt = formats.pop()
    out_features = sum(w.shape[-2] for w in weights)
    shape = (*weights[0].shape[:-2], out_features, weights[0].shape[-1])

    def per_row(w: StoredWeight, scale: torch.Tensor) -> torch.Tensor:
        return scale.float().reshape(-1).expand(w.shape[-2]) if scale.numel() == 1 else scale.float().reshape(-1)

    if fmt in (NVFP4, NVFP4_CT):
        codes = "weight" if fmt == NVFP4 else "weight_packed"
        rows = [
            per_row(w, w.tensors["weight_scale_2"] if fmt == NVFP4 else 1.0 / w.tensors["weight_global_scale"].float())
            for w in weights
        ]
        tensors = {
            "weight": torch.cat([w.tensors[codes] for w in weights], dim=-2),
            "weight_scale": torch.cat([w.tensors["weight_scale"] for w in weights], dim=-2),
            "weight_scale_2": torch.cat(rows),
        }
        return StoredWeight(NVFP4, tensors, shape, name)
    if fmt == FP8_TENSOR:
        tensors = {
            "weight": torch.cat([w.tensors["weight"] for w in weights], dim=-2),
            "weight_scale": torch.cat([per_row(w, w.tensors["weight_scale"]) for w in weights]),
        }
        return StoredWeight(FP8_TENSOR, tensors, shape, name)
    if fmt == FP8_BLOCK:
        rows = weights[0].block_size[0]
        if any(w.shape[-2] % rows for w in weights[:-1]):
            raise ValueError(f"{name}: FP8 blocks of {rows} rows do not tile the joined weights")
    roles = weights[0].tensors
    tensors = {role: torch.cat([w.tensors[role] for w in weights], dim=-2) for role in roles}
    return StoredWeight(fmt, tensors, shape, name, weights[0].block_size)
