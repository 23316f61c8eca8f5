"""MoE Desk's inference engine. This module only re-exports; engine modules import each other directly."""

from engine.config import ModelConfig
from engine.errors import CheckpointError, ContextOverflowError
from engine.loader import load_model

__all__ = ["load_model", "CheckpointError", "ContextOverflowError", "ModelConfig"]
