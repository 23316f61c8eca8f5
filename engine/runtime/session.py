"""A chat session: a conversation kept in a model state, replies streamed as events.

The state only ever grows by what the model has seen: each turn feeds just the new text
(the end of the previous reply, the new user message and the assistant header), so turn N
costs the prefill of turn N alone. Earlier replies stay in the state as generated, reasoning
included, so every render of the history asks the template to keep it (`preserve_thinking`,
which Qwen3.5/3.6 templates take): a saved chat prefilled afresh, or the history recomputed
after a new system prompt, is then the same tokens the live state holds. Templates without the
option (Qwen3's) drop earlier reasoning from a fresh render; the live state still keeps it, the
price of never recomputing history. A snapshot at each of the last `max_snapshots` turn
boundaries (recurrent states copied to host RAM, KV caches remembered by length) lets
regenerate and edit roll back instead. With a `state_store` (the prefix cache the API uses, with its disk
tier), each turn's states go into it, and a turn that starts from a fresh state (another chat was open, the
app restarted) loads the longest prefix of its prompt the store holds and prefills only the rest.

A turn cancelled during its prefill is undone whole (its user message is taken back out of
`messages`; the app keeps the text). Threading: one thread drives `send`/`regenerate`/`edit`
(the app's worker); `cancel` may be called from any thread and takes effect between layers of
a prefill chunk or between tokens.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace


from engine.errors import CheckpointError, ContextOverflowError
from engine.models.base import CausalLM, Interrupted, StateSnapshot
from engine.runtime.events import TurnFinished, TurnStats
from engine.runtime.prefix_cache import CachedPrefix, PrefixCache
from engine.runtime.prompt import Prompt
from engine.runtime.reply import CutReply, Reply, thinking_open
from engine.runtime.sampling import Sampler, SamplingParams
from engine.runtime.tokenizer import ChatTokenizer

# Rendering [user, assistant] with this content around the new messages isolates the text the
# template puts after a finished reply, whatever the template does with earlier turns.
_SENTINEL = "\u2063moedesk-turn-boundary\u2063"
DEFAULT_PREFILL_CHUNK_TOKENS = 512
# Restore points kept for regenerate and edit (each holds every Gated DeltaNet state in host RAM, 61 MiB for
# Qwen3.6-35B-A3B); an edit further back prefills the history again.
DEFAULT_MAX_SNAPSHOTS = 8


@dataclass
class _Boundary:
    """Where a user turn began: restoring it undoes that turn and everything after."""

    message_index: int  # index of the turn's user message in `messages`
    snapshot: StateSnapshot
    fed_tokens: int
    pending: tuple[int, ...]


class ChatSession:
    def __init__(
        self,
        model: CausalLM,
        tokenizer: ChatTokenizer,
        *,
        context_tokens: int,
        sampling: SamplingParams | None = None,
        system_prompt: str | None = None,
        enable_thinking: bool = True,
        prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS,
        max_snapshots: int = DEFAULT_MAX_SNAPSHOTS,
        context_advice: str = "",
        state_store: PrefixCache | None = None,
    ):
        """context_advice: what makes the context larger, where something can (the overflow message says it);
        state_store: where turns' states are kept for resuming this conversation or another one later."""
        self.model, self.tokenizer = model, tokenizer
        self.context_tokens = context_tokens
        self.context_advice = context_advice
        self.sampling = sampling or SamplingParams.from_generation_config(tokenizer.generation_defaults)
        self.system_prompt = system_prompt
        self.enable_thinking = enable_thinking
        self.prefill_chunk_tokens = prefill_chunk_tokens
        if max_snapshots < 1:
            raise ValueError(f"max_snapshots must be 1 or more (the last turn's, for regenerate), not {max_snapshots}")
        self.max_snapshots = max_snapshots
        self.state_store = state_store
        self.messages: list[dict] = []
        self.prefilled_tokens_total = 0  # every token this session pushed through prefill
        self._cancel = threading.Event()
        self._blank = None  # a fresh state's host copy, made by the first whole request
        self.reset()

    # ---- conversation controls ------------------------------------------------------------------

    def reset(self, history: list[dict] | None = None) -> None:
        """Start over, with `history` (user/assistant messages of a saved chat) as the conversation so far;
        it is prefilled together with the next message. The system prompt and settings stay."""
        self.messages = [dict(m) for m in history or []]
        self._forget_state()

    def set_system_prompt(self, text: str | None) -> None:
        """A new system prompt changes the start of the context, so the history is recomputed next turn."""
        self.system_prompt = text or None
        self._forget_state()

    def _forget_state(self) -> None:
        if getattr(self, "_state", None) is None:
            self._state = self.model.new_state(self.context_tokens)
        else:  # emptied in place: a plan's KV cache fits in VRAM once, not twice while a new one is made
            self._state.load(self._blank_copy())
        self._fed: list[int] = []  # token ids in the state, in order
        self._pending: tuple[int, ...] = ()  # sampled but not yet fed (the last token of a reply)
        self._synced = 0  # messages[:_synced] are in the state
        self._boundaries: list[_Boundary] = []
        self._holds_request = False  # set by complete(): the next turn starts from a fresh state
        self._cut_reply: CutReply | None = None  # the last reply, when it was cut: what resume() goes on from
        self._latest: CachedPrefix | None = None  # the state store's latest entry of the state's sequence

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def context_used(self) -> int:
        return self._state.position

    @property
    def snapshot_bytes(self) -> int:
        """Host RAM one restore point takes: what the model state's snapshot copies."""
        return self._state.snapshot_bytes

    # ---- turns ----------------------------------------------------------------------------------

    def send(self, text: str, sampling: SamplingParams | None = None) -> Iterator:
        """Add a user message and stream the reply: ReasoningDelta/AnswerDelta events, then TurnFinished."""
        return self._turn(text, sampling)

    def regenerate(self, sampling: SamplingParams | None = None) -> Iterator:
        """Replace the last reply: roll back to the last user turn's boundary and answer it again."""
        if not self._boundaries:
            raise ValueError("there is no reply to regenerate yet")
        user_text = self.messages[self._boundaries[-1].message_index]["content"]
        self._rewind(len(self._boundaries) - 1)
        return self._turn(user_text, sampling)

    def edit(self, message_index: int, text: str, sampling: SamplingParams | None = None) -> Iterator:
        """Replace user message `message_index` with `text`, drop what came after it, and answer again."""
        turn = self._turn_at(message_index)
        if turn is None:
            raise ValueError(f"message {message_index} is not a user message of this conversation")
        self._rewind(turn)
        return self._turn(text, sampling)

    def can_resume(self) -> bool:
        """Whether the state ends inside the last reply as generated, cut before its end (length limit or Stop)."""
        cut = self._cut_reply
        return (
            not self._holds_request
            and bool(self.messages)
            and bool(self._pending)
            and cut is not None
            and cut.message is self.messages[-1]
            and self._synced == len(self.messages)
        )

    def resume(self, sampling: SamplingParams | None = None) -> Iterator:
        """Write more of the last reply, cut by its length limit or a Stop: decoding goes on after its last token
        and the events carry the new text; TurnFinished has the whole reply."""
        if not self.can_resume():
            raise ValueError("the last reply was not cut, or the engine's state no longer holds it")
        self._cancel.clear()
        return self._run_resume(sampling)

    def _run_resume(self, sampling: SamplingParams | None) -> Iterator:
        params = sampling or self.sampling
        sampler = Sampler(replace(params, stop=tuple(params.stop)))
        needed = self._state.position + len(self._pending) + 1  # the cut reply's last token, and one more
        if needed > self.context_tokens:
            error = str(ContextOverflowError(needed, self.context_tokens, self.context_advice))
            stats = TurnStats(self._state.position, 0, 0, 0.0, 0.0, 0.0, "error", sampler.seed, error)
            yield TurnFinished("", "", stats)
            return
        cut = self._cut_reply
        self.messages.pop()
        self._synced = len(self.messages)
        reply = Reply(self, sampler, list(self._pending), "")
        self._pending = ()
        reply.go_on_from(cut, cut.reasoning)  # its text as generated (the stored message is trimmed)
        yield from reply.run()

    def can_edit(self, message_index: int) -> bool:
        """Whether a snapshot marks that user message, so edit() rolls back instead of recomputing."""
        return self._turn_at(message_index) is not None

    def _turn_at(self, message_index: int) -> int | None:
        return next((i for i, b in enumerate(self._boundaries) if b.message_index == message_index), None)

    def _rewind(self, turn: int) -> None:
        boundary = self._boundaries[turn]
        self._state.restore(boundary.snapshot)
        del self._fed[boundary.fed_tokens :]
        self._pending = boundary.pending
        del self.messages[boundary.message_index :]
        self._synced = boundary.message_index
        del self._boundaries[turn:]
        if self._latest is not None and tuple(self._fed[: len(self._latest.ids)]) != self._latest.ids:
            self._latest = None  # the state no longer begins with that entry's sequence

    def _restore(self, ids: list[int]) -> CachedPrefix | None:
        """Load the longest prefix of `ids` the state store holds into the (fresh) state; that entry, or None."""
        hit = self.state_store.longest_prefix(ids) if self.state_store is not None else None
        if hit is None:
            return None
        try:
            self._state.load(hit.state)
        except Exception:  # a saved state this model cannot hold (a smaller context now): prefill instead
            self._state.load(self._blank_copy())
            return None
        self._fed = list(hit.ids)
        return hit

    def _blank_copy(self):
        """A host copy of what a state holds before any token, made once."""
        if self._blank is None:
            self._blank = self.model.new_state(0).host_copy()
        return self._blank

    def _prompt_ids(self, new_messages: list[dict]) -> tuple[list[int], str]:
        """(token ids to feed, rendered text) that bring the state up to `new_messages`."""

        def encode(messages: list[dict], after: str | None = None) -> tuple[list[int], str]:
            # message texts are data: a control token written in them is never one (ChatTokenizer.encode_chat)
            return self.tokenizer.encode_chat(
                messages,
                after=after,
                add_generation_prompt=True,
                enable_thinking=self.enable_thinking,
                preserve_thinking=True,
                interrupt=self._cancel.is_set,
            )

        if not self._fed:
            system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
            return encode(system + self.messages[: self._synced] + new_messages)
        framed = [{"role": "user", "content": _SENTINEL}, {"role": "assistant", "content": _SENTINEL}]
        ids, text = encode(framed + new_messages, after=_SENTINEL)
        return list(self._pending) + ids, text

    # ---- whole requests (an HTTP API: every request carries its conversation) --------------------

    def complete(
        self,
        prompt: Prompt,
        *,
        sampling: SamplingParams | None = None,
        prefix_cache: PrefixCache | None = None,
        answer_start: Sequence[int] = (),
    ) -> Iterator:
        """Stream the reply to a whole prompt (chat_prompt or text_prompt) as send() does, starting from the
        longest prefix of its tokens that `prefix_cache` holds; the states at the prompt's save points and at
        the end of the reply go into it for the requests that follow. `answer_start`: tokens the answer is made
        to begin with (fed and shown as if sampled, after the reasoning), e.g. the opening of a required tool
        call. The session's own conversation is cleared; a cancel() from now on stops the reply."""
        self._cancel.clear()
        return self._complete(prompt, sampling, prefix_cache, tuple(answer_start))

    def _complete(
        self,
        prompt: Prompt,
        sampling: SamplingParams | None,
        prefix_cache: PrefixCache | None,
        answer_start: tuple[int, ...],
    ) -> Iterator:
        params = sampling or self.sampling
        sampler = Sampler(replace(params, stop=tuple(params.stop)))
        self.messages, self._synced, self._boundaries, self._pending = [], 0, [], ()
        self._holds_request = True
        ids = prompt.ids

        def refused(reason: str, error: str | None = None) -> TurnFinished:
            return TurnFinished("", "", TurnStats(0, 0, 0, 0.0, 0.0, 0.0, reason, sampler.seed, error))

        if not ids:
            yield refused("error", "the prompt is empty: give it some text")
            return
        if len(ids) + 1 > self.context_tokens:
            yield refused("error", str(ContextOverflowError(len(ids) + 1, self.context_tokens, self.context_advice)))
            return
        started = time.perf_counter()  # the time to first token counts the lookup and the restore
        hit = prefix_cache.longest_prefix(ids) if prefix_cache is not None else None
        self._state.load(hit.state if hit is not None else self._blank_copy())
        self._fed = list(hit.ids) if hit is not None else []
        self._boundaries = [_Boundary(0, self._state.snapshot(), len(self._fed), ())]
        reply = Reply(
            self,
            sampler,
            ids[len(self._fed) :],
            prompt.rendered,
            start_logits=hit.logits if hit else None,
            prefix_cache=prefix_cache,
            restored=hit,
            save_at={*prompt.save_at, len(ids)},
            started=started,
            answer_start=answer_start,
        )
        yield from reply.run()
        self.messages, self._synced = [], 0  # the reply is not a turn of the session's own conversation

    def _turn(self, user_text: str, sampling: SamplingParams | None, cut: CutReply | None = None) -> Iterator:
        """The turn's events; a cancel() from now on (before the first event too) stops it."""
        if self._holds_request:  # the state holds a whole request's sequence, not this conversation
            self._forget_state()
        self._cancel.clear()
        return self._run_turn(user_text, sampling, cut)

    def continue_from(self, history: list[dict], cut_reply: dict, sampling: SamplingParams | None = None) -> Iterator:
        """Write more of `cut_reply` (role, content, reasoning_content), the reply to the user message that ends
        `history`, when the state no longer holds it (another chat ran since, a restart): the history is prefilled
        again with the reply's text after the generation prompt, then decoding goes on; the events carry the new
        text and TurnFinished the whole reply."""
        if not history or history[-1]["role"] != "user":
            raise ValueError("the history must end with the user message the cut reply answers")
        self.reset(history[:-1])
        reasoning, answer = cut_reply.get("reasoning_content") or "", cut_reply.get("content") or ""
        return self._turn(history[-1]["content"], sampling, CutReply(None, reasoning, answer, not answer))

    def _reply_prefix(self, rendered: str, cut: CutReply) -> tuple[list[int], bool]:
        """(token ids of the cut reply's text as the model wrote it after the generation prompt `rendered`,
        whether the reply is still in its thinking there). Texts are data, read without control tokens."""
        tok = self.tokenizer
        if not thinking_open(tok, rendered):  # the template closed the thinking (or has none): only the answer follows
            return tok.encode_text(cut.answer) if cut.answer else [], False
        if not cut.answer:
            return tok.encode_text(cut.thoughts), True
        return (
            tok.encode_text(cut.thoughts + "\n") + [tok.token_id(tok.think_end)] + tok.encode_text("\n\n" + cut.answer)
        ), False

    def _run_turn(self, user_text: str, sampling: SamplingParams | None, cut: CutReply | None = None) -> Iterator:
        params = sampling or self.sampling
        sampler = Sampler(replace(params, stop=tuple(params.stop)))
        user = {"role": "user", "content": user_text}

        def refused(reason: str, error: str | None = None) -> TurnFinished:
            return TurnFinished(
                "", "", TurnStats(self._state.position, 0, 0, 0.0, 0.0, 0.0, reason, sampler.seed, error)
            )

        try:
            ids, rendered = self._prompt_ids(self.messages[self._synced :] + [user])
        except Interrupted:  # Stop while the template rendered
            yield refused("cancelled")
            return
        except CheckpointError as exc:  # the model's template cannot render this conversation
            yield refused("error", str(exc))
            return
        if cut is not None:
            prefix, in_thinking = self._reply_prefix(rendered, cut)
            ids = ids + prefix
        needed = self._state.position + len(ids) + 1  # at least one reply token must fit
        if needed > self.context_tokens:
            yield refused("error", str(ContextOverflowError(needed, self.context_tokens, self.context_advice)))
            return
        self.messages.append(user)
        self._boundaries.append(
            _Boundary(len(self.messages) - 1, self._state.snapshot(), len(self._fed), self._pending)
        )
        del self._boundaries[: -self.max_snapshots]  # the oldest go: editing there prefills the history again
        hit = self._restore(ids) if not self._fed else None
        if hit is not None:
            ids = ids[len(hit.ids) :]
        reply = Reply(
            self,
            sampler,
            ids,
            rendered,
            start_logits=hit.logits if hit is not None else None,
            prefix_cache=self.state_store,
            restored=hit or self._latest,
            save_at=frozenset({len(self._fed) + len(ids)}),
        )
        if cut is not None:  # the reply goes on after its text, which the prompt now ends with
            reply.go_on_from(cut, in_thinking)
        yield from reply.run()
