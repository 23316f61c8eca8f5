"""load_model: a checkpoint folder in, a model that produces logits out."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.checkpoint import Checkpoint
from engine.config import read_config
from engine.experts.executor import ReferenceExpertExecutor
from engine.layers.source import WeightSource
from engine.models import BUILDERS
from engine.models.base import CausalLM


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> CausalLM:
    """Open a Hugging Face checkpoint folder. Raises CheckpointError with the path and a plain cause."""
    folder = Path(path).expanduser()
    config = read_config(folder)
    checkpoint = Checkpoint(folder, config.quantization_config)
    source = WeightSource(checkpoint, config, torch.device(device), dtype)
    return BUILDERS[config.model_type](source, ReferenceExpertExecutor())
