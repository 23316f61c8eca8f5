"""The one exception type a user can meet while opening a model."""

from __future__ import annotations

from pathlib import Path


class CheckpointError(Exception):
    """A model folder or file that cannot be used, with the path and the cause in plain words."""

    def __init__(self, path: str | Path, cause: str, hint: str = ""):
        self.path = Path(path)
        self.cause = cause
        self.hint = hint
        message = f"{self.path}: {cause}"
        if hint:
            message += f" ({hint})"
        super().__init__(message)


class ContextOverflowError(ValueError):
    """More tokens than the state was sized for."""

    def __init__(self, needed: int, limit: int, advice: str = ""):
        """`advice`: what else can make room, where something can (e.g. a larger context setting)."""
        self.needed, self.limit = needed, limit
        super().__init__(
            f"the conversation needs {needed} tokens but this session holds at most {limit}; "
            f"start a new chat or shorten the prompt" + (f"; {advice}" if advice else "")
        )


class NonFiniteLogitsError(RuntimeError):
    """The model's scores for the next token hold NaN or infinity, so no token can be chosen."""

    def __init__(self):
        super().__init__(
            "the model produced NaN/inf logits: its weights are damaged or the format is misread; re-download it"
        )


class GraphCaptureError(RuntimeError):
    """A decode step could not be captured as CUDA graphs (an op that cannot be captured)."""
