"""Session events: plain dataclasses, the same for the CLI, the app and any later server."""

from __future__ import annotations

from dataclasses import asdict, dataclass

STOP_REASONS = ("eos", "length", "stop", "cancelled", "error")


@dataclass(frozen=True)
class ReasoningDelta:
    """Text of the model's <think> … </think> part."""

    text: str


@dataclass(frozen=True)
class AnswerDelta:
    """Text of the reply proper."""

    text: str


@dataclass(frozen=True)
class TurnStats:
    prompt_tokens: int  # tokens in the context once the prompt is in (history included)
    prefill_tokens: int  # tokens actually computed for this turn's prompt (history reused)
    new_tokens: int
    time_to_first_token_s: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    stop_reason: str  # one of STOP_REASONS
    seed: int
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens already in the state (from a prefix cache or the chat so far)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class TurnFinished:
    answer: str
    reasoning: str
    stats: TurnStats
