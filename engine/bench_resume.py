"""Time to first token when returning to a long chat: prefilled again, resumed from RAM, resumed from disk.

The chat is scripted (user messages of seeded filler words, short fixed replies) so random weights replay
it exactly. Its history is prefilled once into a session whose prefix cache has a disk tier; then the session
leaves for another chat and comes back (the RAM tier), and a new cache over the same folder (a restarted
app) resumes it again (the disk tier). A session without a cache answers the same turn after prefilling the
whole history: the baseline, and the reference the resumed replies must equal token for token.
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

from engine.runtime.events import TurnFinished
from engine.runtime.prefix_cache import PrefixCache
from engine.runtime.session import ChatSession
from engine.runtime.state_files import StateFolder
from engine.runtime.tokenizer import ChatTokenizer

WORDS = (
    "engine expert cache layer token memory prompt state reply model window card host link chunk plan route "
    "weight table queue thread batch stream graph kernel slot record vector matrix scale"
).split()
QUESTIONS = ("Sum up what we said so far in one line.", "Which part was the longest?")


def chat_history(tokenizer: ChatTokenizer, history_tokens: int, turns: int, seed: int) -> list[dict]:
    """User/assistant messages whose render is about `history_tokens` tokens, in `turns` exchanges."""
    rng = random.Random(seed)
    per_turn = max(history_tokens // turns, 8)
    history = []
    for turn in range(turns):
        words = " ".join(rng.choice(WORDS) for _ in range(per_turn * 3))
        ids = tokenizer.encode_text(words)[: per_turn - 8]
        history += [
            {"role": "user", "content": tokenizer.decode(ids)},
            {"role": "assistant", "content": f"Noted, part {turn + 1}."},
        ]
    return history


def _turn(session: ChatSession, text: str) -> TurnFinished:
    final = [e for e in session.send(text) if isinstance(e, TurnFinished)][-1]
    if final.stats.error is not None:
        raise RuntimeError(final.stats.error)
    return final


def _with(history: list[dict], question: str, reply: TurnFinished) -> list[dict]:
    return history + [
        {"role": "user", "content": question},
        {"role": "assistant", "content": reply.answer, "reasoning_content": reply.reasoning},
    ]


def _cold(session: ChatSession, history: list[dict], question: str) -> TurnFinished:
    """The turn after `history` with no store: the whole prompt prefilled."""
    store, session.state_store = session.state_store, None
    try:
        session.reset(history)
        return _turn(session, question)
    finally:
        session.state_store = store


def run_resume_bench(session: ChatSession, history: list[dict], ram_bytes: int) -> dict:
    """Return to a chat after another one ran (RAM) and after a restart (disk, a new cache over the same folder);
    each turn's time to first token and prefill against the same turn prefilled afresh, and whether the replies
    agree. One session runs it all: its state is the plan's one KV cache."""
    with tempfile.TemporaryDirectory() as scratch:
        folder, disk_bytes = Path(scratch), 64 * 2**30
        store = session.state_store = PrefixCache(ram_bytes, StateFolder(folder, "bench-resume", disk_bytes))
        session.reset(history)
        history = _with(history, "Let us go on.", _turn(session, "Let us go on."))
        session.reset()
        _turn(session, "Hello, another chat.")  # the state now holds another conversation
        session.reset(history)
        ram = _turn(session, QUESTIONS[0])
        ram_history = history
        history = _with(history, QUESTIONS[0], ram)
        store.flush()
        store.spill.close()

        session.state_store = PrefixCache(ram_bytes, StateFolder(folder, "bench-resume", disk_bytes))
        session.reset(history)
        disk = _turn(session, QUESTIONS[1])
        session.state_store.spill.close()
        runs = {
            "resume from RAM": (ram, _cold(session, ram_history, QUESTIONS[0])),
            "resume from disk": (disk, _cold(session, history, QUESTIONS[1])),
        }
        session.state_store = None
    return {
        "rows": {
            name: {
                "prompt_tokens": warm.stats.prompt_tokens,
                "prefilled_tokens": warm.stats.prefill_tokens,
                "time_to_first_token_s": warm.stats.time_to_first_token_s,
                "re_prefill_time_to_first_token_s": cold.stats.time_to_first_token_s,
                "same_reply_as_re_prefill": (warm.answer, warm.reasoning) == (cold.answer, cold.reasoning),
            }
            for name, (warm, cold) in runs.items()
        },
    }


def format_table(result: dict) -> str:
    """The bench's figures as a short text table."""
    lines = [f"{'next turn':18} {'prompt':>8} {'prefilled':>10} {'TTFT s':>8} {'re-prefill s':>13}  same reply"]
    for name, row in result["rows"].items():
        lines.append(
            f"{name:18} {row['prompt_tokens']:>8,} {row['prefilled_tokens']:>10,} "
            f"{row['time_to_first_token_s']:>8.3f} {row['re_prefill_time_to_first_token_s']:>13.3f}  "
            f"{'yes' if row['same_reply_as_re_prefill'] else 'NO'}"
        )
    return "\n".join(lines)
