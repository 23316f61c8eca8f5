"""A record's matrix layout as the int64 fields the kernels read (one row of `meta` a matrix)."""

from __future__ import annotations

import torch

from engine.checkpoint.formats import DENSE, FP8_BLOCK, FP8_TENSOR, NVFP4, NVFP4_CT, NVFP4_GROUP
from engine.kernels.record_layout import MatrixLayout

FORMAT_CODES = {NVFP4: 0, NVFP4_CT: 1, FP8_TENSOR: 2, FP8_BLOCK: 3, DENSE: 4}
DTYPE_CODES = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
    torch.float8_e4m3fn: 3,
    torch.float8_e5m2: 4,
    torch.uint8: 5,
}
# meta[matrix] fields (int64): what the kernels need to find and decode one matrix of a record
(
    M_FORMAT,
    M_OUT,
    M_IN,
    M_WEIGHT,
    M_WEIGHT_DTYPE,
    M_SCALE,
    M_SCALE_DTYPE,
    M_SCALE_COUNT,
    M_GLOBAL,
    M_GLOBAL_DTYPE,
    M_GLOBAL_COUNT,
    M_BLOCK_ROWS,
    M_BLOCK_COLS,
    M_SCALE_COLS,
) = range(14)
META_FIELDS = 14


def _matrix_meta(matrix: MatrixLayout) -> list[int]:
    slots = {slot.role: slot for slot in matrix.tensors}
    out_features, in_features = matrix.shape
    meta = [0] * META_FIELDS
    meta[M_FORMAT], meta[M_OUT], meta[M_IN] = FORMAT_CODES[matrix.format], out_features, in_features

    def put(field: int, role: str) -> None:
        slot = slots[role]
        if slot.dtype not in DTYPE_CODES:
            raise ValueError(f"{role} of dtype {slot.dtype} is not supported by the CPU expert kernels")
        meta[field], meta[field + 1] = slot.offset, DTYPE_CODES[slot.dtype]
        if field in (M_SCALE, M_GLOBAL):
            meta[field + 2] = _count(slot.shape)

    if matrix.format in (NVFP4, NVFP4_CT):
        if in_features % NVFP4_GROUP:
            raise ValueError(f"NVFP4 needs in_features divisible by {NVFP4_GROUP}, got {in_features}")
        put(M_WEIGHT, "weight" if matrix.format == NVFP4 else "weight_packed")
        put(M_SCALE, "weight_scale")
        put(M_GLOBAL, "weight_scale_2" if matrix.format == NVFP4 else "weight_global_scale")
    elif matrix.format in (FP8_TENSOR, FP8_BLOCK):
        put(M_WEIGHT, "weight")
        put(M_SCALE, "weight_scale" if matrix.format == FP8_TENSOR else "weight_scale_inv")
        meta[M_BLOCK_ROWS], meta[M_BLOCK_COLS] = matrix.block_size
        meta[M_SCALE_COLS] = slots["weight_scale_inv"].shape[-1] if matrix.format == FP8_BLOCK else 0
    else:
        put(M_WEIGHT, "weight")
    return meta


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n
