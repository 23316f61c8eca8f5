"""The bf16-activation NVFP4 row dots (AVX512-BF16), written as LLVM IR in numba intrinsics."""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from engine.kernels.cpu_experts.cpu import bf16_dot_supported
from engine.kernels.cpu_experts.llvm import (
    BF16_PAIRS,
    F32,
    I8,
    I16,
    I32,
    I64,
    _block_scales,
    _e2m1_bf16_table,
    _lane_sums,
    _splat,
)

# The codes are prefetched this many groups of rows ahead (rows lie one after another, so a group's bytes are
# contiguous: a line a row is asked for per line read). Development Zen 4, one thread from DRAM: without it
# gate_up ran at half the speed; 1, 2, 4 or 8 groups, or 4 or 8 KiB, were within the noise of each other
PREFETCH_GROUPS = 2


def _nvfp4_dots_bf16(rows, tokens=1):
    """An intrinsic for `rows` consecutive NVFP4 rows of `tokens` tokens (rows * tokens a power of two, 16 at
    most), giving each (row i, token u)'s sum over blocks b of scale b * (E2M1 codes of block b . x of block b)
    as a tuple, at i * tokens + u: codes at address `codes` (two per byte, low nibble first), E4M3 block scales
    at `scales`, bf16 inputs in _lay_out_bf16's order at `x` for one token, else at the `tokens` int64
    addresses at `x`, `octets` runs of eight 16-input blocks a row (at least one).

    Per octet of a row (64 code bytes, 128 inputs): word j of the codes holds codes 4j..4j+3, one a nibble;
    vpermw of the words, and of them shifted right by 4, 8 and 12 (it reads their low 5 bits; the table repeats
    over bit 4) gives the bf16 values of codes 4j, 4j+1, 4j+2, 4j+3. _lay_out_bf16 puts the inputs the same way,
    so four vdpbf16ps leave lane k the sum of inputs 8k..8k+7: lanes 2b and 2b+1 are block b. Two octets' lanes
    added in pairs make a lane a block, and one FMA with the sixteen block scales adds them up. The inputs are
    loaded once for all the rows, each row's codes decoded once for all the tokens, and the sums reduced
    together; a (row, token)'s sum is added in the same order whatever the rows and tokens of the call."""
    sums_count = rows * tokens

    def typer(typingctx, codes, scales, x, octets):
        def codegen(context, builder, signature, args):
            result_type = signature.return_type
            if not bf16_dot_supported():  # never called there (CpuExpertKernel refuses): keep it compilable
                return context.make_tuple(builder, result_type, [ir.Constant(F32, float("nan"))] * sums_count)
            codes_at, scales_at, x_at, count = args
            module = builder.module
            v16f, v16i32, v32i16 = ir.VectorType(F32, 16), ir.VectorType(I32, 16), ir.VectorType(I16, 32)
            permute = cgutils.get_or_insert_function(
                module, ir.FunctionType(v32i16, [v32i16, v32i16]), "llvm.x86.avx512.permvar.hi.512"
            )
            dot = cgutils.get_or_insert_function(
                module, ir.FunctionType(v16f, [v16f, BF16_PAIRS, BF16_PAIRS]), "llvm.x86.avx512bf16.dpbf16ps.512"
            )
            fma = cgutils.get_or_insert_function(module, ir.FunctionType(v16f, [v16f, v16f, v16f]), "llvm.fma.v16f32")
            prefetch = cgutils.get_or_insert_function(  # (address, read, keep in every level, data)
                module, ir.FunctionType(ir.VoidType(), [I8.as_pointer(), I32, I32, I32]), "llvm.prefetch.p0"
            )
            zero = ir.Constant(v16f, None)
            table = _e2m1_bf16_table()

            def c64(v):
                return ir.Constant(I64, v)

            def lanes(indices):
                return ir.Constant(ir.VectorType(I32, len(indices)), list(indices))

            def load(address, offset, element_type, align):
                return builder.load(
                    builder.inttoptr(builder.add(address, offset), element_type.as_pointer()), align=align
                )

            width, blocks = builder.mul(count, c64(64)), builder.mul(count, c64(8))
            x_ats = [x_at] if tokens == 1 else [load(x_at, c64(8 * u), I64, 8) for u in range(tokens)]
            ahead = builder.add(codes_at, builder.mul(width, c64(PREFETCH_GROUPS * rows)))

            def step(octet, sums, both):
                """sums plus the rows' scaled dots of octet `octet` and, if `both`, of the next one too."""
                offsets = [builder.mul(builder.add(octet, c64(h)), c64(64)) for h in range(1 + both)]

                def inputs(at, offset, g):  # a quarter of a token's 128 inputs (256 bytes, an octet)
                    return builder.bitcast(
                        load(at, builder.add(builder.shl(offset, c64(2)), c64(64 * g)), v16i32, 2), BF16_PAIRS
                    )

                # one token's inputs are loaded once for all the rows; several tokens' would not fit in registers
                # beside their sums, so they are loaded where used (from L1)
                shared = [[inputs(x_at, offset, g) for g in range(4)] for offset in offsets] if tokens == 1 else []
                new_sums = []
                for i in range(rows):
                    row_codes = builder.add(codes_at, builder.mul(width, c64(i)))
                    halves = [[] for _ in x_ats]  # a token's dots of each octet
                    for h, offset in enumerate(offsets):
                        words = load(row_codes, offset, v32i16, 1)
                        dots = [zero] * tokens
                        for g in range(4):
                            shifted = builder.lshr(words, _splat(I16, 32, 4 * g)) if g else words
                            values = builder.bitcast(builder.call(permute, [table, shifted]), BF16_PAIRS)
                            dots = [
                                builder.call(dot, [d, values, shared[h][g] if shared else inputs(at, offset, g)])
                                for d, at in zip(dots, x_ats)
                            ]
                        for token_halves, d in zip(halves, dots):
                            token_halves.append(d)
                    scale_at = builder.add(builder.mul(blocks, c64(i)), builder.mul(octet, c64(8)))
                    if both:
                        scale_bytes = load(scales_at, scale_at, ir.VectorType(I8, 16), 1)
                    else:  # the last octet of an odd count: the second half's scales and sums zero
                        eight = load(scales_at, scale_at, ir.VectorType(I8, 8), 1)
                        scale_bytes = builder.shuffle_vector(eight, ir.Constant(eight.type, None), lanes(range(16)))
                        for token_halves in halves:
                            token_halves.append(zero)
                    by_block = [
                        builder.fadd(*(builder.shuffle_vector(*token_halves, lanes(range(h, 32, 2))) for h in (0, 1)))
                        for token_halves in halves
                    ]
                    block_scales = _block_scales(builder, scale_bytes)
                    new_sums += [
                        builder.call(fma, [b, block_scales, sums[i * tokens + u]]) for u, b in enumerate(by_block)
                    ]
                    for offset in offsets:
                        line = builder.add(builder.mul(offset, c64(rows)), c64(64 * i))
                        builder.call(
                            prefetch,
                            [
                                builder.inttoptr(builder.add(ahead, line), I8.as_pointer()),
                                ir.Constant(I32, 0),
                                ir.Constant(I32, 3),
                                ir.Constant(I32, 1),
                            ],
                        )
                return new_sums

            def merged(incoming):
                """phis of the rows' sums from (block, sums) pairs."""
                phis = [builder.phi(v16f) for _ in range(sums_count)]
                for block, sums in incoming:
                    for phi, value in zip(phis, sums):
                        phi.add_incoming(value, block)
                return phis

            # octets two at a time, then the last one if the count is odd
            entry = builder.block
            loop = builder.append_basic_block("nvfp4_bf16.loop")
            after = builder.append_basic_block("nvfp4_bf16.after")
            tail = builder.append_basic_block("nvfp4_bf16.tail")
            done = builder.append_basic_block("nvfp4_bf16.done")
            steps = builder.lshr(count, c64(1))
            builder.cbranch(builder.icmp_signed(">", steps, c64(0)), loop, after)
            builder.position_at_end(loop)
            j = builder.phi(I64)
            sums = [builder.phi(v16f) for _ in range(sums_count)]
            looped = step(builder.shl(j, c64(1)), sums, True)
            following = builder.add(j, c64(1))
            j.add_incoming(c64(0), entry)
            j.add_incoming(following, loop)
            for phi, value in zip(sums, looped):
                phi.add_incoming(zero, entry)
                phi.add_incoming(value, loop)
            builder.cbranch(builder.icmp_signed("<", following, steps), loop, after)
            builder.position_at_end(after)
            sums = merged([(entry, [zero] * sums_count), (loop, looped)])
            builder.cbranch(builder.trunc(count, ir.IntType(1)), tail, done)
            builder.position_at_end(tail)
            tailed = step(builder.sub(count, c64(1)), sums, False)
            builder.branch(done)
            builder.position_at_end(done)
            totals = _lane_sums(builder, merged([(after, sums), (tail, tailed)]))
            return context.make_tuple(
                builder, result_type, [builder.extract_element(totals, ir.Constant(I32, i)) for i in range(sums_count)]
            )

        return types.UniTuple(types.float32, sums_count)(types.intp, types.intp, types.intp, types.intp), codegen

    return intrinsic(typer)


# Rows a call: they share each input load and one reduction. Development Zen 4, one thread: from cache 4 were
# 4 % faster than 2, 8 faster still for down, but 8 streamed gate_up from DRAM at two thirds of 4's speed
BF16_ROWS = 4
_nvfp4_dot_bf16, _nvfp4_dots_bf16_rows = _nvfp4_dots_bf16(1), _nvfp4_dots_bf16(BF16_ROWS)
# Rows and tokens a call when an expert has several tokens: each row's codes are decoded once for the tokens.
# Development Zen 4, one thread, rows from cache (shared, noisy): 2 x 4 ran gate_up and down faster than 4 x 4
# (whose sums leave too few registers); a token of 4 a call cost 0.5-0.7 of a lone token's time
BF16_TILE_ROWS, BF16_TOKENS = 2, 4
_bf16_rows_tokens, _bf16_row_tokens = (_nvfp4_dots_bf16(BF16_TILE_ROWS, BF16_TOKENS), _nvfp4_dots_bf16(1, BF16_TOKENS))
_bf16_rows_pair, _bf16_row_pair = _nvfp4_dots_bf16(BF16_TILE_ROWS, 2), _nvfp4_dots_bf16(1, 2)
_bf16_rows_one = _nvfp4_dots_bf16(BF16_TILE_ROWS, 1)
