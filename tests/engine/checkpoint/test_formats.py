"""engine/checkpoint/formats.py against independent references: compressed-tensors' FP4 pack/unpack,
hand-computed bytes, and hand-written torch.kron block expansion. Our packer (quantize.py) is only ever
checked against these, never used as the reference for its own decoder."""

import pytest
import torch
from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8

from engine.checkpoint import quantize
from engine.checkpoint.formats import (
    DENSE,
    FP8_BLOCK,
    FP8_TENSOR,
    NVFP4,
    NVFP4_CT,
    StoredWeight,
    check_scales,
    detect_format,
    unpack_e2m1,
)

E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _bytes(*shape, seed=0):
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=_gen(seed))


def _ct_values(packed):
    """Reference E2M1 values of a packed [..., n/2] tensor, by compressed-tensors."""
    rows = packed.reshape(-1, packed.shape[-1])
    values = unpack_fp4_from_uint8(rows, rows.shape[0], rows.shape[1] * 2, dtype=torch.float32)
    return values.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _same(a, b):
    """Bitwise-equal floats, the sign of zero included."""
    return torch.equal(a, b) and torch.equal(torch.signbit(a), torch.signbit(b))


def _fp8_scales(*shape, seed=1):
    return (torch.rand(shape, generator=_gen(seed)) * 2 + 0.01).to(torch.float8_e4m3fn)


def _group_expand(scale, group=16):
    """[..., k] -> [..., 16k] by a Kronecker product with a row of ones (no repeat_interleave)."""
    flat = scale.float().reshape(-1, scale.shape[-1])
    return torch.kron(flat, torch.ones(1, group)).reshape(*scale.shape[:-1], scale.shape[-1] * group)


# (a), (b) E2M1 unpacking


def test_unpack_matches_compressed_tensors():
    packed = torch.cat([torch.arange(256, dtype=torch.uint8).reshape(8, 32), _bytes(8, 32)])  # every byte value
    assert _same(unpack_e2m1(packed), _ct_values(packed))
    stacked = _bytes(3, 5, 8, seed=2)  # leading expert dimension
    assert _same(unpack_e2m1(stacked), _ct_values(stacked))


@pytest.mark.parametrize(
    "byte, values",
    [
        (0x21, [0.5, 1.0]),
        (0xF7, [6.0, -6.0]),
        (0x98, [-0.0, -0.5]),
        (0x00, [0.0, 0.0]),
        (0x5C, [-2.0, 3.0]),
        (0xB3, [1.5, -1.5]),
    ],
)
def test_unpack_hand_computed_bytes(byte, values):
    """The low nibble is element 0; bit 3 of a nibble is the sign."""
    assert _same(unpack_e2m1(torch.tensor([byte], dtype=torch.uint8)), torch.tensor(values))


# (c) full NVFP4 dequantisation


def test_nvfp4_modelopt_dequantize():
    out_features, in_features = 24, 64
    tensors = {
        "weight": _bytes(out_features, in_features // 2),
        "weight_scale": _fp8_scales(out_features, 4),
        "weight_scale_2": torch.tensor(0.0123),
        "input_scale": torch.tensor(1.0),
    }
    fmt, shape = detect_format("m", tensors)
    assert (fmt, shape) == (NVFP4, (out_features, in_features))
    weight = StoredWeight(fmt, tensors, shape, "m")
    check_scales(weight)
    expected = _ct_values(tensors["weight"]) * _group_expand(tensors["weight_scale"]) * 0.0123
    torch.testing.assert_close(weight.dequantize(), expected, rtol=1e-6, atol=0)


def test_nvfp4_compressed_tensors_dequantize():
    out_features, in_features = 24, 64
    tensors = {
        "weight_packed": _bytes(out_features, in_features // 2),
        "weight_scale": _fp8_scales(out_features, 4),
        "weight_global_scale": torch.tensor([2688.0]),
    }
    fmt, shape = detect_format("m", tensors)
    assert (fmt, shape) == (NVFP4_CT, (out_features, in_features))
    weight = StoredWeight(fmt, tensors, shape, "m")
    check_scales(weight)
    expected = _ct_values(tensors["weight_packed"]) * _group_expand(tensors["weight_scale"]) / 2688.0
    torch.testing.assert_close(weight.dequantize(), expected, rtol=1e-6, atol=0)


# (d) our packer against compressed-tensors' packer and NVFP4's accuracy


def _nearest_e2m1(x):
    """Round to the E2M1 grid by brute force: the grid value at the least distance (ties: smaller magnitude)."""
    magnitude = E2M1_GRID[(x.abs()[..., None] - E2M1_GRID).abs().argmin(dim=-1)]
    return torch.where(x < 0, -magnitude, magnitude)


@pytest.mark.parametrize("pack", [quantize.nvfp4_modelopt, quantize.nvfp4_compressed_tensors])
def test_nvfp4_packer_matches_compressed_tensors(pack):
    w = torch.randn(32, 128, generator=_gen(3))
    tensors = pack(w)
    packed = tensors.get("weight", tensors.get("weight_packed"))
    global_scale = tensors["weight_scale_2"] if "weight_scale_2" in tensors else 1 / tensors["weight_global_scale"]
    # the E2M1 values these bytes stand for, decoded by compressed-tensors and repacked by it: byte-identical
    values = _ct_values(packed)
    assert torch.equal(pack_fp4_to_uint8(values), packed)
    # and they are the nearest E2M1 values of w / (block scale * global scale), rounded independently here
    divisor = tensors["weight_scale"].float()[..., None] * global_scale.float()
    scaled = (w.reshape(32, 8, 16) / divisor).reshape(32, 128)
    assert torch.equal(pack_fp4_to_uint8(_nearest_e2m1(scaled)), packed)
    assert torch.equal(values, _nearest_e2m1(scaled))
    fmt, shape = detect_format("m", tensors)
    error = (StoredWeight(fmt, tensors, shape, "m").dequantize() - w).norm() / w.norm()
    assert 0 < error < 0.15


# (e) FP8


@pytest.mark.parametrize(
    "shape, block", [((70, 100), (32, 32)), ((50, 130), (16, 48)), ((128, 256), (128, 128)), ((5, 7), (128, 128))]
)
def test_fp8_block_partial_blocks(shape, block):
    out_features, in_features = shape
    weight = (torch.randn(shape, generator=_gen(4)) * 100).to(torch.float8_e4m3fn)
    grid = (-(-out_features // block[0]), -(-in_features // block[1]))
    scale_inv = torch.rand(grid, generator=_gen(5)) + 0.1
    tensors = {"weight": weight, "weight_scale_inv": scale_inv}
    fmt, logical = detect_format("m", tensors)
    assert (fmt, logical) == (FP8_BLOCK, shape)
    stored = StoredWeight(fmt, tensors, logical, "m", block)
    check_scales(stored)
    expected = weight.float() * torch.kron(scale_inv, torch.ones(block))[:out_features, :in_features]
    torch.testing.assert_close(stored.dequantize(), expected, rtol=0, atol=0)


@pytest.mark.parametrize("scale_shape", [(), (1,), (40,), (40, 1)], ids=["scalar", "one", "channel", "channel-col"])
def test_fp8_per_tensor_and_per_channel(scale_shape):
    weight = (torch.randn(40, 48, generator=_gen(6)) * 50).to(torch.float8_e4m3fn)
    scale = torch.rand(scale_shape, generator=_gen(7)) + 0.1
    tensors = {"weight": weight, "weight_scale": scale, "input_scale": torch.tensor(1.0)}
    fmt, shape = detect_format("m", tensors)
    assert (fmt, shape) == (FP8_TENSOR, (40, 48))
    stored = StoredWeight(fmt, tensors, shape, "m")
    check_scales(stored)
    row_scale = scale.reshape(40, 1) if scale.numel() == 40 else scale.reshape(1, 1).expand(40, 1)
    expected = weight.float() * row_scale  # row i scaled by the scale of output channel i
    torch.testing.assert_close(stored.dequantize(), expected, rtol=0, atol=0)


# (f) refusing what we cannot decode


@pytest.mark.parametrize(
    "tensors, match",
    [
        (
            {
                "weight": torch.zeros(4, 8, dtype=torch.uint8),
                "weight_scale": torch.zeros(4, 1, dtype=torch.float8_e4m3fn),
            },
            r"m stores weight \(torch\.uint8\), weight_scale \(torch\.float8_e4m3fn\), which is no weight format",
        ),
        (
            {"weight": torch.zeros(4, 8, dtype=torch.int8)},
            r"m stores weight \(torch\.int8\), which is no weight format",
        ),
        ({"weight": torch.zeros(4, 8), "weight_scale_inv": torch.ones(1, 1)}, "no weight format MoE Desk knows"),
        (
            {"weight_scale": torch.ones(4, 1), "input_scale": torch.ones(())},
            r"m has tensors \['weight_scale'\] but no weight",
        ),
        ({"weight_packed": torch.zeros(4, 8, dtype=torch.uint8), "weight_scale": torch.ones(4, 1)}, "but no weight"),
    ],
)
def test_detect_format_rejects_unknown_combinations(tensors, match):
    with pytest.raises(ValueError, match=match):
        detect_format("m", tensors)


def test_detect_format_ignores_activation_scales():
    dense = {"weight": torch.zeros(4, 8, dtype=torch.bfloat16)}
    assert detect_format("m", dense) == (DENSE, (4, 8))
    fp8 = {
        "weight": torch.zeros(4, 8, dtype=torch.float8_e4m3fn),
        "weight_scale": torch.ones(()),
        "input_scale": torch.ones(()),
        "k_scale": torch.ones(()),
        "v_scale": torch.ones(()),
    }
    assert detect_format("m", fp8) == (FP8_TENSOR, (4, 8))


@pytest.mark.parametrize(
    "fmt, tensors, block, match",
    [
        (
            NVFP4,
            {"weight": _bytes(8, 16), "weight_scale": _fp8_scales(8, 1), "weight_scale_2": torch.ones(())},
            None,
            r"NVFP4 weight_scale has shape \[8, 1\], expected \[8, 2\]",
        ),
        (
            NVFP4_CT,
            {"weight_packed": _bytes(8, 16), "weight_scale": _fp8_scales(2, 8), "weight_global_scale": torch.ones(1)},
            None,
            r"weight_scale has shape \[2, 8\], expected \[8, 2\]",
        ),
        (
            FP8_BLOCK,
            {"weight": torch.zeros(70, 100, dtype=torch.float8_e4m3fn), "weight_scale_inv": torch.ones(2, 4)},
            (32, 32),
            r"weight_scale_inv has shape \[2, 4\], expected \[3, 4\] for 32x32 blocks",
        ),
        (
            FP8_TENSOR,
            {"weight": torch.zeros(8, 16, dtype=torch.float8_e4m3fn), "weight_scale": torch.ones(16)},
            None,
            r"weight_scale has 16 values, expected 1 \(per tensor\) or 8 \(per output channel\)",
        ),
    ],
)
def test_check_scales_rejects_misshaped_scales(fmt, tensors, block, match):
    shape = detect_format("m", tensors)[1]
    weight = StoredWeight(fmt, tensors, shape, "m", block or (128, 128))
    with pytest.raises(ValueError, match=match):
        check_scales(weight)


# (g) one expert out of a stack


def _stack(fmt, w):
    if fmt == DENSE:
        return {"weight": w.to(torch.bfloat16)}
    if fmt == FP8_BLOCK:
        return quantize.fp8_block(w, (16, 32))
    if fmt == FP8_TENSOR + "_channel":
        return {"weight": (w * 40).to(torch.float8_e4m3fn), "weight_scale": torch.rand(w.shape[:-1]) + 0.1}
    return {
        FP8_TENSOR: quantize.fp8_per_tensor,
        NVFP4: quantize.nvfp4_modelopt,
        NVFP4_CT: quantize.nvfp4_compressed_tensors,
    }[fmt](w)


@pytest.mark.parametrize("fmt", [DENSE, FP8_TENSOR, FP8_TENSOR + "_channel", FP8_BLOCK, NVFP4, NVFP4_CT])
def test_select_expert_from_stack(fmt):
    w = torch.randn(3, 40, 64, generator=_gen(8))
    tensors = _stack(fmt, w)
    detected, shape = detect_format("experts", tensors)
    assert detected == fmt.removesuffix("_channel") and shape == (3, 40, 64)
    stack = StoredWeight(detected, tensors, shape, "experts", (16, 32))
    whole = stack.dequantize()
    for e in range(3):
        one = stack.select(e)
        assert one.shape == (40, 64) and one.format == detected
        check_scales(one)
        assert torch.equal(one.dequantize(), whole[e])
