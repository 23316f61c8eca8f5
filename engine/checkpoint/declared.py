"""The quantisation settings exporters write, built from which modules they quantised and how.

engine.checkpoint.quant_config reads these sections; this module writes them the way ModelOpt,
llm-compressor (compressed-tensors) and Qwen's FP8 export lay them out, for the synthetic models
and the tiny test checkpoints.
"""

from __future__ import annotations

NVFP4_GROUP = 16
MODELOPT_NVFP4_WEIGHT_ONLY = "W4A16_NVFP4"  # NVFP4 weights, activations left in bf16
MODELOPT_FP8 = "FP8"  # per-tensor FP8 weights and static FP8 input scales
FP8_TYPE = {"dynamic": False, "num_bits": 8, "type": "float"}


def modelopt_mixed_precision(
    layers: dict[str, str], exclude: list[str], version: str, kv_cache_fp8: bool = True
) -> tuple[dict, dict]:
    """(config.json quantization_config, hf_quant_config.json) of a ModelOpt MIXED_PRECISION export whose
    `layers` (module or quantisation group -> W4A16_NVFP4 | FP8, in export order) are quantised."""
    quantized = {
        m: ({"quant_algo": a, "group_size": NVFP4_GROUP} if a == MODELOPT_NVFP4_WEIGHT_ONLY else {"quant_algo": a})
        for m, a in layers.items()
    }
    unknown = sorted({a for a in layers.values()} - {MODELOPT_NVFP4_WEIGHT_ONLY, MODELOPT_FP8})
    if unknown:
        raise ValueError(f"ModelOpt algorithms {unknown} are not written here")
    groups = {}
    fp8 = sorted(m for m, a in layers.items() if a == MODELOPT_FP8)
    nvfp4 = sorted(m for m, a in layers.items() if a == MODELOPT_NVFP4_WEIGHT_ONLY)
    if fp8:
        groups[f"group_{len(groups)}"] = {
            "input_activations": dict(FP8_TYPE),
            "weights": dict(FP8_TYPE),
            "targets": fp8,
        }
    if nvfp4:
        groups[f"group_{len(groups)}"] = {
            "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": NVFP4_GROUP},
            "targets": nvfp4,
        }
    producer = {"name": "modelopt", "version": version}
    config = {
        "config_groups": groups,
        "quantized_layers": quantized,
        "ignore": list(exclude),
        "quant_algo": "MIXED_PRECISION",
        "kv_cache_scheme": dict(FP8_TYPE) if kv_cache_fp8 else None,
        "producer": dict(producer),
        "quant_method": "modelopt",
    }
    hf_quant = {
        "producer": producer,
        "quantization": {
            "quant_algo": "MIXED_PRECISION",
            "kv_cache_quant_algo": "FP8" if kv_cache_fp8 else None,
            "exclude_modules": list(exclude),
            "quantized_layers": {m: dict(s) for m, s in quantized.items()},
        },
    }
    return config, hf_quant


def compressed_tensors_nvfp4(ignore: list[str], version: str) -> dict:
    """config.json's quantization_config of an llm-compressor NVFP4 (W4A4, nvfp4-pack-quantized) build."""
    scheme = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": NVFP4_GROUP, "strategy": "tensor_group"}
    return {
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": dict(scheme, dynamic=False, scale_dtype="torch.float8_e4m3fn"),
                "input_activations": dict(
                    scheme, dynamic="local", scale_dtype="torch.float8_e4m3fn", observer="static_minmax"
                ),
                "output_activations": None,
                "format": "nvfp4-pack-quantized",
            }
        },
        "quant_method": "compressed-tensors",
        "kv_cache_scheme": None,
        "format": "nvfp4-pack-quantized",
        "quantization_status": "compressed",
        "global_compression_ratio": None,
        "ignore": list(ignore),
        "moe_sparsity_config": None,
        "version": version,
    }


def fp8_block(block: tuple[int, int], modules_to_not_convert: list[str] | None = None) -> dict:
    """config.json's quantization_config of a Qwen FP8 export with one scale per `block` of weights."""
    config = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8"}
    if modules_to_not_convert is not None:
        config["modules_to_not_convert"] = list(modules_to_not_convert)
    return dict(config, weight_block_size=list(block))
