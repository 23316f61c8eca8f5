"""A narrower host-to-GPU link than the machine's, emulated for benchmarks (`bench --link-gbps`): the field
report's laptop has PCIe 4.0 x4 (about 6.5 GB/s), the H200 host 40-55 GB/s.

The copies still happen at the machine's speed; then the stream they ran on is held until the run of copies
began plus its bytes over the emulated rate, so whatever waits for them (compute waiting on the copy stream's
event, the rest of a captured decode step) waits as long as the slower link would make it wait, and no longer
than the real copies took where those are slower. On CUDA a one-warp kernel marks the start with the GPU's
global timer and another spins until the deadline (engine/kernels/triton_link.py), both on the copies' own
stream, so captured CUDA graphs carry the hold: the gather kernel's hold reads the step's miss count from the
same device table the gather reads, every replay. Off CUDA the copies are synchronous, so the host's clock
holds them (the reference the tests run with a fake clock).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


class LinkLimitError(ValueError):
    """A link limit that cannot be emulated here (not positive, or not below the measured link)."""


@dataclass(frozen=True)
class LinkLimit:
    bytes_per_s: float

    def __post_init__(self):
        if not self.bytes_per_s > 0 or math.isinf(self.bytes_per_s):
            raise LinkLimitError(f"a link limit must be a positive number of bytes per second, got {self.bytes_per_s}")

    def nanoseconds(self, nbytes: int) -> int:
        """How long `nbytes` take on the emulated link, rounded up to whole nanoseconds."""
        return math.ceil(nbytes * 1e9 / self.bytes_per_s)

    def check_below(self, measured_bytes_per_s: float, what: str) -> None:
        """LinkLimitError unless the limit is below the measured rate (`what` names the memory it was measured
        from): a throttle can only slow a link down."""
        if self.bytes_per_s >= measured_bytes_per_s:
            raise LinkLimitError(
                f"--link-gbps {self.bytes_per_s / 1e9:g} is not below this machine's measured "
                f"{what} host->GPU rate of {measured_bytes_per_s / 1e9:.1f} GB/s, so there is "
                f"nothing to emulate; give a lower rate or leave --link-gbps out"
            )

    def through(self, bytes_per_s: float) -> float:
        """The rate of copies at `bytes_per_s` once held to this limit."""
        return min(bytes_per_s, self.bytes_per_s)


def copied_records(table: torch.Tensor) -> int:
    """How many records a gather copy table [n, 2] of (record or -1, slot) copies (reference.gather_records)."""
    return sum(source >= 0 for source, _ in table.tolist())


class LinkThrottle:
    """Holds one stream's copies to `limit`: `start()` before a run of copies, then `hold(nbytes)` (or
    `hold_records(table, record_bytes)` after a gather) keeps the stream from going on before the start plus
    their time on the emulated link. One run at a time: the start is one mark per throttle."""

    def __init__(
        self,
        limit: LinkLimit,
        device: torch.device | str,
        clock_ns: Callable[[], int] = time.perf_counter_ns,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.limit = limit
        self.device = torch.device(device)
        self.clock_ns, self.sleep = clock_ns, sleep
        if self.device.type == "cuda":
            try:
                from engine.kernels import triton_link
            except ImportError as error:
                raise LinkLimitError(
                    f"emulating a link on the GPU needs Triton ({error}); install it "
                    f"(pip install triton) or leave --link-gbps out"
                ) from None
            self._kernels = triton_link
            self._mark = torch.zeros(1, dtype=torch.int64, device=self.device)  # the run's start, GPU timer ns
        else:
            self._kernels, self._started = None, 0

    def start(self) -> None:
        """Mark the start of a run of copies on the current stream."""
        if self._kernels is not None:
            self._kernels.mark_time(self._mark)
        else:
            self._started = self.clock_ns()

    def hold(self, nbytes: int) -> None:
        """Hold the current stream until the run's start plus `nbytes` over the link."""
        self._hold_until(self.limit.nanoseconds(nbytes))

    def hold_records(self, table: torch.Tensor, record_bytes: int) -> None:
        """`hold` for the records a gather copy table names; on CUDA the kernel counts them on the device."""
        per_record = self.limit.nanoseconds(record_bytes)
        if self._kernels is not None:
            self._kernels.hold_for_records(self._mark, table, per_record)
        else:
            self._hold_until(copied_records(table) * per_record)

    def _hold_until(self, ns: int) -> None:
        if self._kernels is not None:
            self._kernels.hold_after(self._mark, ns)
            return
        left = self._started + ns - self.clock_ns()
        if left > 0:
            self.sleep(left / 1e9)
