"""Weight-only quantised linears in Triton for CUDA: which weights the kernel takes, and the entry points.

Formats (engine/checkpoint/formats.py): NVFP4 (ModelOpt, global scale that multiplies, scalar or one per row),
NVFP4_CT (compressed-tensors, global scale that divides), FP8_TENSOR (one scale, or one per row) and FP8_BLOCK
(a float32 scale per block); `grouped_linear` and `slot_linear` take stacked NVFP4, FP8_TENSOR and DENSE weights.
Anything else goes to the reference. The kernel is triton_linear_kernel.py, its tiling and launch
triton_linear_launch.py.

Under TRITON_INTERPRET=1 the same kernels run on the CPU, which is how CI checks them (there bf16 inputs use
float32 dots: the interpreter has no bf16 dot).
"""

from __future__ import annotations

import torch

from engine.checkpoint.formats import DENSE, FP8_BLOCK, FP8_TENSOR, NVFP4, NVFP4_CT, NVFP4_GROUP, StoredWeight
from engine.kernels import reference
from engine.kernels.groups import ExpertGroups
from engine.kernels.triton_linear_kernel import F_DENSE, F_FP8, F_FP8_BLOCK, F_NVFP4
from engine.kernels.triton_linear_launch import Operands, cdiv, launch


def _row_scale(t: torch.Tensor, rows: int, stacked: bool):
    """(tensor, slot stride, row stride) of a scale that is a scalar, one per slot, or one per output row."""
    lead = t.shape[0] if stacked and t.dim() >= 1 else None
    if stacked and t.dim() >= 1 and t.numel() == lead * rows and rows > 1:  # [S, N] or [S, N, 1]
        return t, t.stride(0), t.stride(1)
    if stacked and t.dim() >= 1 and t.numel() == lead:  # [S] or [S, 1, ...]: one per slot
        return t, t.stride(0), 0
    if t.numel() == 1:
        return t, 0, 0
    if not stacked and t.numel() == rows:
        flat = t.reshape(-1)
        return flat, 0, flat.stride(0)
    raise ValueError(f"a scale of shape {list(t.shape)} fits no output rows ({rows})")


def _words_aligned(codes: torch.Tensor) -> bool:
    """Whether packed E2M1 bytes can be read as 32-bit words (the GEMV's loads): 4-byte aligned rows and slots."""
    return codes.data_ptr() % 4 == 0 and all(stride % 4 == 0 for stride in codes.stride()[:-1])


def _operands(weight: StoredWeight, stacked: bool) -> Operands | None:
    """None when the kernels do not take this weight (its format or layout), so the reference computes it."""
    fmt = weight.format
    n_out, k_in = weight.shape[-2:]
    tensors = weight.tensors
    dims = 3 if stacked else 2

    def inner_ok(t):  # the kernels index the innermost dimension with stride 1
        return t.dim() == dims and t.stride(-1) == 1

    def strides(t):
        return (t.stride(0) if stacked else 0, t.stride(-2))

    if fmt in (NVFP4, NVFP4_CT):
        codes = tensors["weight" if fmt == NVFP4 else "weight_packed"]
        scales = tensors["weight_scale"]
        if k_in % NVFP4_GROUP or not (inner_ok(codes) and inner_ok(scales) and _words_aligned(codes)):
            return None
        r, r_slot, r_row = _row_scale(
            tensors["weight_scale_2" if fmt == NVFP4 else "weight_global_scale"], n_out, stacked
        )
        return Operands(
            F_NVFP4,
            codes,
            scales.view(torch.uint8),
            r,
            strides(codes),
            (*strides(scales), 1),
            (r_slot, r_row),
            fmt == NVFP4_CT,
            (1, 1),
        )
    if fmt == FP8_TENSOR:
        w = tensors["weight"]
        if w.dtype != torch.float8_e4m3fn or not inner_ok(w):
            return None
        r, r_slot, r_row = _row_scale(tensors["weight_scale"], n_out, stacked)
        return Operands(F_FP8, w.view(torch.uint8), w, r, strides(w), (0, 0, 0), (r_slot, r_row), False, (1, 1))
    if fmt == FP8_BLOCK:
        w, s = tensors["weight"], tensors["weight_scale_inv"]
        if w.dtype != torch.float8_e4m3fn or not inner_ok(w) or s.dim() != dims:
            return None
        return Operands(
            F_FP8_BLOCK,
            w.view(torch.uint8),
            s,
            w,
            strides(w),
            (s.stride(0) if stacked else 0, s.stride(-2), s.stride(-1)),
            (0, 0),
            False,
            tuple(weight.block_size),
        )
    if fmt == DENSE:
        w = tensors["weight"]
        if not w.is_floating_point() or w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) or not inner_ok(w):
            return None
        return Operands(F_DENSE, w, w, w, strides(w), (0, 0, 0), (0, 0), False, (1, 1))
    return None


GEMV_MAX_ROWS = 1  # up to this many rows (per group, for grouped) take the GEMV path


def linear(
    x: torch.Tensor,
    weight: StoredWeight,
    *,
    swiglu: bool = False,
    gemv: bool | None = None,
    block_m: int | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """x [..., K] @ W^T for a quantised weight [N, K]; float32 accumulation, output in x's dtype. With swiglu,
    x [..., 2K] holds gate then up and the input is silu(gate) * up (fused in the GEMV path). Formats the
    kernels do not take (dense among them) go to the reference. gemv/block_m/splits force a tiling (tests)."""
    if gemv is None:
        gemv = x.numel() <= GEMV_MAX_ROWS * x.shape[-1]
    # a dense weight only for the GEMV, in x's dtype: cuBLAS tiles a one-row matmul for many rows
    dense_gemv = gemv and weight.format == DENSE and weight.tensors["weight"].dtype == x.dtype
    takes = len(weight.shape) == 2 and (weight.format != DENSE or dense_gemv)
    ops = _operands(weight, stacked=False) if takes else None
    if ops is None:
        return reference.linear(x, weight, swiglu)
    n_out, k_in = weight.shape
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    rows = flat.shape[0]
    if swiglu and not gemv:  # the tiles path reads its inputs as they are stored
        flat, swiglu = reference.silu_mul(flat), False
    if gemv:
        bm, tiles_m = 1, rows
    else:
        bm = block_m or (16 if rows <= 16 else 32 if rows <= 32 else 64 if rows <= 128 else 128)
        tiles_m = cdiv(rows, bm)
    out = launch(flat, ops, n_out, k_in, None, tiles_m, bm, gemv, splits, swiglu=swiglu)
    return out.reshape(*x.shape[:-1], n_out)


def _group_block_m(groups: ExpertGroups) -> int:
    """Rows per tile from the groups' sizes: 1 (GEMV) when every group has one row, else 16/32/64 by average."""
    sizes = [end - begin for _, begin, end in groups]
    if not sizes or max(sizes) <= GEMV_MAX_ROWS:
        return 1
    average = sum(sizes) / len(sizes)
    return 16 if average <= 16 else 32 if average <= 32 else 64


def _tile_table(groups: ExpertGroups, bm: int, device: torch.device) -> torch.Tensor:
    """int32 [tiles, 3] of (slot, first row, group end row), made once per groups, block and device."""
    key = ("triton_linear_tiles", bm, str(device))
    table = groups.cache.get(key)
    if table is None:
        entries = [(slot, first, end) for slot, begin, end in groups for first in range(begin, end, bm)]
        host = torch.tensor(entries, dtype=torch.int32).reshape(-1, 3)
        if device.type == "cuda":
            host = host.pin_memory()
        table = host.to(device, non_blocking=True)
        groups.cache[key] = table
    return table


def _stacked_operands(weight: StoredWeight) -> Operands | None:
    """The grouped kernels' view of a stacked weight [S, N, K]; None for what they leave to the reference."""
    ops = _operands(weight, stacked=True) if len(weight.shape) == 3 else None
    if ops is None or ops.fmt == F_FP8_BLOCK or weight.format == NVFP4_CT:
        return None
    return ops


def _stacked_inputs(x: torch.Tensor, weight: StoredWeight):
    """(operands, x with unit column stride, out features, in features) when the kernels take this stacked weight,
    else None (its caller's reference runs)."""
    ops = _stacked_operands(weight)
    if ops is None:
        return None
    n_out, k_in = weight.shape[-2:]
    return ops, x if x.stride(-1) == 1 else x.contiguous(), n_out, k_in


def grouped_linear(
    x: torch.Tensor,
    weight: StoredWeight,
    groups: ExpertGroups,
    *,
    block_m: int | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """Rows of x [M, K] sorted by group, each times its own slot of the stacked weight [S, N, K]; [M, N] in x's
    dtype. Stacked NVFP4, FP8 per-tensor/per-row and dense weights run here; other formats on the reference.
    block_m/splits force a tiling (for tests)."""
    stacked = _stacked_inputs(x, weight)
    if stacked is None:
        return reference.grouped_linear(x, weight, groups)
    ops, x, n_out, k_in = stacked
    bm = block_m if block_m is not None else _group_block_m(groups)
    table = _tile_table(groups, bm, x.device)
    return launch(x, ops, n_out, k_in, table, table.shape[0], bm, bm == 1, splits, table_kind=1)


def slot_linear_capturable(weight: StoredWeight) -> bool:
    return _stacked_operands(weight) is not None


def slot_linear(
    x: torch.Tensor, weight: StoredWeight, slots: torch.Tensor, *, swiglu: bool = False, splits: int | None = None
) -> torch.Tensor:
    """Row r of x [M, K] (a zero row stride is fine) times slot slots[r] of the stacked weight [S, N, K], by the
    GEMV path, which reads `slots` (int32) on the device: nothing here reads them on the host. With swiglu, x
    is [M, 2K] of gate and up and the input silu(gate) * up (reference.slot_linear)."""
    stacked = _stacked_inputs(x, weight)
    if stacked is None:
        return reference.slot_linear(x, weight, slots, swiglu=swiglu)
    ops, x, n_out, k_in = stacked
    table = slots if slots.dtype == torch.int32 else slots.to(torch.int32)
    return launch(x, ops, n_out, k_in, table, x.shape[0], 1, True, splits, table_kind=2, swiglu=swiglu)
