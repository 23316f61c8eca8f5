"""The Triton kernel of the weight-only quantised linears: y = x @ W^T with W decoded in registers.

The 16-bit weight never exists in memory: each program loads packed bytes and scales and decodes them with integer
arithmetic into float16 bit patterns (no fp8 or fp4 instructions, nothing Hopper-only), so the same code runs on
Turing (sm_75: fp16 dots), Ampere (bf16 dots) and newer. FORMAT picks the decoding: dense, FP8 (one scale, or one
per row), FP8 block (a scale per block) or NVFP4 (E2M1 codes, an E4M3 scale per 16 inputs, a scale per row).

One kernel, two paths, grid (row tiles, column tiles, K splits):
- GEMV (BM == 1, one input row per program; decode and one-row expert groups): no tl.dot. A [BN, BK] weight tile
  times the row accumulates elementwise in registers over the K steps and is reduced once at the end. NVFP4 reads
  its codes as 32-bit words, a 16-input group's two words in one thread, so a group's sum needs no shuffles.
- tiles (BM 16..128): tl.dot on [BM, BK] x [BK, BN], the weight tile decoded (and block-scaled) to the dot's
  dtype; NVFP4's two nibbles of a byte are joined into one [BN, BK] tile so x loads stay contiguous.
With K split over the third grid axis, float32 partial sums meet by atomic adds (ATOMIC).

Decoding: an E2M1 code's three magnitude bits shifted into a float16's exponent/mantissa give the value times
2^-14 (code 1, the subnormal 0.5, lands on a float16 subnormal, which the hardware keeps exactly); an E4M3 byte's
seven bits likewise give the value times 2^-8. The powers of two are folded into the final scaling. The NVFP4
GEMV decodes two codes of a word at once into a pair of bfloat16 bit patterns (_e2m1_pair), each widened to a
float32 by a shift or a mask: about half the instructions a code of decoding byte by byte through float16.
"""

from __future__ import annotations

import triton
import triton.language as tl

# FORMAT's codes
F_DENSE, F_FP8, F_FP8_BLOCK, F_NVFP4 = 0, 1, 2, 3
_E2M1_UNIT = tl.constexpr(16384.0)  # 2^14: decoded E2M1 bits are the value / 2^14
_E4M3_UNIT = tl.constexpr(256.0)  # 2^8: decoded E4M3 bits are the value / 2^8
# The GEMV's E2M1 pairs are the values / 2^126 (_e2m1_pair); its inputs are scaled by 2^64 so that products stay
# normal floats, and the sums by 2^62 afterwards
_X_UNIT = tl.constexpr(2.0**64)
_PAIR_UNIT = tl.constexpr(2.0**62)


@triton.jit
def _e2m1_low(byte):
    """The low E2M1 code of a byte (int32) -> float32 value / 2^14: its sign (bit 3) and magnitude bits (exponent
    bits 2-1, mantissa bit 0) shifted into a float16's sign, exponent and mantissa."""
    bits = ((byte & 7) << 9) | ((byte & 8) << 12)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e2m1_high(byte):
    """The high E2M1 code of a byte (int32) -> float32 value / 2^14."""
    bits = ((byte & 0x70) << 5) | ((byte & 0x80) << 8)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e2m1_pair(word, i: tl.constexpr):
    """Codes i and i + 4 of a 32-bit word of eight E2M1 codes (code j in bits 4j..4j+3) -> the int32 bits of two
    bfloat16 values / 2^126, code i's in the low half: each code's magnitude bits shifted into the lowest two
    exponent bits and the top mantissa bit of a half (bits 6-8), its sign into the half's sign (bit 15). Code 1,
    0.5, is a float32 subnormal once widened, which multiply-adds keep exactly (the kernels never flush them)."""
    if i < 2:
        magnitude = word << (6 - 4 * i)
    else:
        magnitude = word >> (4 * i - 6)
    return (magnitude & 0x01C001C0) | ((word << (12 - 4 * i)) & -0x7FFF8000)


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
NOT_SPECIALISED = ("M", "N", "split_steps", "stride_rn", "stride_sk", "stride_r_slot", "block_rows", "block_cols")


@triton.jit
def _gemv_input(x_row, offsets, mask, K, SWIGLU: tl.constexpr):
    """Inputs of a GEMV row in float32; with SWIGLU the row holds [gate | up] (K each) and the input is
    silu(gate) * up, rounded once to the row's dtype as if it had been stored."""
    if SWIGLU:
        gate = tl.load(x_row + offsets, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_row + K + offsets, mask=mask, other=0.0).to(tl.float32)
        return (gate / (1.0 + tl.exp(-gate)) * up).to(x_row.dtype.element_ty).to(tl.float32)
    return tl.load(x_row + offsets, mask=mask, other=0.0).to(tl.float32)


@triton.jit(do_not_specialize=NOT_SPECIALISED)
def linear_kernel(
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
        if FORMAT == 3:  # NVFP4: a 16-input group is two 32-bit words of eight codes, [BN, BK/16, 2] a step
            words = w_ptr.to(tl.pointer_type(tl.int32))
            group_in_step = tl.arange(0, BK // 16)
            half = tl.arange(0, 2)
            acc2 = tl.zeros((BN, BK // 16), dtype=tl.float32)  # one sum per 16-input group: scaled once
            for k0 in range(k_lo, k_hi, BK):
                group = k0 // 16 + group_in_step
                group_ok = _below(16 * group, K, EVEN_K)
                word = 2 * group[:, None] + half[None, :]
                packed = tl.load(
                    words + cols[:, None, None] * (stride_wn // 4) + word[None, :, :],
                    mask=col_ok[:, None, None] & group_ok[None, :, None],
                    other=0,
                )
                scale_bits = tl.load(
                    s_ptr + cols[:, None] * stride_sn + group[None, :],
                    mask=col_ok[:, None] & group_ok[None, :],
                    other=0,
                ).to(tl.int32)
                sums = tl.zeros((BN, BK // 16, 2), dtype=tl.float32)
                for i in tl.static_range(4):  # codes i and i + 4 of every word as one bfloat16 pair
                    bits = _e2m1_pair(packed, i)
                    low = (bits << 16).to(tl.float32, bitcast=True)
                    high = (bits & -65536).to(tl.float32, bitcast=True)
                    x_low = _gemv_input(x_row, 8 * word + i, group_ok[:, None], K, SWIGLU) * _X_UNIT
                    x_high = _gemv_input(x_row, 8 * word + i + 4, group_ok[:, None], K, SWIGLU) * _X_UNIT
                    sums += low * x_low[None, :, :]  # two fused multiply-adds a pair
                    sums += high * x_high[None, :, :]
                acc2 += tl.sum(sums, axis=2) * _e4m3_bits16(scale_bits).to(tl.float32)
            acc = tl.sum(acc2, axis=1) * (_PAIR_UNIT * _E4M3_UNIT)
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
                codes = tl.reshape(tl.join(_e2m1_low(packed), _e2m1_high(packed)), (BN, BK))
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
