"""Every bad model folder ends in one CheckpointError that names the file at fault, says what is wrong and
what to do: never a bare traceback. Each test damages a private copy of a tiny checkpoint."""

import json
import os
import re
import shutil
import struct
import threading

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
    error = _fails(
        folder, r"is missing shard model-00002-of-00002\.safetensors listed in model\.safetensors\.index\.json"
    )
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
    cut = {
        "last byte": len(data) - 1,
        "middle of data": (start + len(data)) // 2,
        "first tensor": start + 10,
        "inside header": start // 2,
    }[where]
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
    data[8 : 8 + len(garbage)] = garbage
    file.write_bytes(bytes(data))
    assert _fails(bf16, "corrupt safetensors header").path == file


@pytest.mark.parametrize(
    "content",
    [bytes(range(256)) * 20, b"hello, this is a text file\n" * 40, b"abc", b""],
    ids=["random bytes", "text", "three bytes", "empty"],
)
def test_not_a_safetensors_file(bf16, content):
    file = bf16 / "model.safetensors"
    file.write_bytes(content)
    assert _fails(bf16, "safetensors").path == file


# (h) shapes that disagree with config.json


@pytest.mark.parametrize(
    "fmt, fused, shards, found, expected",
    [
        ("bf16", False, 1, [32, 64], [48, 64]),
        ("bf16", True, 1, [8, 64, 64], [8, 96, 64]),  # fused gate_up stack
        ("nvfp4", False, 3, [32, 64], [48, 64]),  # weight and its scales lie in different shards
        ("nvfp4_ct", False, 1, [32, 64], [48, 64]),
    ],
)
def test_config_shape_mismatch(tiny_checkpoint, tmp_path, fmt, fused, shards, found, expected):
    folder = _copy(tiny_checkpoint(ARCH, fmt, fused, shards), tmp_path)
    _edit_config(folder, moe_intermediate_size=48)
    error = _fails(
        folder,
        rf"tensor '(?P<key>[^']+)' has shape {re.escape(str(found))} "
        rf"but config\.json implies {re.escape(str(expected))}",
    )
    key = re.search(r"tensor '([^']+)'", error.cause).group(1)
    assert re.fullmatch(
        r"model\.layers\.0\.mlp\.experts\.(0\.(gate|up)_proj\.(weight|weight_packed)|gate_up_proj)", key
    )
    index = folder / "model.safetensors.index.json"
    shard = json.loads(index.read_text())["weight_map"][key] if shards > 1 else "model.safetensors"
    assert error.path == folder / shard


@pytest.mark.parametrize(
    "key, shape, expected",
    [
        ("model.layers.0.mlp.experts.3.up_proj.weight", (16, 64), [32, 64]),
        ("model.norm.weight", (32,), [64]),
    ],
)
def test_tensor_shape_mismatch(bf16, key, shape, expected):
    _rewrite(bf16 / "model.safetensors", lambda t: t.__setitem__(key, torch.zeros(shape, dtype=torch.bfloat16)))
    error = _fails(bf16, re.escape(f"tensor '{key}' has shape {list(shape)} but config.json implies {expected}"))
    assert error.path == bf16 / "model.safetensors"


# (i) quantisation we cannot decode, refused before any tensor is read


@pytest.mark.parametrize(
    "quant, what",
    [
        ({"quant_method": "modelopt", "quant_algo": "INT3"}, "ModelOpt quant_algo 'INT3'"),
        ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
        (
            {
                "quant_method": "modelopt",
                "quant_algo": "MIXED_PRECISION",
                "quantized_layers": {"model.layers.0.mlp.experts.0.up_proj": {"quant_algo": "INT3"}},
            },
            "ModelOpt quant_algo 'INT3' for model.layers.0.mlp.experts.0.up_proj",
        ),
    ],
)
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


@pytest.mark.parametrize(
    "quant, match",
    [
        ("nvfp4", "quantization_config that is not a JSON object"),
        ({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "quantized_layers": ["x"]}, "quantized_layers"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size \[128\]"),
    ],
)
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
    error = _fails(
        folder,
        r"layers\.0\.mlp\.experts\.1\.down_proj stores weight \(torch\.uint8\), "
        r"weight_scale \(torch\.float8_e4m3fn\), which is no weight format",
    )
    assert error.path == folder / "model.safetensors"


def test_misshaped_scale(tiny_checkpoint, tmp_path):
    folder = _copy(tiny_checkpoint(ARCH, "nvfp4"), tmp_path)
    key = "model.layers.0.mlp.experts.1.down_proj.weight_scale"  # [64, 2]: one fp8 scale per 16 of 32 inputs
    _rewrite(folder / "model.safetensors", lambda t: t.__setitem__(key, t[key][:, :1].contiguous()))
    error = _fails(folder, r"NVFP4 weight_scale has shape \[64, 1\], expected \[64, 2\]")
    assert error.path == folder / "model.safetensors"


# nonsense values in config.json: refused by name before any tensor is read

QWEN3_MOE = "qwen3_moe"


@pytest.mark.parametrize(
    "arch, changes, match",
    [
        (ARCH, {"num_attention_heads": 0, "head_dim": None}, "num_attention_heads must be at least 1, got 0"),
        (ARCH, {"head_dim": 0}, "head_dim must be at least 1, got 0"),
        (
            ARCH,
            {"layer_types": None, "full_attention_interval": 0},
            "full_attention_interval must be at least 1, got 0",
        ),
        (QWEN3_MOE, {"decoder_sparse_step": 0}, "decoder_sparse_step must be at least 1, got 0"),
        (ARCH, {"rope_parameters": [10000.0, 0.25]}, r"rope_parameters must be a JSON object, got \[10000\.0, 0\.25\]"),
        (QWEN3_MOE, {"rope_scaling": "yarn"}, "rope_scaling must be a JSON object, got 'yarn'"),
        (ARCH, {"num_experts": 0}, "num_experts_per_tok 2 must be from 1 to num_experts 0"),
        (ARCH, {"num_experts_per_tok": 9}, "num_experts_per_tok 9 must be from 1 to num_experts 8"),
        (QWEN3_MOE, {"num_experts_per_tok": 0}, "num_experts_per_tok must be at least 1, got 0"),
        (ARCH, {"num_experts": -8}, "num_experts must be at least 0, got -8"),
        (ARCH, {"moe_intermediate_size": -32}, "moe_intermediate_size must be at least 1, got -32"),
        (ARCH, {"hidden_size": 64.5}, "hidden_size must be a whole number, got 64.5"),
        (ARCH, {"hidden_size": "64"}, "hidden_size must be a whole number, got '64'"),
        (ARCH, {"vocab_size": True}, "vocab_size must be a whole number, got True"),
        (ARCH, {"num_hidden_layers": 0, "layer_types": None}, "num_hidden_layers must be at least 1, got 0"),
        (ARCH, {"num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
        (ARCH, {"linear_num_value_heads": 3}, "linear_num_value_heads 3 is not a multiple of linear_num_key_heads 2"),
        (ARCH, {"max_position_embeddings": 0}, "max_position_embeddings must be at least 1, got 0"),
        (ARCH, {"rms_norm_eps": -1e-6}, "rms_norm_eps must be a number above 0"),
        (QWEN3_MOE, {"rope_theta": float("inf")}, "rope_theta must be a number above 0 and finite, got inf"),
        (
            ARCH,
            {"rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor": 1.5}},
            "partial_rotary_factor must be a number above 0 and at most 1, got 1.5",
        ),
        (
            ARCH,
            {"rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor": 0.01}},
            "head_dim 32 x partial_rotary_factor gives 0 rotated dimensions",
        ),
        (ARCH, {"eos_token_id": "x"}, "eos_token_id must be a token id or a list of them, got 'x'"),
        (QWEN3_MOE, {"mlp_only_layers": 1}, "mlp_only_layers must be a list of layer numbers, got 1"),
        (QWEN3_MOE, {"intermediate_size": 0}, r"intermediate_size must be at least 1 for the dense MLP layers \[1\]"),
        (ARCH, {"layer_types": "full_attention"}, "layer_types must list"),
    ],
)
def test_nonsense_config_value(tiny_checkpoint, tmp_path, arch, changes, match):
    folder = _copy(tiny_checkpoint(arch, "bf16"), tmp_path)
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    error = _fails(folder, "has an unusable setting: " + match)
    assert error.path == folder / "config.json" and "download it again" in error.hint


@pytest.mark.parametrize(
    "side, match",
    [
        ({"quantization": ["NVFP4"]}, r"has a \"quantization\" entry that is not a JSON object \(\['NVFP4'\]\)"),
        ({"quantization": "NVFP4"}, r"has a \"quantization\" entry that is not a JSON object \('NVFP4'\)"),
        (["ab", "cd"], "does not hold a JSON object"),
    ],
)
def test_malformed_hf_quant_config(tiny_checkpoint, tmp_path, side, match):
    folder = _copy(tiny_checkpoint(ARCH, "nvfp4"), tmp_path)
    _edit_config(folder, quantization_config=None)  # the side file is read only without one in config.json
    (folder / "hf_quant_config.json").write_text(json.dumps(side))
    assert _fails(folder, match).path == folder / "hf_quant_config.json"


@pytest.mark.parametrize("block", [[0, 128], [128, -1], [128.5, 128], [True, 128]])
def test_fp8_block_size_that_is_no_block(bf16, block):
    _edit_config(bf16, quantization_config={"quant_method": "fp8", "weight_block_size": block})
    assert _fails(bf16, "is not two whole numbers above 0").path == bf16 / "config.json"


# checkpoint headers and files that are not what their names say


@pytest.mark.parametrize(
    "weight_map",
    [
        {"model.norm.weight": 1},
        {"model.norm.weight": None},
        {},
        {"model.norm.weight": "../elsewhere/model.safetensors"},
    ],
)
def test_index_whose_weight_map_names_no_shard_files(tiny_checkpoint, tmp_path, weight_map):
    folder = _copy(tiny_checkpoint(ARCH, "bf16", shards=2), tmp_path)
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    error = _fails(
        folder,
        "is not a valid safetensors index: its weight_map must give each tensor the name of a "
        "shard file in this folder",
    )
    assert error.path == index


def _edit_header(file, key, change):
    """Rewrite the JSON header of a safetensors file, `change(entry)` editing the entry of tensor `key`."""
    data, start = file.read_bytes(), _header_end(file)
    header = json.loads(data[8:start])
    change(header[key])
    text = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(text)) + text + data[start:])


@pytest.mark.parametrize(
    "field, value",
    [
        ("shape", [-64]),
        ("shape", [-8, -8]),
        ("shape", [64.0]),
        ("shape", [True] * 1),
        ("data_offsets", [-128, 0]),
        ("data_offsets", ["0", "128"]),
    ],
)
def test_header_with_impossible_shape_or_offsets(bf16, field, value):
    file = bf16 / "model.safetensors"
    _edit_header(file, "model.norm.weight", lambda entry: entry.__setitem__(field, value))
    error = _fails(
        bf16,
        r"tensor 'model\.norm\.weight' has shape .* and data offsets .*, which must all be whole "
        r"numbers of 0 or more",
    )
    assert error.path == file


def test_folder_named_like_a_weights_file(bf16):
    (bf16 / "extra.safetensors").mkdir()
    error = _fails(bf16, "is not a regular file: a folder, named pipe or device has the name of a weights file")
    assert error.path == bf16 / "extra.safetensors"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX; Windows has none to block on")
def test_named_pipe_named_like_a_weights_file_is_refused_without_blocking(bf16):
    (bf16 / "model.safetensors").unlink()
    os.mkfifo(bf16 / "model.safetensors")  # opening it would wait for a writer forever
    result = {}
    worker = threading.Thread(
        target=lambda: result.setdefault("error", _fails(bf16, "is not a regular file")), daemon=True
    )
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), "loading blocked on the named pipe"
    assert result["error"].path == bf16 / "model.safetensors"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX; Windows has none to block on")
def test_library_scan_lists_a_named_pipe_weights_file_without_blocking(bf16):
    from app.model_library import scan_library

    (bf16 / "model.safetensors").unlink()
    os.mkfifo(bf16 / "model.safetensors")
    result = {}
    worker = threading.Thread(
        target=lambda: result.setdefault("entries", scan_library([bf16], bf16 / "no-hub")), daemon=True
    )
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), "the library scan blocked on the named pipe"
    (entry,) = [e for e in result["entries"] if e["path"] == str(bf16)]
    assert "model.safetensors: is not a regular file" in entry["error"] and entry["format"] == ""


def _symlink(link, target):
    try:
        os.symlink(target, link)
    except (OSError, NotImplementedError):  # Windows without the privilege to make links
        pytest.skip("this account cannot create symbolic links")


def test_library_scan_survives_a_symlink_loop(tmp_path, bf16):
    from app.model_library import scan_library

    models = tmp_path / "models"
    models.mkdir()
    _symlink(models / "loop", models / "loop")
    _symlink(models / "a", models / "b")
    _symlink(models / "b", models / "a")
    _symlink(bf16 / "self", bf16)  # a link inside a model folder back to itself
    entries = scan_library([models, models / "loop", models / "a", bf16], tmp_path / "no-hub")
    by_path = {e["path"]: e for e in entries}
    for name in ("loop", "a"):
        assert by_path[str(models / name)]["error"] == (
            f"{models / name}: is a link that leads nowhere (broken, or a loop of links) "
            f"(choose the folder that holds config.json and the .safetensors files)"
        )
    assert by_path[str(bf16)]["error"] == "" and by_path[str(bf16)]["size_bytes"] > 0


@pytest.mark.parametrize(
    "changes, fmt",
    [
        (
            {"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4", "quantized_layers": ["x"]}},
            "nvfp4",
        ),
        ({"quantization_config": {"quant_method": "compressed-tensors", "config_groups": [{"weights": 4}]}}, "fp8"),
        ({"text_config": [1]}, "bf16"),
    ],
)
def test_library_scan_survives_malformed_quantisation_sections(bf16, changes, fmt):
    from app.model_library import scan_library

    _edit_config(bf16, **changes)
    (entry,) = [e for e in scan_library([bf16], bf16 / "no-hub") if e["path"] == str(bf16)]
    assert entry["format"] == fmt and entry["architecture"] == ARCH


def test_library_scan_survives_a_list_in_hf_quant_config(tiny_checkpoint, tmp_path):
    from app.model_library import scan_library

    folder = _copy(tiny_checkpoint(ARCH, "nvfp4"), tmp_path)
    _edit_config(folder, quantization_config=None)
    (folder / "hf_quant_config.json").write_text(json.dumps({"quantization": [1, 2]}))
    (entry,) = [e for e in scan_library([folder], folder / "no-hub") if e["path"] == str(folder)]
    assert 'hf_quant_config.json: has a "quantization" entry that is not a JSON object' in entry["error"]


# generation_config.json: sampling values of the wrong kind name the file


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"temperature": "hot"}, "temperature must be a number, got 'hot'"),
        ({"top_k": 1.5}, "top_k must be a whole number, got 1.5"),
        ({"top_p": True}, "top_p must be a number, got True"),
        ({"max_new_tokens": 0}, r"max_new_tokens must be >= 1, got 0"),
        ({"temperature": -1}, r"temperature must be >= 0, got -1\.0"),
    ],
)
def test_generation_config_sampling_value_of_the_wrong_kind(tiny_checkpoint, tmp_path, changes, match):
    from engine.runtime.tokenizer import ChatTokenizer

    folder = _copy(tiny_checkpoint(ARCH, "bf16"), tmp_path)
    _edit_config(folder, "generation_config.json", **changes)
    with pytest.raises(CheckpointError, match="has an unusable sampling setting: " + match) as info:
        ChatTokenizer.from_folder(folder)
    assert info.value.path == folder / "generation_config.json" and "generation_config.json" in info.value.hint


def test_generation_config_eos_token_id_of_the_wrong_kind(tiny_checkpoint, tmp_path):
    from engine.runtime.tokenizer import ChatTokenizer

    folder = _copy(tiny_checkpoint(ARCH, "bf16"), tmp_path)
    _edit_config(folder, "generation_config.json", eos_token_id="x")
    with pytest.raises(CheckpointError, match="has an eos_token_id that is not a token id or a list of them: 'x'"):
        ChatTokenizer.from_folder(folder)
