"""Tiling and launching of the quantised-linear kernel (triton_linear_kernel.py) for one weight's operands.

Tiling: the GEMV path takes the most rows per program that still gives about eight programs per multiprocessor
and a ~4 KB weight tile per K step; the tiles path takes block sizes by row-tile height and format. When the
(row, column) tiles leave multiprocessors idle and K is long, K is split over the third grid axis (a zero-filled
float32 output, cast afterwards).

Launching: Triton's generic launch costs tens of microseconds of host time for this kernel's 33 arguments; _run
keeps each compiled variant under its own key and launches it directly (see there).
"""

from __future__ import annotations

import torch
import triton.language as tl

from engine.kernels.triton_linear_kernel import F_FP8, F_FP8_BLOCK, F_NVFP4, NOT_SPECIALISED, linear_kernel

_TILE_BYTES = 4096  # weight bytes a GEMV program loads per K step


def _dot_dtype(x: torch.Tensor):
    if x.dtype == torch.float32:
        return tl.float32
    if x.dtype == torch.bfloat16:
        if x.device.type != "cuda":  # the interpreter (CPU tensors) computes bf16 dots wrongly: it has no bf16
            return tl.float32
        # Turing (sm_75) tensor cores take fp16 only; bf16 needs Ampere or newer
        if _device_info(x.device)[0] >= 8:
            return tl.bfloat16
    return tl.float16


_DEVICE_INFO: dict[int, tuple[int, int]] = {}


def _device_info(device: torch.device) -> tuple[int, int]:
    """(compute capability major, multiprocessor count) of a CUDA device, asked once."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    info = _DEVICE_INFO.get(index)
    if info is None:
        props = torch.cuda.get_device_properties(index)
        info = _DEVICE_INFO[index] = (props.major, props.multi_processor_count)
    return info


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs, enough to exercise the splitting rules on tiny shapes
    return _device_info(device)[1]


# Host arithmetic in plain Python: triton.cdiv and triton.next_power_of_2 are JIT functions whose host calls
# cost microseconds each, which add up on a decode step's small launches.
def cdiv(a: int, b: int) -> int:
    """Divide a by b, rounding up."""
    return -(-a // b)


def _next_pow2(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


def _pow2_at_most(value: int) -> int:
    return 1 << (max(1, value).bit_length() - 1)


class Operands:
    """The kernel's view of one weight: format code, tensors (bytes for fp8), strides, per-row scale."""

    def __init__(self, fmt, w, s, r, w_strides, s_strides, r_strides, divide, block):
        self.fmt, self.w, self.s, self.r = fmt, w, s, r
        self.w_strides, self.s_strides, self.r_strides = w_strides, s_strides, r_strides
        self.divide, self.block = divide, block

    @property
    def input_bytes(self) -> float:
        """Weight bytes per input element (4-bit codes: half a byte)."""
        return 0.5 if self.fmt == F_NVFP4 else float(self.w.element_size())


def _gemv_blocks(ops: Operands, n_out: int, k_in: int, programs_m: int, sms: int) -> tuple[int, int, int, int]:
    """(BN, BK, num_warps, num_stages) of the GEMV path: few enough rows per program that programs_m * N/BN
    gives about eight programs per multiprocessor (at least 2 rows), then inputs for a tile of about
    _TILE_BYTES weight bytes (BK a power of two, no more than K needs)."""
    bn = 64
    while bn > 2 and programs_m * cdiv(n_out, bn) < 8 * sms:
        bn //= 2
    bn = min(bn, _next_pow2(n_out))
    bk = _pow2_at_most(int(_TILE_BYTES / (bn * ops.input_bytes)))
    bk = max(32, min(bk, _next_pow2(k_in), 2048))
    return bn, bk, 4, 1


def _tile_blocks(ops: Operands, m_tile: int, n_out: int, k_in: int, tiles_m: int) -> tuple[int, int, int, int]:
    """(BN, BK, num_warps, num_stages) of the tl.dot path for tiles of m_tile rows (measured on an H200)."""
    if m_tile <= 16:  # decode-like: narrow column tiles, long K steps; wider columns once many row tiles exist
        bn, bk = (32 if tiles_m < 16 else 64), 256 if ops.fmt != F_NVFP4 or tiles_m < 16 else 128
    elif ops.fmt == F_NVFP4:
        bn, bk = 64, 128
    else:
        bn, bk = 128, 64
    bn = max(16, min(bn, _next_pow2(n_out)))
    bk = max(32, min(bk, _next_pow2(k_in)))
    return bn, bk, 4, 3


def _split_k(programs: int, k_in: int, bk: int, sms: int) -> tuple[int, int]:
    """(splits, inputs per split): split K over programs when the (rows, columns) tiles alone leave
    multiprocessors idle and each has a long run of K steps; float32 partial sums then meet by atomics (at the
    price of a zero fill and a cast)."""
    steps = cdiv(k_in, bk)
    splits = 1
    if programs < sms and steps >= 4:
        splits = min(cdiv(2 * sms, programs), steps // 2, 16)
    per_split = cdiv(steps, splits) * bk
    return cdiv(k_in, per_split), per_split


def launch(
    x: torch.Tensor,
    ops: Operands,
    n_out: int,
    k_in: int,
    table: torch.Tensor | None,
    tiles_m: int,
    bm: int,
    gemv: bool,
    splits: int | None = None,
    table_kind: int = 0,
    swiglu: bool = False,
) -> torch.Tensor:
    """Run the kernel over x [M, K] (row-contiguous; [M, 2K] of gate and up with swiglu); table: the grouped
    tile table (table_kind 1) or one slot per row (2), else None (0)."""
    rows = x.shape[0]
    sms = _sm_count(x.device)
    if gemv:
        bn, bk, warps, stages = _gemv_blocks(ops, n_out, k_in, tiles_m, sms)
    else:
        bn, bk, warps, stages = _tile_blocks(ops, bm, n_out, k_in, tiles_m)
    tiles_n = cdiv(n_out, bn)
    if splits is None:
        splits, per_split = _split_k(tiles_m * tiles_n, k_in, bk, sms)
    else:  # tests force a split
        per_split = cdiv(cdiv(k_in, bk), splits) * bk
        splits = cdiv(k_in, per_split)
    atomic = splits > 1
    out = (torch.zeros if atomic else torch.empty)(
        rows, n_out, device=x.device, dtype=torch.float32 if atomic else x.dtype
    )
    if rows == 0 or tiles_m == 0:
        return out.to(x.dtype)
    dot_dtype = _dot_dtype(x)
    tensors = (x, ops.w, ops.s, ops.r, out, table if table is not None else x)
    scalars = (
        rows,
        n_out,
        k_in,
        per_split // bk,
        x.stride(0),
        out.stride(0),
        *ops.w_strides,
        *ops.s_strides,
        *ops.r_strides,
        *ops.block,
    )
    constexprs = (
        ops.fmt,
        table_kind,
        swiglu,
        1 if gemv else bm,
        bn,
        bk,
        atomic,
        dot_dtype,
        "ieee" if dot_dtype == tl.float32 else "tf32",
        ops.fmt in (F_NVFP4, F_FP8),
        ops.divide,
        *_scale_columns(ops, bk),
        k_in % bk == 0,
    )
    _run((tiles_m, tiles_n, splits), tensors, scalars, constexprs, warps, stages)
    return out if out.dtype == x.dtype else out.to(x.dtype)


def _scale_columns(ops: Operands, bk: int) -> tuple[int, int]:
    """(SCALE_COLS, SCALE_GROUPS): FP8 block columns of a power-of-two width, and how many a BK tile touches;
    (0, 1) for any other layout (one scale load per element)."""
    cols = ops.block[1]
    if ops.fmt != F_FP8_BLOCK or cols & (cols - 1):
        return 0, 1
    return cols, max(1, bk // cols)


_CONSTEXPR_NAMES = (
    "FORMAT",
    "TABLE",
    "SWIGLU",
    "BM",
    "BN",
    "BK",
    "ATOMIC",
    "DOT_DTYPE",
    "PRECISION",
    "ROW_SCALE",
    "DIVIDE",
    "SCALE_COLS",
    "SCALE_GROUPS",
    "EVEN_K",
)
_SCALAR_NAMES = (
    "M",
    "N",
    "K",
    "split_steps",
    "stride_xm",
    "stride_om",
    "stride_w_slot",
    "stride_wn",
    "stride_s_slot",
    "stride_sn",
    "stride_sk",
    "stride_r_slot",
    "stride_rn",
    "block_rows",
    "block_cols",
)
assert tuple(linear_kernel.arg_names) == (
    "x_ptr",
    "w_ptr",
    "s_ptr",
    "r_ptr",
    "out_ptr",
    "table_ptr",
    *_SCALAR_NAMES,
    *_CONSTEXPR_NAMES,
)
_SPECIALISED = tuple(i for i, name in enumerate(_SCALAR_NAMES) if name not in NOT_SPECIALISED)
_COMPILED: dict[tuple, object] = {}  # our own specialisation key -> Triton's compiled kernel
_fast_launch = True


def _run(grid, tensors, scalars, constexprs, warps, stages) -> None:
    """Launch linear_kernel. Triton's own launch path spends tens of microseconds of host time binding and
    specialising 33 arguments; on CUDA the compiled kernel is kept under a key of everything Triton specialises
    on (constexprs, tensor dtypes and 16-byte alignment, the specialised integers' == 1 and multiple-of-16,
    all integers within int32) and launched directly. Any other case takes Triton's path."""
    global _fast_launch
    device = tensors[0].device
    key = None
    if (
        device.type == "cuda"
        and _fast_launch
        and all(-(1 << 31) <= v < (1 << 31) for v in scalars)
        and device.index == torch.cuda.current_device()
    ):
        key = (
            device.index,
            constexprs,
            warps,
            stages,
            tuple((t.dtype, t.data_ptr() % 16 == 0) for t in tensors),
            tuple((scalars[i] == 1, scalars[i] % 16 == 0) for i in _SPECIALISED),
        )
        compiled = _COMPILED.get(key)
        if compiled is not None:
            try:
                compiled[grid](*tensors, *scalars, *constexprs)
                return
            except TypeError:  # a Triton whose launcher takes other arguments: its own path from now on
                _fast_launch = False
                key = None
    compiled = linear_kernel[grid](
        *tensors, *scalars, **dict(zip(_CONSTEXPR_NAMES, constexprs)), num_warps=warps, num_stages=stages
    )
    if key is not None and compiled is not None and hasattr(compiled, "function"):
        _COMPILED[key] = compiled
