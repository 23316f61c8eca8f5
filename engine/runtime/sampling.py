"""Sampling settings and the sampler that turns one step's logits into the next token id."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.errors import NonFiniteLogitsError

# The generation_config.json keys that carry a sampling setting, with the type each is kept as.
_GENERATION_CONFIG_KEYS = {
    "temperature": float,
    "top_k": int,
    "top_p": float,
    "min_p": float,
    "repetition_penalty": float,
    "presence_penalty": float,
    "max_new_tokens": int,
}
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes 0 to 2**64 - 1 (negative seeds wrap around)


def _typed(key: str, value, kind: type) -> float | int:
    """value as `kind` (int or float), refusing text, booleans and, for int, fractions; ValueError names the key."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or (kind is int and not float(value).is_integer()):
        raise ValueError(f"{key} must be {'a whole number' if kind is int else 'a number'}, got {value!r}")
    return kind(value)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.7  # 0 means greedy
    top_k: int = 20  # 0 turns it off
    top_p: float = 0.8  # 1.0 turns it off
    min_p: float = 0.0  # 0.0 turns it off
    repetition_penalty: float = 1.0  # 1.0 turns it off; applies to every token in the context
    presence_penalty: float = 0.0  # applies to tokens generated so far
    frequency_penalty: float = 0.0  # times each one's count in the tokens generated so far
    max_new_tokens: int = 1024
    stop: tuple[str, ...] = ()
    seed: int | None = None  # None: a fresh random seed per sampler

    def validate(self) -> None:
        """Raise ValueError naming the first setting outside its allowed range."""
        checks = [
            ("temperature", self.temperature, self.temperature >= 0, ">= 0"),
            ("top_k", self.top_k, self.top_k >= 0, ">= 0"),
            ("top_p", self.top_p, 0 < self.top_p <= 1, "in (0, 1]"),
            ("min_p", self.min_p, 0 <= self.min_p < 1, "in [0, 1)"),
            ("repetition_penalty", self.repetition_penalty, self.repetition_penalty > 0, "> 0"),
            ("presence_penalty", self.presence_penalty, -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            ("frequency_penalty", self.frequency_penalty, -2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
            ("max_new_tokens", self.max_new_tokens, self.max_new_tokens >= 1, ">= 1"),
            (
                "stop",
                self.stop,
                not isinstance(self.stop, str) and all(isinstance(s, str) and s for s in self.stop),
                "a sequence of non-empty strings",
            ),
            (
                "seed",
                self.seed,
                self.seed is None or isinstance(self.seed, int) and 0 <= self.seed <= MAX_SEED,
                f"a whole number from 0 to {MAX_SEED}",
            ),
        ]
        for name, value, ok, allowed in checks:
            if not ok:  # written as "not ok" so NaN fails every range
                raise ValueError(f"{name} must be {allowed}, got {value!r}")

    @classmethod
    def from_generation_config(cls, config: dict, **overrides) -> SamplingParams:
        """Defaults from a Hugging Face generation_config.json dict; overrides that are not None win."""
        values = {
            key: _typed(key, config[key], kind)
            for key, kind in _GENERATION_CONFIG_KEYS.items()
            if config.get(key) is not None
        }
        if config.get("do_sample") is False:
            values["temperature"] = 0.0  # Hugging Face's switch for greedy decoding
        values.update({key: value for key, value in overrides.items() if value is not None})
        return cls(**values)


class Sampler:
    """Picks next tokens for one generation; owns its random stream so a seed replays the same tokens."""

    def __init__(self, params: SamplingParams):
        params.validate()
        self.params = params
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._generator = torch.Generator().manual_seed(self.seed)

    def __call__(self, logits: torch.Tensor, context_ids: Sequence[int], generated_ids: Sequence[int]) -> int:
        """The next token id from float32 logits [vocab] on the CPU.

        context_ids is every token so far (prompt and generated); generated_ids is the generated part.
        """
        if not bool(torch.isfinite(logits).all()):  # argmax of NaNs is token 0 and multinomial refuses them
            raise NonFiniteLogitsError()
        p = self.params
        logits = logits.clone()  # the caller's logits stay untouched
        if p.repetition_penalty != 1.0:
            ids = _unique(context_ids)
            scores = logits[ids]
            logits[ids] = torch.where(scores < 0, scores * p.repetition_penalty, scores / p.repetition_penalty)
        if p.presence_penalty != 0.0:
            logits[_unique(generated_ids)] -= p.presence_penalty
        if p.frequency_penalty != 0.0 and len(generated_ids):
            ids, counts = torch.as_tensor(list(generated_ids), dtype=torch.long).unique(return_counts=True)
            logits[ids] -= p.frequency_penalty * counts.to(logits.dtype)
        if p.temperature == 0:
            return int(logits.argmax())

        logits /= p.temperature
        if 0 < p.top_k < logits.numel():
            kth_best = logits.topk(p.top_k).values[-1]
            logits[logits < kth_best] = -torch.inf
        if p.top_p < 1.0:
            probs, order = logits.softmax(-1).sort(descending=True)
            mass_before = probs.cumsum(0) - probs
            # A token is needed only while the better ones hold less than top_p; the best always is.
            logits[order[mass_before >= p.top_p]] = -torch.inf
        if p.min_p > 0.0:
            probs = logits.softmax(-1)
            logits[probs < p.min_p * probs.max()] = -torch.inf
        return int(torch.multinomial(logits.softmax(-1), 1, generator=self._generator))


def _unique(ids: Sequence[int]) -> torch.Tensor:
    """Each id once, so a token repeated in the text is penalised once."""
    return torch.as_tensor(list(ids), dtype=torch.long).unique()
