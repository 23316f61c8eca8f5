"""What every supported model shares: embedding, a stack of decoder layers, final norm, LM head,
and the per-sequence state that lets a prompt be fed in chunks of any size."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from engine.checkpoint.source import WeightSource
from engine.config import ModelConfig
from engine.errors import ContextOverflowError, GraphCaptureError
from engine.layers.linear import Linear
from engine.layers.moe import SparseMoe
from engine.layers.norm import RMSNorm
from engine.step import DecodeStep


class DecoderLayer:
    """x + mixer(norm(x)), then x + mlp(norm(x)); the mixer is attention or Gated DeltaNet."""

    def __init__(self, source: WeightSource, index: int, mixer, mlp):
        c = source.config
        self.index, self.mixer, self.mlp = index, mixer, mlp
        self.input_norm = RMSNorm(
            source, f"layers.{index}.input_layernorm.weight", c.hidden_size, c.zero_centered_norms
        )
        self.post_attention_norm = RMSNorm(
            source, f"layers.{index}.post_attention_layernorm.weight", c.hidden_size, c.zero_centered_norms
        )

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, mixer_state) -> torch.Tensor:
        h, normed = self.post_attention_norm.add(x, self.mixer(self.input_norm(x), positions, mixer_state))
        return h + self.mlp(normed)

    def decode_step(self, x: torch.Tensor, positions: torch.Tensor, mixer_state, step: DecodeStep) -> torch.Tensor:
        """The same layer for one token, each part's decode step telling `step` where the host acts."""
        mixed = self.mixer.decode_step(self.input_norm(x), positions, mixer_state, step)
        h, normed = self.post_attention_norm.add(x, mixed)
        return self.mlp.decode_step(normed, h, step)


@dataclass
class ModelState:
    """KV caches and recurrent states of one sequence; `position` tokens have been fed so far."""

    layers: list
    max_tokens: int | None
    position: int = 0

    def clone(self) -> ModelState:
        return ModelState([s.clone() for s in self.layers], self.max_tokens, self.position)

    def snapshot(self) -> StateSnapshot:
        """A cheap restore point: KV caches only grow, so they are remembered by length; recurrent
        states are fixed-size and copied."""
        return StateSnapshot(self.position, [s.snapshot() for s in self.layers])

    @property
    def snapshot_bytes(self) -> int:
        """Sum the host RAM one snapshot() takes: the recurrent states' copies."""
        return sum(s.snapshot_bytes for s in self.layers)

    def restore(self, snapshot: StateSnapshot) -> None:
        """Back to `snapshot`; snapshots taken after it are invalid once new tokens are fed."""
        for layer_state, saved in zip(self.layers, snapshot.layers):
            layer_state.restore(saved)
        self.position = snapshot.position

    def host_copy(self, after: HostState | None = None) -> HostState:
        """A full copy in host RAM (KV rows as well as recurrent states), so it stays valid while this state
        goes on to run other sequences: what a cache shared across requests keeps. `after`: an earlier copy
        whose sequence this state's begins with, loaded from it or grown from it (so its KV rows are these
        rows): its KV blocks are shared, not copied again."""
        if after is not None and after.position > self.position:
            raise ValueError(f"a copy of {self.position} tokens cannot extend one of {after.position}")
        earlier = after.layers if after is not None else [None] * len(self.layers)
        return HostState(self.position, [s.host_copy(e) for s, e in zip(self.layers, earlier)])

    def load(self, saved: HostState) -> None:
        """Hold exactly the sequence of a host_copy(), whatever this state held before."""
        for layer_state, layer_saved in zip(self.layers, saved.layers):
            layer_state.load(layer_saved)
        self.position = saved.position


@dataclass(frozen=True)
class StateSnapshot:
    position: int
    layers: list


@dataclass(frozen=True)
class HostState:
    position: int
    layers: list

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Every host tensor the copy holds; KV blocks may be shared with other copies (host_copy's `after`)."""
        return [t for layer in self.layers for t in layer.tensors]

    @property
    def nbytes(self) -> int:
        """Host RAM the copy holds, shared blocks counted as if it held them alone."""
        return sum(t.numel() * t.element_size() for t in self.tensors)


class Interrupted(Exception):
    """A forward pass stopped between layers because its caller asked it to; the state is partly advanced."""


class CausalLM:
    def __init__(self, source: WeightSource, layers: list[DecoderLayer], executor):
        c = source.config
        self.config: ModelConfig = c
        self.device, self.dtype = source.device, source.dtype
        self.expert_executor = executor
        executor.prepare(
            {layer.index: layer.mlp.experts for layer in layers if isinstance(layer.mlp, SparseMoe)}, self.dtype
        )
        if self.device.type == "cuda":  # hand back what loading left cached, so the plan's KV cache finds room
            torch.cuda.empty_cache()
        # The table stays in host RAM (1 GB in bf16 for a 248K vocabulary): a chunk copies up only its rows.
        self.embed_tokens = source.checkpoint.tensor("embed_tokens.weight", (c.vocab_size, c.hidden_size))
        self.layers = layers
        self.norm = RMSNorm(source, "norm.weight", c.hidden_size, c.zero_centered_norms)
        tied = c.tie_word_embeddings and not source.checkpoint.has("lm_head")
        self.lm_head = Linear(source, "embed_tokens" if tied else "lm_head", c.hidden_size, c.vocab_size)
        # All of the model's GPU work runs on one stream of its own: CUDA graphs cannot be captured on the default
        # stream, and a second stream would cost a second cuBLAS workspace (32 MiB on Hopper) inside the plan
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.decode_runner = None  # what runs one-token calls as captured steps (engine/runtime/graph_runner.py)

    def new_state(self, max_tokens: int | None = None) -> ModelState:
        with self._compute_stream():
            return ModelState(
                [layer.mixer.new_state(max_tokens, self.device, self.dtype) for layer in self.layers], max_tokens
            )

    @contextmanager
    def _compute_stream(self):
        """Run the block on the model's stream, ordered after the caller's work and before what follows it."""
        if self.stream is None:
            yield None
            return
        caller = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(caller)
        with torch.cuda.stream(self.stream):
            yield caller
        caller.wait_stream(self.stream)

    @staticmethod
    def _handed_back(result: torch.Tensor, caller) -> torch.Tensor:
        """`result`, made on the model's stream, safe for the caller's stream to use and free."""
        if caller is not None:
            result.record_stream(caller)
        return result

    @torch.inference_mode()
    def forward(self, token_ids, state: ModelState, interrupt: Callable[[], bool] | None = None) -> torch.Tensor:
        """Append `token_ids` to `state`; float32 logits [vocab] of the last token. `interrupt` is asked
        between layers; when it answers True the pass raises Interrupted (restore a snapshot after it)."""
        ids = self._ids(token_ids)
        with self._compute_stream() as caller:
            if self.decode_runner is not None and ids.numel() == 1:
                if interrupt is not None and interrupt():
                    raise Interrupted()
                try:
                    logits = self.decode_runner.step(int(ids[0]), state)
                    return self._handed_back(logits, caller)
                except GraphCaptureError as error:  # nothing ran: the plain forward takes this step and the next
                    warnings.warn(f"decode runs without CUDA graphs, slower: {error}", RuntimeWarning, stacklevel=2)
                    self.decode_runner = None
                    self.expert_executor.end_trial()
            return self._handed_back(self._run(ids, state, all_logits=False, interrupt=interrupt)[-1], caller)

    # ---- one-token decode steps, as a graph runner drives them ---------------------------------------------

    def begin_decode(self, state: ModelState) -> Hashable:
        """Note that a decode step on `state` begins (auto's trial may switch the expert backend); the key of
        what the step's shape depends on besides the state."""
        self.expert_executor.note_decode_step(state.position)
        return self.expert_executor.decode_key()

    def plan_decode(self) -> None:
        """Plan the decode steps of one shape: how the MoE layers choose slots and share work with the CPU."""
        self.expert_executor.plan_decode(self.config.num_experts_per_tok, self.config.hidden_size)

    def start_decode(self) -> None:
        """Start a planned step's host work that comes before its device work."""
        self.expert_executor.begin_decode()

    def decode_step(
        self, embedding: torch.Tensor, positions: torch.Tensor, state: ModelState, step: DecodeStep
    ) -> torch.Tensor:
        """Float32 logits [1, vocab] of one token, `embedding` [1, H] at positions [1] (device tensors), fed to
        `state`: the one definition of a decode step, run eagerly or captured whole by a graph runner."""
        x = embedding
        for layer, layer_state in zip(self.layers, state.layers):
            x = layer.decode_step(x, positions, layer_state, step)
        return self.lm_head(self.norm(x)).float()

    def end_decode(self, state: ModelState) -> None:
        """Finish a step once its device work is queued: the CPU's share waited for, the position moved on."""
        self.expert_executor.end_decode()
        state.position += 1

    def abandon_decode(self) -> None:
        """Clean up after a step that failed part way."""
        self.expert_executor.abandon_decode()

    @torch.inference_mode()
    def score(self, token_ids) -> torch.Tensor:
        """Float32 logits [T, vocab] of every position of `token_ids`, from a fresh state."""
        ids = self._ids(token_ids)
        state = self.new_state(ids.numel())
        with self._compute_stream() as caller:
            return self._handed_back(self._run(ids, state, all_logits=True), caller)

    def _ids(self, token_ids) -> torch.Tensor:
        ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            raise ValueError(f"token ids must lie in 0..{self.config.vocab_size - 1}")
        return ids

    def _run(self, ids: torch.Tensor, state: ModelState, all_logits: bool, interrupt=None) -> torch.Tensor:
        if ids.numel() == 0:
            raise ValueError("no tokens to run")
        end = state.position + ids.numel()
        if state.max_tokens is not None and end > state.max_tokens:
            raise ContextOverflowError(end, state.max_tokens)  # checked first: the state stays untouched
        positions = torch.arange(state.position, end, device=self.device)
        x = self.embed_tokens[ids].to(self.device, self.dtype)
        for layer, layer_state in zip(self.layers, state.layers):
            if interrupt is not None and interrupt():
                raise Interrupted()
            x = layer(x, positions, layer_state)
        state.position = end
        x = self.norm(x if all_logits else x[-1:])
        return self.lm_head(x).float()
