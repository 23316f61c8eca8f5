"""Expert executors: given a layer's bank, the hidden states and the router's choice, the routed output.

`ReferenceExpertExecutor` computes each chosen expert from the host bank where the hidden states
live, one expert at a time: the plain definition the others are tested against.
`CachedExpertExecutor` (cached_executor.py) is the GPU runtime's. Both report what they did in `stats()`,
which the runtime and the app's gauges read.

The interface is two-phase: `start(...)` routes the work and sets whatever is slow in motion (copies on
the copy stream; CPU compute, later), `wait()` on what it returns gives the routed output. The MoE
layer runs its shared expert in between, so that work hides the transfers.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol

import torch

from engine.experts.bank import ExpertBank, run_expert
from engine.experts.calibration import Calibration
from engine.experts.packed import PackedExperts
from engine.experts.policy import BackendTrial
from engine.step import DecodeStep


class ExpertExecutor(Protocol):
    """What the MoE layers and the model ask of an expert executor, for prompt chunks and decode steps."""

    host_report: dict  # where the expert records lie (pinned, pageable), for reports
    packed: dict[int, PackedExperts]  # each MoE layer's host records, where the executor repacks them
    calibration: Calibration | None  # the machine's CPU and PCIe figures, where a backend needs them
    backend_trial: BackendTrial | None  # auto's trial of the backends, while it runs or once it chose

    def prepare(self, banks: dict[int, ExpertBank], dtype: torch.dtype = torch.float32) -> None: ...

    def start(self, bank: ExpertBank, layer: int, x, expert_ids, expert_weights): ...

    def resize(self, slots: int) -> None: ...

    def decode_capturable(self) -> bool: ...

    def note_decode_step(self, position: int) -> None: ...

    def decode_key(self) -> Hashable: ...

    def plan_decode(self, top_k: int, hidden: int) -> None: ...

    def begin_decode(self) -> None: ...

    def decode_layer(self, layer: int, y, ids, weights, residual, shared, shared_gate, step: DecodeStep): ...

    def end_decode(self) -> None: ...

    def abandon_decode(self) -> None: ...

    def end_trial(self) -> None: ...

    def stats(self) -> dict: ...


class ReferenceExpertExecutor:
    host_report: dict = {}  # nothing is repacked or pinned: experts are read where the checkpoint keeps them
    packed: dict = {}
    calibration = backend_trial = None  # one backend, nothing to measure or to try

    def __init__(self):
        self.expert_calls = 0  # experts computed so far
        self._banks: dict[int, ExpertBank] = {}

    def prepare(self, banks: dict[int, ExpertBank], dtype: torch.dtype = torch.float32) -> None:
        """Keep the banks: experts are computed from them as they are."""
        self._banks = dict(banks)

    def start(self, bank: ExpertBank, layer: int, x, expert_ids, expert_weights) -> Ready:
        out = torch.zeros_like(x)
        for expert in expert_ids.unique().tolist():
            self.expert_calls += 1
            token_idx, slot = torch.where(expert_ids == expert)
            weights = tuple(w.to(x.device) for w in bank.stored(expert))
            y = run_expert(x[token_idx], weights, bank.intermediate)
            out.index_add_(0, token_idx, y * expert_weights[token_idx, slot, None].to(x.dtype))
        return Ready(out)

    def resize(self, slots: int) -> None:
        """Nothing to resize: experts are read from the host bank, with no cache."""

    def decode_capturable(self) -> bool:
        """Never: the host reads the router's choice to pick each expert."""
        return False

    def note_decode_step(self, position: int) -> None:
        """Nothing to time: there is one backend."""

    def decode_key(self) -> Hashable:
        return None

    def plan_decode(self, top_k: int, hidden: int) -> None:
        """Nothing to plan: every layer runs as in a prompt chunk."""

    def begin_decode(self) -> None:
        """Nothing to start."""

    def decode_layer(self, layer: int, y, ids, weights, residual, shared, shared_gate, step: DecodeStep):
        """`residual` plus one token's routed experts of `layer` (and its shared expert, gated by
        sigmoid(shared_gate) when given)."""
        routed = self.start(self._banks[layer], layer, y, ids.reshape(1, -1), weights.reshape(1, -1)).wait()
        if shared is None:
            return residual + routed
        out = shared(y)
        return residual + (routed + (out if shared_gate is None else torch.sigmoid(shared_gate) * out))

    def end_decode(self) -> None:
        """Nothing to wait for."""

    def abandon_decode(self) -> None:
        """Nothing to stop."""

    def end_trial(self) -> None:
        """No trial runs."""

    def stats(self) -> dict:
        return {"expert_calls": self.expert_calls}


class Ready:
    """Work that was done at once."""

    def __init__(self, out: torch.Tensor):
        self.out = out

    def wait(self) -> torch.Tensor:
        return self.out
