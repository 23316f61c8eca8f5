"""The synthetic models are the real checkpoints: their layouts and configs equal the published ones, and a
header-only replica of each real checkpoint plans and loads exactly as its synthetic description says.

tests/fixtures/real-layouts/ holds, per checkpoint, its config.json (and hf_quant_config.json,
generation_config.json) and tensors.json.gz: every tensor of the real files as name -> [dtype, shape, shard].
"""

import gzip
import json
import os
from pathlib import Path

import psutil
import pytest
from locations import FIXTURES

import engine
from engine.checkpoint import INDEX_FILE
from engine.checkpoint.formats import NVFP4
from engine.checkpoint.safetensors_file import DTYPES, SafetensorsFile
from engine.cli import main
from engine.runtime.footprint import footprint_from_checkpoint, footprint_from_synthetic
from engine.runtime.planner import GIB, MIB, PRESETS, PlanError, plan_memory, preset_budget_bytes
from engine.synthetic import SYNTHETIC_MODELS
from engine.testing.replica import write_replica

REAL_LAYOUTS = FIXTURES / "real-layouts"
REAL = {  # synthetic model -> its real checkpoint's folder of fixtures
    "qwen3.6-35b-a3b-nvfp4": "nvidia-Qwen3.6-35B-A3B-NVFP4",
    "qwen3.6-35b-a3b": "Qwen-Qwen3.6-35B-A3B",
    "qwen3.6-35b-a3b-fp8": "Qwen-Qwen3.6-35B-A3B-FP8",
    "qwen3.6-35b-a3b-nvfp4-ct": "compressed-tensors-Qwen3.6-35B-A3B-NVFP4",
    "qwen3-30b-a3b": "Qwen-Qwen3-30B-A3B",
}
AUTO_BUDGETS_GIB = (4, 6, 8, 12, 24)  # auto needs the GPU's free memory; these stand in for it
LOAD_SLACK_BYTES = 512 * MIB
HUB_BYTES_NVIDIA = 23_424_338_320  # the Hub's total for nvidia/Qwen3.6-35B-A3B-NVFP4's safetensors files
HEADER_TEXT_TOLERANCE = 0.0001  # the headers' JSON text (spacing, order of keys) is all a replica may change  # the engine's own objects and allocator rounding beside the weights


def _real(name: str, file_name: str):
    path = REAL_LAYOUTS / REAL[name] / file_name
    if file_name.endswith(".gz"):
        return json.loads(gzip.decompress(path.read_bytes()))
    return json.loads(path.read_text()) if path.is_file() else None


def _real_tensors(name: str) -> dict[str, list]:
    return _real(name, "tensors.json.gz")["tensors"]


def _sparse_files_work(folder: Path) -> bool:
    probe = folder / "sparse-probe"
    with open(probe, "wb") as handle:
        handle.truncate(GIB)
    stat = probe.stat()
    sparse = hasattr(stat, "st_blocks") and stat.st_blocks * 512 < 16 * MIB
    probe.unlink()
    return sparse


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    """The header-only replica of a real checkpoint, in a folder named after its synthetic model."""
    root = tmp_path_factory.mktemp("replicas")
    if not _sparse_files_work(root):
        pytest.skip("this file system does not make sparse files, and a replica would write every weight byte")
    made = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = write_replica(
                root / name,
                _real_tensors(name),
                _real(name, "config.json"),
                _real(name, "hf_quant_config.json"),
                _real(name, "generation_config.json"),
            )
        return made[name]

    return get


@pytest.fixture(scope="module")
def replica_footprint(replica):
    cache = {}

    def get(name: str):
        if name not in cache:
            cache[name] = footprint_from_checkpoint(replica(name))
        return cache[name]

    return get


# ---- (a) the synthetic layouts are the real ones -----------------------------------------------


@pytest.mark.parametrize("name", REAL)
def test_synthetic_layout_is_the_real_checkpoints(name):
    model = SYNTHETIC_MODELS[name]
    real = {key: (dtype, tuple(shape)) for key, (dtype, shape, _) in _real_tensors(name).items()}
    layout = model.tensor_layout()
    assert sorted(set(real) - set(layout))[:5] == [] and sorted(set(layout) - set(real))[:5] == []
    assert {k: v for k, v in layout.items() if real[k] != v} == {}
    assert list(layout) == list(real)  # the exporter's order too


@pytest.mark.parametrize("name", REAL)
def test_synthetic_configs_are_the_real_checkpoints(name):
    model = SYNTHETIC_MODELS[name]
    assert model.config_json == _real(name, "config.json")
    assert model.hf_quant_config == _real(name, "hf_quant_config.json")
    assert model.generation_config == _real(name, "generation_config.json")
    assert model.quantization_config == _real(name, "config.json").get("quantization_config")


def test_nvidia_quantisation_groups_are_what_the_export_declares():
    declared = SYNTHETIC_MODELS["qwen3.6-35b-a3b-nvfp4"].quantization_config["quantized_layers"]
    algos = [spec["quant_algo"] for spec in declared.values()]
    # one W4A16_NVFP4 group per layer's experts, 3 per shared expert, the LM head; FP8 for 130 projections
    assert (algos.count("W4A16_NVFP4"), algos.count("FP8"), len(declared)) == (40 + 120 + 1, 130, 291)
    assert declared["lm_head"] == {"quant_algo": "W4A16_NVFP4", "group_size": 16}


def test_tiny_synthetic_is_the_tiny_nvfp4_checkpoint(tiny_checkpoint):
    folder = tiny_checkpoint("qwen3_5_moe", "nvfp4")
    tiny = SYNTHETIC_MODELS["tiny"]
    header = SafetensorsFile(folder / "model.safetensors")
    dtype_names = {"BF16": "bfloat16", "F32": "float32", "U8": "uint8", "F8_E4M3": "float8_e4m3fn"}
    written = {key: (str(header.dtype(key)).removeprefix("torch."), header.shape(key)) for key in header.keys()}
    described = {key: (dtype_names[dtype], shape) for key, (dtype, shape) in tiny.tensor_layout().items()}
    assert written == described
    config = json.loads((folder / "config.json").read_text())
    assert config == tiny.config_json
    assert json.loads((folder / "hf_quant_config.json").read_text()) == tiny.hf_quant_config


# ---- the replicas ------------------------------------------------------------------------------


def test_replica_headers_are_the_real_headers_over_holes(replica):
    name = "qwen3.6-35b-a3b-nvfp4"
    folder = replica(name)
    real = _real_tensors(name)
    weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
    assert weight_map == {key: shard for key, (_, _, shard) in real.items()}
    file_bytes = 0
    for shard in sorted(set(weight_map.values())):
        header = SafetensorsFile(folder / shard)  # checks every entry's byte range against the file's length
        assert {k: (header.dtype(k), header.shape(k)) for k in header.keys()} == {
            k: (DTYPES[dtype], tuple(shape)) for k, (dtype, shape, s) in real.items() if s == shard
        }
        stat = (folder / shard).stat()
        file_bytes += stat.st_size
        assert stat.st_blocks * 512 < 64 * MIB  # a hole: no weight byte was written
    # the Hub's size of the real files, headers included: only the header text may differ
    assert abs(file_bytes - HUB_BYTES_NVIDIA) < HEADER_TEXT_TOLERANCE * HUB_BYTES_NVIDIA


# ---- (b) a replica plans exactly as its synthetic model ------------------------------------------


@pytest.mark.parametrize("name", REAL)
def test_replica_footprint_is_the_synthetic_footprint(name, replica_footprint):
    assert replica_footprint(name).to_dict() == footprint_from_synthetic(name).to_dict()


def _plan_or_error(footprint, budget: int, preset: str) -> dict | str:
    try:
        return plan_memory(footprint, budget, preset).to_dict()
    except PlanError as exc:
        return f"PlanError: {exc}"


@pytest.mark.parametrize("name", REAL)
def test_replica_plans_are_the_synthetic_plans(name, replica_footprint):
    real, described = replica_footprint(name), footprint_from_synthetic(name)
    asked = [(preset, preset_budget_bytes(preset)) for preset in PRESETS if preset_budget_bytes(preset)]
    asked += [("auto", gib * GIB) for gib in AUTO_BUDGETS_GIB]
    for preset, budget in asked:
        assert _plan_or_error(real, budget, preset) == _plan_or_error(described, budget, preset), (preset, budget)


@pytest.mark.parametrize("name", ["qwen3.6-35b-a3b-nvfp4", "qwen3-30b-a3b"])  # the CLI's own path, twice
def test_plan_cli_on_a_replica_prints_the_synthetic_plan(name, replica, capsys):
    outputs = []
    for target in (["--model", str(replica(name))], ["--synthetic", name]):
        code = main(["plan", *target, "--preset", "12gb", "--json"])
        outputs.append((code, capsys.readouterr()))
    (code_real, real), (code_described, described) = outputs
    assert code_real == code_described == 0
    assert json.loads(real.out) == json.loads(described.out)


def test_nvidia_4gb_plan_from_the_real_headers(replica, replica_footprint):
    plan = plan_memory(replica_footprint("qwen3.6-35b-a3b-nvfp4"), 4 * GIB, "4gb")
    assert round(plan.breakdown["resident_weights"] / GIB, 2) == 1.57
    assert (plan.kv_cache, plan.prefill_chunk_tokens, plan.max_prompt_tokens) == ("bf16", 2048, 49664)
    # the export declares an FP8 KV cache (kv_cache_quant_algo); chosen, it takes 10 KiB a token, not 20
    fp8 = plan_memory(footprint_from_checkpoint(replica("qwen3.6-35b-a3b-nvfp4"), "fp8"), 4 * GIB, "4gb")
    assert (fp8.kv_cache, fp8.prefill_chunk_tokens, fp8.max_prompt_tokens) == ("fp8", 2048, 100352)


# ---- (c) a replica loads on the CPU without its weights being read --------------------------------


@pytest.mark.parametrize("name", ["qwen3.6-35b-a3b-nvfp4", "qwen3-30b-a3b"])
def test_replica_loads_on_the_cpu_reading_only_resident_weights(name, replica, replica_footprint):
    folder = replica(name)
    footprint = replica_footprint(name)
    process = psutil.Process(os.getpid())
    before = process.memory_info().rss
    model = engine.load_model(folder)
    grown = process.memory_info().rss - before
    # loading joins resident projections (a copy) after reading their pages; routed experts (18 GB and more
    # here) stay unread in the mapped files
    assert grown < 2 * footprint.resident_bytes + LOAD_SLACK_BYTES, f"{grown / GIB:.2f} GiB"
    assert footprint.routed_expert_bytes > 4 * (2 * footprint.resident_bytes + LOAD_SLACK_BYTES)
    assert model.config.num_hidden_layers == SYNTHETIC_MODELS[name].config.num_hidden_layers
    if name == "qwen3.6-35b-a3b-nvfp4":
        assert model.lm_head.weight.format == NVFP4 and model.lm_head.weight.shape == (248320, 2048)
    del model
