"""The one-token Gated DeltaNet step: the reference composition equals what GatedDeltaNet computes, and the Triton
step (engine/kernels/triton_gdn.py) equals the reference, in Triton's CPU interpreter (CI; conftest.py sets it) or
on CUDA."""

import os

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="Triton ships for Linux; the Windows app runs the reference kernels")

import engine  # noqa: E402
from engine import kernels  # noqa: E402
from engine.kernels import reference, triton_gdn  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# float32: only the summation order differs; bf16: a conv or norm output may round to the neighbouring bf16 value
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.fixture(autouse=True)
def bf16_casts_round_to_nearest(monkeypatch):
    """The interpreter truncates float32 -> bf16 casts where the GPU (and torch) rounds to nearest even; the step
    rounds at six points, so under truncation its bf16 results drift by percents. Round as the GPU does."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.language import bfloat16, float32
    from triton.runtime import interpreter

    truncating = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar != float32 or dst_type.scalar != bfloat16:
            return truncating(self, src, dst_type)
        rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
        return interpreter.TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16), bfloat16)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "cast_impl", cast_impl)


def _close(got, expected, tolerance):
    scale = float(expected.float().abs().max())
    return torch.allclose(got.float(), expected.float(), rtol=tolerance, atol=tolerance * scale)


def _parameters(gen, key_heads, value_heads, key_dim, value_dim, kernel_size):
    """Float32 like WeightSource.param; the ranges of the tiny checkpoints (and of real ones)."""
    channels = 2 * key_heads * key_dim + value_heads * value_dim
    return dict(
        conv_weight=0.5 * torch.randn(channels, kernel_size, generator=gen),
        a_log=torch.empty(value_heads).uniform_(1.0, 16.0, generator=gen).log(),
        dt_bias=1.0 + 0.5 * torch.randn(value_heads, generator=gen),
        norm_weight=1.0 + 0.1 * torch.randn(value_dim, generator=gen),
    )


def _projections(gen, channels, value_heads, value_dim, dtype):
    """qkv, z and b, a as JoinedLinear gives them: column slices of one [1, N] output each."""
    qkvz = (2 * torch.randn(1, channels + value_heads * value_dim, generator=gen)).to(DEVICE, dtype)
    ba = (2 * torch.randn(1, 2 * value_heads, generator=gen)).to(DEVICE, dtype)
    return (*qkvz.split([channels, value_heads * value_dim], dim=-1), *ba.split(value_heads, dim=-1))


SHAPES = {  # key heads, value heads, key dim, value dim, conv kernel
    "tiny": (2, 4, 16, 32, 4),
    "odd-dims": (2, 4, 24, 40, 4),
    "one-group": (3, 3, 8, 20, 3),
    "qwen3.6": (16, 32, 128, 128, 4),
}


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_step_matches_the_reference(shape, dtype):
    key_heads, value_heads, key_dim, value_dim, kernel_size = shape
    gen = torch.Generator().manual_seed(sum(shape))
    params = {name: t.to(DEVICE) for name, t in _parameters(gen, *shape).items()}
    channels = params["conv_weight"].shape[0]
    conv_state = torch.randn(channels, kernel_size - 1, generator=gen).to(DEVICE, dtype)
    recurrent = (0.3 * torch.randn(value_heads, key_dim, value_dim, generator=gen)).to(DEVICE)
    states = {"reference": (conv_state.clone(), recurrent.clone()), "triton": (conv_state, recurrent)}
    tolerance = TOLERANCE[dtype]
    for _ in range(3 if key_dim < 128 else 1):  # the interpreter is slow at the real size
        qkv, z, b, a = _projections(gen, channels, value_heads, value_dim, dtype)
        outs = {}
        for name, step in (("reference", reference.gated_deltanet), ("triton", triton_gdn.gated_deltanet)):
            conv, rec = states[name]
            outs[name] = _run(step, qkv, z, b, a, conv, rec, params, shape)
        got, expected = outs["triton"], outs["reference"]
        assert got.shape == expected.shape == (1, value_heads * value_dim) and got.dtype == dtype
        assert _close(got, expected, tolerance)
        assert torch.equal(states["triton"][0], states["reference"][0])  # conv state: a copy of the inputs
        assert _close(states["triton"][1], states["reference"][1], tolerance)


def test_a_zero_state_and_extreme_gates():
    """A fresh sequence (zero states), with gates where softplus switches to the identity and sigmoid saturates."""
    _, value_heads, _, value_dim, _ = SHAPES["odd-dims"]
    gen = torch.Generator().manual_seed(3)
    params = {name: t.to(DEVICE) for name, t in _parameters(gen, *SHAPES["odd-dims"]).items()}
    channels = params["conv_weight"].shape[0]
    qkv, z, b, a = _projections(gen, channels, value_heads, value_dim, torch.float32)
    b.copy_(torch.tensor([-30.0, 30.0, 0.0, 5.0]))
    a.copy_(torch.tensor([40.0, -40.0, 19.0, 21.0]))
    for got, expected in zip(*_both_steps(qkv, z, b, a, params, SHAPES["odd-dims"], torch.zeros)):
        assert _close(got, expected, 1e-5)


@pytest.mark.parametrize("tokens", [3, 70, 150])
def test_a_prompt_chunk_equals_the_reference(tokens):
    """More than one token runs the reference's chunked rule with its recurrence in one kernel: the same output and
    states, to float32 rounding (64-token chunks and a shorter last one)."""
    _, value_heads, _, value_dim, _ = SHAPES["odd-dims"]
    gen = torch.Generator().manual_seed(4)
    params = {name: t.to(DEVICE) for name, t in _parameters(gen, *SHAPES["odd-dims"]).items()}
    channels = params["conv_weight"].shape[0]
    qkv = torch.randn(tokens, channels, generator=gen).to(DEVICE)
    z = torch.randn(tokens, value_heads * value_dim, generator=gen).to(DEVICE)
    b, a = torch.randn(2, tokens, value_heads, generator=gen).to(DEVICE)
    for got, expected in zip(*_both_steps(qkv, z, b, a, params, SHAPES["odd-dims"], torch.ones)):
        assert _close(got, expected, TOLERANCE[torch.float32])


@pytest.mark.parametrize(
    "chunks, heads, length, key_dim, value_dim", [(3, 2, 64, 32, 48), (1, 3, 20, 16, 16), (2, 1, 64, 40, 16)]
)
def test_the_recurrence_kernel_equals_the_reference_loop(chunks, heads, length, key_dim, value_dim):
    gen = torch.Generator().manual_seed(chunks + length)
    new_v = torch.randn(chunks, heads, length, value_dim, generator=gen).to(DEVICE)
    w = (0.2 * torch.randn(chunks, heads, length, key_dim, generator=gen)).to(DEVICE)
    k = (0.2 * torch.randn(chunks, heads, length, key_dim, generator=gen)).to(DEVICE)
    end_decay = torch.rand(chunks, heads, 1, 1, generator=gen).to(DEVICE)
    s = torch.randn(heads, key_dim, value_dim, generator=gen).to(DEVICE)
    expected_v = new_v.clone()
    expected = reference.delta_chunk_states(expected_v, w, k.transpose(-1, -2), end_decay, s)
    got = triton_gdn.delta_chunk_states(new_v, w, k.transpose(-1, -2), end_decay, s)
    assert got.shape == (chunks + 1, heads, key_dim, value_dim)
    assert _close(got, expected, 1e-5) and _close(new_v, expected_v, 1e-5)
    assert not torch.equal(got[-1], s)  # the state moved


def _run(step, qkv, z, b, a, conv, rec, params, shape):
    """One token's (or chunk's) Gated DeltaNet through `step` (the reference or the Triton one), states in place."""
    key_heads, value_heads, key_dim, value_dim, _ = shape
    return step(
        qkv,
        z,
        b,
        a,
        conv,
        params["conv_weight"],
        rec,
        params["a_log"],
        params["dt_bias"],
        params["norm_weight"],
        1e-6,
        key_heads,
        value_heads,
        key_dim,
        value_dim,
    )


def _both_steps(qkv, z, b, a, params, shape, fill):
    """(out, conv state, recurrent state) after the reference step and after the Triton step, each from states
    made by `fill` (torch.zeros or torch.ones)."""
    key_heads, value_heads, key_dim, value_dim, kernel_size = shape
    results = []
    for step in (reference.gated_deltanet, triton_gdn.gated_deltanet):
        conv = fill(params["conv_weight"].shape[0], kernel_size - 1, device=DEVICE)
        rec = fill(value_heads, key_dim, value_dim, device=DEVICE)
        out = _run(step, qkv, z, b, a, conv, rec, params, shape)
        results.append((out, conv, rec))
    return results


def _randomise(state, gen):
    state.conv.copy_(torch.randn(state.conv.shape, generator=gen))
    state.recurrent.copy_(0.3 * torch.randn(state.recurrent.shape, generator=gen))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("step", ["dispatch", "triton"])
def test_the_step_equals_what_gated_deltanet_computes(tiny_checkpoint, dtype, step):
    """GatedDeltaNet's own T == 1 forward against its projections around the step (the dispatch is the reference
    on the CPU: bit for bit), on a tiny model's real weights, over several tokens."""
    model = engine.load_model(tiny_checkpoint("qwen3_5_moe", "bf16"), device=DEVICE, dtype=dtype)
    layer = next(layer.mixer for layer in model.layers if hasattr(layer.mixer, "conv_weight"))
    gen = torch.Generator().manual_seed(7)
    expected_state = layer.new_state(None, DEVICE, dtype)
    _randomise(expected_state, gen)
    state = expected_state.clone()
    run = kernels.gated_deltanet if step == "dispatch" else triton_gdn.gated_deltanet
    exact = step == "dispatch" and DEVICE == "cpu"
    for position in range(4):
        x = torch.randn(1, model.config.hidden_size, generator=gen).to(DEVICE, dtype)
        expected = layer(x, torch.tensor([position], device=DEVICE), expected_state)
        qkv, z = layer.in_proj_qkvz(x)
        b, a = layer.in_proj_ba(x)
        out = run(
            qkv,
            z,
            b,
            a,
            state.conv,
            layer.conv_weight,
            state.recurrent,
            layer.a_log,
            layer.dt_bias,
            layer.norm_weight,
            layer.eps,
            layer.key_heads,
            layer.value_heads,
            layer.key_dim,
            layer.value_dim,
        )
        got = layer.out_proj(out)
        if exact:
            assert torch.equal(got, expected)
            assert torch.equal(state.recurrent, expected_state.recurrent)
        else:
            assert _close(got, expected, TOLERANCE[dtype])
            assert _close(state.recurrent, expected_state.recurrent, TOLERANCE[dtype])
        assert torch.equal(state.conv, expected_state.conv)
