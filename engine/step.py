"""The host's points in a one-token decode step, so a graph runner can capture the step around them."""

from __future__ import annotations

from collections.abc import Callable

import torch

HostAction = Callable[[], None]


class DecodeStep:
    """What a layer's `decode_step` tells whoever runs it: where the host must act, and what to do after.

    Run eagerly (`cut` None) every action runs where it is asked for. Under a graph runner's capture, `cut`
    ends the graph being captured at a host action and starts the next one, so replay runs the action there."""

    def __init__(
        self,
        graphed: bool,
        cut: Callable[[HostAction], None] | None = None,
        queued: Callable[[HostAction], None] | None = None,
    ):
        self.graphed = graphed  # whether the step is meant for capture: layers then keep to capturable kernels
        self._cut, self._queued = cut, queued
        self.after: list[HostAction] = []  # host work once the step's device work is queued, every step

    def host(self, action: HostAction) -> None:
        """Run `action` on the host at this point of the step (every replay, when captured)."""
        if self._cut is None:
            action()
        else:
            self._cut(action)

    def host_tensor(self, compute: Callable[[], torch.Tensor], like: Callable[[], torch.Tensor]) -> torch.Tensor:
        """`compute()` run on the host at this point of the step; captured, its result lands in `like()`."""
        if self._cut is None:
            return compute()
        out = like()
        self._cut(lambda: out.copy_(compute()))
        return out

    def when_queued(self, action: HostAction) -> None:
        """Run `action` once the device work asked for so far is queued, without cutting the step there."""
        if self._queued is None:
            action()
        else:
            self._queued(action)

    def at_end(self, action: HostAction) -> None:
        """Run `action` on the host after each step's device work is queued."""
        self.after.append(action)
