"""A stand-in model for session tests: it answers every prompt with a fixed script of tokens.

The session's logic (reasoning split, UTF-8 streaming, stop strings, cancel, turn bookkeeping) is
tested on exact token sequences this way; the numerics are tested on the real engine elsewhere.
"""

import time

import torch

from engine.errors import ContextOverflowError
from engine.models.base import Interrupted, ModelState


class ScriptedModel:
    def __init__(self, vocab_size: int, script: list[int], seconds_per_forward: float = 0.0):
        self.vocab_size, self.script, self.delay = vocab_size, script, seconds_per_forward
        self.fed: list[list[int]] = []  # every forward's ids, in order

    def new_state(self, max_tokens=None):
        return ModelState([], max_tokens)

    def forward(self, token_ids, state, interrupt=None):
        ids = [int(t) for t in token_ids]
        if state.max_tokens is not None and state.position + len(ids) > state.max_tokens:
            raise ContextOverflowError(state.position + len(ids), state.max_tokens)
        deadline = time.perf_counter() + self.delay
        while time.perf_counter() < deadline:  # "layers": the interrupt is asked while working
            if interrupt is not None and interrupt():
                raise Interrupted()
            time.sleep(0.001)
        decoding = (
            bool(self.fed) and len(ids) == 1 and self._cursor < len(self.script) and ids[0] == self.script[self._cursor]
        )
        self._cursor = self._cursor + 1 if decoding else 0
        self.fed.append(ids)
        state.position += len(ids)
        logits = torch.zeros(self.vocab_size)
        logits[self.script[min(self._cursor, len(self.script) - 1)]] = 30.0
        return logits

    _cursor = 0
