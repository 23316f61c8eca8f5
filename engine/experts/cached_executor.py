"""The GPU runtime's expert executor: the layer's experts visit cache slots on the compute device
(engine/experts/cache.py) and run as one grouped matmul per projection over tokens sorted by expert.

Chunks big enough to touch most experts stream the whole layer, and the next layer's experts start streaming
on the copy stream as soon as this layer's compute is queued: into a second block of slots while this layer
computes (prefill overlap, two or more layers of slots), or into the same block once this layer is done,
beside the next layer's attention (one layer of slots). It implements `ExpertExecutor` (executor.py).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Hashable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine import kernels
from engine.experts.backend import BACKENDS, Backend
from engine.experts.bank import ExpertBank
from engine.experts.cache import STREAM_TURN_BLOCKS, ExpertCache
from engine.experts.calibration import CALIBRATION_RECORDS, Calibration, cached_calibration, calibrate, machine_key
from engine.experts.decode_step import ExpertDecodeStep
from engine.experts.link import LinkLimit, LinkThrottle
from engine.experts.packed import PackedExperts, pack_banks
from engine.experts.policy import (
    BackendPolicy,
    BackendTrial,
    HybridBalance,
    cpu_faster_for_chunk,
    policy_for,
    resolve,
    trial_candidates,
)
from engine.kernels.groups import ExpertGroups
from engine.step import DecodeStep


from engine.experts.executor import Ready


class CachedExpertExecutor:
    def __init__(
        self,
        device: torch.device | str,
        slots: int,
        pin_budget_bytes: int | None = None,
        backend: Backend | str = Backend.OFFLOAD,
        cpu_threads: int | None = None,
        link: LinkLimit | None = None,
    ):
        if backend not in BACKENDS:
            raise ValueError(f"unknown expert backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        self.device = torch.device(device)
        self.slots, self.pin_budget_bytes = slots, pin_budget_bytes
        self.requested_backend = self.backend = Backend(backend)
        self.cpu_threads = cpu_threads
        self.link = link  # an emulated narrower host->GPU link (benchmarks), or None: the machine's own
        self._gather_link: LinkThrottle | None = None  # holds the decode step's gathers to it
        self.cache: ExpertCache | None = None
        self.packed: dict[int, PackedExperts] = {}
        self._next_layer: dict[int, int] = {}
        self.host_report: dict = {}
        self.cpu_kernel = None  # the CPU's experts (engine/kernels/cpu_experts/), for the cpu and hybrid backends
        self.calibration: Calibration | None = None
        self._gather_works = False  # a decode step's misses copied by the gather kernel (probed in prepare)
        self.expert_calls = self.cpu_expert_calls = 0
        self._dtype = torch.float32  # the model's activations (prepare)
        self._calibration_calls = 0  # CPU calls the calibration made: where the next one's experts start
        self._policies: dict[Backend, BackendPolicy] = {}  # each backend run so far: hybrid's keeps its balance
        self.backend_trial: BackendTrial | None = None  # auto timing the backends that can win here
        self._calibrated_backend = backend  # what auto stands for by the calibration alone (`resolve`)
        self.clock = time.perf_counter  # what the trial's steps are timed with
        self._last_decode_step: tuple[float, int] | None = None  # (clock, position) when the last step began
        self.decode: ExpertDecodeStep | None = None  # the MoE layers' part of decode steps, made by plan_decode

    def prepare(self, banks: dict[int, ExpertBank], dtype: torch.dtype = torch.float32) -> None:
        """Repack every layer's experts into host records (pinned within the budget) and allocate the cache.
        dtype: the model's activations; 16-bit ones let the CPU kernel round its inputs to bf16 like the GPU's."""
        self._dtype = dtype
        self.packed, self.host_report = pack_banks(banks, self.pin_budget_bytes, pin=self.device.type == "cuda")
        layers = sorted(self.packed)
        self._next_layer = dict(zip(layers, layers[1:]))
        self._build_cache()
        self._gather_works = self.device.type == "cuda" and self._probe_gather()
        self._choose_with_cache()

    def resize(self, slots: int) -> None:
        """Rebuild the expert cache with `slots` slots, filled from the host records as it is used (no checkpoint
        file is read), and choose the backend again: which backends can win depends on what the cache holds."""
        self._refuse_gpu_short_of(slots)  # before the old cache goes: a refused resize keeps it
        self.cache = self.decode = None  # the old pool goes before the new one is allocated
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.slots = slots
        self._build_cache()
        self._choose_with_cache()

    def _build_cache(self) -> None:
        """Allocate a cache of `slots` slots; where it holds fewer layers than the model, prefill keeps the first
        layers' blocks. ValueError where the gpu backend was asked for and the cache cannot hold every expert."""
        self._refuse_gpu_short_of(self.slots)
        layers = sorted(self.packed)
        first = self.packed[layers[0]]
        experts = first.records.shape[0]
        self.cache = ExpertCache(self.device, self.slots, first.layout, experts, layers[-1] + 1, self._throttle())
        if self.cache.blocks < len(layers):  # prefill would stream every layer each chunk: the first ones stay
            self.cache.keep_when_streaming(layers[: max(0, self.cache.blocks - STREAM_TURN_BLOCKS)])
        self._gather_link = self._throttle()  # its own mark: the gathers run on the step's streams, not the copy stream

    def _refuse_gpu_short_of(self, slots: int) -> None:
        """ValueError where the gpu backend was asked for and `slots` slots cannot hold every layer's experts."""
        layers = len(self.packed)
        blocks = slots // next(iter(self.packed.values())).records.shape[0]
        if self.requested_backend is Backend.GPU and blocks < layers:
            raise ValueError(
                f"the gpu expert backend keeps every expert in VRAM: {layers} layers of slots, "
                f"but the cache holds {blocks}; choose offload, cpu, hybrid or auto"
            )

    def _choose_with_cache(self) -> None:
        """Choose the requested backend for the cache built, with the CPU kernel where a backend may use it."""
        wants_cpu = self.requested_backend is Backend.AUTO or self.requested_backend.shares_with_cpu
        if wants_cpu and self.device.type == "cuda" and self.cpu_kernel is None:
            self._prepare_cpu(self.cache.layout, self._dtype)
        self.choose_backend(self.requested_backend)
        if not self.backend.shares_with_cpu and self.backend_trial is None:
            self.cpu_kernel = None

    @property
    def backend(self) -> Backend:
        """The backend the next decode step runs (auto resolved to one of the others)."""
        return self._backend

    @backend.setter
    def backend(self, backend: Backend | str) -> None:
        self._backend = Backend(backend)

    @property
    def policy(self) -> BackendPolicy:
        """The split of the backend of the moment, kept while the backend changes (auto's trial) and back."""
        policy = self._policies.get(self.backend)
        if policy is None:
            policy = self._policies[self.backend] = policy_for(self.backend)
        return policy

    @property
    def hybrid_balance(self) -> HybridBalance | None:
        """Hybrid's split where the device applies it, once a hybrid step made it."""
        hybrid = self._policies.get(Backend.HYBRID)
        return hybrid.balance if hybrid is not None else None

    def _throttle(self) -> LinkThrottle | None:
        """A throttle holding one stream's copies to the emulated link, if there is one."""
        return LinkThrottle(self.link, self.device) if self.link is not None else None

    def choose_backend(self, backend: Backend | str) -> None:
        """Run `backend` from the next step on; `auto` resolves by the calibration, and where the CPU kernel is
        ready and more than one backend can win (`trial_candidates`), decode steps time them in turn
        (`note_decode_step`) before the fastest stays."""
        record_bytes = self.cache.layout.record_bytes
        all_pinned = all(packed.pinned for packed in self.packed.values())
        all_resident = self.cache.blocks >= len(self.packed)
        self.backend = self._calibrated_backend = resolve(
            backend, self.calibration, record_bytes, all_pinned, all_resident
        )
        candidates = (
            trial_candidates(self.calibration, record_bytes, all_pinned, all_resident)
            if Backend(backend) is Backend.AUTO and self.cpu_kernel is not None
            else ()
        )
        self.backend_trial = BackendTrial(candidates) if candidates else None
        if self.backend_trial is not None:
            self.backend = self.backend_trial.backend
        self._last_decode_step = None

    def end_trial(self) -> None:
        """Decode steps are no longer graphed (their capture failed): nothing times them, and the plain forward
        never splits a one-token step, so the calibration's choice stands and the trial stops saying it is timing."""
        if self.backend_trial is not None and self.backend_trial.chosen is None:
            self.backend_trial, self.backend = None, self._calibrated_backend

    def note_decode_step(self, position: int) -> None:
        """A graphed decode step for `position` begins: the time since the last began, if that was the one
        before it (not a prompt between), goes to auto's trial, which says the backend of this step."""
        if self.backend_trial is None or self.backend_trial.chosen is not None:
            return
        now = self.clock()
        if self._last_decode_step is not None and position == self._last_decode_step[1] + 1:
            self.backend_trial.record(now - self._last_decode_step[0])
            self.backend = self.backend_trial.backend
        self._last_decode_step = (now, position)

    def _prepare_cpu(self, layout, dtype: torch.dtype) -> None:
        from engine.kernels import cpu_experts

        cpu_experts.set_threads(self.cpu_threads)
        # a float32 model keeps exact activations; otherwise the kernel's default (bf16 where the CPU has the dot)
        self.cpu_kernel = cpu_experts.CpuExpertKernel(layout, "float32" if dtype == torch.float32 else None)
        layers = list(self.packed.values())
        records = [layers[i % len(layers)].records[i // len(layers)] for i in range(CALIBRATION_RECORDS)]
        key = machine_key(self.device, layout.record_bytes, cpu_experts.threads())
        measured = cached_calibration(key, lambda: calibrate(self.device, records, self._cpu_seconds))
        # the file keeps the machine's own figures; an emulated link holds the copies below them
        self.calibration = measured.through_link(self.link.bytes_per_s if self.link is not None else None)

    def _cpu_seconds(self, calls: int, per_call: int, tokens: int) -> float:
        """Time for `calls` CPU calls of `per_call` experts, each chosen by `tokens` tokens. Every call takes
        experts no call took before (the next in a walk over every layer's records), so they come from RAM
        however big the CPU's cache: the H200 machine's 300 MB held a repeated few and read 70 GB/s, not 35."""
        layers = list(self.packed.values())
        experts = layers[0].records.shape[0]
        x = torch.randn(tokens, self.cpu_kernel.hidden)
        chosen = []
        for _ in range(calls):
            call = self._calibration_calls
            self._calibration_calls += 1
            first = (call // len(layers)) * per_call
            ids = (torch.arange(first, first + per_call) % experts).expand(tokens, per_call)
            chosen.append((layers[call % len(layers)].records, ids))
        started = time.perf_counter()
        for records, ids in chosen:
            self.cpu_kernel.run(
                records, x, ids, torch.ones(tokens, per_call), torch.ones(tokens, per_call, dtype=torch.bool)
            )
        return time.perf_counter() - started

    def start(self, bank: ExpertBank, layer: int, x, expert_ids, expert_weights) -> _CachedWork:
        tokens, top_k = expert_ids.shape
        flat = expert_ids.reshape(-1)
        counts = torch.bincount(flat, minlength=bank.num_experts).tolist()  # the one host sync of a layer
        experts = [e for e, n in enumerate(counts) if n]
        streaming = self.cache.blocks > 0 and tokens * top_k >= bank.num_experts
        if tokens > 1 and self._chunk_on_cpu(layer, counts, experts, streaming):
            self.cpu_expert_calls += len(experts)
            return self._on_cpu(layer, x, expert_ids, expert_weights)
        self.expert_calls += len(experts)
        order = torch.argsort(flat, stable=True)  # assignments sorted by expert
        token_of_row = order // top_k
        rows = x[token_of_row]
        starts = [0]
        for e in experts:
            starts.append(starts[-1] + counts[e])
        # Experts in rounds the cache can hold at once (one round unless the cache is under a layer).
        rounds = []
        for first in range(0, len(experts), self.slots):
            chosen = experts[first : first + self.slots]
            rounds.append((first, chosen, None if first else self._slots(layer, chosen, streaming)))
        return _CachedWork(
            self, layer, x, rows, order, token_of_row, expert_weights, starts, rounds, streaming, bank.intermediate
        )

    def _chunk_on_cpu(self, layer: int, counts: list[int], experts: list[int], streaming: bool) -> bool:
        """Whether the CPU computes this prompt chunk's experts of `layer` (cpu and hybrid backends): when its
        calibrated time beats copying what the GPU lacks, as for a short follow-up message on a narrow link."""
        if not self.backend.shares_with_cpu or self.cpu_kernel is None or self.calibration is None:
            return False
        record_bytes = self.cache.layout.record_bytes
        if streaming:
            copies = 0 if self.cache.holds_layer(layer) else len(counts)
        else:
            copies = len(self.cache.missing(layer, experts))
        return cpu_faster_for_chunk(
            self.calibration, counts, record_bytes, copies * record_bytes, self.packed[layer].pinned
        )

    def _on_cpu(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor) -> Ready:
        """A chunk's routed output computed by the CPU from the host records (exact), sent to x's device."""
        out = self.cpu_kernel.run(
            self.packed[layer].records,
            x.float().cpu(),
            expert_ids.cpu(),
            expert_weights.float().cpu(),
            torch.ones(expert_ids.shape, dtype=torch.bool),
        )
        return Ready(out.to(x.device, x.dtype))

    def _slots(self, layer: int, experts: list[int], streaming: bool) -> list[int]:
        """Cache slots holding `experts`, their copies issued on the copy stream."""
        if streaming:
            base = self.cache.stream_layer(layer, self.packed[layer])
            return [base + e for e in experts]
        return self.cache.fetch(layer, experts, self.packed[layer])

    def _swiglu(self, rows: torch.Tensor, groups: ExpertGroups, intermediate: int) -> torch.Tensor:
        weights = self.cache.weights
        gate, up = kernels.grouped_linear(rows, weights["gate_up"], groups).split(intermediate, dim=-1)
        return kernels.grouped_linear(F.silu(gate) * up, weights["down"], groups)

    # ---- decode steps (engine/experts/decode_step.py) ---------------------------------------------------

    def decode_capturable(self) -> bool:
        """Whether a decode step's expert matmuls can be captured in CUDA graphs (their format has a kernel that
        reads the slots on the device)."""
        return self.device.type == "cuda" and all(
            kernels.slot_linear_capturable(w, self.device) for w in self.cache.weights.values()
        )

    def cpu_share_wanted(self) -> bool:
        """Whether the backend of the moment leaves some of a step's misses to the CPU."""
        return self.cpu_kernel is not None and self.backend.shares_with_cpu

    def decode_key(self) -> Hashable:
        """What a decode step's shape depends on: whether it carries a CPU share (offload's graphs carry none)."""
        return self.cpu_share_wanted()

    def plan_decode(self, top_k: int, hidden: int) -> None:
        """Decide how the MoE layers of the decode steps to come choose slots and share work with the CPU."""
        if self.decode is None:
            self.decode = ExpertDecodeStep(self, top_k, hidden, self._dtype)
        self.decode.plan()

    def begin_decode(self) -> None:
        """Start a planned decode step's host work: the device's slot table, the CPU threads' share."""
        self.decode.begin()

    def decode_layer(self, layer: int, y, ids, weights, residual, shared, shared_gate, step: DecodeStep):
        """`residual` plus one token's experts of `layer` (ids [k] and weights on the device)."""
        return self.decode.layer(layer, y, ids, weights, residual, shared, shared_gate, step)

    def end_decode(self) -> None:
        """Wait for the CPU threads' share of the step just queued."""
        self.decode.end()

    def abandon_decode(self) -> None:
        """Stop the CPU threads of a step that failed, so the next one starts clean."""
        if self.decode is not None:
            self.decode.abandon()

    def count_cpu_share(self, computed: int) -> None:
        """`computed` of the experts the step's lookups counted for the GPU ran on the CPU instead."""
        self.expert_calls -= computed
        self.cpu_expert_calls += computed

    def copies_by_kernel(self, layer: int) -> bool:
        """Whether a decode step copies `layer`'s misses with `gather_misses` (on CUDA a kernel inside the step's
        graph, for pinned records) rather than with copies the host issues. Off CUDA the step runs eagerly and
        the reference gather is as good as host copies."""
        if self.device.type != "cuda":
            return True
        return self._gather_works and kernels.gather_records_capturable(self.packed[layer].records, self.cache.pool)

    def _probe_gather(self) -> bool:
        """Whether the gather kernel copies a pinned record right on this machine (its Triton must accept pinned
        host memory as a kernel argument), tried once while the cache is still empty; if not, the host copies."""
        packed = next((p for p in self.packed.values() if p.pinned), None)
        if packed is None or not kernels.gather_records_capturable(packed.records, self.cache.pool):
            return False
        table = torch.tensor([[0, 0]], dtype=torch.int32, device=self.device)
        try:
            kernels.gather_records(packed.records, self.cache.pool, table)
            works = torch.equal(self.cache.pool[0].cpu(), packed.records[0])
        except Exception as error:  # a Triton that refuses host memory: the host's copies still work
            warnings.warn(
                f"decode copies experts from the host, slower: the copy kernel failed "
                f"({type(error).__name__}: {error})",
                RuntimeWarning,
                stacklevel=2,
            )
            return False
        return works

    def gather_misses(self, layer: int, table: torch.Tensor) -> None:
        """The copies `fetch_for_step` deferred, from a device table [top_k, 2] of (expert or -1, slot); under a
        link limit the current stream is then held for the records the table names (counted on the device)."""
        link = self._gather_link
        if link is not None:
            link.start()
        kernels.gather_records(self.packed[layer].records, self.cache.pool, table)
        if link is not None:
            link.hold_records(table, self.cache.layout.record_bytes)

    def fetch_for_step(
        self, layer: int, experts: list[int], deferred: list[tuple[int, int]] | None = None
    ) -> tuple[list[int], list[bool]]:
        """(cache slot, on the CPU) of each of one token's chosen experts. The backend picks which misses the CPU
        computes (`compute_on_cpu`); the rest are copied in, and the current stream waits for the copies, or,
        with `deferred`, their (expert, slot) pairs go there for `gather_misses`. Compute that reads the slots
        must be followed by `cache.release`. A CPU expert's slot is any slot: the step gives its row no weight."""
        misses = self.cache.missing(layer, experts)
        share = self.policy.cpu_misses(
            len(misses), self.calibration, self.cache.layout.record_bytes, self.packed[layer].pinned
        )
        on_cpu_experts = set(misses[len(misses) - share :])
        on_gpu = [e for e in experts if e not in on_cpu_experts]
        self.expert_calls += len(on_gpu)
        self.cpu_expert_calls += len(on_cpu_experts)
        slot_of = dict(zip(on_gpu, self.cache.fetch(layer, on_gpu, self.packed[layer], deferred))) if on_gpu else {}
        self.cache.wait_ready()
        spare = next(iter(slot_of.values()), 0)
        return [slot_of.get(e, spare) for e in experts], [e in on_cpu_experts for e in experts]

    def cpu_counts(self, top_k: int) -> list[int]:
        """How many of a token's m misses in a pinned layer the CPU computes, for m = 0..top_k: the split the
        device applies when it chooses the slots (engine/kernels/cpu_share.py); hybrid's is balanced by the
        steps themselves (`balance_share`), from the calibration's."""
        return self.policy.cpu_counts(top_k, self.calibration, self.cache.layout.record_bytes)

    def balance_share(self, waited: int, layers: int) -> None:
        """A device-split step's outcome: in `waited` of its `layers` layers with CPU experts, the GPU waited."""
        self.policy.hear(waited, layers)

    def compute_on_cpu(
        self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor, on_cpu: torch.Tensor
    ) -> torch.Tensor:
        """The CPU's share of a layer's routed output, float32 [T, H] on the host (inputs on the host)."""
        return self.cpu_kernel.run(self.packed[layer].records, x, expert_ids, expert_weights, on_cpu)

    def slot_swiglu(self, rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Row r of `rows` through the expert in cache slot slots[r] (a device tensor: capturable)."""
        weights = self.cache.weights
        gate_up = kernels.slot_linear(rows, weights["gate_up"], slots)
        return kernels.slot_linear(gate_up, weights["down"], slots, swiglu=True)  # the activation inside the kernel

    def stats(self) -> dict:
        computed = self.expert_calls + self.cpu_expert_calls
        return {
            "expert_calls": self.expert_calls,
            "expert_backend": str(self.backend),
            "cpu_expert_calls": self.cpu_expert_calls,
            **({"hybrid_cpu_fraction": self.hybrid_balance.fraction} if self.hybrid_balance else {}),
            **({"expert_backend_trial": self.backend_trial.to_dict()} if self.backend_trial else {}),
            "cpu_expert_share": self.cpu_expert_calls / computed if computed else 0.0,
            **({"calibration": self.calibration.to_dict()} if self.calibration else {}),
            **self.host_report,
            **self.cache.stats(),
        }


@dataclass
class _CachedWork:
    """A layer's routed experts whose first round of copies is in flight."""

    executor: CachedExpertExecutor
    layer: int
    x: torch.Tensor
    rows: torch.Tensor  # x's rows, one per (token, chosen expert), sorted by expert
    order: torch.Tensor  # flat (token * top_k + k) index of each row
    token_of_row: torch.Tensor
    expert_weights: torch.Tensor
    starts: list[int]  # first row of each present expert, and the end
    rounds: list[tuple]  # (index of its first expert, experts, slots or None until fetched)
    streaming: bool
    intermediate: int

    def wait(self) -> torch.Tensor:
        executor, cache = self.executor, self.executor.cache
        out_rows = torch.empty_like(self.rows)
        for first, chosen, slots in self.rounds:
            if slots is None:
                slots = executor._slots(self.layer, chosen, self.streaming)
            begin, end = self.starts[first], self.starts[first + len(chosen)]
            groups = ExpertGroups(slots, [s - begin for s in self.starts[first : first + len(chosen) + 1]])
            cache.wait_ready()
            out_rows[begin:end] = executor._swiglu(self.rows[begin:end], groups, self.intermediate)
            cache.release(slots)
        following = executor._next_layer.get(self.layer)
        if self.streaming and following is not None:  # next layer's experts stream while this one finishes
            cache.stream_layer(following, executor.packed[following], count_as_lookups=False)
        weighted = out_rows * self.expert_weights.reshape(-1)[self.order, None].to(out_rows.dtype)
        return torch.zeros_like(self.x).index_add_(0, self.token_of_row, weighted)
