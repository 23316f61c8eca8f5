"""The quantisation settings a checkpoint declares, checked before any tensor is read.

Which format each weight is in is read off its tensors (formats.detect_format); this module
refuses the methods and algorithms we cannot decode, and finds the FP8 block size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from engine.errors import CheckpointError

MODELOPT_ALGOS = {"FP8", "NVFP4", "W4A16_NVFP4", "MIXED_PRECISION"}
MODELOPT_LAYER_ALGOS = {"FP8", "NVFP4", "W4A16_NVFP4"}
COMPRESSED_TENSORS_FORMATS = {"nvfp4-pack-quantized", "float-quantized", "mixed-precision"}
SUPPORTED = "bf16/fp16/fp32, FP8 (block or per-tensor) and NVFP4 (ModelOpt or compressed-tensors)"
REPAIR = "the quantisation settings are damaged; download config.json (and hf_quant_config.json) again"
HF_QUANT_CONFIG = "hf_quant_config.json"


@dataclass(frozen=True)
class QuantSettings:
    method: str | None  # None for unquantised checkpoints
    fp8_block_size: tuple[int, int] = (128, 128)
    kv_cache_fp8: bool = False  # the exporter declares an FP8 KV cache (calibrated for, or expected by, the build)


def read_hf_quant_config(folder: Path) -> dict | None:
    """The quantisation section of ModelOpt's side file hf_quant_config.json as a modelopt quantization_config,
    or None when the folder has no such file; CheckpointError when it is not the JSON object it should be."""
    source = folder / HF_QUANT_CONFIG
    if not source.is_file():
        return None
    try:
        side = json.loads(source.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(source, f"is not valid quantisation JSON ({exc})", REPAIR) from None
    if not isinstance(side, dict):
        raise CheckpointError(source, "does not hold a JSON object", REPAIR)
    quantization = side.get("quantization")
    if not isinstance(quantization, (dict, type(None))):
        raise CheckpointError(
            source, f'has a "quantization" entry that is not a JSON object ({quantization!r:.60})', REPAIR
        )
    return dict(quantization or {}, quant_method="modelopt")


def read_quant_settings(folder: Path, quantization_config: dict | None) -> QuantSettings:
    source = folder / "config.json"
    if quantization_config is None and (side := read_hf_quant_config(folder)) is not None:
        source, quantization_config = folder / HF_QUANT_CONFIG, side
    if not quantization_config:
        return QuantSettings(method=None)
    if not isinstance(quantization_config, dict):
        raise CheckpointError(
            source, f"has a quantization_config that is not a JSON object ({quantization_config!r:.60})", REPAIR
        )
    return replace(
        _weight_settings(source, quantization_config), kv_cache_fp8=declares_fp8_kv_cache(quantization_config)
    )


def declares_fp8_kv_cache(quantization_config: dict) -> bool:
    """Tell whether a quantisation section declares an FP8 KV cache: ModelOpt's kv_cache_quant_algo "FP8"
    (hf_quant_config.json), or a kv_cache_scheme of 8-bit floats (config.json, ModelOpt and compressed-tensors)."""
    scheme = quantization_config.get("kv_cache_scheme")
    if isinstance(scheme, dict) and scheme.get("type") == "float" and scheme.get("num_bits") == 8:
        return True
    return str(quantization_config.get("kv_cache_quant_algo")).upper() == "FP8"


def _weight_settings(source: Path, quantization_config: dict) -> QuantSettings:
    method = str(quantization_config.get("quant_method", "")).lower()
    if method == "fp8":
        block = quantization_config.get("weight_block_size") or [128, 128]
        try:
            rows, cols = (int(b) for b in block)
            if rows < 1 or cols < 1 or any(isinstance(b, bool) or int(b) != b for b in block):
                raise ValueError(block)
        except (TypeError, ValueError):
            raise CheckpointError(
                source, f"has an FP8 weight_block_size {block!r} that is not two whole numbers above 0", REPAIR
            ) from None
        return QuantSettings(method, fp8_block_size=(rows, cols))
    if method == "modelopt":
        algo = str(quantization_config.get("quant_algo", "")).upper()
        if algo not in MODELOPT_ALGOS:
            raise _unknown(source, f"ModelOpt quant_algo {algo!r}")
        layers = quantization_config.get("quantized_layers") or {}
        if not isinstance(layers, dict):
            raise CheckpointError(source, "has a ModelOpt quantized_layers entry that is not a JSON object", REPAIR)
        for layer, spec in layers.items():
            layer_algo = str(spec.get("quant_algo", "")).upper() if isinstance(spec, dict) else repr(spec)
            if layer_algo not in MODELOPT_LAYER_ALGOS:
                raise _unknown(source, f"ModelOpt quant_algo {layer_algo!r} for {layer}")
            group = spec.get("group_size", 16) if "NVFP4" in layer_algo else 16
            if group != 16:
                raise _unknown(source, f"NVFP4 group size {group} for {layer}")
        return QuantSettings(method)
    if method == "compressed-tensors":
        fmt = str(quantization_config.get("format", ""))
        if fmt not in COMPRESSED_TENSORS_FORMATS:
            raise _unknown(source, f"compressed-tensors format {fmt!r}")
        return QuantSettings(method)
    raise _unknown(source, f"quant_method {method or '(none given)'!r}")


def _unknown(source: Path, what: str) -> CheckpointError:
    return CheckpointError(
        source,
        f"uses the unknown quantisation algorithm {what}",
        f"MoE Desk reads {SUPPORTED}; pick another build of this model",
    )


KV_CACHE_CHOICES = ("auto", "bf16", "fp8")


def kv_cache_choice(choice: str, quant: QuantSettings) -> str:
    """Resolve a kv_cache_dtype option to "bf16" (unquantised rows in the compute dtype) or "fp8" (e4m3 rows with
    scales); auto is bf16 until the FP8 path's prefill and kernels have been measured on a GPU (`quant` says
    whether the checkpoint declares an FP8 KV cache, which is when fp8 is worth choosing)."""
    if choice not in KV_CACHE_CHOICES:
        raise ValueError(f"the KV cache dtype is one of {', '.join(KV_CACHE_CHOICES)}, not {choice!r}")
    del quant  # auto's rule once measured: fp8 where quant.kv_cache_fp8
    return "bf16" if choice == "auto" else choice
