"""One-token decode steps replayed as CUDA graphs.

A decode step of a 40-layer MoE model launches about 4,000 small kernels. At several microseconds of host
time each, the host set the speed, not the GPU or the expert copies (H200, 4gb plan: 110 ms a step, 20 ms of
it GPU work). Here a step is a few graphs per layer, cut only where the host must act:
- after each MoE router, where the device cannot choose the slots (a layer beyond the pin budget, a cache too
  big for the slot kernel): the host reads the chosen experts, has the expert cache fetch the misses
  (engine/experts/), and copies their slots to the device, where the next graph's expert kernels read them;
  elsewhere the device chooses them, and the CPU's share of the misses (cpu and hybrid backends) goes to CPU
  threads through a mailbox in host memory (engine/kernels/cpu_share.py), inside the graph;
- around each attention layer's KV append and attention, whose length grows every step (run eagerly), only
  where attention cannot read that length on the device: a cache that grows, or no kernel for the device
  (engine/kernels/triton_attention.py is CUDA's).

Graphs hold the addresses of the tensors they were captured with, so they belong to one sequence state and
are captured again for another. Capture never runs kernels for the first time: the first step of all runs
the model's plain forward, which compiles and loads them.

With `use_graphs=False` the same segments run eagerly; that is how the CPU tests check the cuts against the
plain forward, and gpu_tests/ checks the captured graphs against both.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable

import torch

from engine import kernels
from engine.errors import ContextOverflowError
from engine.kernels import cpu_share
from engine.layers.attention import Attention

Action = tuple[str, object]  # ("segment", fn) device work, or (host action, layer index)


def graphs_enabled() -> bool:
    """MOEDESK_DECODE_GRAPHS=0 turns graphed decode off (a diagnosis switch; the plain forward runs)."""
    return os.environ.get("MOEDESK_DECODE_GRAPHS", "1") != "0"


class DecodeSteps:
    def __init__(self, model, use_graphs: bool = True):
        self.model, self.executor = model, model.expert_executor
        self.use_graphs = use_graphs
        device, c = model.device, model.config
        self.positions = torch.zeros(1, dtype=torch.long, device=device)
        self.embedding = torch.zeros(1, c.hidden_size, dtype=model.dtype, device=device)
        k = c.num_experts_per_tok
        # What the host sends after each router, as one copy: the chosen experts' slots, then the misses' copy
        # table [(expert or -1, slot)] that the step's gather kernel reads (layers whose misses it copies)
        self._exchange = torch.zeros(3 * k, dtype=torch.int32, device=device)
        self.slots, self.copy_table = self._exchange[:k], self._exchange[k:].view(k, 2)
        # The CPU's share (cpu and hybrid backends): rows it computes get no weight on the GPU, and its summed
        # output comes back as one row. Graphs are made with it or without it, for the backend of the moment.
        self.with_cpu_share = self._cpu_share_wanted()
        self.gpu_rows = torch.ones(k, dtype=torch.float32, device=device)
        self.cpu_counts = torch.zeros(k + 1, dtype=torch.int32, device=device)  # of m misses, the CPU's (device split)
        self.share_base = torch.zeros(1, dtype=torch.int32, device=device)  # the step's first mailbox sequence number
        self.share_waits = torch.zeros(2, dtype=torch.int32, device=device)  # kernels.wait_cpu_share's counts
        self._waits_taken = [0, 0]
        self._waits_backend: str | None = None  # the backend of the step whose waits were copied last
        self._share: cpu_share.CpuShareWorker | None = None  # the CPU threads of the device-driven share
        self._share_on_device = False  # whether this step's CPU share goes through the mailbox
        self._counts_sent: list[int] | None = None  # the split last copied into cpu_counts
        self.cpu_routed = torch.zeros(1, c.hidden_size, dtype=torch.float32, device=device)
        self._cpu_routed_dirty = False
        self._gpu_rows_sent = [1.0] * k
        cuda = device.type == "cuda"
        # Host ends of the per-layer exchanges, page-locked so the copies are asynchronous and capturable
        self._ids_host = torch.zeros(k, dtype=torch.long, pin_memory=cuda)
        self._exchange_host = torch.zeros_like(self._exchange, device="cpu", pin_memory=cuda)
        self._exchange_staging = self._exchange_host.numpy()  # written through numpy: cheaper than torch.tensor
        self._embedding_host = torch.zeros_like(self.embedding, device="cpu", pin_memory=cuda)
        self._y_host = torch.zeros_like(self.embedding, device="cpu", pin_memory=cuda)
        self._weights_host = torch.zeros(k, dtype=torch.float32, pin_memory=cuda)
        self._gpu_rows_host = torch.ones(k, dtype=torch.float32, pin_memory=cuda)
        self._cpu_routed_host = torch.zeros(1, c.hidden_size, dtype=torch.float32, pin_memory=cuda)
        self._share_base_host = torch.zeros(1, dtype=torch.int32, pin_memory=cuda)
        self._share_waits_host = torch.zeros(2, dtype=torch.int32, pin_memory=cuda)
        self._waits_copied = torch.cuda.Event() if cuda else None
        self._stream = model.stream  # the model's compute stream, current while a step runs
        self._side = torch.cuda.Stream(device) if cuda else None  # copies beside compute, inside the graphs
        self._ids_ready = torch.cuda.Event() if cuda else None
        self._embedding_sent = torch.cuda.Event() if cuda else None
        self.buf: dict[str, torch.Tensor] = {}  # segment inputs and outputs; static while graphs replay
        self._actions: list[Action] = []
        self._kv_moved: list = []
        self._slots_on_device = 0
        self._slot_table: dict | None = None  # the expert cache's slot table, when the device chooses slots
        self._gathered: set[int] = set()  # layers whose misses the gather kernel copies inside the step
        self._graphs: list = []
        self._captured = False  # whether the actions were captured as graphs (the first step runs them eagerly)
        self._held: dict[int, dict] = {}  # per host action: the graph outputs it reads, as they were captured
        self._state = None  # weak reference to the state the actions (and graphs) were made for
        self._warm = not use_graphs
        self._release: list[int] | None = None  # slots the next segment reads, released after it
        self._cpu_job: tuple | None = None  # the CPU's share of the last fetched layer: (ids, y, weights, on_cpu)

    @torch.inference_mode()
    def step(self, token: int, state) -> torch.Tensor:
        """Feed one token to `state`; float32 logits [vocab] of it."""
        if state.max_tokens is not None and state.position + 1 > state.max_tokens:
            raise ContextOverflowError(state.position + 1, state.max_tokens)
        self.executor.note_decode_step(state.position)  # auto's trial may switch the backend for this step
        if self._stream is None:
            return self._step(token, state)
        logits = self._step(token, state).clone()
        self._warm = True  # the first step ran the segments eagerly: kernels compile and load outside any capture
        return logits  # the graphs' output is overwritten by the next step

    def _cpu_share_wanted(self) -> bool:
        return getattr(self.executor, "cpu_kernel", None) is not None and self.executor.backend in ("cpu", "hybrid")

    def _step(self, token: int, state) -> torch.Tensor:
        if self._cpu_share_wanted() != self.with_cpu_share:  # the backend changed: offload's graphs carry no share
            self.with_cpu_share = not self.with_cpu_share
            self._forget()
        capture = self.use_graphs and self._warm
        if self._state is None or self._state() is not state or self._captured != capture:
            self._prepare(state, capture)
        if self._slots_on_device:  # the device's slot table is the truth again (the host may have used the cache)
            self.executor.cache.hand_to_device(self._slots_on_device * len(self.slots))
            self.executor.expert_calls += self._slots_on_device * len(self.slots)
        self.positions.fill_(state.position)
        if self._embedding_sent is not None:
            self._embedding_sent.synchronize()  # the last step's copies have left the staging rows
        self._embedding_host.copy_(self.model.embed_tokens[token])
        self.embedding.copy_(self._embedding_host, non_blocking=True)
        if self._share_on_device:  # the CPU threads serve this step's layers, numbered from the base
            self._take_waits()
            self._send_cpu_counts()
            self._share_base_host[0] = self._share.start(self._slots_on_device)
            self.share_base.copy_(self._share_base_host, non_blocking=True)
        if self._embedding_sent is not None:
            self._embedding_sent.record()
        try:
            self._run_actions(state)
            computed = self._share.finish() if self._share_on_device else 0
        except BaseException:
            if self._share_on_device:
                self._abandon_share()
            raise
        if self._share_on_device:
            self.executor.expert_calls -= computed
            self.executor.cpu_expert_calls += computed
            self._share_waits_host.copy_(self.share_waits, non_blocking=True)  # read at the next step, not waited for
            self._waits_backend = self.executor.backend
            if self._waits_copied is not None:
                self._waits_copied.record()
        for cache in self._kv_moved:
            cache.length = state.position + 1
        state.position += 1
        return self.buf["logits"][0]

    def _run_actions(self, state) -> None:
        graphs = iter(self._graphs)
        for index, (kind, payload) in enumerate(self._actions):
            if kind == "segment":
                if self._captured:
                    next(graphs).replay()
                else:
                    payload()
                if self._release is not None:
                    self.executor.cache.release(self._release)
                    self._release = None
            else:
                getattr(self, "_" + kind)(payload, state, self._held.get(index, self.buf))

    def _abandon_share(self) -> None:
        """A step failed with the CPU threads serving it: stop them, release the GPU's waits, and let the device
        finish what it queued before the mailbox is used again."""
        self._share.cancel()
        try:
            self._share.finish()
        except cpu_share.CpuShareError:
            pass  # cancelled, as asked: the step's own error is the one to report
        if self._stream is not None:
            torch.cuda.synchronize(self.model.device)
        self._share.clear_cancel()

    # ---- the step's actions ------------------------------------------------------------------------------

    def _prepare(self, state, capture: bool) -> None:
        """The actions of a step on `state`, captured as graphs with `capture`."""
        self._forget()  # the last state's graphs and tensors go first, so their memory serves the new ones
        self._actions = _merge(self._walk(state))
        # The actions hold the state's recurrent tensors: when the state goes, they go with it.
        self._state = weakref.ref(state, lambda _: self._forget())
        if not capture:
            return
        self.buf["attention"] = None  # made below, before capture, so every graph reads the same tensor
        for layer in self.model.layers:
            if isinstance(layer.mixer, Attention):
                m = layer.mixer
                self.buf["attention"] = torch.zeros(1, m.heads, m.head_dim, dtype=self.model.dtype,
                                                    device=self.model.device)
                break
        torch.cuda.empty_cache()  # the graphs' pool is private: it takes what the allocator holds unused (planned)
        pool = torch.cuda.graph_pool_handle()
        try:
            for index, (kind, payload) in enumerate(self._actions):
                if kind != "segment":  # later captures replace what buf names; hold what this action reads
                    self._held[index] = dict(self.buf)
                    continue
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=self._stream, capture_error_mode="thread_local"):
                    payload()
                self._graphs.append(graph)
            self._captured = True
        except Exception as error:  # out of memory included: the plain forward still fits
            self._forget()
            torch.cuda.empty_cache()
            raise GraphCaptureError(f"{type(error).__name__}: {error}") from error

    def _forget(self) -> None:
        self._actions, self._graphs, self.buf, self._held, self._state = [], [], {}, {}, None
        self._kv_moved, self._gathered, self._captured, self._slots_on_device = [], set(), False, 0
        self._slot_table, self._share_on_device = None, False

    def _walk(self, state) -> list[Action]:
        """Device work as ("segment", fn) pieces (merged later between host actions), host work as names."""
        # what the walk finds: caches written at the device position (their lengths move on on the host), layers
        # whose misses the gather kernel copies, how many MoE layers choose their slots on the device
        moe = [layer.index for layer in self.model.layers if hasattr(layer.mlp, "route")]
        self._kv_moved = []
        self._gathered = {index for index in moe if self.executor.copies_by_kernel(index)}
        # The device chooses slots only for all MoE layers or none: its table and the host's bookkeeping cannot
        # both be the truth within a step (a pageable layer keeps the host's copies, and so the host's choice).
        # A CPU share needs the CPU threads (numba) to go with it.
        device_share_possible = not self.with_cpu_share or cpu_share.numba is not None
        table = self.executor.cache.hand_to_device() if moe and device_share_possible \
            and len(self._gathered) == len(moe) else None
        self._slot_table = table if table is not None and (
            self._stream is None or kernels.assign_slots_capturable(table["keys"])) else None
        self._slots_on_device = len(moe) if self._slot_table is not None else 0
        self._share_on_device = self.with_cpu_share and self._slot_table is not None
        if self._share_on_device:
            self._prepare_share(moe)
        actions: list[Action] = [("segment", lambda: self.buf.__setitem__("x", self.embedding))]
        for layer, layer_state in zip(self.model.layers, state.layers):
            actions += self._mixer_actions(layer, layer_state)
            actions += self._mlp_actions(layer)
        model = self.model
        actions.append(("segment", lambda: self.buf.__setitem__(
            "logits", model.lm_head(model.norm(self.buf["x"])).float())))
        return actions

    def _prepare_share(self, moe: list[int]) -> None:
        """The CPU threads and their mailbox (made once: the records stay), and the split of misses for the
        device's slot choice."""
        executor, k = self.executor, len(self.slots)
        if self._share is None or self._share.kernel is not executor.cpu_kernel:
            mailbox = cpu_share.Mailbox(k, self.model.config.hidden_size, pin=self._stream is not None)
            self._share = cpu_share.CpuShareWorker(executor.cpu_kernel, [executor.packed[i].records for i in moe],
                                                   mailbox)
        self._counts_sent = None

    def _take_waits(self) -> None:
        """The last step's waits for the CPU, to the executor's hybrid balance, once their copy has landed."""
        if self._waits_copied is not None and not self._waits_copied.query():
            return  # still in flight: the next step takes them
        waits = self._share_waits_host.tolist()
        waited, layers = (now - before for now, before in zip(waits, self._waits_taken))
        self._waits_taken = waits
        if self._waits_backend == self.executor.backend:  # a cpu step of auto's trial says nothing of hybrid's split
            self.executor.balance_share(waited, layers)

    def _send_cpu_counts(self) -> None:
        """The split for the backend of the moment (cpu and hybrid share the graphs: the table tells them apart)."""
        counts = self.executor.cpu_counts(len(self.slots))
        if counts != self._counts_sent:
            self.cpu_counts.copy_(torch.tensor(counts, dtype=torch.int32))
            self._counts_sent = counts

    def _mixer_actions(self, layer, layer_state) -> list[Action]:
        mixer, buf = layer.mixer, self.buf
        if not isinstance(mixer, Attention):
            def mix():
                buf["h"] = buf["x"] + mixer(layer.input_norm(buf["x"]), self.positions, layer_state)
            return [("segment", mix)]
        if self._attention_in_graph(mixer, layer_state):
            self._kv_moved.append(layer_state)

            def attend():
                buf["h"] = buf["x"] + mixer.decode_step(layer.input_norm(buf["x"]), self.positions, layer_state)
            return [("segment", attend)]

        def project():
            buf["q"], buf["k"], buf["v"], buf["gate"] = mixer.project(layer.input_norm(buf["x"]), self.positions)

        def output():
            buf["h"] = buf["x"] + mixer.output(buf["attention"], buf["gate"])
        return [("segment", project), ("attend", layer.index), ("segment", output)]

    def _mlp_actions(self, layer) -> list[Action]:
        mlp, buf = layer.mlp, self.buf
        if not hasattr(mlp, "route"):  # a dense MLP layer
            def dense():
                buf["x"] = buf["h"] + mlp(layer.post_attention_norm(buf["h"]))
            return [("segment", dense)]

        gather = layer.index in self._gathered
        cache, table = self.executor.cache, self._slot_table
        on_device, share = table is not None, self._share_on_device
        ordinal = sum(hasattr(other.mlp, "route") for other in self.model.layers[:layer.index])

        def route():
            buf["y"] = layer.post_attention_norm(buf["h"])
            ids, buf["weights"] = mlp.route(buf["y"])
            buf["ids"] = ids.reshape(-1)
            if on_device:  # the slots, and the copy table of the misses, chosen on the device: no host action
                kernels.assign_slots(buf["ids"], layer.index * cache.experts_per_layer, table["keys"], table["ages"],
                                     table["clock"], self.slots, self.copy_table, table["counts"],
                                     *((self.cpu_counts, self.gpu_rows) if share else ()))
                if share:  # the CPU's misses to its threads, which work while the GPU copies and computes the rest
                    kernels.post_cpu_share(buf["ids"], buf["weights"], self.gpu_rows, buf["y"], self.share_base,
                                           ordinal, self._share.mailbox)
            elif self._stream is not None:
                if self.with_cpu_share:  # the CPU's inputs first: the host waits for the ids, the last copy
                    self._y_host.copy_(buf["y"], non_blocking=True)
                    self._weights_host.copy_(buf["weights"].reshape(-1), non_blocking=True)
                self._ids_host.copy_(buf["ids"], non_blocking=True)

        def shared():
            buf["shared"] = mlp.shared(buf["y"])

        def gather_beside_shared():
            """The misses' copies on a side stream (a parallel branch of the graph) while the shared expert runs."""
            if self._side is not None:
                self._side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._side):  # None (no CUDA): the current stream
                self.executor.gather_misses(layer.index, self.copy_table)
            shared()
            if self._side is not None:
                torch.cuda.current_stream().wait_stream(self._side)

        def finish():
            if gather and not on_device:
                self.executor.gather_misses(layer.index, self.copy_table)
            y, k = buf["y"], mlp.top_k
            buf["routed"] = self.executor.slot_swiglu(y.expand(k, y.shape[-1]), self.slots)
            if not self.with_cpu_share:  # else the CPU's share comes later: add_cpu_share ends the layer
                combine()

        def add_cpu_share():
            if share:
                kernels.wait_cpu_share(self.gpu_rows, self.share_base, ordinal, self._share.mailbox, self.cpu_routed,
                                       self.share_waits)
            combine(self.gpu_rows, self.cpu_routed)

        def combine(gpu_rows=None, cpu_routed=None):  # the CPU's rows (gpu_rows 0) read any slot: masked there
            buf["x"] = kernels.combine_experts(buf["h"], buf["routed"], buf["weights"], gpu_rows,
                                               buf["shared"] if mlp.shared_expert is not None else None, cpu_routed)
        # the shared expert runs while the host waits for the ids; without one, no (empty) graph there
        beside = [("segment", shared)] if mlp.shared_expert is not None else []
        if on_device:
            return [("segment", route), ("segment", gather_beside_shared), ("segment", finish),
                    *([("segment", add_cpu_share)] if share else [])]
        actions = [("segment", route), ("ids_sent", layer.index), *beside, ("fetch", layer.index), ("segment", finish)]
        if self.with_cpu_share:  # the GPU copies and computes its share (finish) while the host computes the CPU's
            actions += [("cpu_share", layer.index), ("segment", add_cpu_share)]
        return actions

    def _attention_in_graph(self, mixer: Attention, cache) -> bool:
        """Attention runs inside the step's graphs when its cache is preallocated and the device has a kernel that
        reads the length on the device (eagerly, as the same segment, when graphs are off)."""
        if cache.limit is None:
            return False
        query = torch.empty(1, mixer.heads, mixer.head_dim, dtype=cache.keys.dtype, device=cache.keys.device)
        return not self.use_graphs or kernels.decode_attention_capturable(query, cache.keys, cache.values)

    def _attend(self, layer_index: int, state, inputs: dict) -> None:
        mixer = self.model.layers[layer_index].mixer
        out = mixer.attend(inputs["q"], inputs["k"], inputs["v"], state.layers[layer_index])
        if self._captured:
            self.buf["attention"].copy_(out)
        else:
            self.buf["attention"] = out

    def _ids_sent(self, layer_index: int, state, inputs: dict) -> None:
        if self._ids_ready is not None:
            self._ids_ready.record()

    def _fetch(self, layer_index: int, state, inputs: dict) -> None:
        if self._ids_ready is not None:
            self._ids_ready.synchronize()  # the shared expert's graph keeps the GPU busy meanwhile
            ids, y, weights = self._ids_host, self._y_host, self._weights_host
        else:
            ids, y, weights = inputs["ids"], inputs["y"], inputs["weights"].reshape(-1)
        deferred = [] if layer_index in self._gathered else None
        slots, on_cpu = self.executor.fetch_for_step(layer_index, ids.tolist(), deferred)  # copies start here
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
            self._cpu_job = (ids, y, weights, on_cpu)

    def _send_gpu_rows(self, on_cpu: list[bool]) -> None:
        """Which of the chosen experts the GPU weighs (the CPU's rows get weight 0), for the finish graph."""
        rows = [0.0 if c else 1.0 for c in on_cpu]
        if rows != self._gpu_rows_sent:  # most steps repeat the last mask (offload: all ones)
            self._gpu_rows_host.copy_(torch.tensor(rows))
            self.gpu_rows.copy_(self._gpu_rows_host, non_blocking=True)
            self._gpu_rows_sent = rows

    def _cpu_share(self, layer_index: int, state, inputs: dict) -> None:
        """The CPU's experts, computed while the GPU's finish graph copies and computes the rest; their sum goes
        up for the segment after this action, which adds it."""
        ids, y, weights, on_cpu = self._cpu_job
        if any(on_cpu):
            out = self.executor.compute_on_cpu(layer_index, y.float(), ids.reshape(1, -1), weights.reshape(1, -1),
                                               torch.tensor([on_cpu]))
            self._cpu_routed_host.copy_(out)
            self.cpu_routed.copy_(self._cpu_routed_host, non_blocking=True)
            self._cpu_routed_dirty = True
        elif self._cpu_routed_dirty:
            self.cpu_routed.zero_()
            self._cpu_routed_dirty = False


class GraphCaptureError(RuntimeError):
    """A decode step could not be captured as CUDA graphs (an op that cannot be captured)."""


def _merge(actions: list[Action]) -> list[Action]:
    """Consecutive segments as one: each graph spans everything between two host actions."""
    merged: list[Action] = []
    for kind, payload in actions:
        if kind == "segment" and merged and merged[-1][0] == "segment":
            merged[-1] = ("segment", _chain(merged[-1][1], payload))
        else:
            merged.append((kind, payload))
    return merged


def _chain(first: Callable[[], None], second: Callable[[], None]) -> Callable[[], None]:
    def both():
        first()
        second()
    return both
