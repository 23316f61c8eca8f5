"""The engine's logits equal transformers' (float32, on the dequantised weights) for every
architecture, expert layout and weight format we load."""

import json

import pytest
import torch
from reference import dequantised_copy, transformers_greedy, transformers_logits, transformers_model

import engine

# (arch, format, fused experts, shards)
LAYOUTS = [
    ("qwen3_5_moe", "bf16", True, 1),  # the Qwen/... bf16 release: VL wrapper, fused experts
    ("qwen3_5_moe", "bf16", False, 2),
    ("qwen3_5_moe", "nvfp4", False, 1),  # nvidia/...-NVFP4: ModelOpt MIXED_PRECISION
    ("qwen3_5_moe", "fp8_block", False, 3),  # Qwen/...-FP8
    ("qwen3_5_moe", "nvfp4_ct", False, 1),  # compressed-tensors NVFP4
    ("qwen3_5_moe_text", "bf16", False, 1),
    ("qwen3_5_moe_text", "fp32", True, 1),
    ("qwen3_5_moe_text", "nvfp4", False, 2),
    ("qwen3_5_moe_text", "fp8_block", False, 1),
    ("qwen3_moe", "bf16", False, 1),
    ("qwen3_moe", "fp8_block", False, 2),
    ("qwen3_moe", "nvfp4", False, 1),
    ("qwen3_moe", "nvfp4_ct", False, 1),
]
RELATIVE_TOLERANCE = 2e-3  # max |Δlogit| / max |logit|


def _ids(n, seed):
    return torch.randint(2, 320, (n,), generator=torch.Generator().manual_seed(seed))


def _relative_error(ours, theirs):
    return float((ours - theirs).abs().max() / theirs.abs().max())


def _greedy(model, prompt, new_tokens):
    """Greedy tokens through the incremental path (one forward per token), and the logits behind each."""
    state = model.new_state()
    logits = [model.forward(prompt, state)]
    out = []
    for _ in range(new_tokens):
        out.append(int(logits[-1].argmax()))
        logits.append(model.forward([out[-1]], state))
    return out, torch.stack(logits[:-1])


@pytest.fixture(scope="module")
def reference_pair(tiny_checkpoint, tmp_path_factory):
    cache = {}

    def get(layout):
        if layout not in cache:
            folder = tiny_checkpoint(*layout)
            ref_folder = dequantised_copy(folder, tmp_path_factory.mktemp("reference"))
            # transformers keeps an unquantised KV cache; the FP8 one is held to it in tests/engine/kernels/test_fp8_kv_cache.py
            cache[layout] = engine.load_model(folder, kv_cache_dtype="bf16"), transformers_model(ref_folder)
        return cache[layout]

    return get


def layout_id(layout) -> str:
    """Names a layout case for pytest: arch-format-fused/split-shards."""
    arch, fmt, fused, shards = layout
    return f"{arch}-{fmt}-{'fused' if fused else 'split'}-{shards}"


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_score_matches_transformers(layout, reference_pair):
    ours, theirs = reference_pair(layout)
    ids = _ids(150, seed=1)  # longer than one 64-token GDN chunk
    expected = transformers_logits(theirs, ids)
    got = ours.score(ids)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert _relative_error(got, expected) <= RELATIVE_TOLERANCE


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_greedy_tokens_match_transformers(layout, reference_pair):
    ours, theirs = reference_pair(layout)
    prompt = _ids(20, seed=2)
    tokens, decode_logits = _greedy(ours, prompt, 32)
    assert tokens == transformers_greedy(theirs, prompt, 32)
    # the decode steps' logits, not only their argmax, equal a full forward over the same sequence
    full = transformers_logits(theirs, torch.cat([prompt, torch.tensor(tokens[:-1])]))
    assert _relative_error(decode_logits, full[len(prompt) - 1 :]) <= RELATIVE_TOLERANCE


def _randomise(model, seed):
    """save_pretrained of a fresh model writes zero norms and constant biases; give every tensor values."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.empty(param.shape).uniform_(1, 16, generator=generator).log())
            else:
                std = 0.1 if param.dim() == 1 else param.shape[-1] ** -0.5
                param.copy_(
                    torch.randn(param.shape, generator=generator) * std
                    + (1.0 if "norm" in name and "qwen3_moe" in type(model).__module__ else 0.0)
                )
    return model


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_5_moe_text", "qwen3_moe"])
def test_checkpoints_written_by_transformers_save_pretrained(arch, tiny_checkpoint, tmp_path):
    source = dequantised_copy(tiny_checkpoint(arch, "fp32"), tmp_path / "source")
    config = json.loads((source / "config.json").read_text())
    model = _randomise(transformers_model(source), seed=3)
    model.save_pretrained(tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["model_type"] == config["model_type"]
    ids = _ids(80, seed=4)
    expected = transformers_logits(model, ids)
    got = engine.load_model(tmp_path / "saved").score(ids)
    assert _relative_error(got, expected) <= RELATIVE_TOLERANCE
