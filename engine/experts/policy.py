"""Where a decode step's expert misses run: copied over PCIe into the GPU cache (`offload`), computed on the CPU
straight from host RAM (`cpu`), or split between the two so that both finish together (`hybrid`).

On a laptop's narrow PCIe link the CPU's memory bandwidth is the faster path, on a desktop PCIe is; both
together beat either. The split comes from the machine's calibration (engine/experts/calibration.py). `gpu`
asks for every expert resident in VRAM (a cache of every layer), which never misses once warm; `auto` takes
it where the cache holds every layer. Otherwise `auto` times decode steps under each backend that can win
here (`trial_candidates`: cpu, hybrid and offload where the CPU would take some of a token's misses, cpu and
offload where records are pageable) and keeps the fastest (`BackendTrial`); with
nothing to try, offload.
"""

from __future__ import annotations

import statistics

from engine.experts.backend import Backend
from engine.experts.calibration import TOKEN_MISSES, Calibration


def cpu_share(
    misses: int, backend: Backend, calibration: Calibration | None, record_bytes: int, pinned: bool = True
) -> int:
    """How many of a step's `misses` (records of `record_bytes`, `pinned` or beyond the pin budget) the CPU
    computes under `backend` (`BackendPolicy.cpu_misses`)."""
    return policy_for(backend).cpu_misses(misses, calibration, record_bytes, pinned)


class BackendPolicy:
    """How one backend splits a decode step's misses between copies to the GPU and the CPU: offload's way, none
    to the CPU; each other backend is a subclass."""

    backend = Backend.OFFLOAD

    def cpu_misses(self, misses: int, calibration: Calibration | None, record_bytes: int, pinned: bool = True) -> int:
        """How many of a layer's `misses` the CPU computes."""
        return 0

    def cpu_counts(self, top_k: int, calibration: Calibration | None, record_bytes: int) -> list[int]:
        """Of m misses in a pinned layer (m = 0..top_k), how many the CPU computes: the table the device applies
        where it chooses the slots."""
        return [self.cpu_misses(m, calibration, record_bytes) for m in range(top_k + 1)]

    def hear(self, waited: int, layers: int) -> None:
        """Take a device-split step's outcome: in `waited` of its `layers` layers with CPU experts, the GPU waited."""

    @property
    def balance(self) -> HybridBalance | None:
        """The split the steps themselves balance, where the backend keeps one."""
        return None


class GpuPolicy(BackendPolicy):
    """Every expert resident in VRAM: misses only while the cache warms, copied as offload copies them."""

    backend = Backend.GPU


class CpuPolicy(BackendPolicy):
    """Every miss computed by the CPU from host RAM."""

    backend = Backend.CPU

    def cpu_misses(self, misses: int, calibration: Calibration | None, record_bytes: int, pinned: bool = True) -> int:
        return misses


class HybridPolicy(BackendPolicy):
    """Misses split so the copies and the CPU finish together, then balanced by the steps (`HybridBalance`)."""

    backend = Backend.HYBRID

    def __init__(self):
        self._balance: HybridBalance | None = None  # made by the first device-split step, from the calibration

    @property
    def balance(self) -> HybridBalance | None:
        return self._balance

    def cpu_misses(self, misses: int, calibration: Calibration | None, record_bytes: int, pinned: bool = True) -> int:
        """The count that minimises the later of the two finishing times: the copies of the rest (at the pinned or
        the pageable bandwidth) and the CPU's call with its experts."""
        if misses == 0:
            return 0
        copy_seconds = record_bytes / calibration.copy_bytes_per_s(pinned)
        cpu_seconds = record_bytes / calibration.cpu_bytes_per_s

        def finish(m: int) -> float:
            cpu = calibration.cpu_call_seconds + m * cpu_seconds if m else 0.0
            return max((misses - m) * copy_seconds, cpu)

        return min(range(misses + 1), key=lambda m: (finish(m), m))

    def cpu_counts(self, top_k: int, calibration: Calibration | None, record_bytes: int) -> list[int]:
        if calibration is None:
            return super().cpu_counts(top_k, calibration, record_bytes)
        if self._balance is None:
            self._balance = HybridBalance(self.cpu_misses(TOKEN_MISSES, calibration, record_bytes) / TOKEN_MISSES)
        return self._balance.counts(top_k)

    def hear(self, waited: int, layers: int) -> None:
        if self._balance is not None:
            self._balance.update(waited, layers)


POLICIES = {policy.backend: policy for policy in (BackendPolicy, GpuPolicy, CpuPolicy, HybridPolicy)}


def policy_for(backend: Backend | str) -> BackendPolicy:
    """A fresh policy of `backend` (not auto: resolve it first)."""
    backend = Backend(backend)
    if backend not in POLICIES:
        raise ValueError(f"{backend} is not a backend a step runs: resolve it first")
    return POLICIES[backend]()


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


def cpu_faster_for_chunk(
    calibration: Calibration, tokens_per_expert: list[int], record_bytes: int, copy_bytes: int, pinned: bool
) -> bool:
    """Whether the CPU computes a prompt chunk's routed experts of one layer (`tokens_per_expert`: the tokens of
    each expert present) sooner than `copy_bytes` cross PCIe to the GPU. The CPU decodes each expert's weights
    once and multiplies them with its tokens (engine/kernels/cpu_experts/): an expert costs the calibrated
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
    return calibration is not None and any(
        cpu_share(TOKEN_MISSES, Backend.HYBRID, calibration, record_bytes, pinned) for pinned in {True, all_pinned}
    )


def resolve(
    backend: Backend,
    calibration: Calibration | None,
    record_bytes: int,
    all_pinned: bool = True,
    all_resident: bool = False,
) -> Backend:
    """The backend `auto` stands for on this machine's calibration: gpu when the cache holds every layer
    (`all_resident`: nothing misses once warm), hybrid where the CPU helps (`cpu_helps`), else offload; the
    others are themselves. The executor then has a `BackendTrial` time the `trial_candidates`."""
    backend = Backend(backend)
    if backend is not Backend.AUTO:
        return backend
    if all_resident:
        return Backend.GPU
    return Backend.HYBRID if cpu_helps(calibration, record_bytes, all_pinned) else Backend.OFFLOAD


def trial_candidates(
    calibration: Calibration | None, record_bytes: int, all_pinned: bool = True, all_resident: bool = False
) -> tuple[Backend, ...]:
    """The backends auto's trial times, where the CPU expert kernel is ready: hybrid, cpu and offload where the
    CPU helps (`cpu_helps`; hybrid first, as its balance starts from the calibration's split); cpu and offload
    where it does not but some records are pageable, since decode's pageable copies (a layer's few at a time,
    from anywhere in RAM) can run far below the calibration's rate (a few fresh records back to back), and
    hybrid would split as offload does; none where the cache holds every layer or pinned copies win (the
    calibration's choice stands)."""
    if calibration is None or all_resident:
        return ()
    if cpu_helps(calibration, record_bytes, all_pinned):
        return (Backend.HYBRID, Backend.CPU, Backend.OFFLOAD)
    return () if all_pinned else (Backend.CPU, Backend.OFFLOAD)


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

    def __init__(self, candidates: tuple[Backend, ...]):
        if not 2 <= len(candidates) <= self.MOST_CANDIDATES:
            raise ValueError(f"a backend trial times two or three backends, not {candidates!r}")
        self.candidates = tuple(Backend(backend) for backend in candidates)
        self.steps = self.WINDOW * self.ROUNDS * len(candidates)
        self.seconds: dict[Backend, list[float]] = {backend: [] for backend in self.candidates}
        self.chosen: Backend | None = None
        self._steps = 0

    @property
    def backend(self) -> Backend:
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
        return {
            "chosen": None if self.chosen is None else str(self.chosen),
            "step_seconds": {
                str(backend): statistics.median(seconds) if seconds else None
                for backend, seconds in self.seconds.items()
            },
        }
