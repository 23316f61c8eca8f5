"""The per-machine calibration of the expert backends: two bandwidths measured once and kept in a JSON file.

The split between the CPU and PCIe (engine/experts/policy.py) comes from a pinned record copy to the GPU and the
CPU expert kernel at the chosen thread count, measured once per machine and kept next to the downloaded models,
so later loads skip the measurement.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass, replace

import torch

from engine.paths import calibration_file

CALIBRATION_RECORDS = 16  # records copied, and experts computed, per measurement: a few ms of work each
TOKEN_MISSES = 8  # a decode token's misses in a layer when nothing is cached (Qwen3.5/3.6 route to 8 experts)
CHUNK_TOKENS = 8  # tokens per expert in the calibration's prompt-chunk call
# In the machine key, so figures measured another way are measured again: version 1 read records the CPU's cache
# could hold (too fast); version 2 timed the two-phase CPU kernel that the item loop replaced (0b18c63)
CALIBRATION_VERSION = 3


@dataclass(frozen=True)
class Calibration:
    pcie_bytes_per_s: float  # pinned host records copied one at a time into the GPU cache
    cpu_bytes_per_s: float  # record bytes the CPU expert kernel gets through, one token per expert
    cpu_call_seconds: float  # what a call costs besides its experts (waking the threads, setting up)
    cpu_threads: int
    pageable_bytes_per_s: float | None = None  # records beyond the pin budget (None: not measured, as pinned)
    cpu_token_seconds: float | None = None  # each further token of an expert in a prompt chunk (None: not measured)

    def copy_bytes_per_s(self, pinned: bool) -> float:
        return self.pcie_bytes_per_s if pinned or not self.pageable_bytes_per_s else self.pageable_bytes_per_s

    def to_dict(self) -> dict:
        return asdict(self)

    def through_link(self, bytes_per_s: float | None) -> Calibration:
        """These figures with the copies held to an emulated link of `bytes_per_s` (engine/experts/link.py holds
        a copy to the slower of the two rates), so the split and auto choose for that link; None: as measured."""
        if bytes_per_s is None:
            return self
        pageable = None if self.pageable_bytes_per_s is None else min(self.pageable_bytes_per_s, bytes_per_s)
        return replace(self, pcie_bytes_per_s=min(self.pcie_bytes_per_s, bytes_per_s), pageable_bytes_per_s=pageable)

    def plausible(self) -> bool:
        """Whether the figures can be real: a busy machine during the measurement can make the CPU's per-expert
        time vanish into the noise (seen on the H200 machine: 1.8e15 B/s and 6.5 ms a call)."""
        return (
            1e8 <= self.pcie_bytes_per_s <= 1e12
            and 1e7 <= self.cpu_bytes_per_s <= 1e12
            and 0.0 <= self.cpu_call_seconds <= 0.05
            and (self.pageable_bytes_per_s is None or 1e7 <= self.pageable_bytes_per_s <= 1e12)
            and (self.cpu_token_seconds is None or 0.0 <= self.cpu_token_seconds <= 0.05)
        )


def machine_key(device: torch.device, record_bytes: int, threads: int) -> str:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return (
        f"v{CALIBRATION_VERSION}|{platform.machine()}|{platform.processor() or os.cpu_count()}|{gpu}|"
        f"{record_bytes}|{threads}"
    )


def calibrate(device: torch.device, records: list[torch.Tensor], cpu_seconds) -> Calibration:
    """Measure both paths now: `records` are host expert records (uint8 [record_bytes] each) to copy;
    `cpu_seconds(calls, per_call, tokens)` computes `calls` calls of `per_call` experts, each chosen by `tokens`
    tokens, on the CPU, never reading a record twice (so from RAM, as decoding does)."""
    record_bytes = records[0].numel()
    target = torch.empty(record_bytes, dtype=torch.uint8, device=device)
    pinned = [r if r.is_pinned() else r.pin_memory() for r in records[:CALIBRATION_RECORDS]]
    target.copy_(pinned[0], non_blocking=True)  # first touch
    pageable = [r.clone() for r in pinned]  # as records beyond the pin budget lie

    def copy_rate(sources: list[torch.Tensor]) -> float:
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        for record in sources:
            target.copy_(record, non_blocking=True)
        torch.cuda.synchronize(device)
        return len(sources) * record_bytes / (time.perf_counter() - started)

    return calibrate_cpu(copy_rate(pinned), record_bytes, cpu_seconds, copy_rate(pageable))


def calibrate_cpu(
    pcie_bytes_per_s: float, record_bytes: int, cpu_seconds, pageable_bytes_per_s: float | None = None
) -> Calibration:
    """The CPU's side of the calibration: calls of one expert and of a token's misses, the difference is the
    experts, the rest is the cost of a call; then the misses each chosen by CHUNK_TOKENS tokens, for the cost of
    a further token. A measurement that cannot be real (the machine was busy) is taken again, twice at most."""
    from engine.kernels import cpu_experts

    cpu_seconds(2, TOKEN_MISSES, 1)  # compiles on first use (cached on disk after) and wakes every thread
    cpu_seconds(1, TOKEN_MISSES, CHUNK_TOKENS)
    for _ in range(3):
        single = min(cpu_seconds(4, 1, 1) for _ in range(3)) / 4
        full = min(cpu_seconds(4, TOKEN_MISSES, 1) for _ in range(3)) / 4
        chunk = min(cpu_seconds(2, TOKEN_MISSES, CHUNK_TOKENS) for _ in range(2)) / 2
        per_expert = max((full - single) / (TOKEN_MISSES - 1), 1e-9)
        per_token = max((chunk - full) / (TOKEN_MISSES * (CHUNK_TOKENS - 1)), 0.0)
        calibration = Calibration(
            pcie_bytes_per_s,
            record_bytes / per_expert,
            max(single - per_expert, 0.0),
            cpu_experts.threads(),
            pageable_bytes_per_s,
            per_token,
        )
        if calibration.plausible():
            break
    return calibration


def cached_calibration(key: str, measure) -> Calibration:
    """This machine's calibration from the file, or `measure()` saved there for next time."""
    path = calibration_file()
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        saved = {}
    if isinstance(saved.get(key), dict):
        try:
            calibration = Calibration(**saved[key])
        except TypeError:
            calibration = None  # an older layout: measure again
        if calibration is not None and calibration.plausible():
            return calibration
    calibration = measure()
    if not calibration.plausible():
        return calibration  # used for this run only: the next load measures again
    saved[key] = calibration.to_dict()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(saved, indent=1), encoding="utf-8")
    except OSError:
        pass  # a read-only data folder only costs the measurement next time
    return calibration
