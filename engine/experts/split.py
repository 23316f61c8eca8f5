"""Where a decode step's expert misses run: copied over PCIe into the GPU cache (`offload`), computed on the CPU
straight from host RAM (`cpu`), or split between the two so that both finish together (`hybrid`).

On a laptop's narrow PCIe link the CPU's memory bandwidth is the faster path, on a desktop PCIe is; both
together beat either. The split comes from two bandwidths measured once per machine (a pinned record copy to
the GPU, and the CPU expert kernel at the chosen thread count) and kept in a small JSON file, so later loads
skip the measurement. `gpu` asks for every expert resident in VRAM (a cache of every layer), which never misses
once warm; `auto` takes it where the cache holds every layer. Otherwise `auto` times decode steps under each
backend that can win here (`trial_candidates`: cpu, hybrid and offload where the CPU would take some of a
token's misses, cpu and offload where records are pageable) and keeps the fastest (`BackendTrial`); with
nothing to try, offload.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, replace

import torch

from engine.paths import calibration_file

BACKENDS = ("auto", "gpu", "offload", "cpu", "hybrid")
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
        return (1e8 <= self.pcie_bytes_per_s <= 1e12 and 1e7 <= self.cpu_bytes_per_s <= 1e12
                and 0.0 <= self.cpu_call_seconds <= 0.05
                and (self.pageable_bytes_per_s is None or 1e7 <= self.pageable_bytes_per_s <= 1e12)
                and (self.cpu_token_seconds is None or 0.0 <= self.cpu_token_seconds <= 0.05))


def cpu_share(misses: int, backend: str, calibration: Calibration | None, record_bytes: int,
              pinned: bool = True) -> int:
    """How many of a step's `misses` (records of `record_bytes`, `pinned` or beyond the pin budget) the CPU
    computes: none (offload), all (cpu), or (hybrid) the count that minimises the later of the two finishing
    times, the copies of the rest (at the pinned or the pageable bandwidth) and the CPU's call with its experts."""
    if misses == 0 or backend in ("offload", "gpu"):
        return 0
    if backend == "cpu":
        return misses
    copy_seconds = record_bytes / calibration.copy_bytes_per_s(pinned)
    cpu_seconds = record_bytes / calibration.cpu_bytes_per_s

    def finish(m: int) -> float:
        cpu = calibration.cpu_call_seconds + m * cpu_seconds if m else 0.0
        return max((misses - m) * copy_seconds, cpu)
    return min(range(misses + 1), key=lambda m: (finish(m), m))


class HybridBalance:
    """Hybrid's fraction of a decode step's misses for the CPU where the device splits them (engine/kernels/
    cpu_share.py), moved after each step toward where the GPU, ending a layer, seldom finds the CPU still at
    work: a GPU that waited in most layers gives the CPU less, one that hardly waited gives it more. It starts
    from the calibration's split; the calibration measures each path alone, the steps see them share the host's
    memory (on the H200 machine the calibrated split left the CPU idle while the copies set the pace). Moves the
    same way double, up to LARGEST_NOTCH, so a start far from the balance is left in a few steps (crossing half
    the range took 16 at 1/32, as long as the H200's short benchmark run); a move back starts again from NOTCH,
    so it settles finely."""

    NOTCH = 1 / 32
    LARGEST_NOTCH = 1 / 8

    def __init__(self, fraction: float):
        self.fraction = min(max(fraction, 0.0), 1.0)
        self.notch, self._direction = self.NOTCH, 0

    def counts(self, top_k: int) -> list[int]:
        """Of m misses (m = 0..top_k), how many the CPU computes."""
        return [min(m, int(self.fraction * m + 0.5)) for m in range(top_k + 1)]

    def update(self, waited: int, layers: int) -> None:
        """After a step: of its `layers` layers with CPU experts, the GPU waited for the CPU in `waited`."""
        if layers == 0:  # nothing for the CPU: from zero it tries again (a probe), else all were hits
            if self.fraction == 0.0:
                self._move(1)
            return
        if waited > layers / 2:
            self._move(-1)
        elif waited < layers / 5:
            self._move(1)
        else:
            self._direction = 0  # balanced: the next move starts small

    def _move(self, direction: int) -> None:
        same = direction == self._direction
        self.notch = min(2 * self.notch, self.LARGEST_NOTCH) if same else self.NOTCH
        self._direction = direction
        self.fraction = min(max(self.fraction + direction * self.notch, 0.0), 1.0)


def cpu_faster_for_chunk(calibration: Calibration, tokens_per_expert: list[int], record_bytes: int,
                         copy_bytes: int, pinned: bool) -> bool:
    """Whether the CPU computes a prompt chunk's routed experts of one layer (`tokens_per_expert`: the tokens of
    each expert present) sooner than `copy_bytes` cross PCIe to the GPU. The CPU decodes each expert's weights
    once and multiplies them with its tokens (engine/kernels/cpu_experts.py): an expert costs the calibrated
    one-token time plus the calibrated time of each further token (where not measured: a quarter of the
    one-token time, which the H200 machine's bf16 kernel showed is too little, 2026-11-30)."""
    if copy_bytes == 0:
        return False  # the experts are on the GPU already
    per_expert = record_bytes / calibration.cpu_bytes_per_s
    per_token = calibration.cpu_token_seconds if calibration.cpu_token_seconds is not None else per_expert / 4
    cpu = calibration.cpu_call_seconds + sum(per_expert + (n - 1) * per_token for n in tokens_per_expert if n)
    return cpu < copy_bytes / calibration.copy_bytes_per_s(pinned)


def cpu_helps(calibration: Calibration | None, record_bytes: int, all_pinned: bool = True) -> bool:
    """Whether the calibration gives the CPU some of a token's misses (TOKEN_MISSES of them) from a pinned layer,
    or from a pageable one if some layers are (`all_pinned` False)."""
    return calibration is not None and any(cpu_share(TOKEN_MISSES, "hybrid", calibration, record_bytes, pinned)
                                           for pinned in {True, all_pinned})


def resolve(backend: str, calibration: Calibration | None, record_bytes: int, all_pinned: bool = True,
            all_resident: bool = False) -> str:
    """The backend `auto` stands for on this machine's calibration: gpu when the cache holds every layer
    (`all_resident`: nothing misses once warm), hybrid where the CPU helps (`cpu_helps`), else offload; the
    others are themselves. The executor then has a `BackendTrial` time the `trial_candidates`."""
    if backend != "auto":
        return backend
    if all_resident:
        return "gpu"
    return "hybrid" if cpu_helps(calibration, record_bytes, all_pinned) else "offload"


def trial_candidates(calibration: Calibration | None, record_bytes: int, all_pinned: bool = True,
                     all_resident: bool = False) -> tuple[str, ...]:
    """The backends auto's trial times, where the CPU expert kernel is ready: hybrid, cpu and offload where the
    CPU helps (`cpu_helps`; hybrid first, as its balance starts from the calibration's split); cpu and offload
    where it does not but some records are pageable, since decode's pageable copies (a layer's few at a time,
    from anywhere in RAM) can run far below the calibration's rate (a few fresh records back to back), and
    hybrid would split as offload does; none where the cache holds every layer or pinned copies win (the
    calibration's choice stands)."""
    if calibration is None or all_resident:
        return ()
    if cpu_helps(calibration, record_bytes, all_pinned):
        return ("hybrid", "cpu", "offload")
    return () if all_pinned else ("cpu", "offload")


class BackendTrial:
    """`auto`'s choice among `candidates` (`trial_candidates`), by decode steps timed under each. The calibration
    times each path alone on a token's full misses; a step's speed also depends on how few misses the cache
    leaves, on what the CPU share's hand-offs cost (H200 at 12gb, ~85 % hits: offload 132 tok/s, hybrid 119,
    though the calibration favoured the CPU) and on how pageable copies fare in decode. The candidates take
    turns in windows of WINDOW steps, ROUNDS each, so the cache's warming favours none; a window's first SETTLE
    steps are not counted (the step's graphs are captured again for another backend). Then the one with the
    shortest median step stays. STEPS is the most steps a trial takes (MOST_CANDIDATES of them): what a
    benchmark leaves untimed for it."""

    WINDOW = 8
    SETTLE = 2
    ROUNDS = 2
    MOST_CANDIDATES = 3
    STEPS = WINDOW * ROUNDS * MOST_CANDIDATES

    def __init__(self, candidates: tuple[str, ...]):
        if not 2 <= len(candidates) <= self.MOST_CANDIDATES:
            raise ValueError(f"a backend trial times two or three backends, not {candidates!r}")
        self.candidates = candidates
        self.steps = self.WINDOW * self.ROUNDS * len(candidates)
        self.seconds: dict[str, list[float]] = {backend: [] for backend in candidates}
        self.chosen: str | None = None
        self._steps = 0

    @property
    def backend(self) -> str:
        """The backend for the next step."""
        if self.chosen is not None:
            return self.chosen
        return self.candidates[(self._steps // self.WINDOW) % len(self.candidates)]

    def record(self, seconds: float) -> None:
        """A decode step under `backend` took `seconds`."""
        if self.chosen is not None:
            return
        if self._steps % self.WINDOW >= self.SETTLE:
            self.seconds[self.backend].append(seconds)
        self._steps += 1
        if self._steps == self.steps:
            self.chosen = min(self.candidates, key=lambda backend: statistics.median(self.seconds[backend]))

    def to_dict(self) -> dict:
        """The choice once made, and each candidate's median step so far (seconds; None before its first), in
        the order they are timed."""
        return {"chosen": self.chosen, "step_seconds": {backend: statistics.median(seconds) if seconds else None
                                                        for backend, seconds in self.seconds.items()}}


def machine_key(device: torch.device, record_bytes: int, threads: int) -> str:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return (f"v{CALIBRATION_VERSION}|{platform.machine()}|{platform.processor() or os.cpu_count()}|{gpu}|"
            f"{record_bytes}|{threads}")


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


def calibrate_cpu(pcie_bytes_per_s: float, record_bytes: int, cpu_seconds,
                  pageable_bytes_per_s: float | None = None) -> Calibration:
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
        calibration = Calibration(pcie_bytes_per_s, record_bytes / per_expert, max(single - per_expert, 0.0),
                                  cpu_experts.threads(), pageable_bytes_per_s, per_token)
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
