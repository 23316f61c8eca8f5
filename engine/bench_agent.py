"""`python -m engine bench-agent`: an agent's session replayed request by request through the path the server
takes (chat template -> token ids -> the prefix cache's longest prefix -> restore -> prefill the rest ->
a few generated tokens -> the state stored at the message boundaries), with what each request prefilled.

The session is scripted, the same on every run for one tokenizer: a system prompt and a read_file tool, then
after every reply (a short thought and a read_file call) the file's contents as the tool's result (a few
hundred to a couple of thousand tokens, sized so the prompt reaches the target), and a new user question
every fifth request. Replies are the script's, not the model's, so a model with random weights replays the
same conversation: what is measured is what the engine reuses and what it prefills.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.runtime.events import TurnFinished
from engine.runtime.prefix_cache import PrefixCache
from engine.runtime.sampling import SamplingParams
from engine.runtime.session import ChatSession
from engine.runtime.prompt import chat_prompt
from engine.runtime.tokenizer import ChatTokenizer

READ_FILE = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file of the repository and return its contents.",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string", "description": "relative path"}},
            "required": ["path"],
        },
    },
}
SYSTEM_PROMPT = (
    "You are a coding agent working in a Python repository. Read the files you need with read_file "
    "before you answer, and answer with the file and line you mean."
)
QUESTIONS = [
    "Why does the order service retry a payment twice when the gateway times out?",
    "Where is the retry limit configured, and what reads it?",
    "Could the cache layer serve a stale order after a refund? Show me the path.",
    "Which of these modules would a change to the invoice format touch?",
]
RESULT_WEIGHTS = (0.35, 1.6)  # a tool result's size, as a share of the mean the target leaves per result
MIN_RESULT_TOKENS = 200
_NOUNS = [
    "order",
    "payment",
    "invoice",
    "customer",
    "gateway",
    "refund",
    "ledger",
    "cache",
    "session",
    "retry",
    "account",
    "batch",
    "queue",
    "record",
    "receipt",
    "limit",
    "token",
    "report",
    "event",
    "store",
]
_VERBS = ["load", "apply", "check", "build", "send", "parse", "merge", "update", "resolve", "fetch"]


@dataclass(frozen=True)
class AgentScript:
    """A whole agent session: its messages, and how many of them each request sends."""

    messages: list[dict]
    request_messages: list[int]  # request i sends messages[:request_messages[i]]
    tools: list[dict]
    last_prompt_tokens: int  # the last request's prompt, rendered

    def request(self, index: int) -> list[dict]:
        return self.messages[: self.request_messages[index]]


def file_contents(rng: random.Random, tokenizer: ChatTokenizer, tokens: int) -> str:
    """Python-like source, function after function, of about `tokens` tokens (counted line by line)."""
    lines, count = [], 0
    while count < tokens:
        verb, noun, other, third = rng.choice(_VERBS), rng.choice(_NOUNS), rng.choice(_NOUNS), rng.choice(_NOUNS)
        number = rng.randint(2, 900)
        block = [
            f"def {verb}_{noun}(self, {other}_id: int, {third}: dict | None = None) -> float:",
            f'    """{verb.capitalize()} the {noun} of one {other}, with the {third} settings if given."""',
            f"    {noun} = self.{other}s.get({other}_id)",
            f"    if {noun} is None:",
            f'        raise LookupError(f"no {noun} for {other} {{{other}_id}}")',
            f"    total = sum(item.amount for item in {noun}.items if item.{third}_id != {number})",
            f'    return total * ({third} or {{}}).get("rate", {rng.randint(1, 99) / 100})',
            "",
        ]
        for line in block:
            lines.append(line)
            count += len(tokenizer.encode(line)) + 1
    return "\n".join(lines)


def agent_script(
    tokenizer: ChatTokenizer, requests: int = 20, target_tokens: int = 30_000, seed: int = 0
) -> AgentScript:
    """The scripted session of `requests` requests whose last prompt reaches about `target_tokens` tokens
    (tool results grow it; each is sized from what the rendered prompt holds so far)."""
    if requests < 2:
        raise ValueError(f"an agent session needs 2 requests or more (a tool result between them), not {requests}")
    rng = random.Random(seed)
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": QUESTIONS[0]}]
    counts, overhead, before = [], 0, None  # overhead: what a request adds besides its tool result, last seen
    for request in range(requests):
        counts.append(len(messages))
        if request == requests - 1:
            break
        prompt_tokens = len(chat_prompt(tokenizer, messages, tools=[READ_FILE]).ids)
        if before is not None:
            overhead = max(prompt_tokens - before, 0)
        results_left = requests - 1 - request
        mean = max(target_tokens - prompt_tokens - overhead * results_left, 0) / results_left
        size = max(int(mean if results_left == 1 else mean * rng.uniform(*RESULT_WEIGHTS)), MIN_RESULT_TOKENS)
        path = f"src/{rng.choice(_NOUNS)}/{rng.choice(_VERBS)}_{rng.choice(_NOUNS)}.py"
        call_id = f"call_{request + 1}"
        messages.append(
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": f"I need to see {path} before I can say more.",
                "tool_calls": [
                    {"type": "function", "id": call_id, "function": {"name": "read_file", "arguments": {"path": path}}}
                ],
            }
        )
        contents = file_contents(rng, tokenizer, size)
        messages.append({"role": "tool", "tool_call_id": call_id, "content": contents})
        before = prompt_tokens + len(tokenizer.encode(contents))
        if request % 5 == 4:
            messages.append({"role": "user", "content": QUESTIONS[(request // 5 + 1) % len(QUESTIONS)]})
    last = len(chat_prompt(tokenizer, messages[: counts[-1]], tools=[READ_FILE]).ids)
    return AgentScript(messages, counts, [READ_FILE], last)


def replay(
    session: ChatSession,
    script: AgentScript,
    cache: PrefixCache | None,
    decode_tokens: int,
    clock: Callable[[], float] = time.perf_counter,
    progress: Callable[[dict], None] | None = None,
) -> dict:
    """Send the script's requests one after another as the server does; a row per request (prompt, cached,
    prefilled and new tokens, render time and time to first token) and the totals. `new_tokens`: the prompt
    past its longest common prefix with the request before, what an ideal cache would prefill."""
    sampling = SamplingParams(temperature=0.0, max_new_tokens=decode_tokens)
    rows, previous = [], []
    for index in range(len(script.request_messages)):
        began = clock()
        prompt = chat_prompt(session.tokenizer, script.request(index), tools=script.tools)
        rendered = clock()
        finals = [
            e for e in session.complete(prompt, sampling=sampling, prefix_cache=cache) if isinstance(e, TurnFinished)
        ]
        stats = finals[-1].stats
        shared = next(
            (i for i, (a, b) in enumerate(zip(prompt.ids, previous)) if a != b), min(len(prompt.ids), len(previous))
        )
        row = {
            "request": index + 1,
            "messages": script.request_messages[index],
            "prompt_tokens": len(prompt.ids),
            "cached_tokens": stats.cached_tokens,
            "prefilled_tokens": stats.prefill_tokens,
            "new_tokens": len(prompt.ids) - shared,
            "generated_tokens": stats.new_tokens,
            "render_s": rendered - began,
            "time_to_first_token_s": stats.time_to_first_token_s,
            "cache_entries": len(cache) if cache is not None else 0,
            "cache_bytes": cache.nbytes if cache is not None else 0,
        }
        if stats.error is not None:
            row["error"] = stats.error
        rows.append(row)
        if progress is not None:
            progress(row)
        previous = prompt.ids
    totals = {
        key: sum(row[key] for row in rows)
        for key in ("prompt_tokens", "cached_tokens", "prefilled_tokens", "new_tokens", "time_to_first_token_s")
    }
    return {
        "requests": rows,
        "totals": totals,
        "last_prompt_tokens": rows[-1]["prompt_tokens"],
        "errors": sum("error" in row for row in rows),
    }


def run_agent_bench(session: ChatSession, script: AgentScript, cache_bytes: int, decode_tokens: int) -> dict:
    """A short untimed request first (it compiles or loads the kernels), then the replay against an empty
    prefix cache of `cache_bytes`."""
    warm = chat_prompt(session.tokenizer, [{"role": "user", "content": "hello"}])
    for _ in session.complete(warm, sampling=SamplingParams(temperature=0.0, max_new_tokens=2)):
        pass
    cache = PrefixCache(cache_bytes) if cache_bytes else None
    result = replay(
        session,
        script,
        cache,
        decode_tokens,
        progress=lambda row: print(f"bench-agent: {row}", file=sys.stderr, flush=True),
    )
    result.update(
        prefix_cache_max_bytes=cache_bytes,
        decode_tokens=decode_tokens,
        prefill_chunk_tokens=session.prefill_chunk_tokens,
        context_tokens=session.context_tokens,
    )
    return result


def format_table(result: dict) -> str:
    """The per-request table and the totals."""
    lines = [f"{'request':>7} {'prompt':>7} {'cached':>7} {'prefilled':>9} {'new':>6} {'TTFT s':>8} {'cache MiB':>9}"]
    for row in result["requests"]:
        lines.append(
            f"{row['request']:>7} {row['prompt_tokens']:>7,} {row['cached_tokens']:>7,} "
            f"{row['prefilled_tokens']:>9,} {row['new_tokens']:>6,} {row['time_to_first_token_s']:>8.2f} "
            f"{row['cache_bytes'] / 2**20:>9.0f}" + (f"  error: {row['error']}" if "error" in row else "")
        )
    t = result["totals"]
    share = t["prefilled_tokens"] / t["prompt_tokens"] if t["prompt_tokens"] else 0.0
    lines.append(
        f"{'total':>7} {t['prompt_tokens']:>7,} {t['cached_tokens']:>7,} {t['prefilled_tokens']:>9,} "
        f"{t['new_tokens']:>6,} {t['time_to_first_token_s']:>8.2f}"
    )
    lines.append(
        f"{len(result['requests'])} requests, the last prompt {result['last_prompt_tokens']:,} tokens: "
        f"{t['prefilled_tokens']:,} of {t['prompt_tokens']:,} prompt tokens prefilled ({share:.1%}); "
        f"new: past the longest common prefix with the request before"
    )
    for note in result.get("notes", []):
        lines.append(f"note: {note}")
    return "\n".join(lines)
