"""The Triton NVFP4 linear equals dequantise-then-matmul; on CI it runs in Triton's CPU interpreter."""

import pytest
import torch

# On a machine without a GPU, conftest.py has switched Triton to its CPU interpreter.
pytest.importorskip("triton", reason="Triton ships for Linux; the Windows app runs the reference kernels")

from engine.checkpoint import quantize  # noqa: E402
from engine.checkpoint.formats import NVFP4, NVFP4_CT, StoredWeight, detect_format  # noqa: E402
from engine.kernels.triton_nvfp4 import nvfp4_linear  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _weight(out_features, in_features, encoder, seed):
    w = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
    tensors = {role: t.to(DEVICE) for role, t in encoder(w).items()}
    fmt, shape = detect_format("w", tensors)
    return StoredWeight(fmt, tensors, shape, "w")


@pytest.mark.parametrize("encoder, fmt", [(quantize.nvfp4_modelopt, NVFP4),
                                          (quantize.nvfp4_compressed_tensors, NVFP4_CT)])
@pytest.mark.parametrize("tokens, out_features, in_features", [
    (1, 64, 128),  # one decode token
    (5, 48, 80),  # sizes that fill no block: masked rows, columns and a half-used K block
    (33, 130, 256),
])
def test_matches_dequantise_then_matmul(encoder, fmt, tokens, out_features, in_features):
    weight = _weight(out_features, in_features, encoder, seed=tokens)
    assert weight.format == fmt
    x = torch.randn(tokens, in_features, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    expected = x.double() @ weight.dequantize(torch.float64).T
    got = nvfp4_linear(x, weight)
    assert got.shape == (tokens, out_features) and got.dtype == torch.float32
    # float32 operands and float32 math: the only difference is summation order
    assert float((got.double() - expected).abs().max() / expected.abs().max()) < 1e-5


def test_half_precision_inputs():
    weight = _weight(64, 128, quantize.nvfp4_modelopt, seed=3)
    x = torch.randn(7, 128, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    expected = x.double() @ weight.dequantize(torch.float64).T
    got = nvfp4_linear(x.half(), weight)
    assert got.dtype == torch.float16
    assert float((got.double() - expected).abs().max() / expected.abs().max()) < 5e-3  # fp16 operands


def test_leading_dimensions_are_kept():
    weight = _weight(32, 64, quantize.nvfp4_modelopt, seed=4)
    x = torch.randn(2, 3, 64).to(DEVICE)
    assert nvfp4_linear(x, weight).shape == (2, 3, 32)
