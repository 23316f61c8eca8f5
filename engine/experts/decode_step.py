"""The cached executor's share of a one-token decode step: each MoE layer's slots, copies and CPU experts.

Where the device can choose the slots (every layer's misses copied by the gather kernel, a slot table the
kernel can keep), a layer needs no host: the router's ids go to kernels.assign_slots, the misses are gathered
on a side stream beside the shared expert, and the CPU's share (cpu and hybrid backends) goes to CPU threads
through a mailbox in host memory (engine/kernels/cpu_share.py). Otherwise the layer cuts the step after its
router: the host reads the ids, has the expert cache fetch the misses and sends their slots down, and computes
the CPU's share itself while the GPU computes the rest.
"""

from __future__ import annotations

import torch

from engine import kernels
from engine.kernels import cpu_share
from engine.step import DecodeStep


class ExpertDecodeStep:
    """Buffers, plan and host actions of the MoE layers of a decode step, for one `CachedExpertExecutor`."""

    def __init__(self, executor, top_k: int, hidden: int, dtype: torch.dtype):
        self.executor, self.top_k = executor, top_k
        device = executor.device
        cuda = device.type == "cuda"
        # What the host sends after each router, as one copy: the chosen experts' slots, then the misses' copy
        # table [(expert or -1, slot)] that the step's gather kernel reads (layers whose misses it copies)
        self._exchange = torch.zeros(3 * top_k, dtype=torch.int32, device=device)
        self.slots, self.copy_table = self._exchange[:top_k], self._exchange[top_k:].view(top_k, 2)
        # The CPU's share: rows it computes get no weight on the GPU, its summed output comes back as one row
        self.gpu_rows = torch.ones(top_k, dtype=torch.float32, device=device)
        self.cpu_counts = torch.zeros(top_k + 1, dtype=torch.int32, device=device)  # of m misses, the CPU's
        self.share_base = torch.zeros(1, dtype=torch.int32, device=device)  # the step's first mailbox number
        self.share_waits = torch.zeros(2, dtype=torch.int32, device=device)  # kernels.wait_cpu_share's counts
        self.cpu_routed = torch.zeros(1, hidden, dtype=torch.float32, device=device)
        self._cpu_routed_dirty = False
        self._gpu_rows_sent = [1.0] * top_k
        self._waits_taken = [0, 0]
        self._waits_backend = None  # the backend of the step whose waits were copied last
        self._counts_sent: list[int] | None = None  # the split last copied into cpu_counts
        # Host ends of the per-layer exchanges, page-locked so the copies are asynchronous and capturable
        self._ids_host = torch.zeros(top_k, dtype=torch.long, pin_memory=cuda)
        self._exchange_host = torch.zeros_like(self._exchange, device="cpu", pin_memory=cuda)
        self._exchange_staging = self._exchange_host.numpy()  # written through numpy: cheaper than torch.tensor
        self._y_host = torch.zeros(1, hidden, dtype=dtype, pin_memory=cuda)
        self._weights_host = torch.zeros(top_k, dtype=torch.float32, pin_memory=cuda)
        self._gpu_rows_host = torch.ones(top_k, dtype=torch.float32, pin_memory=cuda)
        self._cpu_routed_host = torch.zeros(1, hidden, dtype=torch.float32, pin_memory=cuda)
        self._share_base_host = torch.zeros(1, dtype=torch.int32, pin_memory=cuda)
        self._share_waits_host = torch.zeros(2, dtype=torch.int32, pin_memory=cuda)
        self._base_sent = torch.cuda.Event() if cuda else None
        self._waits_copied = torch.cuda.Event() if cuda else None
        self._side = torch.cuda.Stream(device) if cuda else None  # copies beside compute, inside the graphs
        self._ids_ready = torch.cuda.Event() if cuda else None
        self.share: cpu_share.CpuShareWorker | None = None  # the CPU threads of the device-driven share
        self.forget()

    def forget(self) -> None:
        """Drop the plan: the next step makes one again."""
        self.with_cpu_share = False  # whether the plan's layers leave some misses to the CPU
        self.gathered: set[int] = set()  # layers whose misses the gather kernel copies inside the step
        self.slot_table: dict | None = None  # the expert cache's slot table, when the device chooses slots
        self.slots_on_device = 0  # MoE layers that choose their slots on the device
        self.share_on_device = False  # whether the CPU's share goes through the mailbox
        self._job: tuple | None = None  # the CPU's share of the last fetched layer: (ids, y, weights, on_cpu)
        self._release: list[int] | None = None  # slots the layer's expert matmuls read, released after them

    def plan(self) -> None:
        """Decide, for the steps until the next plan, which layers choose their slots on the device."""
        executor = self.executor
        self.forget()
        self.with_cpu_share = executor.cpu_share_wanted()
        moe = sorted(executor.packed)
        self.gathered = {index for index in moe if executor.copies_by_kernel(index)}
        # The device chooses slots for all MoE layers or none: the slot table is read back to the host only
        # between steps (a pageable layer keeps the host's copies, and so the host's choice). A CPU share needs
        # the CPU threads (numba) to go with it.
        device_share_possible = not self.with_cpu_share or cpu_share.numba is not None
        table = (
            executor.cache.device_table() if moe and device_share_possible and len(self.gathered) == len(moe) else None
        )
        cuda = executor.device.type == "cuda"
        if table is not None and (not cuda or kernels.assign_slots_capturable(table["keys"])):
            self.slot_table = table
        self.slots_on_device = len(moe) if self.slot_table is not None else 0
        self.share_on_device = self.with_cpu_share and self.slot_table is not None
        if self.share_on_device:
            if self.share is None or self.share.kernel is not executor.cpu_kernel:
                mailbox = cpu_share.Mailbox(self.top_k, self.cpu_routed.shape[-1], pin=cuda)
                self.share = cpu_share.CpuShareWorker(
                    executor.cpu_kernel, [executor.packed[i].records for i in moe], mailbox
                )
            self._counts_sent = None

    def begin(self) -> None:
        """Send the slot table to the device for this step's lookups, and start the CPU threads' share."""
        executor = self.executor
        if self.slots_on_device:  # with the host's changes, if the host used the cache since the last step
            lookups = self.slots_on_device * self.top_k
            executor.cache.device_table(lookups)
            executor.expert_calls += lookups
        if not self.share_on_device:
            return
        self._take_waits()
        counts = executor.cpu_counts(self.top_k)  # cpu and hybrid share the graphs: the table tells them apart
        if counts != self._counts_sent:
            self.cpu_counts.copy_(torch.tensor(counts, dtype=torch.int32))
            self._counts_sent = counts
        if self._base_sent is not None:
            self._base_sent.synchronize()  # the last step's copy has left the staging row
        self._share_base_host[0] = self.share.start(self.slots_on_device)
        self.share_base.copy_(self._share_base_host, non_blocking=True)
        if self._base_sent is not None:
            self._base_sent.record()

    def end(self) -> None:
        """Wait for the CPU threads' share of the step and count what they computed."""
        if not self.share_on_device:
            return
        computed = self.share.finish()
        self.executor.count_cpu_share(computed)
        self._share_waits_host.copy_(self.share_waits, non_blocking=True)  # read at the next step, not waited for
        self._waits_backend = self.executor.backend
        if self._waits_copied is not None:
            self._waits_copied.record()

    def abandon(self) -> None:
        """After a failed step: stop the CPU threads, release the GPU's waits, and let the device finish what it
        queued before the mailbox is used again."""
        if not self.share_on_device:
            return
        self.share.cancel()
        try:
            self.share.finish()
        except cpu_share.CpuShareError:
            pass  # cancelled, as asked: the step's own error is the one to report
        if self.executor.device.type == "cuda":
            torch.cuda.synchronize(self.executor.device)
        self.share.clear_cancel()

    def layer(
        self,
        layer: int,
        y: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        residual: torch.Tensor,
        shared,
        shared_gate: torch.Tensor | None,
        step: DecodeStep,
    ) -> torch.Tensor:
        """`residual` plus layer `layer`'s experts for one token routed to `ids` with `weights`, and its shared
        expert `shared` (or None) gated by sigmoid(shared_gate) in the layer's combine."""
        executor, cache, table = self.executor, self.executor.cache, self.slot_table
        k = self.top_k
        if table is not None:  # the slots, and the misses' copy table, chosen on the device: no host action
            share = self.share_on_device
            ordinal = sorted(executor.packed).index(layer)
            kernels.assign_slots(
                ids,
                layer * cache.experts_per_layer,
                table["keys"],
                table["ages"],
                table["clock"],
                table["where"],
                self.slots,
                self.copy_table,
                table["counts"],
                *((self.cpu_counts, self.gpu_rows) if share else ()),
            )
            if share:  # the CPU's misses to its threads, which work while the GPU copies and computes the rest
                kernels.post_cpu_share(ids, weights, self.gpu_rows, y, self.share_base, ordinal, self.share.mailbox)
            if self._side is not None:  # the misses' copies on a side stream, beside the shared expert
                self._side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._side):  # None (no CUDA): the current stream
                executor.gather_misses(layer, self.copy_table)
            shared_out = shared(y) if shared is not None else None
            if self._side is not None:
                torch.cuda.current_stream().wait_stream(self._side)
            routed = executor.slot_swiglu(y.expand(k, y.shape[-1]), self.slots)
            if not share:
                return kernels.combine_experts(residual, routed, weights, None, shared_out, None, shared_gate)
            kernels.wait_cpu_share(
                self.gpu_rows, self.share_base, ordinal, self.share.mailbox, self.cpu_routed, self.share_waits
            )
            return kernels.combine_experts(
                residual, routed, weights, self.gpu_rows, shared_out, self.cpu_routed, shared_gate
            )
        cuda = executor.device.type == "cuda"
        if cuda:
            if self.with_cpu_share:  # the CPU's inputs first: the host waits for the ids, the last copy
                self._y_host.copy_(y, non_blocking=True)
                self._weights_host.copy_(weights.reshape(-1), non_blocking=True)
            self._ids_host.copy_(ids, non_blocking=True)
        shared_out = None
        if shared is not None:  # it runs while the host waits for the ids
            step.host(self._ids_sent)
            shared_out = shared(y)
        step.host(lambda: self._fetch(layer, ids, y, weights, shared is None))
        if layer in self.gathered:
            executor.gather_misses(layer, self.copy_table)
        routed = executor.slot_swiglu(y.expand(k, y.shape[-1]), self.slots)
        step.when_queued(self._release_slots)
        if not self.with_cpu_share:
            return kernels.combine_experts(residual, routed, weights, None, shared_out, None, shared_gate)
        step.host(lambda: self._cpu_share(layer))  # while the GPU copies and computes its share
        return kernels.combine_experts(
            residual, routed, weights, self.gpu_rows, shared_out, self.cpu_routed, shared_gate
        )

    # ---- host actions ------------------------------------------------------------------------------------

    def _take_waits(self) -> None:
        """Pass the last step's waits for the CPU to the executor's hybrid balance, once their copy has landed."""
        if self._waits_copied is not None and not self._waits_copied.query():
            return  # still in flight: the next step takes them
        waits = self._share_waits_host.tolist()
        waited, layers = (now - before for now, before in zip(waits, self._waits_taken))
        self._waits_taken = waits
        if self._waits_backend == self.executor.backend:  # a cpu step of auto's trial says nothing of hybrid's
            self.executor.balance_share(waited, layers)

    def _ids_sent(self) -> None:
        if self._ids_ready is not None:
            self._ids_ready.record()

    def _fetch(self, layer: int, ids: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, mark: bool) -> None:
        """Read the router's ids, fetch the misses the GPU computes, and send their slots (and copy table) down."""
        if self._ids_ready is not None:
            if mark:  # no shared expert ran since the ids' copy: mark it here
                self._ids_ready.record()
            self._ids_ready.synchronize()  # the shared expert keeps the GPU busy meanwhile
            ids, y, weights = self._ids_host, self._y_host, self._weights_host
        else:
            weights = weights.reshape(-1)
        deferred = [] if layer in self.gathered else None
        slots, on_cpu = self.executor.fetch_for_step(layer, ids.tolist(), deferred)  # copies start here
        k = len(slots)  # the last layer's copy from the staging row is done: the ids' event came after it
        staging = self._exchange_staging
        staging[:k] = slots
        if deferred is not None:
            staging[k:] = -1
            for row, (expert, slot) in enumerate(deferred):
                staging[k + 2 * row], staging[k + 2 * row + 1] = expert, slot
        self._exchange.copy_(self._exchange_host, non_blocking=True)
        self._release = slots
        if self.with_cpu_share:
            self._send_gpu_rows(on_cpu)
            self._job = (ids, y, weights, on_cpu)

    def _release_slots(self) -> None:
        if self._release is not None:
            self.executor.cache.release(self._release)
            self._release = None

    def _send_gpu_rows(self, on_cpu: list[bool]) -> None:
        """Send which of the chosen experts the GPU weighs (the CPU's rows get weight 0)."""
        rows = [0.0 if c else 1.0 for c in on_cpu]
        if rows != self._gpu_rows_sent:  # most steps repeat the last mask (offload: all ones)
            self._gpu_rows_host.copy_(torch.tensor(rows))
            self.gpu_rows.copy_(self._gpu_rows_host, non_blocking=True)
            self._gpu_rows_sent = rows

    def _cpu_share(self, layer: int) -> None:
        """Compute the CPU's experts of the last fetched layer and send their sum up, for the layer's combine."""
        ids, y, weights, on_cpu = self._job
        if any(on_cpu):
            out = self.executor.compute_on_cpu(
                layer, y.float(), ids.reshape(1, -1), weights.reshape(1, -1), torch.tensor([on_cpu])
            )
            self._cpu_routed_host.copy_(out)
            self.cpu_routed.copy_(self._cpu_routed_host, non_blocking=True)
            self._cpu_routed_dirty = True
        elif self._cpu_routed_dirty:
            self.cpu_routed.zero_()
            self._cpu_routed_dirty = False
