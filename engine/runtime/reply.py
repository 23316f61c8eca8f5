"""One reply of a chat session: its prompt prefilled in chunks, then decoded, reasoning split from answer,
events streamed as they come; and what a reply cut before its end leaves to go on from."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.errors import NonFiniteLogitsError
from engine.models.base import Interrupted
from engine.runtime.events import AnswerDelta, ReasoningDelta, TurnFinished, TurnStats
from engine.runtime.prefix_cache import CachedPrefix, PrefixCache
from engine.runtime.sampling import Sampler
from engine.runtime.stop import StopMatcher
from engine.runtime.tokenizer import ChatTokenizer, IncrementalDetokenizer

if TYPE_CHECKING:
    from engine.runtime.session import ChatSession


def thinking_open(tok: ChatTokenizer, rendered: str) -> bool:
    """Whether `rendered` (a generation prompt) leaves the model inside its thinking: Qwen3.5/3.6 templates open
    <think> in the generation prompt itself."""
    return bool(tok.think_start) and rendered.rfind(tok.think_start) > rendered.rfind(tok.think_end or "")


@dataclass(frozen=True)
class CutReply:
    """A reply cut before its end: its message in the conversation (None: not in it), its text (untrimmed when the
    session made it), whether in its thinking."""

    message: dict | None
    thoughts: str
    answer: str
    reasoning: bool


def explain_failure(exc: Exception, phase: str) -> str:
    """Says what failed while `phase` ran and what the user can do next."""
    if isinstance(exc, NonFiniteLogitsError):
        return str(exc)
    if isinstance(exc, torch.OutOfMemoryError):
        return (
            f"the engine ran out of memory while {phase}; the conversation is as it was before this message. "
            f"Try a shorter message, a larger VRAM preset, or closing other programs that use the GPU"
        )
    return (
        f"the engine failed while {phase} ({type(exc).__name__}: {exc}); the conversation is as it was "
        f"before this message, so you can send again. The log has the details"
    )


class Reply:
    """One reply: prefill the prompt in chunks, then decode, splitting reasoning from answer."""

    def __init__(
        self,
        session: ChatSession,
        sampler: Sampler,
        prompt_ids: list[int],
        rendered: str,
        *,
        start_logits: torch.Tensor | None = None,
        prefix_cache: PrefixCache | None = None,
        restored: CachedPrefix | None = None,
        save_at: frozenset[int] = frozenset(),
        started: float | None = None,
        answer_start: tuple[int, ...] = (),
    ):
        """prompt_ids: what the state still needs; start_logits: the state's last token's logits, for when that
        is nothing; the states once `save_at` tokens are in (counted from the sequence's start), and the state
        at the end of the reply, go into prefix_cache, sharing the KV blocks of `restored` (the entry the state
        was loaded from) and of each other. `started`: when the request began (default: when run() does);
        `answer_start`: tokens forced where the answer begins."""
        self.session, self.sampler, self.prompt_ids = session, sampler, prompt_ids
        self.logits, self.prefix_cache, self.save_at = start_logits, prefix_cache, save_at
        self.cached, self.started = restored, started  # cached: the latest entry of this state's sequence
        tok = session.tokenizer
        self.think_start = tok.token_id(tok.think_start) if tok.think_start else None
        self.think_end = tok.token_id(tok.think_end) if tok.think_end else None
        self.reasoning = thinking_open(tok, rendered)
        self.detok = IncrementalDetokenizer(tok)
        self.stop = StopMatcher(sampler.params.stop)
        self.answer: list[str] = []
        self.thoughts: list[str] = []
        self.segment_started = False  # leading newlines of a segment are template layout, not text
        self.prompt_tokens = session.context_used  # until the prefill has run
        # forced tokens waiting to be fed: the answer's start now, or once the model closes its reasoning, after
        # the blank line the templates put between reasoning and answer
        self.forced: list[int] = [] if self.reasoning or not answer_start else list(answer_start)
        self.forced_after_reasoning = (
            tuple(tok.encode("\n\n")) + answer_start if self.reasoning and answer_start else ()
        )

    def run(self) -> Iterator:
        s = self.session
        start = first_token_at = self.started if self.started is not None else time.perf_counter()
        generated: list[int] = []
        phase = "reading the prompt"
        try:
            logits = self._prefill()
            first_token_at = time.perf_counter()
            self.prompt_tokens = s._state.position
            phase = "writing the reply"
            reason = yield from self._decode(logits, generated)
            if reason != "cancelled":
                self._save()
            s._latest = self.cached
        except Interrupted:
            s._rewind(len(s._boundaries) - 1)
            yield self._finish("cancelled", start, start, 0, prefilled=0)
            return
        except Exception as exc:  # out of memory, a kernel failure: the turn is undone, the session lives on
            s._rewind(len(s._boundaries) - 1)
            yield self._finish(
                "error", start, first_token_at, len(generated), prefilled=0, error=explain_failure(exc, phase)
            )
            return
        yield from self._drain(reason)
        # the last sampled token is not in the state yet; eos is written by the next turn's template text
        s._pending = () if reason == "eos" or not generated else (generated[-1],)
        message = self._assistant_message()
        s.messages.append(message)
        s._synced = len(s.messages)
        s._cut_reply = (
            CutReply(message, "".join(self.thoughts), "".join(self.answer), self.reasoning) if s._pending else None
        )
        yield self._finish(reason, start, first_token_at, len(generated), prefilled=len(self.prompt_ids))

    def _save(self) -> None:
        """Put the state (its token ids, the logits of the last) into the prefix cache, unless it holds it;
        only the KV rows past the latest entry of this sequence are copied."""
        s = self.session
        if self.prefix_cache is not None:
            self.cached = self.prefix_cache.store(s._fed, s._state, self.logits, after=self.cached) or self.cached

    def _decode(self, logits, generated: list[int]):
        """Sample until a stop; yields text events, returns the stop reason."""
        s = self.session
        budget = min(self.sampler.params.max_new_tokens, s.context_tokens - s._state.position)
        while len(generated) < budget:
            if s._cancel.is_set():
                return "cancelled"
            token = self.forced.pop(0) if self.forced else self.sampler(logits, s._fed, generated)
            generated.append(token)
            if token in s.tokenizer.eos_token_ids:
                return "eos"
            if token == self.think_end and self.forced_after_reasoning:
                self.forced, self.forced_after_reasoning = list(self.forced_after_reasoning), ()
            events, stopped = self._emit(token)
            yield from events
            if stopped:
                return "stop"
            if len(generated) == budget:
                break
            logits = self.logits = s.model.forward([token], s._state)
            s._fed.append(token)
        return "length"

    def _prefill(self):
        """Feed the prompt in chunks that end at every save point; the last token's logits."""
        s = self.session
        offset = len(s._fed)  # the save points count from the start of the sequence, the prompt from here
        ends = sorted(
            {p - offset for p in self.save_at if 0 < p - offset < len(self.prompt_ids)} | {len(self.prompt_ids)}
        )
        begin = 0
        for end in ends:
            while begin < end:
                piece = self.prompt_ids[begin : min(begin + s.prefill_chunk_tokens, end)]
                self.logits = s.model.forward(piece, s._state, interrupt=s._cancel.is_set)
                s._fed.extend(piece)
                s.prefilled_tokens_total += len(piece)
                begin += len(piece)
            if end + offset in self.save_at:
                self._save()
        s._pending = ()
        return self.logits

    def _emit(self, token: int) -> tuple[list, bool]:
        if token == self.think_start or token == self.think_end:
            events, stopped = self._text(self.detok.flush())
            self.detok = IncrementalDetokenizer(self.session.tokenizer)
            self.reasoning = token == self.think_start
            self.segment_started = False
            return events, stopped
        return self._text(self.detok.feed(token))

    def _text(self, delta: str) -> tuple[list, bool]:
        shown, stopped = self.stop.feed(delta)
        if not self.segment_started:
            shown = shown.lstrip("\n")
            self.segment_started = bool(shown)
        if not shown:
            return [], stopped
        (self.thoughts if self.reasoning else self.answer).append(shown)
        return [ReasoningDelta(shown) if self.reasoning else AnswerDelta(shown)], stopped

    def _drain(self, reason: str) -> Iterator:
        if reason == "stop":
            return
        events, _ = self._text(self.detok.flush())
        yield from events
        tail = self.stop.flush()
        if tail:
            (self.thoughts if self.reasoning else self.answer).append(tail)
            yield ReasoningDelta(tail) if self.reasoning else AnswerDelta(tail)

    def go_on_from(self, cut: CutReply, reasoning: bool) -> None:
        """Make this reply the continuation of `cut`: its text so far, in its thinking or not."""
        self.reasoning, self.segment_started = reasoning, True
        self.thoughts = [cut.thoughts] if cut.thoughts else []
        self.answer = [cut.answer] if cut.answer else []

    def _assistant_message(self) -> dict:
        message = {"role": "assistant", "content": "".join(self.answer).rstrip()}
        if self.thoughts:
            message["reasoning_content"] = "".join(self.thoughts).strip()
        return message

    def _finish(
        self,
        reason: str,
        start: float,
        first_token_at: float,
        new_tokens: int,
        prefilled: int,
        error: str | None = None,
    ) -> TurnFinished:
        end = time.perf_counter()
        prefill_s = max(first_token_at - start, 1e-9)
        decode_s = end - first_token_at
        stats = TurnStats(
            prompt_tokens=self.prompt_tokens,
            prefill_tokens=prefilled,
            new_tokens=new_tokens,
            time_to_first_token_s=prefill_s,
            prefill_tokens_per_s=prefilled / prefill_s,
            decode_tokens_per_s=(new_tokens - 1) / decode_s if new_tokens > 1 and decode_s > 0 else 0.0,
            stop_reason=reason,
            seed=self.sampler.seed,
            error=error,
            cached_tokens=self.prompt_tokens - prefilled if reason not in ("cancelled", "error") else 0,
        )
        return TurnFinished("".join(self.answer).rstrip(), "".join(self.thoughts).strip(), stats)
