"""Every bad model folder ends in one CheckpointError that names the file at fault, says what is wrong and
what to do: never a bare traceback. Each test damages a private copy of a tiny checkpoint."""

import json
import re
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

import engine
from engine import CheckpointError

ARCH = "qwen3_5_moe_text"  # flat config.json, keys under model.


def _copy(src, tmp_path):
    return shutil.copytree(src, tmp_path / "model")


def _fails(path, match):
    """load_model(path) raises CheckpointError matching `match`, formatted 'path: cause (hint)' with a hint."""
    with pytest.raises(CheckpointError, match=match) as info:
        engine.load_model(path)
    error = info.value
    assert error.hint, "the user must be told what to do"
    assert str(error) == f"{error.path}: {error.cause} ({error.hint})"
    return error


def _edit_config(folder, name="config.json", **changes):
    config = json.loads((folder / name).read_text())
    config.update(changes)
    (folder / name).write_text(json.dumps(config))


def _rewrite(file, change):
    tensors = {k: v.clone() for k, v in load_file(str(file)).items()}
    change(tensors)
    save_file(tensors, str(file))


def _header_end(file):
    return 8 + struct.unpack("<Q", file.read_bytes()[:8])[0]


@pytest.fixture
def bf16(tiny_checkpoint, tmp_path):
    return _copy(tiny_checkpoint(ARCH, "bf16"), tmp_path)


# (a), (b), (c), (d): the folder and its config.json

def test_folder_without_config(bf16):
    (bf16 / "config.json").unlink()
    assert _fails(bf16, "has no config.json").path == bf16


def test_path_that_does_not_exist(tmp_path):
    assert _fails(tmp_path / "nowhere", "does not exist").path == tmp_path / "nowhere"


def test_path_that_is_a_file(bf16):
    file = bf16 / "model.safetensors"  # the user picked the weights file instead of its folder
    error = _fails(file, "is not a folder")
    assert error.path == file and "config.json" in error.hint


@pytest.mark.parametrize("text", ["{not json", '{"model_type": "qwen3_5_moe_text", "hidden_'])
def test_config_not_json(bf16, text):
    (bf16 / "config.json").write_text(text)
    assert _fails(bf16, "is not valid JSON").path == bf16 / "config.json"


def test_unsupported_model_type(bf16):
    _edit_config(bf16, model_type="llama")
    error = _fails(bf16, "model_type 'llama' is not supported")
    assert error.path == bf16 / "config.json" and "qwen3_moe" in error.hint


# (e) missing shard, (j) no weights

def test_missing_shard(tiny_checkpoint, tmp_path):
    folder = _copy(tiny_checkpoint(ARCH, "bf16", shards=2), tmp_path)
    (folder / "model-00002-of-00002.safetensors").unlink()
    error = _fails(folder, r"is missing shard model-00002-of-00002\.safetensors listed in model\.safetensors\.index\.json")
    assert error.path == folder and "incomplete" in error.hint


def test_no_safetensors_files(bf16):
    (bf16 / "model.safetensors").unlink()
    (bf16 / "model.gguf").write_bytes(b"GGUF")
    error = _fails(bf16, "holds no .safetensors weights")
    assert error.path == bf16 and "GGUF" in error.hint


# (f), (g) and non-safetensors files: the header is checked before anything is read

@pytest.mark.parametrize("where", ["last byte", "middle of data", "first tensor", "inside header"])
def test_truncated_file(bf16, where):
    file = bf16 / "model.safetensors"
    data, start = file.read_bytes(), _header_end(file)
    cut = {"last byte": len(data) - 1, "middle of data": (start + len(data)) // 2, "first tensor": start + 10,
           "inside header": start // 2}[where]
    file.write_bytes(data[:cut])
    assert _fails(bf16, "truncated").path == file


def test_huge_header_length(bf16):
    file = bf16 / "model.safetensors"
    file.write_bytes(struct.pack("<Q", 2**62) + file.read_bytes()[8:])
    error = _fails(bf16, r"corrupt or truncated safetensors header \(header says 4611686018427387904 bytes")
    assert error.path == file and "download" in error.hint


@pytest.mark.parametrize("garbage", [b"\xff\xfe\x00\x81 binary junk", b"this is not JSON at all", b"[" + b" " * 30])
def test_garbage_header(bf16, garbage):
    file = bf16 / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[8:8 + len(garbage)] = garbage
    file.write_bytes(bytes(data))
    assert _fails(bf16, "corrupt safetensors header").path == file


@pytest.mark.parametrize("content", [bytes(range(256)) * 20, b"hello, this is a text file\n" * 40, b"abc", b""],
                         ids=["random bytes", "text", "three bytes", "empty"])
def test_not_a_safetensors_file(bf16, content):
    file = bf16 / "model.safetensors"
    file.write_bytes(content)
    assert _fails(bf16, "safetensors").path == file


# (h) shapes that disagree with config.json

@pytest.mark.parametrize("fmt, fused, shards, found, expected", [
    ("bf16", False, 1, [32, 64], [48, 64]),
    ("bf16", True, 1, [8, 64, 64], [8, 96, 64]),  # fused gate_up stack
    ("nvfp4", False, 3, [32, 64], [48, 64]),  # weight and its scales lie in different shards
    ("nvfp4_ct", False, 1, [32, 64], [48, 64]),
])
def test_config_shape_mismatch(tiny_checkpoint, tmp_path, fmt, fused, shards, found, expected):
    folder = _copy(tiny_checkpoint(ARCH, fmt, fused, shards), tmp_path)
    _edit_config(folder, moe_intermediate_size=48)
    error = _fails(folder, rf"tensor '(?P<key>[^']+)' has shape {re.escape(str(found))} "
                           rf"but config\.json implies {re.escape(str(expected))}")
    key = re.search(r"tensor '([^']+)'", error.cause).group(1)
    assert re.fullmatch(r"model\.layers\.0\.mlp\.experts\.(0\.(gate|up)_proj\.(weight|weight_packed)|gate_up_proj)", key)
    index = folder / "model.safetensors.index.json"
    shard = json.loads(index.read_text())["weight_map"][key] if shards > 1 else "model.safetensors"
    assert error.path == folder / shard


@pytest.mark.parametrize("key, shape, expected", [
    ("model.layers.0.mlp.experts.3.up_proj.weight", (16, 64), [32, 64]),
    ("model.norm.weight", (32,), [64]),
])
def test_tensor_shape_mismatch(bf16, key, shape, expected):
    _rewrite(bf16 / "model.safetensors", lambda t: t.__setitem__(key, torch.zeros(shape, dtype=torch.bfloat16)))
    error = _fails(bf16, re.escape(f"tensor '{key}' has shape {list(shape)} but config.json implies {expected}"))
    assert error.path == bf16 / "model.safetensors"


# (i) quantisation we cannot decode, refused before any tensor is read

@pytest.mark.parametrize("quant, what", [
    ({"quant_method": "modelopt", "quant_algo": "INT3"}, "ModelOpt quant_algo 'INT3'"),
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
    ({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",
      "quantized_layers": {"model.layers.0.mlp.experts.0.up_proj": {"quant_algo": "INT3"}}},
     "ModelOpt quant_algo 'INT3' for model.layers.0.mlp.experts.0.up_proj"),
])
def test_unknown_quantisation(bf16, quant, what):
    _edit_config(bf16, quantization_config=quant)
    error = _fails(bf16, "uses the unknown quantisation algorithm " + re.escape(what))
    assert error.path == bf16 / "config.json" and "NVFP4" in error.hint


def test_unknown_quantisation_in_hf_quant_config(tiny_checkpoint, tmp_path):
    folder = _copy(tiny_checkpoint(ARCH, "nvfp4"), tmp_path)
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]  # older ModelOpt exports keep it in hf_quant_config.json only
    (folder / "config.json").write_text(json.dumps(config))
    hf_quant = json.loads((folder / "hf_quant_config.json").read_text())
    hf_quant["quantization"]["quant_algo"] = "W4A8_AWQ"
    (folder / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    assert _fails(folder, "quant_algo 'W4A8_AWQ'").path == folder / "hf_quant_config.json"


@pytest.mark.parametrize("quant, match", [
    ("nvfp4", "quantization_config that is not a JSON object"),
    ({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "quantized_layers": ["x"]}, "quantized_layers"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size \[128\]"),
])
def test_malformed_quantisation_config(bf16, quant, match):
    _edit_config(bf16, quantization_config=quant)
    assert _fails(bf16, match).path == bf16 / "config.json"


# (k) tensors the config calls for

@pytest.mark.parametrize("key", ["model.layers.2.mlp.experts.5.down_proj.weight", "model.layers.1.linear_attn.A_log"])
def test_missing_tensor(bf16, key):
    _rewrite(bf16 / "model.safetensors", lambda t: t.pop(key))
    name = key.removeprefix("model.")
    error = _fails(bf16, rf"has no tensor '{re.escape(name)}' that the config calls for")
    assert error.path == bf16


def test_missing_scale_of_quantised_weight(tiny_checkpoint, tmp_path):
    folder = _copy(tiny_checkpoint(ARCH, "nvfp4"), tmp_path)
    module = "model.layers.0.mlp.experts.1.down_proj"
    _rewrite(folder / "model.safetensors", lambda t: t.pop(module + ".weight_scale_2"))
    error = _fails(folder, r"layers\.0\.mlp\.experts\.1\.down_proj stores weight \(torch\.uint8\), "
                           r"weight_scale \(torch\.float8_e4m3fn\), which is no weight format")
    assert error.path == folder / "model.safetensors"


def test_misshaped_scale(tiny_checkpoint, tmp_path):
    folder = _copy(tiny_checkpoint(ARCH, "nvfp4"), tmp_path)
    key = "model.layers.0.mlp.experts.1.down_proj.weight_scale"  # [64, 2]: one fp8 scale per 16 of 32 inputs
    _rewrite(folder / "model.safetensors", lambda t: t.__setitem__(key, t[key][:, :1].contiguous()))
    error = _fails(folder, r"NVFP4 weight_scale has shape \[64, 1\], expected \[64, 2\]")
    assert error.path == folder / "model.safetensors"
