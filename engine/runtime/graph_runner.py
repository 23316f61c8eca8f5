"""One-token decode steps replayed as CUDA graphs.

A decode step of a 40-layer MoE model launches about 4,000 small kernels; launched one by one from Python the
host sets the speed, not the GPU or the expert copies. The runner captures the model's one definition of a step,
`CausalLM.decode_step`, whole, and replays it with the token's embedding and position copied into its inputs.
It knows nothing of what is inside: where a layer needs the host mid-step (engine/step.py's `DecodeStep.host`:
the expert cache choosing slots on the host, attention over a growing cache) the capture is cut there, and
replay runs that host action between the graphs before and after it.

Graphs hold the addresses of the tensors they were captured with, so they belong to one sequence state and one
shape of the step (`CausalLM.begin_decode`'s key: the expert backend's), and are captured again for another.
Capture never runs kernels for the first time: the first step of all runs eagerly, which compiles and loads
them. With `use_graphs=False` every step runs eagerly, cut actions in place: that is how the CPU tests check
the step against the plain forward, and gpu_tests/ checks the captured graphs against both.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable

import torch

from engine.errors import ContextOverflowError, GraphCaptureError
from engine.step import DecodeStep


def graphs_enabled() -> bool:
    """MOEDESK_DECODE_GRAPHS=0 turns graphed decode off (a diagnosis switch; the plain forward runs)."""
    return os.environ.get("MOEDESK_DECODE_GRAPHS", "1") != "0"


def attach_graph_runner(model) -> None:
    """Give `model` a runner for its one-token calls where its expert executor can be captured."""
    if model.expert_executor.decode_capturable() and graphs_enabled():
        model.decode_runner = GraphRunner(model)


class GraphRunner:
    """Runs `model.decode_step` per token: captured once per state and shape, replayed after."""

    def __init__(self, model, use_graphs: bool = True):
        self.model, self.use_graphs = model, use_graphs
        cuda = model.device.type == "cuda"
        self.positions = torch.zeros(1, dtype=torch.long, device=model.device)
        self.embedding = torch.zeros(1, model.config.hidden_size, dtype=model.dtype, device=model.device)
        self._embedding_host = torch.zeros_like(self.embedding, device="cpu", pin_memory=cuda)
        self._embedding_sent = torch.cuda.Event() if cuda else None
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self._program: list[Callable[[], None]] = []  # graph replays and host actions, in the step's order
        self._after: list[Callable[[], None]] = []  # the captured step's host work once it is queued
        self._logits: torch.Tensor | None = None  # the captured step's output, overwritten by each replay
        self._state = None  # weak reference to the state the plan (and graphs) were made for
        self._key = None
        self._captured = False
        self._warm = not use_graphs  # the first step runs eagerly: kernels load outside any capture

    @property
    def state(self):
        """The state the step was planned (and captured) for, or None."""
        return self._state() if self._state is not None else None

    @torch.inference_mode()
    def step(self, token: int, state) -> torch.Tensor:
        """Feed one token to `state`; float32 logits [vocab] of it."""
        if state.max_tokens is not None and state.position + 1 > state.max_tokens:
            raise ContextOverflowError(state.position + 1, state.max_tokens)
        model = self.model
        key = model.begin_decode(state)
        capture = self.use_graphs and self._warm
        if self.state is not state or self._key != key or self._captured != capture:
            self._prepare(state, key, capture)
        self.positions.fill_(state.position)
        if self._embedding_sent is not None:
            self._embedding_sent.synchronize()  # the last step's copy has left the staging row
        self._embedding_host.copy_(model.embed_tokens[token])
        self.embedding.copy_(self._embedding_host, non_blocking=True)
        if self._embedding_sent is not None:
            self._embedding_sent.record()
        model.start_decode()
        try:
            if self._captured:
                for action in self._program:
                    action()
                logits, after = self._logits, self._after
            else:
                step = DecodeStep(self.use_graphs)
                logits, after = model.decode_step(self.embedding, self.positions, state, step), step.after
            model.end_decode(state)
        except BaseException:
            model.abandon_decode()
            raise
        for action in after:
            action()
        if model.device.type != "cuda":
            return logits[0]
        self._warm = True
        return logits[0].clone()  # the graphs' output is overwritten by the next step

    def _prepare(self, state, key, capture: bool) -> None:
        """Plan the step for `state`, and capture it as graphs with `capture`."""
        self.release()  # the last state's graphs go first, so their memory serves the new ones
        self.model.plan_decode()
        self._state = weakref.ref(state, lambda _: self.release())  # the graphs hold the state's tensors
        self._key = key
        if not capture:
            return
        torch.cuda.empty_cache()  # the graphs' pool is private: it takes what the allocator holds unused (planned)
        try:
            self._capture(state, torch.cuda.graph_pool_handle())
        except Exception as error:  # out of memory included: the plain forward still fits
            self.release()
            torch.cuda.empty_cache()
            raise GraphCaptureError(f"{type(error).__name__}: {error}") from error
        self._captured = True

    def _capture(self, state, pool) -> None:
        """Record the step as graphs cut at its host actions, all in one memory pool, replayed in this order."""
        program, queued = [], []
        capturing = []  # the open capture: (graph, its context)

        def open_graph():
            graph = torch.cuda.CUDAGraph()
            context = torch.cuda.graph(graph, pool=pool, stream=self.model.stream, capture_error_mode="thread_local")
            context.__enter__()
            capturing.append((graph, context))

        def close_graph(error=None):
            graph, context = capturing.pop()
            context.__exit__(type(error) if error else None, error, None)
            self.graphs.append(graph)
            program.append(graph.replay)
            program.extend(queued)
            queued.clear()

        def cut(action):
            close_graph()
            program.append(action)
            open_graph()

        step = DecodeStep(True, cut=cut, queued=queued.append)
        open_graph()
        try:
            logits = self.model.decode_step(self.embedding, self.positions, state, step)
        except BaseException as error:
            if capturing:
                close_graph(error)
            raise
        close_graph()
        self._program, self._after, self._logits = program, step.after, logits

    def release(self) -> None:
        """Drop the captured graphs and the plan, and with them the memory they hold; the next step plans anew."""
        self.graphs, self._program, self._after, self._logits = [], [], [], None
        self._state, self._key, self._captured = None, None, False
