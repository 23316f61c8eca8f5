"""The reference side of the parity tests: transformers in float32 on independently dequantised weights.

Nothing here uses the engine's decoders: NVFP4 is unpacked by compressed-tensors, FP8 by torch's
own float8 cast, so a mistake in engine/checkpoint/formats.py cannot hide on both sides.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
from safetensors import safe_open
from safetensors.torch import save_file

SCALE_ROLES = (
    "weight_scale",
    "weight_scale_2",
    "weight_scale_inv",
    "input_scale",
    "weight_global_scale",
    "input_global_scale",
)


def _fp4_values(packed: torch.Tensor) -> torch.Tensor:
    rows, half = packed.shape
    return unpack_fp4_from_uint8(packed, rows, half * 2, dtype=torch.float32)


def _dequantise(module: str, parts: dict[str, torch.Tensor], block: tuple[int, int]) -> torch.Tensor:
    if "weight_packed" in parts:  # compressed-tensors NVFP4: the global scale divides
        scale = parts["weight_scale"].float().repeat_interleave(16, dim=-1)
        return _fp4_values(parts["weight_packed"]) * scale / parts["weight_global_scale"].float()
    weight = parts["weight"]
    if "weight_scale_2" in parts:  # ModelOpt NVFP4: the second-level scale multiplies
        scale = parts["weight_scale"].float().repeat_interleave(16, dim=-1)
        return _fp4_values(weight) * scale * parts["weight_scale_2"].float()
    if "weight_scale_inv" in parts:
        rows, cols = weight.shape
        scale = torch.kron(parts["weight_scale_inv"].float(), torch.ones(block))[:rows, :cols]
        return weight.float() * scale
    if "weight_scale" in parts:
        return weight.float() * parts["weight_scale"].float()
    return weight.float()


def dequantised_copy(src: Path, dst: Path) -> Path:
    """A float32, unquantised copy of checkpoint `src` with the same tensor names and config."""
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    quant = config.pop("quantization_config", None) or {}
    block = tuple(quant.get("weight_block_size") or (128, 128))
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for file in sorted(src.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            for key in handle.keys():
                module, _, role = key.rpartition(".")
                if role in SCALE_ROLES or role in ("weight", "weight_packed"):
                    modules.setdefault(module, {})[role] = handle.get_tensor(key)
                else:
                    modules.setdefault(key, {})[""] = handle.get_tensor(key)
    tensors = {}
    for module, parts in modules.items():
        if "" in parts:
            tensors[module] = parts[""].float()
        else:
            tensors[f"{module}.weight"] = _dequantise(module, parts, block)
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(config))
    shutil.copy(src / "generation_config.json", dst / "generation_config.json")
    return dst


def transformers_model(folder: Path):
    import transformers

    model_type = json.loads((folder / "config.json").read_text())["model_type"]
    cls = {
        "qwen3_5_moe": transformers.Qwen3_5MoeForConditionalGeneration,
        "qwen3_5_moe_text": transformers.Qwen3_5MoeForCausalLM,
        "qwen3_moe": transformers.Qwen3MoeForCausalLM,
    }[model_type]
    return cls.from_pretrained(str(folder), dtype=torch.float32).eval()


@torch.inference_mode()
def transformers_logits(model, token_ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=token_ids[None], use_cache=False).logits[0].float()


@torch.inference_mode()
def transformers_greedy(model, prompt: torch.Tensor, new_tokens: int) -> list[int]:
    """Greedy continuation, recomputing the whole sequence each step (no cache on the reference side)."""
    ids = prompt.clone()
    out = []
    for _ in range(new_tokens):
        nxt = int(transformers_logits(model, ids)[-1].argmax())
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([nxt])])
    return out
