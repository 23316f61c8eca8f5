"""Weight-only quantised linears in Triton: y = x @ W^T with W decoded in registers, for CUDA.

Formats (engine/checkpoint/formats.py): NVFP4 (ModelOpt, global scale that multiplies, scalar or one per row),
NVFP4_CT (compressed-tensors, global scale that divides), FP8_TENSOR (one scale, or one per row) and FP8_BLOCK
(a float32 scale per block); `grouped_linear` takes stacked NVFP4, FP8_TENSOR and DENSE weights. The 16-bit weight
never exists in memory: each program loads packed bytes and scales and decodes them with integer arithmetic
into float16 bit patterns (no fp8 or fp4 instructions, nothing Hopper-only), so the same code runs on Turing
(sm_75: fp16 dots), Ampere (bf16 dots) and newer.

One kernel, two paths, grid (row tiles, column tiles, K splits):
- GEMV (BM == 1, one input row per program; decode and one-row expert groups): no tl.dot. A [BN, BK] weight tile
  times the row accumulates elementwise in registers over the K steps and is reduced once at the end. BN is the
  most rows per program that still gives about eight programs per multiprocessor, BK makes a ~4 KB tile.
- tiles (BM 16..128): tl.dot on [BM, BK] x [BK, BN], the weight tile decoded (and block-scaled) to the dot's
  dtype; NVFP4's two nibbles of a byte are joined into one [BN, BK] tile so x loads stay contiguous.
When the (row, column) tiles leave multiprocessors idle and K is long, K is split over the third grid axis and
float32 partial sums meet by atomic adds (a zero-filled float32 output, cast afterwards).

Decoding: an E2M1 code's three magnitude bits shifted into a float16's exponent/mantissa give the value times
2^-14 (code 1, the subnormal 0.5, lands on a float16 subnormal, which the hardware keeps exactly); an E4M3 byte's
seven bits likewise give the value times 2^-8. The powers of two are folded into the final scaling.

Launching: Triton's generic launch costs tens of microseconds of host time for this kernel's 33 arguments; _run
keeps each compiled variant under its own key and launches it directly (see there).

Under TRITON_INTERPRET=1 the same kernels run on the CPU, which is how CI checks them (there bf16 inputs use
float32 dots: the interpreter has no bf16 dot).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.checkpoint.formats import DENSE, FP8_BLOCK, FP8_TENSOR, NVFP4, NVFP4_CT, NVFP4_GROUP, StoredWeight
from engine.kernels import reference
from engine.kernels.groups import ExpertGroups

# kernel-side format codes
_F_DENSE, _F_FP8, _F_FP8_BLOCK, _F_NVFP4 = 0, 1, 2, 3
_E2M1_UNIT = tl.constexpr(16384.0)  # 2^14: decoded E2M1 bits are the value / 2^14
_E4M3_UNIT = tl.constexpr(256.0)  # 2^8: decoded E4M3 bits are the value / 2^8
_TILE_BYTES = 4096  # weight bytes a GEMV program loads per K step


@triton.jit
def _e2m1_bits(code):
    """4-bit E2M1 code (int32) -> float32 value / 2^14 (sign bit 3, exponent bits 2-1, mantissa bit 0)."""
    bits = ((code & 7) << 9) | ((code & 8) << 12)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e4m3_bits16(byte):
    """float8_e4m3fn bits (int32) -> float16 value / 2^8, exact (subnormals included)."""
    bits = ((byte & 127) << 7) | ((byte & 128) << 8)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit
def _block_scales(
    s_ptr,
    cols,
    col_ok,
    kk,
    k0,
    K,
    block_rows,
    block_cols,
    stride_sn,
    stride_sk,
    in_ok,
    BN: tl.constexpr,
    BK: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    SCALE_GROUPS: tl.constexpr,
):
    """FP8_BLOCK: the scale (stored bf16 or float32, computed in float32) of each element of the [BN, BK] weight tile at inputs kk = k0 + 0..BK-1.
    SCALE_COLS > 0 (block columns a power of two): load the SCALE_GROUPS block columns the tile touches once per
    row and broadcast them; else load one scale per element."""
    if SCALE_COLS > 0:
        column = k0 // SCALE_COLS + tl.arange(0, SCALE_GROUPS)
        scale = tl.load(
            s_ptr + (cols // block_rows)[:, None] * stride_sn + column[None, :] * stride_sk,
            mask=col_ok[:, None] & (column * SCALE_COLS < K)[None, :],
            other=0.0,
        ).to(tl.float32)
        return tl.reshape(tl.broadcast_to(scale[:, :, None], (BN, SCALE_GROUPS, BK // SCALE_GROUPS)), (BN, BK))
    else:
        return tl.load(
            s_ptr + (cols // block_rows)[:, None] * stride_sn + (kk // block_cols)[None, :] * stride_sk,
            mask=col_ok[:, None] & in_ok[None, :],
            other=0.0,
        ).to(tl.float32)


@triton.jit
def _below(index, limit, ALWAYS: tl.constexpr):
    """index < limit, or a constant all-true mask when the host knows it (K a multiple of BK): a constant mask
    lets loads along K stay 16-byte vectors."""
    if ALWAYS:
        return tl.full(index.shape, 1, tl.int1)
    else:
        return index < limit


# Arguments Triton need not specialise (on == 1 or multiples of 16): nothing vectorises along them, and each
# specialised argument costs host time at every launch.
_NOT_SPECIALISED = ("M", "N", "split_steps", "stride_rn", "stride_sk", "stride_r_slot", "block_rows", "block_cols")


@triton.jit
def _gemv_input(x_row, offsets, mask, K, SWIGLU: tl.constexpr):
    """Inputs of a GEMV row in float32; with SWIGLU the row holds [gate | up] (K each) and the input is
    silu(gate) * up, rounded once to the row's dtype as if it had been stored."""
    if SWIGLU:
        gate = tl.load(x_row + offsets, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_row + K + offsets, mask=mask, other=0.0).to(tl.float32)
        return (gate / (1.0 + tl.exp(-gate)) * up).to(x_row.dtype.element_ty).to(tl.float32)
    return tl.load(x_row + offsets, mask=mask, other=0.0).to(tl.float32)


@triton.jit(do_not_specialize=_NOT_SPECIALISED)
def _linear_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    r_ptr,
    out_ptr,
    table_ptr,
    M,
    N,
    K,
    split_steps,
    stride_xm,
    stride_om,
    stride_w_slot,
    stride_wn,
    stride_s_slot,
    stride_sn,
    stride_sk,
    stride_r_slot,
    stride_rn,
    block_rows,
    block_cols,
    FORMAT: tl.constexpr,
    TABLE: tl.constexpr,
    SWIGLU: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    ATOMIC: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    DIVIDE: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    SCALE_GROUPS: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """out[rows, cols] (+)= x[rows, k-range] @ W[cols, k-range]^T for one (row tile, column tile, K split).

    TABLE 1 (grouped): program_id(0) indexes a table of (slot, first row, group end row); the weight tensors are
    stacked [S, ...] with slot strides stride_*_slot (any value: slots are records in a byte pool). TABLE 2
    (slots): the table holds one slot per row, and program_id(0) is the row. TABLE 0: slot 0 and rows
    program_id(0) * BM + ... below M.
    SWIGLU (GEMV only): x rows hold [gate | up] and the input is silu(gate) * up (_gemv_input).
    w: codes (uint8 bytes: packed E2M1 pairs, E4M3, or a dense float); s: NVFP4 block scales [N, K/16] (E4M3
    bytes) or FP8_BLOCK scale_inv [ceil(N/block_rows), ceil(K/block_cols)] bf16 or float32; r: one scale per output
    row (stride_rn 0 for a scalar) that multiplies, or divides with DIVIDE.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    if TABLE != 0:
        if TABLE == 1:
            slot = tl.load(table_ptr + 3 * pid_m).to(tl.int64)
            row_begin = tl.load(table_ptr + 3 * pid_m + 1)
            row_end = tl.load(table_ptr + 3 * pid_m + 2)
        else:
            slot = tl.load(table_ptr + pid_m).to(tl.int64)
            row_begin = pid_m
            row_end = pid_m + 1
        w_ptr += slot * stride_w_slot
        s_ptr += slot * stride_s_slot
        r_ptr += slot * stride_r_slot
    else:
        row_begin = pid_m * BM
        row_end = M
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < N
    k_lo = pid_k * split_steps * BK  # a multiple of BK the compiler can see: loads along K stay vectors
    k_hi = tl.minimum(K, k_lo + split_steps * BK)

    if BM == 1:
        # ---------------------------------------------------------------- GEMV: broadcast-multiply and tl.sum
        # Products accumulate elementwise across K steps; the one cross-thread reduction is at the end.
        x_row = x_ptr + row_begin.to(tl.int64) * stride_xm
        if FORMAT == 3:  # NVFP4: packed bytes [BN, BK/2]; inputs (2j, 2j+1) of byte j loaded as pairs
            half = tl.arange(0, BK // 2)
            groups = tl.arange(0, BK // 16)
            acc2 = tl.zeros((BN, BK // 2), dtype=tl.float32)
            for k0 in range(k_lo, k_hi, BK):
                byte = k0 // 2 + half
                byte_ok = _below(2 * byte, K, EVEN_K)
                packed = tl.load(
                    w_ptr + cols[:, None] * stride_wn + byte[None, :], mask=col_ok[:, None] & byte_ok[None, :], other=0
                ).to(tl.int32)
                pair = _gemv_input(x_row, 2 * byte[:, None] + tl.arange(0, 2)[None, :], byte_ok[:, None], K, SWIGLU)
                x_even, x_odd = tl.split(pair)
                group = k0 // 16 + groups
                group_ok = _below(16 * group, K, EVEN_K)
                scale_bits = tl.load(
                    s_ptr + cols[:, None] * stride_sn + group[None, :],
                    mask=col_ok[:, None] & group_ok[None, :],
                    other=0,
                ).to(tl.int32)
                scale = _e4m3_bits16(scale_bits).to(tl.float32)
                scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BN, BK // 16, 8)), (BN, BK // 2))
                acc2 += (_e2m1_bits(packed & 15) * x_even[None, :] + _e2m1_bits(packed >> 4) * x_odd[None, :]) * scale
            acc = tl.sum(acc2, axis=1) * (_E2M1_UNIT * _E4M3_UNIT)
        else:
            ks = tl.arange(0, BK)
            acc2 = tl.zeros((BN, BK), dtype=tl.float32)
            for k0 in range(k_lo, k_hi, BK):
                kk = k0 + ks
                in_ok = _below(kk, K, EVEN_K)
                xv = _gemv_input(x_row, kk, in_ok, K, SWIGLU)
                raw = tl.load(
                    w_ptr + cols[:, None] * stride_wn + kk[None, :], mask=col_ok[:, None] & in_ok[None, :], other=0
                )
                if FORMAT == 0:
                    w = raw.to(tl.float32)
                else:
                    w = _e4m3_bits16(raw.to(tl.int32)).to(tl.float32)
                if FORMAT == 2:
                    w = w * _block_scales(
                        s_ptr,
                        cols,
                        col_ok,
                        kk,
                        k0,
                        K,
                        block_rows,
                        block_cols,
                        stride_sn,
                        stride_sk,
                        in_ok,
                        BN,
                        BK,
                        SCALE_COLS,
                        SCALE_GROUPS,
                    )
                acc2 += w * xv[None, :]
            acc = tl.sum(acc2, axis=1)
            if FORMAT != 0:
                acc = acc * _E4M3_UNIT
        if ROW_SCALE:
            row_scale = tl.load(r_ptr + cols * stride_rn, mask=col_ok, other=1.0).to(tl.float32)
            acc = acc / row_scale if DIVIDE else acc * row_scale
        out = out_ptr + row_begin.to(tl.int64) * stride_om + cols
        if ATOMIC:
            tl.atomic_add(out, acc, mask=col_ok, sem="relaxed")
        else:
            tl.store(out, acc, mask=col_ok)
    else:
        # ---------------------------------------------------------------- tiles: tl.dot
        tl.static_assert(not SWIGLU, "SWIGLU inputs take the GEMV path")
        rows = row_begin + tl.arange(0, BM)
        row_ok = rows < row_end
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if FORMAT == 3:  # NVFP4: low and high nibbles joined into one [BN, BK] tile, one scale per 16 inputs
            groups = tl.arange(0, BK // 16)
            half = tl.arange(0, BK // 2)
            ks = tl.arange(0, BK)
            for k0 in range(k_lo, k_hi, BK):
                byte = k0 // 2 + half
                packed = tl.load(
                    w_ptr + cols[:, None] * stride_wn + byte[None, :],
                    mask=col_ok[:, None] & _below(2 * byte, K, EVEN_K)[None, :],
                    other=0,
                ).to(tl.int32)
                codes = tl.reshape(tl.join(_e2m1_bits(packed & 15), _e2m1_bits(packed >> 4)), (BN, BK))
                group = k0 // 16 + groups
                group_ok = _below(16 * group, K, EVEN_K)
                scale_bits = tl.load(
                    s_ptr + cols[:, None] * stride_sn + group[None, :],
                    mask=col_ok[:, None] & group_ok[None, :],
                    other=0,
                ).to(tl.int32)
                scale = _e4m3_bits16(scale_bits).to(tl.float32) * (_E2M1_UNIT * _E4M3_UNIT)
                scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BN, BK // 16, 16)), (BN, BK))
                w = (codes * scale).to(DOT_DTYPE)
                kk = k0 + ks
                xv = tl.load(x_rows + kk[None, :], mask=row_ok[:, None] & _below(kk, K, EVEN_K)[None, :], other=0.0)
                acc += tl.dot(xv.to(DOT_DTYPE), tl.trans(w), input_precision=PRECISION)
        else:
            ks = tl.arange(0, BK)
            for k0 in range(k_lo, k_hi, BK):
                kk = k0 + ks
                in_ok = _below(kk, K, EVEN_K)
                raw = tl.load(
                    w_ptr + cols[:, None] * stride_wn + kk[None, :], mask=col_ok[:, None] & in_ok[None, :], other=0
                )
                xv = tl.load(x_rows + kk[None, :], mask=row_ok[:, None] & in_ok[None, :], other=0.0).to(DOT_DTYPE)
                if FORMAT == 0:
                    acc += tl.dot(xv, tl.trans(raw.to(DOT_DTYPE)), input_precision=PRECISION)
                elif FORMAT == 1:
                    w = _e4m3_bits16(raw.to(tl.int32)).to(tl.float32).to(DOT_DTYPE)
                    acc += tl.dot(xv, tl.trans(w), input_precision=PRECISION)
                else:  # scaled before the dot (as the reference decodes to the input dtype): acc stays the dot's
                    scale = _block_scales(
                        s_ptr,
                        cols,
                        col_ok,
                        kk,
                        k0,
                        K,
                        block_rows,
                        block_cols,
                        stride_sn,
                        stride_sk,
                        in_ok,
                        BN,
                        BK,
                        SCALE_COLS,
                        SCALE_GROUPS,
                    )
                    w = (_e4m3_bits16(raw.to(tl.int32)).to(tl.float32) * scale).to(DOT_DTYPE)
                    acc += tl.dot(xv, tl.trans(w), input_precision=PRECISION)
            if FORMAT != 0:
                acc = acc * _E4M3_UNIT
        if ROW_SCALE:
            row_scale = tl.load(r_ptr + cols * stride_rn, mask=col_ok, other=1.0).to(tl.float32)
            acc = acc / row_scale[None, :] if DIVIDE else acc * row_scale[None, :]
        out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        if ATOMIC:
            tl.atomic_add(out, acc, mask=mask, sem="relaxed")
        else:
            tl.store(out, acc, mask=mask)


# -------------------------------------------------------------------------------------------------- host side


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
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


def _pow2_at_most(value: int) -> int:
    return 1 << (max(1, value).bit_length() - 1)


class _Operands:
    """The kernel's view of one weight: format code, tensors (bytes for fp8), strides, per-row scale."""

    def __init__(self, fmt, w, s, r, w_strides, s_strides, r_strides, divide, block):
        self.fmt, self.w, self.s, self.r = fmt, w, s, r
        self.w_strides, self.s_strides, self.r_strides = w_strides, s_strides, r_strides
        self.divide, self.block = divide, block

    @property
    def input_bytes(self) -> float:
        """Weight bytes per input element (4-bit codes: half a byte)."""
        return 0.5 if self.fmt == _F_NVFP4 else float(self.w.element_size())


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


def _operands(weight: StoredWeight, stacked: bool) -> _Operands | None:
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
        if k_in % NVFP4_GROUP or not (inner_ok(codes) and inner_ok(scales)):
            return None
        r, r_slot, r_row = _row_scale(
            tensors["weight_scale_2" if fmt == NVFP4 else "weight_global_scale"], n_out, stacked
        )
        return _Operands(
            _F_NVFP4,
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
        return _Operands(_F_FP8, w.view(torch.uint8), w, r, strides(w), (0, 0, 0), (r_slot, r_row), False, (1, 1))
    if fmt == FP8_BLOCK:
        w, s = tensors["weight"], tensors["weight_scale_inv"]
        if w.dtype != torch.float8_e4m3fn or not inner_ok(w) or s.dim() != dims:
            return None
        return _Operands(
            _F_FP8_BLOCK,
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
        return _Operands(_F_DENSE, w, w, w, strides(w), (0, 0, 0), (0, 0), False, (1, 1))
    return None


def _gemv_blocks(ops: _Operands, n_out: int, k_in: int, programs_m: int, sms: int) -> tuple[int, int, int, int]:
    """(BN, BK, num_warps, num_stages) of the GEMV path: few enough rows per program that programs_m * N/BN
    gives about eight programs per multiprocessor (at least 2 rows), then inputs for a tile of about
    _TILE_BYTES weight bytes (BK a power of two, no more than K needs)."""
    bn = 64
    while bn > 2 and programs_m * _cdiv(n_out, bn) < 8 * sms:
        bn //= 2
    bn = min(bn, _next_pow2(n_out))
    bk = _pow2_at_most(int(_TILE_BYTES / (bn * ops.input_bytes)))
    bk = max(32, min(bk, _next_pow2(k_in), 2048))
    return bn, bk, 4, 1


def _tile_blocks(ops: _Operands, m_tile: int, n_out: int, k_in: int, tiles_m: int) -> tuple[int, int, int, int]:
    """(BN, BK, num_warps, num_stages) of the tl.dot path for tiles of m_tile rows (measured on an H200)."""
    if m_tile <= 16:  # decode-like: narrow column tiles, long K steps; wider columns once many row tiles exist
        bn, bk = (32 if tiles_m < 16 else 64), 256 if ops.fmt != _F_NVFP4 or tiles_m < 16 else 128
    elif ops.fmt == _F_NVFP4:
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
    steps = _cdiv(k_in, bk)
    splits = 1
    if programs < sms and steps >= 4:
        splits = min(_cdiv(2 * sms, programs), steps // 2, 16)
    per_split = _cdiv(steps, splits) * bk
    return _cdiv(k_in, per_split), per_split


def _launch(
    x: torch.Tensor,
    ops: _Operands,
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
    tiles_n = _cdiv(n_out, bn)
    if splits is None:
        splits, per_split = _split_k(tiles_m * tiles_n, k_in, bk, sms)
    else:  # tests force a split
        per_split = _cdiv(_cdiv(k_in, bk), splits) * bk
        splits = _cdiv(k_in, per_split)
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
        ops.fmt in (_F_NVFP4, _F_FP8),
        ops.divide,
        *_scale_columns(ops, bk),
        k_in % bk == 0,
    )
    _run((tiles_m, tiles_n, splits), tensors, scalars, constexprs, warps, stages)
    return out if out.dtype == x.dtype else out.to(x.dtype)


def _scale_columns(ops: _Operands, bk: int) -> tuple[int, int]:
    """(SCALE_COLS, SCALE_GROUPS): FP8 block columns of a power-of-two width, and how many a BK tile touches;
    (0, 1) for any other layout (one scale load per element)."""
    cols = ops.block[1]
    if ops.fmt != _F_FP8_BLOCK or cols & (cols - 1):
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
assert tuple(_linear_kernel.arg_names) == (
    "x_ptr",
    "w_ptr",
    "s_ptr",
    "r_ptr",
    "out_ptr",
    "table_ptr",
    *_SCALAR_NAMES,
    *_CONSTEXPR_NAMES,
)
_SPECIALISED = tuple(i for i, name in enumerate(_SCALAR_NAMES) if name not in _NOT_SPECIALISED)
_COMPILED: dict[tuple, object] = {}  # our own specialisation key -> Triton's compiled kernel
_fast_launch = True


def _run(grid, tensors, scalars, constexprs, warps, stages) -> None:
    """Launch _linear_kernel. Triton's own launch path spends tens of microseconds of host time binding and
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
    compiled = _linear_kernel[grid](
        *tensors, *scalars, **dict(zip(_CONSTEXPR_NAMES, constexprs)), num_warps=warps, num_stages=stages
    )
    if key is not None and compiled is not None and hasattr(compiled, "function"):
        _COMPILED[key] = compiled


GEMV_MAX_ROWS = 1  # up to this many rows (per group, for grouped) take the GEMV path


def linear(
    x: torch.Tensor,
    weight: StoredWeight,
    *,
    gemv: bool | None = None,
    block_m: int | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """x [..., K] @ W^T for a quantised weight [N, K]; float32 accumulation, output in x's dtype. Formats the
    kernels do not take (dense among them) go to the reference. gemv/block_m/splits force a tiling (tests)."""
    ops = _operands(weight, stacked=False) if len(weight.shape) == 2 and weight.format != DENSE else None
    if ops is None:
        return reference.linear(x, weight)
    n_out, k_in = weight.shape
    flat = x.reshape(-1, k_in)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    rows = flat.shape[0]
    if gemv is None:
        gemv = rows <= GEMV_MAX_ROWS
    if gemv:
        bm, tiles_m = 1, rows
    else:
        bm = block_m or (16 if rows <= 16 else 32 if rows <= 32 else 64 if rows <= 128 else 128)
        tiles_m = _cdiv(rows, bm)
    out = _launch(flat, ops, n_out, k_in, None, tiles_m, bm, gemv, splits)
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


def _stacked_operands(weight: StoredWeight) -> _Operands | None:
    """The grouped kernels' view of a stacked weight [S, N, K]; None for what they leave to the reference."""
    ops = _operands(weight, stacked=True) if len(weight.shape) == 3 else None
    if ops is None or ops.fmt == _F_FP8_BLOCK or weight.format == NVFP4_CT:
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
    return _launch(x, ops, n_out, k_in, table, table.shape[0], bm, bm == 1, splits, table_kind=1)


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
    return _launch(x, ops, n_out, k_in, table, x.shape[0], 1, True, splits, table_kind=2, swiglu=swiglu)
