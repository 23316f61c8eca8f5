"""The llama.cpp side-by-side tools: the random qwen35moe GGUF reads back as llama.cpp's loader expects it, and
the sdist trimmer keeps the build's files and drops the rest."""

import io
import tarfile

import gguf
import numpy as np
import pytest

from tools import gguf_random, llama_source

Q4_K, F16, F32 = (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny GGUF, written once and read back with gguf's own reader."""
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    assert gguf_random.main([str(path), "--tiny"]) == 0
    return gguf.GGUFReader(path)


def field(reader, key):
    """Return a metadata field's value as read from the file."""
    return reader.fields[key].contents()


def test_tiny_gguf_has_the_qwen35moe_metadata(tiny):
    assert field(tiny, "general.architecture") == "qwen35moe"
    expected = {
        "block_count": 4,
        "embedding_length": 256,
        "attention.head_count": 2,
        "attention.head_count_kv": 1,
        "attention.key_length": 64,
        "expert_count": 8,
        "expert_used_count": 2,
        "expert_feed_forward_length": 256,
        "expert_shared_feed_forward_length": 256,
        "ssm.conv_kernel": 4,
        "ssm.inner_size": 4 * 32,
        "ssm.state_size": 32,
        "ssm.time_step_rank": 4,
        "ssm.group_count": 2,
        "full_attention_interval": 4,
        "vocab_size": 512,
        "rope.dimension_count": 16,
    }
    assert {key: field(tiny, f"qwen35moe.{key}") for key in expected} == expected
    assert field(tiny, "qwen35moe.rope.dimension_sections") == [3, 3, 2, 0]
    assert field(tiny, "tokenizer.ggml.model") == "none"


def test_tiny_gguf_tensors_are_named_shaped_and_typed_for_the_loader(tiny):
    # ggml's order (ne: fastest dimension first), as src/models/qwen35moe.cpp creates them
    tensors = {t.name: (tuple(int(n) for n in t.shape), t.tensor_type) for t in tiny.tensors}
    assert tensors["token_embd.weight"] == ((256, 512), F16)
    assert tensors["output.weight"] == ((256, 512), F16)
    assert tensors["blk.3.attn_q.weight"] == ((256, 2 * 2 * 64), F16)  # queries and their gate
    assert tensors["blk.3.attn_k.weight"] == ((256, 64), F16)
    assert tensors["blk.3.attn_output.weight"] == ((2 * 64, 256), F16)
    assert tensors["blk.0.attn_qkv.weight"] == ((256, 2 * 2 * 32 + 4 * 32), F16)
    assert tensors["blk.0.attn_gate.weight"] == ((256, 4 * 32), F16)
    assert tensors["blk.0.ssm_conv1d.weight"] == ((4, 2 * 2 * 32 + 4 * 32), F32)
    assert tensors["blk.0.ssm_a"] == ((4,), F32)
    assert tensors["blk.0.ssm_dt.bias"] == ((4,), F32)
    assert tensors["blk.0.ssm_out.weight"] == ((4 * 32, 256), F16)
    assert tensors["blk.2.ffn_gate_inp.weight"] == ((256, 8), F32)
    assert tensors["blk.2.ffn_gate_exps.weight"] == ((256, 256, 8), Q4_K)
    assert tensors["blk.2.ffn_up_exps.weight"] == ((256, 256, 8), Q4_K)
    assert tensors["blk.2.ffn_down_exps.weight"] == ((256, 256, 8), Q4_K)
    assert tensors["blk.2.ffn_gate_inp_shexp.weight"] == ((256,), F32)
    assert tensors["blk.2.ffn_down_shexp.weight"] == ((256, 256), F16)
    # layer 3 is the only full-attention layer of 4: it has no Gated DeltaNet, the others no attention
    assert [n for n in tensors if n.endswith("attn_q.weight")] == ["blk.3.attn_q.weight"]
    assert sum(n.endswith("ssm_out.weight") for n in tensors) == 3
    per_linear_layer, per_full_layer, outside_layers = 19, 16, 3
    assert len(tensors) == outside_layers + 3 * per_linear_layer + per_full_layer


def test_tiny_gguf_weights_do_not_repeat(tiny):
    data = {t.name: np.asarray(t.data) for t in tiny.tensors}
    embedding = data["token_embd.weight"]
    assert len(np.unique(embedding, axis=0)) == embedding.shape[0]
    experts = data["blk.0.ffn_gate_exps.weight"].reshape(8, -1)
    assert len(np.unique(experts, axis=0)) == 8
    assert not np.array_equal(data["blk.0.ffn_gate_exps.weight"], data["blk.1.ffn_gate_exps.weight"])
    assert not np.array_equal(data["blk.0.ffn_gate_exps.weight"], data["blk.0.ffn_up_exps.weight"])


def test_q4_k_block_scales_are_finite_and_positive(tiny):
    expert = next(t for t in tiny.tensors if t.name == "blk.0.ffn_down_exps.weight")
    blocks = np.asarray(expert.data).reshape(-1, 144)
    scales = blocks[:, :4].copy().view(np.float16)
    assert np.isfinite(scales).all() and (scales > 0).all()


def test_full_shape_matches_the_real_config_and_the_stated_expert_bytes():
    assert gguf_random.FULL.rotary_dim == 64 and gguf_random.FULL.rope_sections == (11, 11, 10, 0)
    assert (gguf_random.FULL.experts, gguf_random.FULL.experts_used, gguf_random.FULL.hidden) == (256, 8, 2048)
    specs = {s.name: s for s in gguf_random.tensor_specs(gguf_random.FULL)}
    assert sum(n.endswith("attn_q.weight") for n in specs) == 10
    assert sum(n.endswith("ssm_out.weight") for n in specs) == 30
    assert specs["blk.39.ffn_gate_exps.weight"].shape == (256, 512, 2048)
    expert_bytes = sum(
        s.shape[1] * s.shape[2] // 256 * 144
        for n, s in specs.items()
        if n.startswith("blk.0.") and n.endswith("_exps.weight")
    )
    assert expert_bytes == 1_769_472


def make_sdist(path, names):
    """Write a .tar.gz holding these files (under the sdist's folder), each a few bytes."""
    with tarfile.open(path, "w:gz") as archive:
        for name, text in names.items():
            data = text.encode()
            info = tarfile.TarInfo(f"llama_cpp_python-9.9.9/{name}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))


def test_llama_source_keeps_the_build_and_drops_the_rest(tmp_path):
    kept = [
        "CMakeLists.txt",
        "src/llama-arch.cpp",
        "ggml/src/ggml.c",
        "ggml/src/CMakeLists.txt",
        "ggml/src/ggml-cuda/mmq.cu",
        "ggml/src/ggml-cpu/ops.cpp",
        "tools/llama-bench/llama-bench.cpp",
        "tools/ui/CMakeLists.txt",
        "scripts/ui-assets.cmake",
        "vendor/nlohmann/json.hpp",
    ]
    dropped = [
        "docs/build.md",
        "models/ggml-vocab.gguf",
        "ggml/src/ggml-vulkan/vk.cpp",
        "tools/ui/src/app.ts",
        "tests/test-backend-ops.cpp",
        "scripts/sync.py",
        "convert_hf_to_gguf.py",
    ]
    files = {f"vendor/llama.cpp/{name}": "x" for name in kept + dropped}
    files["CHANGELOG.md"] = (
        "## [Unreleased]\n\n## [9.9.9]\n\n- feat: update llama.cpp to ggml-org/llama.cpp@abc1234\n"
        "\n## [9.9.8]\n\n- feat: update llama.cpp to ggml-org/llama.cpp@def5678\n"
    )
    sdist = tmp_path / "sdist.tar.gz"
    make_sdist(sdist, files)
    out = tmp_path / "src"
    assert llama_source.main([str(sdist), "--out", str(out)]) == 0
    written = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert written == sorted(kept + ["VENDORED_COMMIT"])
    assert (out / "VENDORED_COMMIT").read_text().split() == ["abc1234", "llama-cpp-python", "9.9.9"]


def test_llama_source_says_what_to_do_without_an_sdist(tmp_path, capsys):
    assert llama_source.main([str(tmp_path / "missing.tar.gz"), "--out", str(tmp_path / "src")]) == 1
    assert "is not a file" in capsys.readouterr().out


def test_like_nvidia_stores_the_fp8_projections_in_q8_0_and_the_shared_expert_in_q4_k(tmp_path):
    path = tmp_path / "tiny.gguf"
    assert gguf_random.main([str(path), "--tiny", "--like-nvidia"]) == 0
    reader = gguf.GGUFReader(path)
    types = {t.name: t.tensor_type for t in reader.tensors}
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    assert {
        types[n]
        for n in (
            "blk.3.attn_q.weight",
            "blk.3.attn_output.weight",
            "blk.0.attn_qkv.weight",
            "blk.0.attn_gate.weight",
            "blk.0.ssm_out.weight",
        )
    } == {q8_0}
    assert {
        types[n]
        for n in (
            "output.weight",
            "blk.0.ffn_gate_shexp.weight",
            "blk.0.ffn_down_shexp.weight",
            "blk.0.ffn_up_exps.weight",
        )
    } == {Q4_K}
    assert (types["token_embd.weight"], types["blk.0.ssm_beta.weight"]) == (F16, F16)
    qkv = next(t for t in reader.tensors if t.name == "blk.0.attn_qkv.weight")
    scales = np.asarray(qkv.data).reshape(-1, 34)[:, :2].copy().view(np.float16)
    assert np.isfinite(scales).all() and (scales > 0).all()
