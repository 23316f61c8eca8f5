"""Encoders for the stored formats: the inverse of formats.py, used to write test and demo checkpoints.

Each returns the tensors a real export would store for one weight, keyed by role.
"""

from __future__ import annotations

import torch

from engine.checkpoint.formats import E2M1_VALUES, NVFP4_GROUP

FP8_MAX = 448.0  # largest float8_e4m3fn value
E2M1_MAX = 6.0


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code (0..15) of each value of x, already scaled into [-6, 6]."""
    magnitudes = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32)
    midpoints = (magnitudes[1:] + magnitudes[:-1]) / 2  # bucketize on midpoints: nearest value, no [..., 8] temporary
    nearest = torch.bucketize(x.abs(), midpoints)
    return (nearest | ((x < 0).long() << 3)).to(torch.uint8)


def _pack_codes(codes: torch.Tensor) -> torch.Tensor:
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _nvfp4_blocks(w: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes, fp8 block scales) for value = e2m1 * block_scale * global_scale."""
    groups = w.float().reshape(*w.shape[:-1], -1, NVFP4_GROUP)
    block_scale = (groups.abs().amax(dim=-1) / E2M1_MAX / global_scale).to(torch.float8_e4m3fn)
    divisor = block_scale.float()[..., None] * global_scale
    scaled = torch.where(divisor > 0, groups / divisor.clamp_min(1e-30), torch.zeros_like(groups))
    codes = _e2m1_codes(scaled.clamp(-E2M1_MAX, E2M1_MAX)).reshape(w.shape)
    return _pack_codes(codes), block_scale


def nvfp4_modelopt(w: torch.Tensor) -> dict[str, torch.Tensor]:
    scale_2 = (w.float().abs().amax() / (FP8_MAX * E2M1_MAX)).clamp_min(1e-12)
    packed, block_scale = _nvfp4_blocks(w, scale_2)
    return {
        "weight": packed,
        "weight_scale": block_scale,
        "weight_scale_2": scale_2.reshape(()),
        "input_scale": torch.tensor(1.0),
    }


def nvfp4_compressed_tensors(w: torch.Tensor) -> dict[str, torch.Tensor]:
    global_scale = (FP8_MAX * E2M1_MAX / w.float().abs().amax()).clamp_max(1e12)
    packed, block_scale = _nvfp4_blocks(w, 1.0 / global_scale)
    return {
        "weight_packed": packed,
        "weight_scale": block_scale,
        "weight_global_scale": global_scale.reshape(1),
        "input_global_scale": torch.ones(1),
    }


def fp8_per_tensor(w: torch.Tensor) -> dict[str, torch.Tensor]:
    scale = (w.float().abs().amax() / FP8_MAX).clamp_min(1e-12)
    return {
        "weight": (w.float() / scale).to(torch.float8_e4m3fn),
        "weight_scale": scale.reshape(()),
        "input_scale": torch.tensor(1.0),
    }


def fp8_block(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> dict[str, torch.Tensor]:
    rows, cols = block
    out_features, in_features = w.shape[-2:]
    padded = torch.zeros(*w.shape[:-2], -(-out_features // rows) * rows, -(-in_features // cols) * cols)
    padded[..., :out_features, :in_features] = w.float()
    tiles = padded.unflatten(-1, (-1, cols)).unflatten(-3, (-1, rows))  # [..., R, rows, C, cols]
    # Qwen's FP8 exports store the scales in bf16: round them first, so the codes are quantised against them
    scale = (tiles.abs().amax(dim=(-3, -1)) / FP8_MAX).clamp_min(1e-12).to(torch.bfloat16)  # [..., R, C]
    expanded = scale.float().repeat_interleave(rows, dim=-2).repeat_interleave(cols, dim=-1)
    # a scale rounded down can lift a block's largest value just past the FP8 range
    weight = (padded / expanded).clamp(-FP8_MAX, FP8_MAX)[..., :out_features, :in_features].to(torch.float8_e4m3fn)
    return {"weight": weight, "weight_scale_inv": scale}
