"""LLVM IR helpers and numba intrinsics that decode the small float formats of expert records."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

I8, I32, F32 = ir.IntType(8), ir.IntType(32), ir.FloatType()


def _e2m1_twice(builder, code):
    """IR: 2 * the E2M1 value of a 4-bit code in an i8, as a signed i8 (exact: -12..12)."""

    def c(v):
        return ir.Constant(I8, v)

    magnitude = builder.and_(code, c(7))
    above4 = builder.select(builder.icmp_unsigned(">", magnitude, c(4)), magnitude, c(4))
    above6 = builder.select(builder.icmp_unsigned(">", magnitude, c(6)), magnitude, c(6))
    # 2|v| of codes 0..7 is 0,1,2,3,4,6,8,12: k + max(k-4, 0) + 2 max(k-6, 0)
    twice = builder.add(builder.add(magnitude, builder.sub(above4, c(4))), builder.shl(builder.sub(above6, c(6)), c(1)))
    negative = builder.sub(c(0), builder.lshr(code, c(3)))
    return builder.sub(builder.xor(twice, negative), negative)


@intrinsic
def _e2m1_low(typingctx, byte):
    def codegen(context, builder, signature, args):
        return _e2m1_twice(builder, builder.and_(args[0], ir.Constant(I8, 15)))

    return types.int8(types.uint8), codegen


@intrinsic
def _e2m1_high(typingctx, byte):
    def codegen(context, builder, signature, args):
        return _e2m1_twice(builder, builder.lshr(args[0], ir.Constant(I8, 4)))

    return types.int8(types.uint8), codegen


@intrinsic
def _signed_byte(typingctx, word, index):
    """Byte `index` (0..3, little-endian) of a uint32 as a signed value, in float32."""

    def codegen(context, builder, signature, args):
        shift = builder.sub(ir.Constant(I32, 24), builder.mul(builder.trunc(args[1], I32), ir.Constant(I32, 8)))
        return builder.sitofp(builder.ashr(builder.shl(args[0], shift), ir.Constant(I32, 24)), F32)

    return types.float32(types.uint32, types.int64), codegen


@intrinsic
def _bits_of(typingctx, value):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], I32)

    return types.uint32(types.float32), codegen


@intrinsic
def _float_bits(typingctx, bits):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], F32)

    return types.float32(types.uint32), codegen


def _minifloat(builder, bits, magnitude_mask, shift, bias, subnormal_below, subnormal_scale, special):
    """IR: float32 of a small float in the low bits of an i32: a normal number is its magnitude bits moved to
    float32's place with the exponent rebiased, a subnormal is its mantissa times a power of two; `special`
    ('e4m3': 0x7f is NaN, 'ieee': all-ones exponent is inf/NaN) says what the top codes mean."""

    def c(v):
        return ir.Constant(I32, v)

    magnitude = builder.and_(bits, c(magnitude_mask))
    normal = builder.add(builder.shl(magnitude, c(shift)), c(bias << 23))
    if special == "ieee":
        top = builder.icmp_unsigned(">=", magnitude, c((magnitude_mask + 1) - (1 << (23 - shift))))
        normal = builder.select(top, builder.or_(builder.shl(magnitude, c(shift)), c(0x7F800000)), normal)
    else:
        normal = builder.select(builder.icmp_unsigned("==", magnitude, c(magnitude_mask)), c(0x7FC00000), normal)
    subnormal = builder.fmul(builder.uitofp(magnitude, F32), ir.Constant(F32, subnormal_scale))
    value = builder.select(
        builder.icmp_unsigned("<", magnitude, c(subnormal_below)), builder.bitcast(subnormal, I32), normal
    )
    sign = builder.shl(builder.lshr(bits, c(magnitude_mask.bit_length())), c(31))
    return builder.bitcast(builder.or_(value, sign), F32)


def _minifloat_intrinsic(code_type, *layout):
    """An intrinsic giving the float32 of one small float of `code_type` (`layout`: _minifloat's arguments)."""

    @intrinsic
    def decode(typingctx, code):
        def codegen(context, builder, signature, args):
            return _minifloat(builder, builder.zext(args[0], I32), *layout)

        return types.float32(code_type), codegen

    return decode


_e4m3 = _minifloat_intrinsic(types.uint8, 0x7F, 20, 120, 8, 2.0**-9, "e4m3")
_e5m2 = _minifloat_intrinsic(types.uint8, 0x7F, 21, 112, 4, 2.0**-16, "ieee")
_f16 = _minifloat_intrinsic(types.uint16, 0x7FFF, 13, 112, 0x400, 2.0**-24, "ieee")


@intrinsic
def _bf16(typingctx, half):
    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.shl(builder.zext(args[0], I32), ir.Constant(I32, 16)), F32)

    return types.float32(types.uint16), codegen


I16, I64 = ir.IntType(16), ir.IntType(64)


class _BFloat(ir.Type):
    """LLVM's bfloat, which llvmlite does not name: the BF16 dot is declared on it."""

    def _to_string(self):
        return "bfloat"


BF16_PAIRS = ir.VectorType(_BFloat(), 32)  # one instance: llvmlite compares types of its own classes by identity


def _e2m1_bf16_table() -> ir.Constant:
    """The bf16 bits of 256 times E2M1 code i & 15 for i in 0..31: vpermw indexes with 5 bits and the code sits
    in 4; the 256 (exact, a power of two) cancels the 1/256 of _block_scales."""
    magnitudes = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    bits = [
        int(np.float32(256 * (-magnitudes[i & 7] if i & 8 else magnitudes[i & 7])).view(np.uint32)) >> 16
        for i in (c & 15 for c in range(32))
    ]
    return ir.Constant(ir.VectorType(I16, 32), bits)


def _splat(element_type, count, value):
    return ir.Constant(ir.VectorType(element_type, count), [value] * count)


def _block_scales(builder, raw):
    """IR: sixteen E4M3 block scales (<16 x i8>) as <16 x float>, each over 256, exactly: the byte moved to the
    top of a 16-bit word and shifted back one (arithmetically, so the sign stays on top) is an fp16 of the
    same exponent and mantissa, subnormals included, with bias 15 for E4M3's 7; magnitude 0x7f is NaN.
    vcvtph2ps widens the halves."""

    def c(element_type, value):
        return _splat(element_type, 16, value)

    words = builder.shl(builder.zext(raw, ir.VectorType(I16, 16)), c(I16, 8))
    bits = builder.and_(builder.ashr(words, c(I16, 1)), c(I16, 0xBF80))  # the sign's copy at bit 14 cleared
    nan = builder.icmp_unsigned("==", builder.and_(raw, c(I8, 0x7F)), c(I8, 0x7F))
    bits = builder.select(nan, c(I16, 0x7E00), bits)
    return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), 16)), ir.VectorType(F32, 16))


def _lane_sums(builder, vectors):
    """IR: the horizontal sums of `vectors` (each <16 x float>), as one vector in their order: pairs of vectors
    are folded into one (half the lanes of each), then the vector into itself, so a sum is a few shuffles."""
    segments, length = 1, 16  # each vector: `segments` partial sums of `length` lanes, row after row

    def fold(p, q):
        """Each segment of p, and of q if given, its second half added to its first: p's then q's."""
        half = length // 2
        picks = [[s * length + h * half + k for s in range(segments) for k in range(half)] for h in (0, 1)]
        if q is None:
            q = p
        else:  # the shuffle numbers q's lanes after p's
            picks = [pick + [segments * length + i for i in pick] for pick in picks]
        low, high = (builder.shuffle_vector(p, q, ir.Constant(ir.VectorType(I32, len(pick)), pick)) for pick in picks)
        return builder.fadd(low, high)

    while len(vectors) > 1:
        vectors = [fold(vectors[i], vectors[i + 1]) for i in range(0, len(vectors), 2)]
        segments, length = 2 * segments, length // 2
    total = vectors[0]
    while length > 1:
        total = fold(total, None)
        length //= 2
    return total
