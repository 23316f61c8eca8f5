"""Honest random weights (engine/testing/random_weights.py): no repeats, and the magnitudes each role needs."""

import pytest
import torch

from engine.checkpoint.formats import FP8_BLOCK, FP8_TENSOR, NVFP4, NVFP4_CT, StoredWeight
from engine.testing.random_weights import random_tensors

H, INTER, E = 256, 64, 8
LAYOUT = {
    "model.language_model.embed_tokens.weight": ("BF16", (1000, H)),
    "model.language_model.layers.0.input_layernorm.weight": ("BF16", (H,)),
    "model.language_model.layers.0.linear_attn.A_log": ("BF16", (32,)),
    "model.language_model.layers.0.mlp.gate.weight": ("BF16", (E, H)),
    "model.language_model.layers.0.self_attn.q_proj.weight": ("F8_E4M3", (H, H)),
    "model.language_model.layers.0.self_attn.q_proj.weight_scale": ("F32", ()),
    "model.language_model.layers.0.self_attn.q_proj.input_scale": ("F32", ()),
    "model.layers.0.mlp.shared_expert.up_proj.weight": ("F8_E4M3", (INTER, H)),
    "model.layers.0.mlp.shared_expert.up_proj.weight_scale_inv": ("BF16", (1, 2)),
    "lm_head.weight": ("U8", (1000, H // 2)),
    "lm_head.weight_scale": ("F8_E4M3", (1000, H // 16)),
    "lm_head.weight_scale_2": ("F32", ()),
    "model.layers.1.mlp.experts.0.down_proj.weight_packed": ("U8", (H, INTER // 2)),
    "model.layers.1.mlp.experts.0.down_proj.weight_scale": ("F8_E4M3", (H, INTER // 16)),
    "model.layers.1.mlp.experts.0.down_proj.weight_global_scale": ("F32", ()),
    "mtp.fc.weight": ("BF16", (H, 2 * H)),
    "model.visual.blocks.0.attn.qkv.weight": ("BF16", (48, 16)),
}
for e in range(E):
    LAYOUT[f"model.language_model.layers.0.mlp.experts.{e}.gate_proj.weight"] = ("U8", (INTER, H // 2))
    LAYOUT[f"model.language_model.layers.0.mlp.experts.{e}.gate_proj.weight_scale"] = ("F8_E4M3", (INTER, H // 16))
    LAYOUT[f"model.language_model.layers.0.mlp.experts.{e}.gate_proj.weight_scale_2"] = ("F32", ())


@pytest.fixture(scope="module")
def tensors():
    return random_tensors(LAYOUT, zero_centred_norms=True, seed=3, threads=2)


def stored(tensors, module, fmt, **roles):
    found = {role: tensors[f"{module}.{name}"] for role, name in roles.items()}
    weight = found.get("weight", found.get("weight_packed"))
    out, inner = weight.shape
    shape = (out, inner * 2) if fmt in (NVFP4, NVFP4_CT) else (out, inner)
    return StoredWeight(fmt, found, shape, module, (128, 128)).dequantize()


def test_the_layout_is_followed_and_skipped_parts_left_out(tensors):
    expected = {n for n in LAYOUT if not n.startswith(("mtp.", "model.visual."))}
    assert set(tensors) == expected
    for name in expected:
        dtype, shape = LAYOUT[name]
        assert tuple(tensors[name].shape) == shape, name


def test_no_row_repeats(tensors):
    embedding = tensors["model.language_model.embed_tokens.weight"]
    assert embedding.unique(dim=0).shape[0] == embedding.shape[0]
    router = tensors["model.language_model.layers.0.mlp.gate.weight"]
    assert router.unique(dim=0).shape[0] == E
    firsts = torch.stack(
        [tensors[f"model.language_model.layers.0.mlp.experts.{e}.gate_proj.weight"][0] for e in range(E)]
    )
    assert firsts.unique(dim=0).shape[0] == E
    head = tensors["lm_head.weight"]
    assert head.unique(dim=0).shape[0] == head.shape[0]


def test_same_seed_same_weights_other_seed_other_weights(tensors):
    again = random_tensors(LAYOUT, zero_centred_norms=True, seed=3, threads=1)
    other = random_tensors(LAYOUT, zero_centred_norms=True, seed=4, threads=2)
    name = "model.language_model.layers.0.mlp.experts.3.gate_proj.weight"
    assert torch.equal(again[name], tensors[name]) and not torch.equal(other[name], tensors[name])


@pytest.mark.parametrize(
    "module, fmt, roles",
    [
        (
            "model.language_model.layers.0.self_attn.q_proj",
            FP8_TENSOR,
            dict(weight="weight", weight_scale="weight_scale"),
        ),
        (
            "model.layers.0.mlp.shared_expert.up_proj",
            FP8_BLOCK,
            dict(weight="weight", weight_scale_inv="weight_scale_inv"),
        ),
        ("lm_head", NVFP4, dict(weight="weight", weight_scale="weight_scale", weight_scale_2="weight_scale_2")),
        (
            "model.layers.1.mlp.experts.0.down_proj",
            NVFP4_CT,
            dict(weight_packed="weight_packed", weight_scale="weight_scale", weight_global_scale="weight_global_scale"),
        ),
    ],
)
def test_quantised_weights_dequantise_to_unit_variance_over_their_inputs(tensors, module, fmt, roles):
    w = stored(tensors, module, fmt, **roles)
    assert torch.isfinite(w).all()
    assert w.pow(2).mean().sqrt().item() == pytest.approx(w.shape[1] ** -0.5, rel=0.15)


def test_plain_tensors_by_role(tensors):
    norm = tensors["model.language_model.layers.0.input_layernorm.weight"].float()
    assert abs(norm.mean().item()) < 0.05  # zero-centred: the norm multiplies by 1 + weight
    a_log = tensors["model.language_model.layers.0.linear_attn.A_log"].float()
    assert 0.0 < a_log.mean().item() < 3.0
