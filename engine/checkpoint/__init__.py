"""A checkpoint folder: its files, its tensor names (normalised once, here) and its weight formats.

Layers ask `Checkpoint.weight(module, shape)` for a linear weight and `Checkpoint.tensor(name, shape)`
for a plain parameter, always with the normalised name (`layers.3.linear_attn.in_proj_qkv`), never
with a raw checkpoint key.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from engine.checkpoint.formats import StoredWeight, check_scales, detect_format
from engine.checkpoint.quant_config import QuantSettings, read_quant_settings
from engine.checkpoint.safetensors_file import DTYPES, REDOWNLOAD, SafetensorsFile
from engine.errors import CheckpointError

# Exports put the language model under different prefixes; the longest match is stripped.
KEY_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")
# Vision tower and multi-token-prediction head: a text-only engine never reads them.
SKIPPED_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.")
WEIGHT_ROLES = frozenset(
    {
        "weight",
        "weight_scale",
        "weight_scale_2",
        "weight_scale_inv",
        "input_scale",
        "weight_packed",
        "weight_global_scale",
        "input_global_scale",
    }
)
INDEX_FILE = "model.safetensors.index.json"


def normalise_key(key: str) -> str | None:
    """The engine's name for a checkpoint key, or None for tensors a text-only engine skips."""
    if key.startswith(SKIPPED_PREFIXES):
        return None
    for prefix in KEY_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix) :]
    return key


class TensorShard:
    """Tensors already in memory, offered the way a safetensors file offers its own (for benchmarks that
    build full-size random models without writing them)."""

    def __init__(self, tensors: dict[str, torch.Tensor], path: Path):
        self._tensors, self.path = tensors, path

    def keys(self):
        return self._tensors.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._tensors[key].shape)

    def dtype(self, key: str) -> torch.dtype:
        return self._tensors[key].dtype

    def tensor(self, key: str) -> torch.Tensor:
        return self._tensors[key]


class HeaderShard:
    """Another shard's tensors as meta tensors: the shapes and dtypes of its header, never its data."""

    def __init__(self, shard):
        self._shard, self.path = shard, shard.path

    def keys(self):
        return self._shard.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        return self._shard.shape(key)

    def dtype(self, key: str) -> torch.dtype:
        return self._shard.dtype(key)

    def tensor(self, key: str) -> torch.Tensor:
        return torch.empty(self.shape(key), dtype=self.dtype(key), device="meta")


class LayoutShard:
    """A safetensors file known only by its tensors' dtypes and shapes (a header fetched before downloading, or
    a synthetic model's layout), offered the way a file offers its own: keys, shapes and dtypes, no data."""

    def __init__(self, layout: dict[str, tuple[str, tuple[int, ...]]], path: Path):
        self._layout, self.path = layout, path

    def keys(self):
        return self._layout.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._layout[key][1])

    def dtype(self, key: str) -> torch.dtype:
        """The tensor's dtype; KeyError for a safetensors dtype MoE Desk does not know."""
        return DTYPES[self._layout[key][0]]


class Checkpoint:
    def __init__(self, folder: Path, quantization_config: dict | None, shards: list | None = None):
        """The checkpoint in `folder`, or, with `shards`, the tensors those in-memory shards hold."""
        self.folder = folder
        self._quantization_config = quantization_config
        self.quant: QuantSettings = read_quant_settings(folder, quantization_config)
        self._files: dict[str, SafetensorsFile] = {}
        self._location: dict[str, tuple[SafetensorsFile | TensorShard, str]] = {}
        for shard in shards if shards is not None else map(self._open, self._file_names()):
            for key in shard.keys():
                name = normalise_key(key)
                if name is not None:
                    self._location[name] = (shard, key)
        self._modules: dict[str, dict[str, str]] = {}
        for name in self._location:
            module, _, role = name.rpartition(".")
            if role in WEIGHT_ROLES:
                self._modules.setdefault(module, {})[role] = name

    def _file_names(self) -> list[str]:
        index_path = self.folder / INDEX_FILE
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
                names = sorted(set(weight_map.values()))
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise CheckpointError(index_path, f"is not a valid safetensors index ({exc!r})", REDOWNLOAD) from None
            if not names or not all(isinstance(n, str) and n and Path(n).name == n for n in names):
                raise CheckpointError(
                    index_path,
                    f"is not a valid safetensors index: its weight_map must give each "
                    f"tensor the name of a shard file in this folder, not "
                    f"{names[:3]!r:.80}",
                    REDOWNLOAD,
                )
            missing = [n for n in names if not (self.folder / n).is_file()]
            if missing:
                raise CheckpointError(
                    self.folder,
                    f"is missing shard {missing[0]}"
                    + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
                    + f" listed in {INDEX_FILE}",
                    "the download is incomplete; resume or repeat it",
                )
            return names
        names = sorted(p.name for p in self.folder.glob("*.safetensors"))
        if not names:
            raise CheckpointError(
                self.folder,
                "holds no .safetensors weights",
                "MoE Desk reads Hugging Face safetensors checkpoints; GGUF and .bin are not supported",
            )
        return names

    def _open(self, file_name: str) -> SafetensorsFile:
        if file_name not in self._files:
            self._files[file_name] = SafetensorsFile(self.folder / file_name)
        return self._files[file_name]

    def headers_only(self) -> Checkpoint:
        """This checkpoint with meta tensors for its weights: shapes, dtypes and formats, no data read."""
        shards = {id(shard): shard for shard, _ in self._location.values()}
        return Checkpoint(self.folder, self._quantization_config, [HeaderShard(s) for s in shards.values()])

    # ---- what layers ask for -------------------------------------------------------------------

    def tensor_bytes(self):
        """(normalised name, stored bytes) of every tensor, from the headers alone."""
        for name, (shard, key) in self._location.items():
            yield name, math.prod(shard.shape(key)) * shard.dtype(key).itemsize

    def has(self, name: str) -> bool:
        return name in self._location or name in self._modules

    def tensor(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """A plain (unquantised) parameter such as a norm weight or A_log."""
        if name not in self._location:
            raise self._missing(name)
        shard, key = self._location[name]
        tensor = shard.tensor(key)
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            raise self._bad_shape(key, shard, tuple(tensor.shape), shape)
        return tensor

    def weight(self, module: str, shape: tuple[int, ...]) -> StoredWeight:
        """The weight of linear `module` (or a stacked expert tensor) in its stored format."""
        roles = self._modules.get(module)
        if roles is None:
            if module in self._location:  # fused expert stacks are bare tensors without a .weight suffix
                roles = {"weight": module}
            else:
                raise self._missing(module + ".weight")
        tensors = {role: self._location[name][0].tensor(self._location[name][1]) for role, name in roles.items()}
        # errors name the weight itself (and its shard), not whichever scale tensor happens to come first
        shard, key = self._location[roles.get("weight") or roles.get("weight_packed") or next(iter(roles.values()))]
        try:
            fmt, logical_shape = detect_format(module, tensors)
            weight = StoredWeight(fmt, tensors, logical_shape, module, self.quant.fp8_block_size)
            if logical_shape != tuple(shape):
                raise self._bad_shape(key, shard, logical_shape, shape)
            check_scales(weight)
        except ValueError as exc:
            raise CheckpointError(shard.path, str(exc), REDOWNLOAD) from None
        return weight

    def _missing(self, name: str) -> CheckpointError:
        return CheckpointError(
            self.folder,
            f"has no tensor {name!r} that the config calls for",
            "the checkpoint does not match its config.json, or a shard is incomplete",
        )

    @staticmethod
    def _bad_shape(key: str, shard: SafetensorsFile, found: tuple, expected: tuple) -> CheckpointError:
        return CheckpointError(
            shard.path,
            f"tensor {key!r} has shape {list(found)} but config.json implies {list(expected)}",
            "the weights and config.json come from different models",
        )
