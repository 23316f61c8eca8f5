"""The CPU's share of a graphed decode step, computed by CPU threads that the GPU drives through pinned memory.

With the host in the loop, each MoE layer of a step waited for the router's choice to reach Python, then for
Python to start the CPU kernel and send its sum back (H200, 4gb plan, 4,096 tokens: hybrid 44.5 tok/s against
offload's 60.1, with the host's waits and launches most of the difference). Here the step stays one graph:
after each router the GPU posts the CPU's experts and their input to a `Mailbox` in page-locked host memory
(kernels.post_cpu_share), CPU threads spinning on it compute them with cpu_experts' row kernels while the GPU
copies and computes its own share, and the GPU spins (kernels.wait_cpu_share) until their sum is posted back.

The protocol, one sequence number per MoE layer of a step, chosen by the host (`CpuShareWorker.start`):
- the GPU writes the ids (-1 where the GPU computes that expert), the routing weights and the input, then
  sets `request` to the layer's number;
- every CPU thread waits for that number, reads the layer, and checks `done` is still below it (the GPU
  rewrites the mailbox only after `done` reaches the number, so the layer it read is whole);
- the threads take work items from the layer's counters (cpu_experts.scheduler._layer_part): blocks of 64 gate_up rows
  of one expert (whoever ends an expert's last block computes its activation), then blocks of 64 down rows of
  one expert (eight experts make 256 such items, enough to keep 15 threads evenly busy; dealt statically
  instead, threads waited up to 96 us a layer at the barrier on the H200 machine's Xeon); once every down item
  has ended, one thread sums the experts' outputs, weighted, and sets `done`, and so does the first thread to
  see a layer with nothing for the CPU;
- the GPU waits for `done`, then reads the sum.
Items are taken, not dealt, so a thread the OS holds back delays only the item it holds, and a thread that
comes late finds the items gone and moves on. `cancel` stops everyone (the host sets it when a step fails).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np
import torch

from engine.kernels import cpu_experts
from engine.kernels.cpu_experts.cpu import numba
from engine.kernels.cpu_experts.pool import _launch

REQUEST, DONE, CANCEL = 0, 1, 2  # the mailbox's flags (int32)
LAST_SEQUENCE = 2**31 - 1  # sequence numbers are int32 on the GPU: the host starts again at 1 before this


class CpuShareError(RuntimeError):
    """The CPU's share of a decode step did not come back."""


class Mailbox:
    """What the GPU and the CPU threads exchange for one MoE layer at a time, in page-locked host memory the GPU
    reads and writes directly (plain host memory off CUDA)."""

    def __init__(self, top_k: int, hidden: int, pin: bool):
        self.flags = torch.zeros(4, dtype=torch.int32, pin_memory=pin)
        self.ids = torch.full((top_k,), -1, dtype=torch.int32, pin_memory=pin)
        self.weights = torch.zeros(top_k, dtype=torch.float32, pin_memory=pin)
        self.x = torch.zeros(hidden, dtype=torch.float32, pin_memory=pin)
        self.out = torch.zeros(hidden, dtype=torch.float32, pin_memory=pin)


def share_threads_for(threads: int) -> int:
    """`threads` CPU expert threads, less one where they would take every logical CPU: they spin, and the thread
    that launches the step's graph (and whatever else the machine runs) must not push one off its core mid-layer."""
    return max(1, min(threads, (os.cpu_count() or 1) - 1))


class CpuShareWorker:
    """CPU threads that compute, for each decode step, the share of every MoE layer the GPU posts to `mailbox`.
    records: each MoE layer's host expert records (uint8 [experts, record_bytes]), in the step's layer order."""

    def __init__(
        self,
        kernel: cpu_experts.CpuExpertKernel,
        records: list[torch.Tensor],
        mailbox: Mailbox,
        threads: int | None = None,
    ):
        """threads: how many serve (None: share_threads_for the expert kernels' thread count)."""
        if numba is None:
            raise CpuShareError("the CPU's share of a decode step needs numba (pip install numba)")
        self.kernel, self.mailbox, self._records = kernel, mailbox, records  # held: the threads read their memory
        self._addresses = np.array([r.data_ptr() for r in records], dtype=np.int64)
        self._record_bytes = records[0].shape[1]
        top_k, intermediate = mailbox.ids.numel(), kernel.intermediate
        self._counters = np.zeros((len(records), (ENDED_GATE_UP + top_k) * COUNTER_STRIDE), dtype=np.int32)
        self._hidden_rows = np.zeros((top_k, 2 * intermediate), dtype=np.float32)
        self._acts = np.zeros((top_k, intermediate), dtype=np.float32)
        self._acts16 = np.zeros((top_k, intermediate), dtype=np.uint16)
        self._outputs = np.zeros((top_k, kernel.hidden), dtype=np.float32)  # shared: one thread sums them all
        self._views = [t.numpy() for t in (mailbox.flags, mailbox.ids, mailbox.weights, mailbox.x, mailbox.out)]
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="cpu-experts")
        self._running = None
        self.threads = threads or share_threads_for(cpu_experts.threads())
        self.next_sequence = 1
        self._serve(1, 0)  # compiled now (or loaded from numba's cache), not while a step's GPU waits

    def start(self, layers: int) -> int:
        """Serve the next step's `layers` MoE layers on the pool's thread; the sequence number of its first."""
        if self._running is not None:
            raise CpuShareError("a step's CPU share is still running")
        if self.next_sequence + layers > LAST_SEQUENCE:  # nothing is in flight: numbers may start again
            self._views[0][:] = 0
            self.next_sequence = 1
        first = self.next_sequence
        self.next_sequence += layers
        self._counters[:layers] = 0
        self._running = self._pool.submit(self._serve, first, layers)
        return first

    def finish(self, timeout: float = 60.0) -> int:
        """Wait for the step's share; the experts the CPU computed. On failure the GPU's waits are released
        (cancel) and CpuShareError says what happened."""
        running, self._running = self._running, None
        if running is None:
            return 0
        try:
            computed = running.result(timeout)
        except FutureTimeout:
            self.cancel()
            running.result()  # the threads see cancel within microseconds
            raise CpuShareError(
                f"the CPU's experts of a decode step did not finish within {timeout:.0f} s; "
                f"choose the offload expert backend in Settings if this repeats"
            ) from None
        except Exception as error:
            self.cancel()
            raise CpuShareError(
                f"the CPU's experts of a decode step failed ({type(error).__name__}: {error}); "
                f"choose the offload expert backend in Settings if this repeats"
            ) from error
        if computed < 0:
            raise CpuShareError("the CPU's experts of a decode step were cancelled")
        return computed

    def cancel(self) -> None:
        """Stop the threads and release the GPU's waits (the step's output is then garbage: its caller raises)."""
        self._views[0][CANCEL] = 1

    def clear_cancel(self) -> None:
        """After a cancelled step has ended on both sides, before the next."""
        self._views[0][CANCEL] = 0

    def close(self) -> None:
        self.cancel()
        self._pool.shutdown(wait=True)

    def _serve(self, first: int, layers: int) -> int:
        flags, ids, weights, x, out = self._views
        try:
            with _launch:
                cpu_experts.numba_threads(self.threads)
                return int(
                    _serve_step(
                        self._addresses,
                        self._records[0].shape[0],
                        self._record_bytes,
                        self.kernel._meta,
                        flags,
                        ids,
                        weights,
                        x,
                        out,
                        first,
                        layers,
                        self._counters,
                        self._hidden_rows,
                        self._acts,
                        self._acts16,
                        self._outputs,
                        self.kernel.activations == "bf16",
                        self.threads,
                    )
                )
        except BaseException:
            self.cancel()  # the GPU's waits end now, not when the host notices
            raise


if numba is not None:
    from engine.kernels.cpu_experts.atomics import _fetch_add, _load_acquire, _raise_to, _wait_for
    from engine.kernels.cpu_experts.meta import M_OUT
    from engine.kernels.cpu_experts.rows import _lay_out, _lay_out_bf16
    from engine.kernels.cpu_experts.scheduler import (
        COUNTER_STRIDE,
        ENDED_GATE_UP,
        FINISHER,
        Groups,
        LayerRecords,
        RowBuffers,
        Tokens,
        _counter,
        _group_rows,
        _layer_part,
    )

    @numba.njit(nogil=True, cache=True)
    def _serve_layers(
        addresses,
        num_experts,
        record_bytes,
        meta,
        flags,
        ids,
        weights,
        x,
        out,
        first,
        layers,
        counters,
        hidden_rows,
        acts,
        acts16,
        outputs,
        bf16,
    ):
        """One thread's part of a step (the protocol in the module's docstring); experts it ended, -1 if cancelled."""
        hidden, top_k = meta[1][M_OUT], ids.shape[0]
        flags_at = flags.ctypes.data
        request_at, done_at, cancel_at = flags_at + 4 * REQUEST, flags_at + 4 * DONE, flags_at + 4 * CANCEL
        laid, laid16 = np.empty((1, hidden), np.float32), np.empty((1, hidden), np.uint16)
        chosen_ids, on_cpu = ids.reshape((1, top_k)), np.empty((1, top_k), np.bool_)
        counts, group_experts = np.empty(num_experts + 1, np.int64), np.empty(top_k, np.int64)
        starts = np.empty(top_k + 1, np.int64)
        token_of_row, row_of, own_rows = np.empty(top_k, np.int64), np.empty((1, top_k), np.int64), np.arange(top_k)
        ended = 0
        for layer in range(layers):
            sequence = first + layer
            seen = _wait_for(request_at, sequence, cancel_at)
            if seen < 0:
                return -1
            if seen != sequence:
                continue  # the GPU is past this layer: it was done without this thread
            for j in range(top_k):
                on_cpu[0, j] = ids[j] >= 0
            groups = _group_rows(chosen_ids, on_cpu, num_experts, counts, group_experts, starts, token_of_row, row_of)
            if groups > 0:
                _lay_out(x, laid[0], meta[0])
                if bf16:
                    _lay_out_bf16(x, laid16[0])
            if _load_acquire(done_at) >= sequence:
                continue  # ended while this thread read: what it read may be the next layer's
            if groups < 0:  # the GPU sent an expert outside the records: end the step, its caller raises
                _raise_to(cancel_at, 1)
                return -1
            counters_at = counters[layer].ctypes.data
            if groups == 0:
                if _fetch_add(_counter(counters_at, FINISHER), 1) == 0:
                    _raise_to(done_at, sequence)
                continue
            summed = _layer_part(
                LayerRecords(addresses[layer], record_bytes, meta),
                Groups(groups, group_experts, starts, token_of_row, row_of),
                Tokens(weights.reshape((1, top_k)), laid, laid16, out.reshape((1, hidden))),
                RowBuffers(hidden_rows, acts, acts16, outputs, own_rows),
                counters_at,
                bf16,
                cancel_at,
            )
            if summed < 0:
                return -1
            if summed:
                ended += summed
                _raise_to(done_at, sequence)
        return ended

    @numba.njit(parallel=True, nogil=True, cache=True)
    def _serve_step(
        addresses,
        num_experts,
        record_bytes,
        meta,
        flags,
        ids,
        weights,
        x,
        out,
        first,
        layers,
        counters,
        hidden_rows,
        acts,
        acts16,
        outputs,
        bf16,
        threads,
    ):
        ended = np.zeros(threads, np.int64)
        for t in numba.prange(threads):
            ended[t] = _serve_layers(
                addresses,
                num_experts,
                record_bytes,
                meta,
                flags,
                ids,
                weights,
                x,
                out,
                first,
                layers,
                counters,
                hidden_rows,
                acts,
                acts16,
                outputs,
                bf16,
            )
        return -1 if ended.min() < 0 else ended.sum()
