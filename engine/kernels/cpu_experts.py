"""Routed experts on the CPU, computed exactly from the host expert records (engine/experts/packed.py).

`CpuExpertKernel(layout).run(records, x, expert_ids, expert_weights, on_cpu)` gives the weighted sum of the
chosen experts' SwiGLU outputs for the assignments marked `on_cpu`, reading each expert's weights where its
record lies, in the checkpoint's format (NVFP4 ModelOpt and compressed-tensors, FP8 per-tensor/per-row and
block-scaled, bf16/fp16/fp32): nothing is re-quantised, activations stay float32, and the result matches
dequantise-then-matmul in float32 up to float32 rounding.

The kernels are numba functions compiled on the user's machine (cached on disk after the first call). They
run with the GIL released, so a Python thread can compute experts beside GPU work. A call runs one parallel
region whose threads take (expert, block of rows) items from atomic counters, gate_up then down, then blocks of
tokens to sum, as the CPU share's threads do for each layer of a decode step (cpu_share.py). Decoding is arithmetic
that LLVM vectorises: E2M1 codes are decoded to signed int8 over whole rows, then an NVFP4 row is computed with
one block of 16 inputs per vector lane, so each E4M3 block scale multiplies a lane and no per-block horizontal
sum is needed (the inputs are laid out block-lane order once per token to match). Without numba, a plain
PyTorch version with the same interface computes the same numbers, slower.
"""

from __future__ import annotations

import functools
import os
import platform
import threading

import numpy as np
import torch
import torch.nn.functional as F

from engine.checkpoint.formats import DENSE, FP8_BLOCK, FP8_TENSOR, NVFP4, NVFP4_CT, NVFP4_GROUP
from engine.experts.packed import MatrixLayout, RecordLayout

try:
    import numba
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic
except ImportError:  # the engine still works: CpuExpertKernel falls back to PyTorch
    numba = None


def _prefer_512_bit_vectors() -> None:
    """LLVM tunes Intel server CPUs to 256-bit vectors even where they have AVX-512; these kernels ran 2.25x
    faster per core with 512-bit ones on the H200 machine's Xeon (Emerald Rapids). Before the first compile;
    NUMBA_CPU_FEATURES, when set, wins."""
    if numba is None or numba.config.CPU_FEATURES is not None:
        return
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return
    from llvmlite import binding
    numba.config.CPU_FEATURES = binding.get_host_cpu_features().flatten() + ",-prefer-256-bit"


_prefer_512_bit_vectors()


def bf16_dot_supported() -> bool:
    """Whether the kernels were compiled for a CPU with AVX512-BF16's dot (Intel Cooper Lake, Sapphire Rapids and
    later Xeons; AMD Zen 4 and later) and AVX512-BW's word permute, which the bf16-activation path uses, by an
    LLVM that declares the dot on bfloat vectors (17 and later: the only declaration tested)."""
    if numba is None or platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    from llvmlite import binding
    if binding.llvm_version_info[0] < 17:
        return False
    features = numba.config.CPU_FEATURES
    if features is None:
        features = binding.get_host_cpu_features().flatten()
    enabled = set(features.split(","))
    return {"+avx512bf16", "+avx512bw"} <= enabled

FORMAT_CODES = {NVFP4: 0, NVFP4_CT: 1, FP8_TENSOR: 2, FP8_BLOCK: 3, DENSE: 4}
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float8_e4m3fn: 3,
               torch.float8_e5m2: 4, torch.uint8: 5}
# Rows a work item (_layer_part): on the H200 machine's Xeon, 15 threads, a decode layer of 8 experts took 201 us
# with 64 against 228 with 32 (the atomics and the calls' fixed costs are shared by more bytes)
ITEM_ROWS = 64
COUNTER_STRIDE = 16  # int32s between a layer's counters: each on its own 64-byte line
TILE = 4  # rows (and tokens) multiplied together when an expert has several tokens; 4 x 4 sums fit in registers
# meta[matrix] fields (int64): what the kernels need to find and decode one matrix of a record
(M_FORMAT, M_OUT, M_IN, M_WEIGHT, M_WEIGHT_DTYPE, M_SCALE, M_SCALE_DTYPE, M_SCALE_COUNT, M_GLOBAL, M_GLOBAL_DTYPE,
 M_GLOBAL_COUNT, M_BLOCK_ROWS, M_BLOCK_COLS, M_SCALE_COLS) = range(14)
META_FIELDS = 14

_threads: int | None = None
_launch = threading.Lock()  # numba's default thread pool takes one parallel launch at a time
_launching = threading.local()  # the thread count numba was last given on this calling thread


@functools.cache
def default_threads() -> int:
    """Physical cores (hyper-threads share one core's vector units), within numba's pool. Asked once: psutil
    reads the CPU topology from the system each time (150 us, once per expert call before it was cached)."""
    try:
        import psutil
        cores = psutil.cpu_count(logical=False)
    except ImportError:
        cores = None
    cores = cores or os.cpu_count() or 1
    return min(cores, numba.config.NUMBA_NUM_THREADS) if numba is not None else cores


def set_threads(n: int | None) -> None:
    """Threads the expert kernels use (None: default_threads())."""
    global _threads
    if n is not None:
        limit = numba.config.NUMBA_NUM_THREADS if numba is not None else os.cpu_count() or 1
        if not 1 <= n <= limit:
            raise ValueError(f"threads must be between 1 and {limit}, got {n}")
    _threads = n


def threads() -> int:
    return _threads or default_threads()


def numba_threads(n: int) -> None:
    """Give numba's pool `n` threads for launches from this thread (numba keeps it per calling thread); a call
    costs 19 us, so only when it changes. Code that launches numba kernels sets threads through here."""
    if getattr(_launching, "threads", None) != n:
        numba.set_num_threads(n)
        _launching.threads = n


class CpuExpertKernel:
    """Routed experts of one model computed on the CPU from its expert records (one RecordLayout)."""

    def __init__(self, layout: RecordLayout, activations: str | None = None):
        """activations: "bf16" rounds each token's inputs to bf16 for NVFP4 rows (AVX512-BF16's dot, about 3x the
        float32 path per core for one token an expert, and each row's codes decoded once for up to 4 of an
        expert's tokens; the GPU kernels round activations to bf16 the same way), "float32" keeps them exact;
        None picks bf16 where the CPU has the instructions."""
        if activations is None:
            activations = "bf16" if bf16_dot_supported() else "float32"
        if activations not in ("bf16", "float32"):
            raise ValueError(f"activations must be 'bf16' or 'float32', got {activations!r}")
        if activations == "bf16" and not bf16_dot_supported():
            raise ValueError("bf16 activations need a CPU with AVX512-BF16 and AVX512-BW (and numba)")
        self.activations = activations
        gate_up, down = layout.matrices["gate_up"], layout.matrices["down"]
        intermediate, hidden = gate_up.shape[0] // 2, gate_up.shape[1]
        if gate_up.shape != (2 * intermediate, hidden) or down.shape != (hidden, intermediate):
            raise ValueError(f"expert records hold gate_up {list(gate_up.shape)} and down {list(down.shape)}, "
                             f"not [2I, H] and [H, I]")
        self.layout, self.hidden, self.intermediate = layout, hidden, intermediate
        self._meta = np.array([_matrix_meta(gate_up), _matrix_meta(down)], dtype=np.int64)

    def run(self, records: torch.Tensor, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor,
            on_cpu: torch.Tensor) -> torch.Tensor:
        """sum over (t, j) with on_cpu[t, j] of expert_weights[t, j] * expert_{expert_ids[t, j]}(x[t]):
        float32 [T, H]. records: uint8 [E, record_bytes] on the host; x: [T, H]; the rest [T, k]."""
        if records.dtype != torch.uint8 or records.dim() != 2 or records.shape[1] != self.layout.record_bytes:
            raise ValueError(f"records must be uint8 [experts, {self.layout.record_bytes}], "
                             f"got {records.dtype} {list(records.shape)}")
        x = x.detach().to(torch.float32).contiguous()
        ids = expert_ids.detach().to(torch.int64).contiguous()
        weights = expert_weights.detach().to(torch.float32).contiguous()
        chosen = on_cpu.detach().to(torch.bool).contiguous()
        if numba is None:
            return self._run_torch(records, x, ids, weights, chosen)
        out = np.zeros((x.shape[0], self.hidden), dtype=np.float32)
        with _launch:
            numba_threads(threads())
            ids_known = _experts(records.contiguous().numpy(), self._meta, x.numpy(), ids.numpy(), weights.numpy(),
                                 chosen.numpy(), out, self.activations == "bf16", threads())
        if not ids_known:
            raise ValueError(f"expert id out of range of the records (0..{records.shape[0] - 1})")
        return torch.from_numpy(out)

    def _run_torch(self, records, x, ids, weights, chosen) -> torch.Tensor:
        views = self.layout.view(records)
        out = torch.zeros(x.shape[0], self.hidden)
        for expert in ids[chosen].unique().tolist():
            tokens, slot = torch.where((ids == expert) & chosen)
            gate, up = F.linear(x[tokens], views["gate_up"].select(expert).dequantize()).split(self.intermediate, -1)
            y = F.linear(F.silu(gate) * up, views["down"].select(expert).dequantize())
            out.index_add_(0, tokens, y * weights[tokens, slot, None])
        return out


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


if numba is not None:
    I8, I32, F32 = ir.IntType(8), ir.IntType(32), ir.FloatType()
    # 'reassoc' lets LLVM vectorise float sums (the order of additions changes, float32 rounding only);
    # 'contract' lets it use FMA. No flag that changes NaN, infinity or signed-zero results.
    FAST = {"reassoc", "contract"}

    def _e2m1_twice(builder, code):
        """IR: 2 * the E2M1 value of a 4-bit code in an i8, as a signed i8 (exact: -12..12)."""
        def c(v):
            return ir.Constant(I8, v)
        magnitude = builder.and_(code, c(7))
        above4 = builder.select(builder.icmp_unsigned(">", magnitude, c(4)), magnitude, c(4))
        above6 = builder.select(builder.icmp_unsigned(">", magnitude, c(6)), magnitude, c(6))
        # 2|v| of codes 0..7 is 0,1,2,3,4,6,8,12: k + max(k-4, 0) + 2 max(k-6, 0)
        twice = builder.add(builder.add(magnitude, builder.sub(above4, c(4))),
                            builder.shl(builder.sub(above6, c(6)), c(1)))
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
        value = builder.select(builder.icmp_unsigned("<", magnitude, c(subnormal_below)),
                               builder.bitcast(subnormal, I32),
                               normal)
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

    _e4m3 = _minifloat_intrinsic(types.uint8, 0x7F, 20, 120, 8, 2.0 ** -9, "e4m3")
    _e5m2 = _minifloat_intrinsic(types.uint8, 0x7F, 21, 112, 4, 2.0 ** -16, "ieee")
    _f16 = _minifloat_intrinsic(types.uint16, 0x7FFF, 13, 112, 0x400, 2.0 ** -24, "ieee")

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
        bits = [int(np.float32(256 * (-magnitudes[i & 7] if i & 8 else magnitudes[i & 7])).view(np.uint32)) >> 16
                for i in (c & 15 for c in range(32))]
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
            low, high = (builder.shuffle_vector(p, q, ir.Constant(ir.VectorType(I32, len(pick)), pick))
                         for pick in picks)
            return builder.fadd(low, high)

        while len(vectors) > 1:
            vectors = [fold(vectors[i], vectors[i + 1]) for i in range(0, len(vectors), 2)]
            segments, length = 2 * segments, length // 2
        total = vectors[0]
        while length > 1:
            total = fold(total, None)
            length //= 2
        return total

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
                permute = cgutils.get_or_insert_function(module, ir.FunctionType(v32i16, [v32i16, v32i16]),
                                                         "llvm.x86.avx512.permvar.hi.512")
                dot = cgutils.get_or_insert_function(module, ir.FunctionType(v16f, [v16f, BF16_PAIRS, BF16_PAIRS]),
                                                     "llvm.x86.avx512bf16.dpbf16ps.512")
                fma = cgutils.get_or_insert_function(module, ir.FunctionType(v16f, [v16f, v16f, v16f]),
                                                     "llvm.fma.v16f32")
                prefetch = cgutils.get_or_insert_function(  # (address, read, keep in every level, data)
                    module, ir.FunctionType(ir.VoidType(), [I8.as_pointer(), I32, I32, I32]), "llvm.prefetch.p0")
                zero = ir.Constant(v16f, None)
                table = _e2m1_bf16_table()

                def c64(v):
                    return ir.Constant(I64, v)

                def lanes(indices):
                    return ir.Constant(ir.VectorType(I32, len(indices)), list(indices))

                def load(address, offset, element_type, align):
                    return builder.load(builder.inttoptr(builder.add(address, offset), element_type.as_pointer()),
                                        align=align)

                width, blocks = builder.mul(count, c64(64)), builder.mul(count, c64(8))
                x_ats = [x_at] if tokens == 1 else [load(x_at, c64(8 * u), I64, 8) for u in range(tokens)]
                ahead = builder.add(codes_at, builder.mul(width, c64(PREFETCH_GROUPS * rows)))

                def step(octet, sums, both):
                    """sums plus the rows' scaled dots of octet `octet` and, if `both`, of the next one too."""
                    offsets = [builder.mul(builder.add(octet, c64(h)), c64(64)) for h in range(1 + both)]

                    def inputs(at, offset, g):  # a quarter of a token's 128 inputs (256 bytes, an octet)
                        return builder.bitcast(load(at, builder.add(builder.shl(offset, c64(2)), c64(64 * g)),
                                                    v16i32, 2), BF16_PAIRS)
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
                                dots = [builder.call(dot, [d, values, shared[h][g] if shared else
                                                           inputs(at, offset, g)]) for d, at in zip(dots, x_ats)]
                            for token_halves, d in zip(halves, dots):
                                token_halves.append(d)
                        scale_at = builder.add(builder.mul(blocks, c64(i)), builder.mul(octet, c64(8)))
                        if both:
                            scale_bytes = load(scales_at, scale_at, ir.VectorType(I8, 16), 1)
                        else:  # the last octet of an odd count: the second half's scales and sums zero
                            eight = load(scales_at, scale_at, ir.VectorType(I8, 8), 1)
                            scale_bytes = builder.shuffle_vector(eight, ir.Constant(eight.type, None),
                                                                 lanes(range(16)))
                            for token_halves in halves:
                                token_halves.append(zero)
                        by_block = [builder.fadd(*(builder.shuffle_vector(*token_halves, lanes(range(h, 32, 2)))
                                                   for h in (0, 1))) for token_halves in halves]
                        block_scales = _block_scales(builder, scale_bytes)
                        new_sums += [builder.call(fma, [b, block_scales, sums[i * tokens + u]])
                                     for u, b in enumerate(by_block)]
                        for offset in offsets:
                            line = builder.add(builder.mul(offset, c64(rows)), c64(64 * i))
                            builder.call(prefetch, [builder.inttoptr(builder.add(ahead, line), I8.as_pointer()),
                                                    ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])
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
                return context.make_tuple(builder, result_type,
                                          [builder.extract_element(totals, ir.Constant(I32, i))
                                           for i in range(sums_count)])
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
    _bf16_rows_tokens, _bf16_row_tokens = (_nvfp4_dots_bf16(BF16_TILE_ROWS, BF16_TOKENS),
                                           _nvfp4_dots_bf16(1, BF16_TOKENS))
    _bf16_rows_pair, _bf16_row_pair = _nvfp4_dots_bf16(BF16_TILE_ROWS, 2), _nvfp4_dots_bf16(1, 2)
    _bf16_rows_one = _nvfp4_dots_bf16(BF16_TILE_ROWS, 1)

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
            bits = (np.uint32(record[at]) | (np.uint32(record[at + 1]) << np.uint32(8))
                    | (np.uint32(record[at + 2]) << np.uint32(16)) | (np.uint32(record[at + 3]) << np.uint32(24)))
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
                block += (_signed_byte(l0, i) * x[(2 * i) * blocks + b]
                          + _signed_byte(h0, i) * x[(2 * i + 1) * blocks + b]
                          + _signed_byte(l1, i) * x[(2 * i + 8) * blocks + b]
                          + _signed_byte(h1, i) * x[(2 * i + 9) * blocks + b])
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
                factors = record[meta[M_GLOBAL] + 4 * first:meta[M_GLOBAL] + 4 * last].view(np.float32)
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
                _decode_e2m1_row(record[meta[M_WEIGHT] + r * width:meta[M_WEIGHT] + (r + 1) * width], low, high)
                scales = record[meta[M_SCALE] + r * blocks:meta[M_SCALE] + (r + 1) * blocks]
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
                _decode_e2m1_row(record[meta[M_WEIGHT] + r * width:meta[M_WEIGHT] + (r + 1) * width], low, high)
                scales = record[meta[M_SCALE] + r * blocks:meta[M_SCALE] + (r + 1) * blocks]
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
                _decode_row(record[start:start + row_bytes], dtype, weights)
                if fmt == 2:
                    factors[t] = _scalar(record, meta[M_SCALE], r if meta[M_SCALE_COUNT] > 1 else 0,
                                         meta[M_SCALE_DTYPE])
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
                    s00 += a * e; s01 += a * f; s02 += a * g; s03 += a * h
                    s10 += b * e; s11 += b * f; s12 += b * g; s13 += b * h
                    s20 += c * e; s21 += c * f; s22 += c * g; s23 += c * h
                    s30 += d * e; s31 += d * f; s32 += d * g; s33 += d * h
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
                        s0 += w0[i] * e; s1 += w1[i] * e; s2 += w2[i] * e; s3 += w3[i] * e
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

    _X86 = platform.machine().lower() in ("x86_64", "amd64")

    def _int32_at(builder, address):
        return builder.inttoptr(address, I32.as_pointer())

    @intrinsic
    def _load_acquire(typingctx, address):
        """The int32 at `address`, read with acquire order (what was written before its release is visible)."""
        def codegen(context, builder, signature, args):
            value = builder.load_atomic(_int32_at(builder, args[0]), "acquire", 4)
            return builder.sext(value, ir.IntType(64))
        return types.int64(types.intp), codegen

    @intrinsic
    def _fetch_add(typingctx, address, value):
        """Atomically add `value` to the int32 at `address`; the value before."""
        def codegen(context, builder, signature, args):
            old = builder.atomic_rmw("add", _int32_at(builder, args[0]), builder.trunc(args[1], I32), "seq_cst")
            return builder.sext(old, ir.IntType(64))
        return types.int64(types.intp, types.int64), codegen

    @intrinsic
    def _raise_to(typingctx, address, value):
        """Atomically raise the int32 at `address` to `value` (release order); a stale writer cannot lower it."""
        def codegen(context, builder, signature, args):
            builder.atomic_rmw("max", _int32_at(builder, args[0]), builder.trunc(args[1], I32), "release")
            return context.get_dummy_value()
        return types.void(types.intp, types.int64), codegen

    @intrinsic
    def _pause(typingctx):
        """A spin-wait hint (x86's pause: the sibling hyper-thread gets the core, less power); nothing elsewhere."""
        def codegen(context, builder, signature, args):
            if _X86:
                fn = builder.module.declare_intrinsic("llvm.x86.sse2.pause", fnty=ir.FunctionType(ir.VoidType(), []))
                builder.call(fn, [])
            return context.get_dummy_value()
        return types.void(), codegen

    @intrinsic
    def _bytes_at(typingctx, address):
        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], ir.IntType(8).as_pointer())
        return types.CPointer(types.uint8)(types.intp), codegen

    @numba.njit(nogil=True, cache=True)
    def _wait_for(address, target, cancel_at):
        """Spin until the int32 at `address` reaches `target`; its value, or -1 once cancel is set."""
        while True:
            value = _load_acquire(address)
            if value >= target:
                return value
            if _load_acquire(cancel_at) != 0:
                return -1
            _pause()

    @numba.njit(nogil=True, cache=True)
    def _take(counter_at, experts, blocks):
        """The next item (expert, block) of a phase from its counter, or (-1, 0) once all are taken."""
        item = _fetch_add(counter_at, 1)
        if item >= experts * blocks:
            return -1, 0
        return item // blocks, item % blocks

    @numba.njit(nogil=True, cache=True)
    def _record(base, expert, record_bytes):
        """An expert's record, from its layer's records at address `base`."""
        return numba.carray(_bytes_at(base + expert * record_bytes), (record_bytes,))

    # A layer's experts for its tokens are computed by threads that take work items from atomic counters: the
    # CPU share's threads (cpu_share.py) run each of a step's layers through _layer_part, and run() a call the
    # same way, in one parallel region. Counters, COUNTER_STRIDE int32s apart: gate_up items taken, groups
    # activated, down items taken and ended, sum items taken and ended, the finisher of a layer with nothing for
    # the CPU; then per group its gate_up items ended
    TAKEN_GATE_UP, ACTIVATED, TAKEN_DOWN, ENDED_DOWN, TAKEN_SUM, ENDED_SUM, FINISHER, ENDED_GATE_UP = range(8)
    SUM_TOKENS = 16  # tokens a sum item

    @numba.njit(nogil=True, cache=True)
    def _counter(counters_at, which):
        """The address of counter `which` of a layer whose counters start at `counters_at`."""
        return counters_at + 4 * COUNTER_STRIDE * which

    @numba.njit(nogil=True, cache=True)
    def _group_rows(expert_ids, on_cpu, num_experts, counts, group_experts, starts, token_of_row, row_of):
        """The assignments marked on_cpu [T, k] grouped by expert (a counting sort): group g is expert
        group_experts[g] for rows starts[g]..starts[g+1]-1, row r is for token token_of_row[r], and
        row_of[t, j] is assignment (t, j)'s row (-1 off the CPU). counts: int64 [num_experts + 1], scratch. The
        number of groups, or -1 if an expert id is outside 0..num_experts-1."""
        tokens, top_k = expert_ids.shape
        counts[:] = 0
        for t in range(tokens):
            for j in range(top_k):
                if on_cpu[t, j]:
                    e = expert_ids[t, j]
                    if e < 0 or e >= num_experts:
                        return -1
                    counts[e + 1] += 1
        groups, rows = 0, 0
        for e in range(num_experts):
            if counts[e + 1]:
                group_experts[groups], starts[groups] = e, rows
                rows += counts[e + 1]
                counts[e + 1] = starts[groups]  # from here: where the expert's next row goes
                groups += 1
        starts[groups] = rows
        for t in range(tokens):
            for j in range(top_k):
                row_of[t, j] = -1
                if on_cpu[t, j]:
                    row = counts[expert_ids[t, j] + 1]
                    counts[expert_ids[t, j] + 1] += 1
                    token_of_row[row], row_of[t, j] = t, row
        return groups

    @numba.njit(nogil=True, cache=True)
    def _next_item(counter_at, groups, items, base, record_bytes, group_experts, starts, matrix, inputs, inputs16,
                   picks, results, bf16):
        """Take a phase's next item from its counter and compute it: rows item * ITEM_ROWS onwards of a group's
        `matrix` (records from address `base`), for each of the group's rows r the inputs of picks[r], into
        results[r]. The group, or -1 once every item is taken."""
        g, item = _take(counter_at, groups, items)
        if g >= 0:
            first, last = starts[g], starts[g + 1]
            _rows(_record(base, group_experts[g], record_bytes), matrix, item * ITEM_ROWS,
                  min((item + 1) * ITEM_ROWS, matrix[M_OUT]), inputs, inputs16, picks[first:last],
                  results[first:last], bf16)
        return g

    @numba.njit(nogil=True, cache=True)
    def _layer_part(base, record_bytes, meta, groups, group_experts, starts, token_of_row, own_rows, row_of, weights,
                    laid, laid16, counters_at, hidden_rows, acts, acts16, outputs, out, bf16, cancel_at):
        """One thread's part of a layer's experts (_group_rows' groups; records from address `base`) for tokens
        laid out in laid [T, H] and laid16. It takes gate_up items (ITEM_ROWS rows of one group; whoever ends a
        group's last one computes its rows' activations) and waits for every group's; takes down items the same
        way and waits for all to end; then takes sum items (SUM_TOKENS tokens: out[t] = the sum over j of
        weights[t, j] times row row_of[t, j]'s output). own_rows = 0..rows-1; hidden_rows, acts, acts16, outputs
        [rows, ...] and out [T, H] are shared by the threads. The rows computed if this thread ended the last sum
        item, else 0; -1 once the int32 at cancel_at is set."""
        gate_up, down = meta[0], meta[1]
        hidden, intermediate = down[M_OUT], down[M_IN]
        per_group = (2 * intermediate + ITEM_ROWS - 1) // ITEM_ROWS
        down_items = (hidden + ITEM_ROWS - 1) // ITEM_ROWS
        act = np.empty(intermediate, np.float32)
        while True:
            g = _next_item(_counter(counters_at, TAKEN_GATE_UP), groups, per_group, base, record_bytes, group_experts,
                           starts, gate_up, laid, laid16, token_of_row, hidden_rows, bf16)
            if g < 0:
                break
            if _fetch_add(_counter(counters_at, ENDED_GATE_UP + g), 1) == per_group - 1:
                for row in range(starts[g], starts[g + 1]):
                    _swiglu_laid_out(hidden_rows[row], act, acts[row], acts16[row], down, bf16)
                _fetch_add(_counter(counters_at, ACTIVATED), 1)
        if _wait_for(_counter(counters_at, ACTIVATED), groups, cancel_at) < 0:
            return -1
        while _next_item(_counter(counters_at, TAKEN_DOWN), groups, down_items, base, record_bytes, group_experts,
                         starts, down, acts, acts16, own_rows, outputs, bf16) >= 0:
            _fetch_add(_counter(counters_at, ENDED_DOWN), 1)
        if _wait_for(_counter(counters_at, ENDED_DOWN), groups * down_items, cancel_at) < 0:
            return -1
        tokens, top_k = row_of.shape
        sum_items = (tokens + SUM_TOKENS - 1) // SUM_TOKENS
        while True:
            item = _fetch_add(_counter(counters_at, TAKEN_SUM), 1)
            if item >= sum_items:
                return 0
            for t in range(item * SUM_TOKENS, min((item + 1) * SUM_TOKENS, tokens)):
                out[t, :] = 0
                for j in range(top_k):
                    row = row_of[t, j]
                    if row >= 0:
                        weight = weights[t, j]
                        for r in range(hidden):
                            out[t, r] += weight * outputs[row, r]
            if _fetch_add(_counter(counters_at, ENDED_SUM), 1) == sum_items - 1:
                return starts[groups]

    @numba.njit(parallel=True, nogil=True, cache=True)
    def _experts(records, meta, x, expert_ids, expert_weights, on_cpu, out, bf16, threads):
        """out [T, H] = each token's weighted sum of its experts marked on_cpu, by `threads` threads taking items;
        False if an expert id is outside the records."""
        tokens, top_k = expert_ids.shape
        num_experts, assignments = records.shape[0], tokens * top_k
        group_experts, starts = np.empty(assignments, np.int64), np.empty(assignments + 1, np.int64)
        token_of_row, row_of = np.empty(assignments, np.int64), np.empty((tokens, top_k), np.int64)
        groups = _group_rows(expert_ids, on_cpu, num_experts, np.empty(num_experts + 1, np.int64), group_experts,
                             starts, token_of_row, row_of)
        if groups <= 0:
            return groups == 0
        rows = starts[groups]
        hidden, intermediate = meta[1][M_OUT], meta[1][M_IN]
        laid = np.empty((tokens, hidden), np.float32)
        laid16 = np.empty((tokens if bf16 else 0, hidden), np.uint16)
        for t in range(tokens):
            _lay_out(x[t], laid[t], meta[0])
            if bf16:
                _lay_out_bf16(x[t], laid16[t])
        counters = np.zeros((ENDED_GATE_UP + groups) * COUNTER_STRIDE, np.int32)
        never = np.zeros(1, np.int32)  # nothing cancels a call
        hidden_rows = np.empty((rows, 2 * intermediate), np.float32)
        acts, acts16 = np.empty((rows, intermediate), np.float32), np.empty((rows, intermediate), np.uint16)
        outputs, own_rows = np.empty((rows, hidden), np.float32), np.arange(rows)
        base, record_bytes = np.int64(records.ctypes.data), records.shape[1]
        for _ in numba.prange(threads):
            _layer_part(base, record_bytes, meta, groups, group_experts, starts, token_of_row, own_rows, row_of,
                        expert_weights, laid, laid16, counters.ctypes.data, hidden_rows, acts, acts16, outputs, out,
                        bf16, never.ctypes.data)
        return True
