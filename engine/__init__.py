"""MoE Desk's inference engine. This module re-exports load_model, ModelConfig and the errors for scripts and
tests; the app's face is engine/api.py, and engine modules import each other directly."""

from engine.config import ModelConfig
from engine.errors import CheckpointError, ContextOverflowError
from engine.loader import load_model

__all__ = ["load_model", "CheckpointError", "ContextOverflowError", "ModelConfig"]
