"""The chunked gated delta rule (reference.gated_delta_rule, which prefill runs) equals its definition, the
token-by-token recurrence, whatever the prompt's length against the 64-token chunks."""

import pytest
import torch

from engine.kernels import reference

TOLERANCE = 1e-4  # float32 against float64: only rounding and summation order differ


def _recurrence(q, k, v, g, beta, state):
    """S <- exp(g) S + k (beta (v - exp(g) S^T k))^T and o = S^T q, one token at a time, in float64."""
    s = state.double().clone()
    outputs = []
    for t in range(q.shape[0]):
        s = s * g[t].double().exp()[:, None, None]
        delta = beta[t].double()[:, None] * (v[t].double() - torch.einsum("hkv,hk->hv", s, k[t].double()))
        s = s + k[t].double()[:, :, None] * delta[:, None, :]
        outputs.append(torch.einsum("hkv,hk->hv", s, q[t].double()))
    return torch.stack(outputs), s


def _inputs(tokens, heads=3, key_dim=16, value_dim=24, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def unit(t):
        return t / t.norm(dim=-1, keepdim=True)

    q = unit(torch.randn(tokens, heads, key_dim, generator=gen)) * key_dim**-0.5
    k = unit(torch.randn(tokens, heads, key_dim, generator=gen))
    v = torch.randn(tokens, heads, value_dim, generator=gen)
    # log-decays from nearly none to strong (exp(-8)), as softplus gates give them
    g = -(torch.rand(tokens, heads, generator=gen) ** 3) * 8
    beta = torch.rand(tokens, heads, generator=gen)
    state = 0.3 * torch.randn(heads, key_dim, value_dim, generator=gen)
    return q, k, v, g, beta, state


def _relative(got, expected):
    return float((got.double() - expected).abs().max() / expected.abs().max())


@pytest.mark.parametrize("tokens", [2, 5, 63, 64, 65, 128, 200, 321, 600])
def test_the_chunked_rule_is_the_recurrence(tokens):
    q, k, v, g, beta, state = _inputs(tokens, seed=tokens)
    expected_o, expected_state = _recurrence(q, k, v, g, beta, state)
    got_o = reference.gated_delta_rule(q, k, v, g, beta, state)
    assert got_o.shape == expected_o.shape and got_o.dtype == torch.float32
    assert _relative(got_o, expected_o) < TOLERANCE
    assert _relative(state, expected_state) < TOLERANCE  # the state was updated in place


def test_a_prompt_in_pieces_equals_it_whole():
    """Prefill chunks continue one another's state: 70 + 1 + 129 tokens give what 200 at once give."""
    q, k, v, g, beta, state = _inputs(200, seed=7)
    whole_state, pieces_state = state.clone(), state.clone()
    whole = reference.gated_delta_rule(q, k, v, g, beta, whole_state)
    pieces = [
        reference.gated_delta_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], pieces_state)
        for a, b in ((0, 70), (70, 71), (71, 200))
    ]
    assert _relative(torch.cat(pieces), whole.double()) < TOLERANCE
    assert _relative(pieces_state, whole_state.double()) < TOLERANCE


def test_no_decay_and_full_decay():
    """g = 0 keeps the whole past, a strongly negative g forgets it: both stay finite and exact."""
    for scale in (0.0, 60.0):
        q, k, v, g, beta, state = _inputs(130, seed=3)
        g = torch.full_like(g, -scale)
        expected_o, expected_state = _recurrence(q, k, v, g, beta, state)
        got_o = reference.gated_delta_rule(q, k, v, g, beta, state)
        assert torch.isfinite(got_o).all()
        assert _relative(got_o, expected_o) < TOLERANCE
        assert _relative(state, expected_state) < TOLERANCE


@pytest.mark.parametrize("heads", [1, 3])
def test_the_inputs_are_left_as_they_were(heads):
    q, k, v, g, beta, state = _inputs(130, heads=heads, seed=5)
    inputs = [t.clone() for t in (q, k, v, g, beta)]
    reference.gated_delta_rule(q, k, v, g, beta, state)
    assert all(torch.equal(a, b) for a, b in zip(inputs, (q, k, v, g, beta)))
