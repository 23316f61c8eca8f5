"""The Triton linears (engine/kernels/triton_linear.py) equal dequantise-then-matmul; on CI they run in Triton's CPU
interpreter (conftest.py switches it on), on CPU tensors, with tiny shapes."""

import math

import pytest
import torch
import torch.nn.functional as F

# On a machine without a GPU, conftest.py has switched Triton to its CPU interpreter.
pytest.importorskip("triton", reason="Triton ships for Linux; the Windows app runs the reference kernels")

from engine import kernels  # noqa: E402
from engine.checkpoint import quantize  # noqa: E402
from engine.checkpoint.formats import (
    DENSE,
    FP8_BLOCK,
    FP8_TENSOR,
    NVFP4,
    NVFP4_CT,
    StoredWeight,  # noqa: E402
    detect_format,
    fuse_rows,
)
from engine.kernels import reference, triton_linear, triton_linear_launch  # noqa: E402
from engine.kernels.groups import ExpertGroups  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FLOAT32_TOLERANCE = 1e-5  # float32 operands and float32 math: only the summation order differs
BF16_TOLERANCE = 1e-2  # bf16 activations rounded once more on the way out (2^-9 relative) against float32 math
FP16_TOLERANCE = 5e-3


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _weight(out_features, in_features, encoder, seed, block=(128, 128)):
    w = torch.randn(out_features, in_features, generator=_gen(seed))
    tensors = encoder(w, block) if encoder is quantize.fp8_block else encoder(w)
    tensors = {role: t.to(DEVICE) for role, t in tensors.items()}
    fmt, shape = detect_format("w", tensors)
    return StoredWeight(fmt, tensors, shape, "w", block)


def _per_row(weight_a, weight_b):
    """gate and up of different global scales joined: one multiplying scale per output row."""
    return fuse_rows([weight_a, weight_b], "gate_up")


def _expected(x, weight):
    return F.linear(x.float(), weight.dequantize(torch.float32))


def _rel_error(got, expected):
    assert torch.isfinite(got).all()
    return float((got.float() - expected).abs().max() / expected.abs().max())


WEIGHTS = {  # name -> weight maker (odd sizes; NVFP4 needs K a multiple of 16)
    "nvfp4": lambda: _weight(37, 80, quantize.nvfp4_modelopt, seed=1),
    "nvfp4 per-row": lambda: _per_row(
        _weight(20, 80, quantize.nvfp4_modelopt, seed=2), _weight(17, 80, quantize.nvfp4_modelopt, seed=3)
    ),
    "nvfp4_ct": lambda: _weight(37, 80, quantize.nvfp4_compressed_tensors, seed=4),
    "fp8": lambda: _weight(37, 75, quantize.fp8_per_tensor, seed=5),
    "fp8 per-row": lambda: _per_row(
        _weight(20, 75, quantize.fp8_per_tensor, seed=6), _weight(17, 75, quantize.fp8_per_tensor, seed=7)
    ),
    "fp8 block": lambda: _weight(130, 200, quantize.fp8_block, seed=8),  # 128x128 blocks, neither side a multiple
    "fp8 block 24x40": lambda: _weight(50, 90, quantize.fp8_block, seed=9, block=(24, 40)),  # per-element scales
    # K a multiple of every K step: loads without K masks
    "fp8 K=256": lambda: _weight(24, 256, quantize.fp8_per_tensor, seed=10),
    "fp8 block K=256": lambda: _weight(40, 256, quantize.fp8_block, seed=11, block=(32, 64)),
}
FORMATS = {
    "nvfp4": NVFP4,
    "nvfp4 per-row": NVFP4,
    "nvfp4_ct": NVFP4_CT,
    "fp8": FP8_TENSOR,
    "fp8 per-row": FP8_TENSOR,
    "fp8 block": FP8_BLOCK,
    "fp8 block 24x40": FP8_BLOCK,
    "fp8 K=256": FP8_TENSOR,
    "fp8 block K=256": FP8_BLOCK,
}


@pytest.mark.parametrize("name", list(WEIGHTS))
@pytest.mark.parametrize("tokens", [1, 3, 17, 40])
def test_linear_matches_dequantise_then_matmul(name, tokens):
    weight = WEIGHTS[name]()
    assert weight.format == FORMATS[name]
    if name.endswith("per-row"):
        assert weight.tensors["weight_scale_2" if weight.format == NVFP4 else "weight_scale"].shape == (37,)
    x = torch.randn(tokens, weight.shape[1], generator=_gen(tokens)).to(DEVICE)
    got = triton_linear.linear(x, weight)
    assert got.shape == (tokens, weight.shape[0]) and got.dtype == torch.float32
    assert _rel_error(got, _expected(x, weight)) <= FLOAT32_TOLERANCE


@pytest.mark.parametrize("name", list(WEIGHTS))
@pytest.mark.parametrize(
    "path",
    [
        dict(gemv=True, splits=3),
        dict(gemv=False, splits=3),
        dict(gemv=True, splits=1),
        dict(gemv=False, block_m=32, splits=1),
    ],
)
def test_every_path_of_every_format(name, path):
    """The GEMV path on several rows, tiles on one row, and K split over programs (float32 atomics)."""
    weight = WEIGHTS[name]()
    x = torch.randn(2, weight.shape[1], generator=_gen(5)).to(DEVICE)
    got = triton_linear.linear(x, weight, **path)
    assert got.shape == (2, weight.shape[0]) and got.dtype == torch.float32
    assert _rel_error(got, _expected(x, weight)) <= FLOAT32_TOLERANCE


@pytest.mark.parametrize(
    "encoder, fmt", [(quantize.nvfp4_modelopt, NVFP4), (quantize.nvfp4_compressed_tensors, NVFP4_CT)]
)
@pytest.mark.parametrize(
    "tokens, out_features, in_features",
    [
        (1, 64, 128),  # one decode token
        (5, 48, 80),  # sizes that fill no block: masked rows, columns and a half-used K block
        (33, 130, 256),
    ],
)
def test_nvfp4_against_float64(encoder, fmt, tokens, out_features, in_features):
    """Carried over from the first NVFP4 kernel's tests: both flavours against a float64 product."""
    weight = _weight(out_features, in_features, encoder, seed=tokens)
    assert weight.format == fmt
    x = torch.randn(tokens, in_features, generator=_gen(1)).to(DEVICE)
    expected = x.double() @ weight.dequantize(torch.float64).T
    got = triton_linear.linear(x, weight)
    assert got.shape == (tokens, out_features) and got.dtype == torch.float32
    assert float((got.double() - expected).abs().max() / expected.abs().max()) < FLOAT32_TOLERANCE


@pytest.mark.parametrize("name", ["nvfp4 per-row", "fp8", "fp8 block"])
@pytest.mark.parametrize("tokens", [1, 17])
def test_bf16_inputs(name, tokens):
    weight = WEIGHTS[name]()
    x = torch.randn(tokens, weight.shape[1], generator=_gen(2)).to(DEVICE).to(torch.bfloat16)
    got = triton_linear.linear(x, weight)
    assert got.dtype == torch.bfloat16
    assert _rel_error(got, _expected(x, weight)) <= BF16_TOLERANCE


def test_half_precision_inputs():
    weight = _weight(64, 128, quantize.nvfp4_modelopt, seed=3)
    x = torch.randn(7, 128, generator=_gen(2)).to(DEVICE)
    expected = x.double() @ weight.dequantize(torch.float64).T
    got = triton_linear.linear(x.half(), weight)
    assert got.dtype == torch.float16
    assert float((got.double() - expected).abs().max() / expected.abs().max()) < FP16_TOLERANCE


def test_leading_dimensions_are_kept():
    weight = _weight(32, 64, quantize.nvfp4_modelopt, seed=4)
    x = torch.randn(2, 3, 64, generator=_gen(3)).to(DEVICE)
    got = triton_linear.linear(x, weight)
    assert got.shape == (2, 3, 32)
    assert _rel_error(got.reshape(6, 32), _expected(x.reshape(6, 64), weight)) <= FLOAT32_TOLERANCE


@pytest.mark.parametrize(
    "rows, n_out, k_in, fmt",
    [
        (1, 512, 2048, NVFP4),
        (1, 2048, 512, NVFP4),
        (1, 8192, 2048, FP8_TENSOR),
        (16, 512, 2048, NVFP4),
        (2048, 8192, 2048, FP8_TENSOR),
        (3, 40, 96, FP8_TENSOR),
    ],
)
def test_block_sizes_cover_the_problem(rows, n_out, k_in, fmt):
    """The host-side tiling on an H200-sized chip: power-of-two blocks, enough programs for a decode GEMV, and
    K splits that cover K exactly in whole K steps."""
    sms = 132
    if fmt == NVFP4:
        tensors = {
            "weight": torch.empty(n_out, k_in // 2, dtype=torch.uint8),
            "weight_scale": torch.empty(n_out, k_in // 16, dtype=torch.float8_e4m3fn),
            "weight_scale_2": torch.ones(()),
        }
    else:
        tensors = {"weight": torch.empty(n_out, k_in, dtype=torch.float8_e4m3fn), "weight_scale": torch.ones(())}
    ops = triton_linear._operands(StoredWeight(fmt, tensors, (n_out, k_in), "w"), stacked=False)
    if rows == 1:
        bn, bk, _, _ = triton_linear_launch._gemv_blocks(ops, n_out, k_in, 1, sms)
        assert n_out // bn >= min(n_out // 2, 4 * sms)  # many programs in flight
        assert bn * bk * ops.input_bytes <= triton_linear_launch._TILE_BYTES
    else:
        bm = 16 if rows <= 16 else 128
        bn, bk, _, _ = triton_linear_launch._tile_blocks(ops, bm, n_out, k_in, -(-rows // bm))
        assert bn >= 16 and bk >= 32
    assert bn & (bn - 1) == 0 and bk & (bk - 1) == 0 and bk <= max(32, 2 * k_in)
    programs = -(-rows // (1 if rows == 1 else 16 if rows <= 16 else 128)) * -(-n_out // bn)
    splits, per_split = triton_linear_launch._split_k(programs, k_in, bk, sms)
    assert per_split % bk == 0 and splits * per_split >= k_in > (splits - 1) * per_split


def test_grouped_reads_the_pool_in_place(monkeypatch):
    """The stacked weight is strided views into the cache's byte pool: the kernel must not copy it."""
    weight, pool = _stacked_experts(NVFP4, 5, 16, 32, seed=50)
    copies = []
    original = torch.Tensor.contiguous

    def spy(tensor, *args, **kwargs):
        if tensor.untyped_storage().data_ptr() == pool.untyped_storage().data_ptr():
            copies.append(tuple(tensor.shape))
        return original(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "contiguous", spy)
    groups = ExpertGroups([4, 1], [0, 1, 2])
    x = torch.randn(2, 32, generator=_gen(15)).to(DEVICE)
    got = triton_linear.grouped_linear(x, weight, groups)
    monkeypatch.undo()
    assert not copies
    assert _rel_error(got, reference.grouped_linear(x, weight, groups)) <= FLOAT32_TOLERANCE


def test_dense_rows_go_to_the_reference():
    w = torch.randn(9, 16, generator=_gen(4)).to(DEVICE)
    weight = StoredWeight(DENSE, {"weight": w}, (9, 16), "w")
    x = torch.randn(2, 16, generator=_gen(5)).to(DEVICE)
    assert torch.equal(triton_linear.linear(x, weight), reference.linear(x, weight))


def test_nvfp4_codes_off_word_alignment_go_to_the_reference():
    weight = WEIGHTS["nvfp4"]()
    codes = weight.tensors["weight"]
    shifted = torch.empty(codes.numel() + 1, dtype=torch.uint8, device=codes.device)[1:].view(codes.shape)
    shifted.copy_(codes)
    moved = StoredWeight(weight.format, {**weight.tensors, "weight": shifted}, weight.shape, "w")
    assert triton_linear._operands(weight, stacked=False) is not None
    assert triton_linear._operands(moved, stacked=False) is None
    x = torch.randn(1, 80, generator=_gen(6)).to(DEVICE)
    assert torch.equal(triton_linear.linear(x, moved), reference.linear(x, moved))


def test_cuda_dispatch_registers_both_ops():
    saved = {device: dict(ops) for device, ops in kernels._BY_DEVICE.items()}
    try:
        kernels._register_cuda_kernels()
        assert kernels._BY_DEVICE["cuda"]["linear"] is triton_linear.linear
        assert kernels._BY_DEVICE["cuda"]["grouped_linear"] is triton_linear.grouped_linear
        assert kernels._BY_DEVICE["cuda"]["slot_linear"] is triton_linear.slot_linear
    finally:
        kernels._BY_DEVICE.clear()
        kernels._BY_DEVICE.update(saved)


# ------------------------------------------------------------------------------------------ grouped (stacked)


def _stack_in_pool(parts, align=64):
    """Stacked views of `parts` (each role -> [S, ...] tensor) into one uint8 byte pool, one record per slot that
    holds every tensor of every part (as the expert cache keeps an expert's gate_up and down together): each
    view's slot stride is the record size, no product of its own sizes."""
    layout, offset = [], 0
    for index, part in enumerate(parts):
        for role, t in part.items():
            nbytes = math.prod(t.shape[1:]) * t.element_size()
            layout.append((index, role, t, offset, nbytes))
            offset += -(-nbytes // align) * align
    record = offset + 3 * align  # spare bytes at the end of each record
    slots = next(iter(parts[0].values())).shape[0]
    pool = torch.zeros(slots * record, dtype=torch.uint8, device=DEVICE)
    views = [dict() for _ in parts]
    for index, role, t, offset, nbytes in layout:
        view = pool.view(slots, record)[:, offset : offset + nbytes].view(t.dtype).unflatten(1, t.shape[1:])
        view.copy_(t)
        views[index][role] = view
    return pool, views


def _stacked_experts(fmt, slots, out_features, in_features, seed):
    """(stacked weight [S, N, K] as views into a byte pool, the pool): NVFP4 and FP8 experts are gate and up
    of different global scales joined (one scale per row), dense ones float32 or bf16."""
    experts = []
    for slot in range(slots):
        half = out_features // 2
        if fmt in (NVFP4, FP8_TENSOR):
            encoder = quantize.nvfp4_modelopt if fmt == NVFP4 else quantize.fp8_per_tensor
            experts.append(
                _per_row(
                    _weight(half, in_features, encoder, seed + 2 * slot),
                    _weight(out_features - half, in_features, encoder, seed + 2 * slot + 1),
                )
            )
        elif fmt == NVFP4_CT:
            experts.append(_weight(out_features, in_features, quantize.nvfp4_compressed_tensors, seed + slot))
        elif fmt == FP8_BLOCK:
            experts.append(_weight(out_features, in_features, quantize.fp8_block, seed + slot, block=(16, 32)))
        else:
            dtype = torch.bfloat16 if fmt == "dense bf16" else torch.float32
            w = torch.randn(out_features, in_features, generator=_gen(seed + slot)).to(dtype).to(DEVICE)
            experts.append(StoredWeight(DENSE, {"weight": w}, (out_features, in_features), "w"))
    stacked = {role: torch.stack([e.tensors[role] for e in experts]) for role in experts[0].tensors}
    other = {"down": torch.randn(slots, 5, 7, generator=_gen(seed)).to(DEVICE)}  # shares each record
    pool, (views, _) = _stack_in_pool([stacked, other])
    weight = StoredWeight(
        experts[0].format, views, (slots, out_features, in_features), "experts", experts[0].block_size
    )
    return weight, pool


GROUPED = [(NVFP4, 33, 48), (FP8_TENSOR, 33, 40), ("dense", 19, 24), ("dense bf16", 19, 24)]
GROUPINGS = {  # (slots, offsets): empty groups, slots out of order and repeated
    "decode": ([4, 0, 5, 2], [0, 1, 2, 3, 4]),
    "mixed": ([3, 1, 1, 5, 0, 2], [0, 3, 3, 20, 21, 21, 40]),
    "all empty but one": ([2, 4, 1], [0, 0, 6, 6]),
}


@pytest.mark.parametrize("fmt, out_features, in_features", GROUPED)
@pytest.mark.parametrize("grouping", list(GROUPINGS))
def test_grouped_matches_reference(fmt, out_features, in_features, grouping):
    weight, pool = _stacked_experts(fmt, 6, out_features, in_features, seed=10)
    codes = weight.tensors["weight"]
    assert codes.data_ptr() >= pool.data_ptr() and not codes.is_contiguous()
    assert codes.stride(0) != math.prod(codes.shape[1:])  # a record, not the tensor's own size
    slots, offsets = GROUPINGS[grouping]
    groups = ExpertGroups(slots, offsets)
    dtype = torch.bfloat16 if fmt == "dense bf16" else torch.float32
    x = torch.randn(groups.rows, in_features, generator=_gen(11)).to(DEVICE).to(dtype)
    got = triton_linear.grouped_linear(x, weight, groups)
    expected = reference.grouped_linear(x.float(), weight, groups)
    assert got.shape == (groups.rows, out_features) and got.dtype == dtype
    tolerance = BF16_TOLERANCE if dtype == torch.bfloat16 else FLOAT32_TOLERANCE
    assert _rel_error(got, expected) <= tolerance
    assert any(key[0] == "triton_linear_tiles" for key in groups.cache)  # the tile table is kept with the groups


@pytest.mark.parametrize("fmt, out_features, in_features", GROUPED[:3])
@pytest.mark.parametrize(
    "tiling",
    [dict(block_m=1), dict(block_m=16), dict(block_m=16, splits=2), dict(block_m=1, splits=2), dict(block_m=32)],
)
def test_grouped_every_tiling(fmt, out_features, in_features, tiling):
    weight, _pool = _stacked_experts(fmt, 6, out_features, in_features, seed=20)
    groups = ExpertGroups([3, 1, 1, 5, 0, 2], [0, 3, 3, 20, 21, 21, 40])
    x = torch.randn(groups.rows, in_features, generator=_gen(12)).to(DEVICE)
    got = triton_linear.grouped_linear(x, weight, groups, **tiling)
    assert _rel_error(got, reference.grouped_linear(x, weight, groups)) <= FLOAT32_TOLERANCE


def test_grouped_tile_table_is_made_once():
    weight, _pool = _stacked_experts(NVFP4, 4, 16, 32, seed=30)
    groups = ExpertGroups([2, 0], [0, 2, 5])
    x = torch.randn(5, 32, generator=_gen(13)).to(DEVICE)
    first = triton_linear.grouped_linear(x, weight, groups)
    table = next(t for key, t in groups.cache.items() if key[0] == "triton_linear_tiles")
    assert table.tolist() == [[2, 0, 2], [0, 2, 5]]  # (slot, first row, group end) per tile of 16 rows
    second = triton_linear.grouped_linear(x, weight, groups)
    assert torch.equal(first, second)
    assert next(t for key, t in groups.cache.items() if key[0] == "triton_linear_tiles") is table


@pytest.mark.parametrize("fmt, out_features, in_features", GROUPED)
@pytest.mark.parametrize("splits", [None, 2])
def test_slot_linear_matches_reference(fmt, out_features, in_features, splits):
    """A decode step's rows, each with its own slot read from a device tensor; the input row repeated by a
    zero-stride view (one token's hidden state for each of its experts)."""
    weight, _pool = _stacked_experts(fmt, 6, out_features, in_features, seed=60)
    dtype = torch.bfloat16 if fmt == "dense bf16" else torch.float32
    x = torch.randn(1, in_features, generator=_gen(16)).to(DEVICE).to(dtype).expand(4, in_features)
    slots = torch.tensor([5, 0, 3, 1], device=DEVICE)
    got = triton_linear.slot_linear(x, weight, slots, splits=splits)
    expected = reference.slot_linear(x.float(), weight, slots)
    for row, slot in enumerate(slots.tolist()):  # the reference itself, row by row against one expert's matmul
        assert torch.allclose(expected[row], reference.linear(x[row : row + 1].float(), weight.select(slot))[0])
    assert got.shape == (4, out_features) and got.dtype == dtype
    assert _rel_error(got, expected) <= (BF16_TOLERANCE if dtype == torch.bfloat16 else FLOAT32_TOLERANCE)


@pytest.mark.parametrize("fmt, out_features, in_features", GROUPED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slot_linear_takes_swiglu_inputs(fmt, out_features, in_features, dtype):
    """The down projection reading gate and up rows, silu(gate) * up computed inside the kernel, against the
    activation written out first (in the input's dtype, as the unfused path stores it), then the matmul."""
    weight, _pool = _stacked_experts(fmt, 5, out_features, in_features, seed=61)
    dtype = torch.bfloat16 if fmt == "dense bf16" else dtype
    gate_up = (2 * torch.randn(3, 2 * in_features, generator=_gen(17))).to(DEVICE).to(dtype)
    slots = torch.tensor([4, 0, 4], dtype=torch.int32, device=DEVICE)
    got = triton_linear.slot_linear(gate_up, weight, slots, swiglu=True)
    gate, up = gate_up[:, :in_features], gate_up[:, in_features:]
    activation = (F.silu(gate.float()) * up.float()).to(dtype)
    expected = reference.slot_linear(activation.float(), weight, slots)
    assert torch.allclose(
        reference.slot_linear(gate_up, weight, slots, swiglu=True).float(),
        reference.slot_linear(F.silu(gate) * up, weight, slots).float(),
    )
    assert got.shape == (3, out_features) and got.dtype == dtype
    assert _rel_error(got, expected) <= (BF16_TOLERANCE if dtype == torch.bfloat16 else FLOAT32_TOLERANCE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features", [257, 64, 3])
def test_one_row_through_a_dense_weight_takes_the_gemv(dtype, out_features, monkeypatch):
    """A decode step's dense linear (a router and its shared expert's gate) runs the kernel's GEMV, not the
    reference; several rows, or a weight of another dtype than the input, go to the reference."""
    w = torch.randn(out_features, 96, generator=_gen(19)).to(DEVICE, dtype)
    weight = StoredWeight(DENSE, {"weight": w}, (out_features, 96), "w")
    x = torch.randn(1, 96, generator=_gen(20)).to(DEVICE, dtype)
    launched = []
    launch = triton_linear.launch
    monkeypatch.setattr(triton_linear, "launch", lambda *a, **k: launched.append(a) or launch(*a, **k))
    got = triton_linear.linear(x, weight)
    assert len(launched) == 1 and got.dtype == dtype and got.shape == (1, out_features)
    expected = x.float() @ w.float().T
    assert _rel_error(got, expected) <= (BF16_TOLERANCE if dtype == torch.bfloat16 else FLOAT32_TOLERANCE)
    triton_linear.linear(x.expand(3, 96), weight)
    triton_linear.linear(x.to(torch.float16), weight)
    assert len(launched) == 1


@pytest.mark.parametrize("name", ["nvfp4", "fp8 per-row", "fp8 block"])
@pytest.mark.parametrize("tokens, dtype", [(1, torch.float32), (1, torch.bfloat16), (5, torch.float32)])
def test_linear_takes_swiglu_inputs(name, tokens, dtype):
    """A shared expert's down projection reading [gate | up]: the GEMV path computes silu(gate) * up in the
    kernel, the tiles path (several rows) writes it out first; both against the activation in the input's dtype,
    then dequantise-then-matmul."""
    weight = WEIGHTS[name]()
    k_in = weight.shape[1]
    gate_up = (2 * torch.randn(tokens, 2 * k_in, generator=_gen(18))).to(DEVICE).to(dtype)
    got = triton_linear.linear(gate_up, weight, swiglu=True)
    activation = (F.silu(gate_up[:, :k_in].float()) * gate_up[:, k_in:].float()).to(dtype)
    expected = reference.linear(activation.float(), weight)
    assert got.shape == (tokens, weight.shape[0]) and got.dtype == dtype
    # bf16: the activation's rounding and the output's; Triton's CPU interpreter truncates them (CUDA rounds)
    assert _rel_error(got, expected) <= (2 * BF16_TOLERANCE if dtype == torch.bfloat16 else FLOAT32_TOLERANCE)
    plain = reference.linear(gate_up, weight, swiglu=True)  # the reference's swiglu is the activation first
    assert torch.equal(plain, reference.linear(reference.silu_mul(gate_up), weight))


@pytest.mark.parametrize("fmt", [FP8_BLOCK, NVFP4_CT])
def test_grouped_formats_without_a_kernel_go_to_the_reference(fmt):
    weight, _pool = _stacked_experts(fmt, 3, 24, 64, seed=40)
    groups = ExpertGroups([2, 0], [0, 2, 3])
    x = torch.randn(3, 64, generator=_gen(14)).to(DEVICE)
    assert torch.equal(triton_linear.grouped_linear(x, weight, groups), reference.grouped_linear(x, weight, groups))
