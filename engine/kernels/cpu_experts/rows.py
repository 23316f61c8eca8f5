"""Row kernels: a block of one matrix's output rows for some tokens, read from a record in its format."""

from __future__ import annotations

import numba
import numpy as np

from engine.checkpoint.formats import NVFP4_GROUP
from engine.kernels.cpu_experts.bf16_dots import (
    BF16_ROWS,
    BF16_TILE_ROWS,
    BF16_TOKENS,
    _bf16_row_pair,
    _bf16_row_tokens,
    _bf16_rows_one,
    _bf16_rows_pair,
    _bf16_rows_tokens,
    _nvfp4_dot_bf16,
    _nvfp4_dots_bf16_rows,
)
from engine.kernels.cpu_experts.llvm import (
    _bf16,
    _bits_of,
    _e2m1_high,
    _e2m1_low,
    _e4m3,
    _e5m2,
    _f16,
    _float_bits,
    _signed_byte,
)
from engine.kernels.cpu_experts.meta import (
    M_BLOCK_COLS,
    M_BLOCK_ROWS,
    M_FORMAT,
    M_GLOBAL,
    M_GLOBAL_COUNT,
    M_GLOBAL_DTYPE,
    M_IN,
    M_SCALE,
    M_SCALE_COLS,
    M_SCALE_COUNT,
    M_SCALE_DTYPE,
    M_WEIGHT,
    M_WEIGHT_DTYPE,
)

# 'reassoc' lets LLVM vectorise float sums (the order of additions changes, float32 rounding only);
# 'contract' lets it use FMA. No flag that changes NaN, infinity or signed-zero results.
FAST = {"reassoc", "contract"}
TILE = 4  # rows (and tokens) multiplied together when an expert has several tokens; 4 x 4 sums fit in registers


@numba.njit(nogil=True, cache=True)
def _put(result, totals, r, q, tokens):
    """result[q + u, r + i] = totals[i * tokens + u]: a dots intrinsic's tuple put in place."""
    for k in range(len(totals)):
        result[q + k % tokens, r + k // tokens] = totals[k]


@numba.njit(nogil=True, cache=True)
def _nvfp4_tokens_bf16(codes_at, scales_at, inputs16, picks, octets, first, last, result):
    """result[q, r] before the global scales, for rows first..last-1 and several tokens inputs16[picks[q]]:
    BF16_TILE_ROWS rows (then one) by BF16_TOKENS tokens (then two, then one) a call. Tokens outside rows: a
    row block's codes (32 KiB of gate_up's rows on the development machine) are read again from L2 for each
    group of tokens rather than every token's inputs for each group of rows."""
    count, width, blocks = picks.shape[0], 64 * octets, 8 * octets
    addresses = np.empty(count, np.int64)
    for q in range(count):
        addresses[q] = inputs16[picks[q]].ctypes.data
    listed = np.int64(addresses.ctypes.data)
    q = 0
    while q < count:
        tokens = BF16_TOKENS if count - q >= BF16_TOKENS else 2 if count - q >= 2 else 1
        at = listed + 8 * q
        r = first
        while r < last:
            several = last - r >= BF16_TILE_ROWS
            codes, scales = codes_at + r * width, scales_at + r * blocks
            if tokens == BF16_TOKENS:
                if several:
                    _put(result, _bf16_rows_tokens(codes, scales, at, octets), r, q, tokens)
                else:
                    _put(result, _bf16_row_tokens(codes, scales, at, octets), r, q, tokens)
            elif tokens == 2:
                if several:
                    _put(result, _bf16_rows_pair(codes, scales, at, octets), r, q, tokens)
                else:
                    _put(result, _bf16_row_pair(codes, scales, at, octets), r, q, tokens)
            elif several:
                _put(result, _bf16_rows_one(codes, scales, addresses[q], octets), r, q, tokens)
            else:
                _put(result, _nvfp4_dot_bf16(codes, scales, addresses[q], octets), r, q, tokens)
            r += BF16_TILE_ROWS if several else 1
        q += tokens


@numba.njit(nogil=True, cache=True)
def _bf16_bits(value):
    """float32 to bf16 bits, rounded to nearest even (finite values)."""
    b = np.uint32(_bits_of(value))
    return np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@numba.njit(nogil=True, cache=True)
def _lay_out_bf16(source, target):
    """An input row as bf16 bits in the bf16 NVFP4 dot's order: per 128 inputs, inputs 4j (j = 0..31), then
    4j + 1, 4j + 2 and 4j + 3. Rows of other lengths are left as they are: their matrices take the float32
    path."""
    if source.shape[0] % 128:
        return
    for base in range(0, source.shape[0], 128):
        for g in range(4):
            for j in range(32):
                target[base + 32 * g + j] = _bf16_bits(source[base + 4 * j + g])


@numba.njit(nogil=True, cache=True)
def _scalar(record, offset, index, dtype):
    """Element `index` of a float tensor at byte `offset` of a record, whatever its dtype, as float32."""
    if dtype == 0:
        at = offset + 4 * index
        bits = (
            np.uint32(record[at])
            | (np.uint32(record[at + 1]) << np.uint32(8))
            | (np.uint32(record[at + 2]) << np.uint32(16))
            | (np.uint32(record[at + 3]) << np.uint32(24))
        )
        return _float_bits(np.uint32(bits))
    if dtype == 1 or dtype == 2:
        at = offset + 2 * index
        half = np.uint16(np.uint16(record[at]) | (np.uint16(record[at + 1]) << np.uint16(8)))
        return _bf16(half) if dtype == 1 else _f16(half)
    if dtype == 3:
        return _e4m3(record[offset + index])
    return _e5m2(record[offset + index])


@numba.njit(nogil=True, cache=True)
def _global_scale(record, meta, row):
    """The NVFP4 factor of a row, applied by multiplying (ModelOpt) or dividing (compressed-tensors)."""
    return _scalar(record, meta[M_GLOBAL], row if meta[M_GLOBAL_COUNT] > 1 else 0, meta[M_GLOBAL_DTYPE])


@numba.njit(nogil=True, cache=True)
def _decode_e2m1_row(codes, low, high):
    for j in range(codes.shape[0]):  # a loop over bytes alone, so LLVM decodes 64 codes per vector
        low[j] = _e2m1_low(codes[j])
        high[j] = _e2m1_high(codes[j])


@numba.njit(nogil=True, cache=True, fastmath=FAST)
def _nvfp4_one_token(low_words, high_words, scales, x, blocks):
    """2 * (row . x) from a row's decoded codes, one block of 16 inputs per vector lane (x laid out to match)."""
    total = np.float32(0)
    for b in range(blocks):
        l0, l1, h0, h1 = low_words[2 * b], low_words[2 * b + 1], high_words[2 * b], high_words[2 * b + 1]
        block = np.float32(0)
        for i in range(4):
            block += (
                _signed_byte(l0, i) * x[(2 * i) * blocks + b]
                + _signed_byte(h0, i) * x[(2 * i + 1) * blocks + b]
                + _signed_byte(l1, i) * x[(2 * i + 8) * blocks + b]
                + _signed_byte(h1, i) * x[(2 * i + 9) * blocks + b]
            )
        total += block * _e4m3(scales[b])
    return total


@numba.njit(nogil=True, cache=True, fastmath=FAST)
def _nvfp4_weights(low_words, high_words, scales, block_scales, weights, blocks):
    """A row's float32 weights, laid out block-lane like the inputs."""
    for b in range(blocks):
        block_scales[b] = _e4m3(scales[b]) * np.float32(0.5)
    for i in range(4):  # both words of each pair read in one loop: LLVM shuffles them apart rather than gathering
        for b in range(blocks):
            l0, l1, h0, h1 = low_words[2 * b], low_words[2 * b + 1], high_words[2 * b], high_words[2 * b + 1]
            scale = block_scales[b]
            weights[(2 * i) * blocks + b] = _signed_byte(l0, i) * scale
            weights[(2 * i + 1) * blocks + b] = _signed_byte(h0, i) * scale
            weights[(2 * i + 8) * blocks + b] = _signed_byte(l1, i) * scale
            weights[(2 * i + 9) * blocks + b] = _signed_byte(h1, i) * scale


@numba.njit(nogil=True, cache=True)
def _nvfp4_rows(record, meta, first, last, inputs, inputs16, picks, result, bf16):
    """result[q, r] for rows first..last-1 and inputs[picks[q]] (laid out block-lane: x[16 b + k] at
    k*blocks + b); with `bf16`, rows of whole octets of blocks read inputs16[picks[q]] (bf16 bits,
    _lay_out_bf16's order) instead."""
    in_features = meta[M_IN]
    width, blocks = in_features // 2, in_features // NVFP4_GROUP
    divide = meta[M_FORMAT] == 1
    if bf16 and blocks % 8 == 0:
        record_at = np.int64(record.ctypes.data)
        codes_at, scales_at = record_at + meta[M_WEIGHT], record_at + meta[M_SCALE]
        octets = np.int64(blocks // 8)
        if picks.shape[0] == 1:
            x_at = np.int64(inputs16[picks[0]].ctypes.data)
            whole = last - (last - first) % BF16_ROWS
            for r in range(first, whole, BF16_ROWS):
                totals = _nvfp4_dots_bf16_rows(codes_at + r * width, scales_at + r * blocks, x_at, octets)
                for i in range(BF16_ROWS):
                    result[0, r + i] = totals[i]
            for r in range(whole, last):
                result[0, r] = _nvfp4_dot_bf16(codes_at + r * width, scales_at + r * blocks, x_at, octets)[0]
        else:
            _nvfp4_tokens_bf16(codes_at, scales_at, inputs16, picks, octets, first, last, result)
        # the global factors without a _global_scale call a row (5 ns a row on the development Zen 4)
        if meta[M_GLOBAL_COUNT] == 1:
            factors = np.full(last - first, _global_scale(record, meta, 0))
        elif meta[M_GLOBAL_DTYPE] == 0:  # float32 a row: read as an array
            factors = record[meta[M_GLOBAL] + 4 * first : meta[M_GLOBAL] + 4 * last].view(np.float32)
        else:
            factors = np.empty(last - first, np.float32)
            for r in range(first, last):
                factors[r - first] = _global_scale(record, meta, r)
        for r in range(first, last):
            factor = factors[r - first]
            for q in range(picks.shape[0]):
                result[q, r] = result[q, r] / factor if divide else result[q, r] * factor
        return
    low, high = np.empty(width, np.int8), np.empty(width, np.int8)
    low_words, high_words = low.view(np.uint32), high.view(np.uint32)
    if picks.shape[0] == 1:  # one token: weights times inputs as they are decoded
        x = inputs[picks[0]]
        for r in range(first, last):
            _decode_e2m1_row(record[meta[M_WEIGHT] + r * width : meta[M_WEIGHT] + (r + 1) * width], low, high)
            scales = record[meta[M_SCALE] + r * blocks : meta[M_SCALE] + (r + 1) * blocks]
            total = _nvfp4_one_token(low_words, high_words, scales, x, blocks) * np.float32(0.5)
            factor = _global_scale(record, meta, r)
            result[0, r] = total / factor if divide else total * factor
        return
    tile = np.zeros((TILE, in_features), np.float32)
    block_scales = np.empty(blocks, np.float32)
    factors = np.ones(TILE, np.float32)
    for top in range(first, last, TILE):
        for t in range(min(TILE, last - top)):
            r = top + t
            _decode_e2m1_row(record[meta[M_WEIGHT] + r * width : meta[M_WEIGHT] + (r + 1) * width], low, high)
            scales = record[meta[M_SCALE] + r * blocks : meta[M_SCALE] + (r + 1) * blocks]
            _nvfp4_weights(low_words, high_words, scales, block_scales, tile[t], blocks)
            factor = _global_scale(record, meta, r)
            factors[t] = np.float32(1) / factor if divide else factor
        _tile_dots(tile, factors, inputs, picks, result, top, last)


@numba.njit(nogil=True, cache=True, fastmath=FAST)
def _decode_row(raw, dtype, weights):
    if dtype == 0:
        weights[:] = raw.view(np.float32)
    elif dtype == 1:
        halves = raw.view(np.uint16)
        for i in range(weights.shape[0]):
            weights[i] = _bf16(halves[i])
    elif dtype == 2:
        halves = raw.view(np.uint16)
        for i in range(weights.shape[0]):
            weights[i] = _f16(halves[i])
    elif dtype == 3:
        for i in range(weights.shape[0]):
            weights[i] = _e4m3(raw[i])
    else:
        for i in range(weights.shape[0]):
            weights[i] = _e5m2(raw[i])


@numba.njit(nogil=True, cache=True, fastmath=FAST)
def _decoded_rows(record, meta, first, last, inputs, picks, result):
    """result[q, r] for FP8 and dense rows: rows decoded to float32 a tile at a time, then multiplied."""
    fmt, in_features, dtype = meta[M_FORMAT], meta[M_IN], meta[M_WEIGHT_DTYPE]
    row_bytes = in_features * (1 if dtype >= 3 else 4 if dtype == 0 else 2)
    tile = np.zeros((TILE, in_features), np.float32)
    factors = np.ones(TILE, np.float32)
    for top in range(first, last, TILE):
        for t in range(min(TILE, last - top)):
            r = top + t
            start = meta[M_WEIGHT] + r * row_bytes
            weights = tile[t]
            _decode_row(record[start : start + row_bytes], dtype, weights)
            if fmt == 2:
                factors[t] = _scalar(record, meta[M_SCALE], r if meta[M_SCALE_COUNT] > 1 else 0, meta[M_SCALE_DTYPE])
            elif fmt == 3:
                cols = meta[M_BLOCK_COLS]
                row_of_scales = (r // meta[M_BLOCK_ROWS]) * meta[M_SCALE_COLS]
                for c in range(meta[M_SCALE_COLS]):
                    scale = _scalar(record, meta[M_SCALE], row_of_scales + c, meta[M_SCALE_DTYPE])
                    for i in range(c * cols, min((c + 1) * cols, in_features)):
                        weights[i] *= scale
        _tile_dots(tile, factors, inputs, picks, result, top, last)


@numba.njit(nogil=True, cache=True, fastmath=FAST)
def _tile_dots(tile, factors, inputs, picks, result, top, last):
    """result[q, top + t] = factors[t] * (tile[t] . inputs[picks[q]]) for the tile's rows below `last`:
    four rows by four tokens at a time, so each loaded weight and input serves four products."""
    rows = min(TILE, last - top)
    w0, w1, w2, w3 = tile[0], tile[1], tile[2], tile[3]
    count = picks.shape[0]
    sums = np.zeros((TILE, TILE), np.float32)
    for q0 in range(0, count, TILE):
        if count - q0 >= TILE:
            x0, x1, x2, x3 = inputs[picks[q0]], inputs[picks[q0 + 1]], inputs[picks[q0 + 2]], inputs[picks[q0 + 3]]
            s00 = s01 = s02 = s03 = s10 = s11 = s12 = s13 = np.float32(0)
            s20 = s21 = s22 = s23 = s30 = s31 = s32 = s33 = np.float32(0)
            for i in range(w0.shape[0]):
                a, b, c, d = w0[i], w1[i], w2[i], w3[i]
                e, f, g, h = x0[i], x1[i], x2[i], x3[i]
                s00 += a * e
                s01 += a * f
                s02 += a * g
                s03 += a * h
                s10 += b * e
                s11 += b * f
                s12 += b * g
                s13 += b * h
                s20 += c * e
                s21 += c * f
                s22 += c * g
                s23 += c * h
                s30 += d * e
                s31 += d * f
                s32 += d * g
                s33 += d * h
            sums[0, 0], sums[0, 1], sums[0, 2], sums[0, 3] = s00, s01, s02, s03
            sums[1, 0], sums[1, 1], sums[1, 2], sums[1, 3] = s10, s11, s12, s13
            sums[2, 0], sums[2, 1], sums[2, 2], sums[2, 3] = s20, s21, s22, s23
            sums[3, 0], sums[3, 1], sums[3, 2], sums[3, 3] = s30, s31, s32, s33
            tokens = TILE
        else:
            tokens = count - q0
            for u in range(tokens):
                x = inputs[picks[q0 + u]]
                s0 = s1 = s2 = s3 = np.float32(0)
                for i in range(w0.shape[0]):
                    e = x[i]
                    s0 += w0[i] * e
                    s1 += w1[i] * e
                    s2 += w2[i] * e
                    s3 += w3[i] * e
                sums[0, u], sums[1, u], sums[2, u], sums[3, u] = s0, s1, s2, s3
        for t in range(rows):
            for u in range(tokens):
                result[q0 + u, top + t] = sums[t, u] * factors[t]


@numba.njit(nogil=True, cache=True)
def _rows(record, meta, first, last, inputs, inputs16, picks, result, bf16):
    if meta[M_FORMAT] <= 1:
        _nvfp4_rows(record, meta, first, last, inputs, inputs16, picks, result, bf16)
    else:
        _decoded_rows(record, meta, first, last, inputs, picks, result)


@numba.njit(nogil=True, cache=True)
def _lay_out(source, target, meta):
    """An input row in the order the matrix's kernel reads it: block-lane for NVFP4, as it is otherwise."""
    n = source.shape[0]
    if meta[M_FORMAT] <= 1:
        blocks = n // NVFP4_GROUP
        for k in range(NVFP4_GROUP):
            for b in range(blocks):
                target[k * blocks + b] = source[NVFP4_GROUP * b + k]
    else:
        target[:] = source


@numba.njit(nogil=True, cache=True, fastmath=FAST)
def _swiglu_laid_out(hidden_row, act, target, target16, down, bf16):
    """SwiGLU of one expert's gate_up output (gate, then up), laid out for its down matrix (and as bf16)."""
    intermediate = act.shape[0]
    for i in range(intermediate):
        gate = hidden_row[i]
        act[i] = gate / (np.float32(1) + np.exp(-gate)) * hidden_row[intermediate + i]
    _lay_out(act, target, down)
    if bf16:
        _lay_out_bf16(act, target16)
