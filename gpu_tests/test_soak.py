"""A long chat on the full-size real-layout model at the 4 GB preset stays inside the plan (issue 20): turn
snapshots live in host RAM, so a hundred turns take no more of the card than one."""

import gc
import gzip
import shutil
from pathlib import Path

import torch

from engine.bench import build_random_model, plan_for
from engine.runtime.reserve import runtime_reserve
from engine.runtime.sampling import SamplingParams
from engine.runtime.session import ChatSession
from engine.runtime.tokenizer import ChatTokenizer
from engine.runtime.vram import cap_process_memory, measured_peak

TOKENIZER = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "real-tokenizers" / "qwen3.6"
TURNS = 100
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)


def real_tokenizer(folder: Path) -> ChatTokenizer:
    for path in TOKENIZER.iterdir():
        if path.name == "tokenizer.json.gz":
            with gzip.open(path, "rb") as packed, open(folder / "tokenizer.json", "wb") as plain:
                shutil.copyfileobj(packed, plain)
        elif path.suffix in (".json", ".jinja") and path.name != "golden-encodings.json":
            shutil.copyfile(path, folder / path.name)
    return ChatTokenizer.from_folder(folder)


def test_a_hundred_turns_at_4gb_stay_within_the_budget_and_match_a_fresh_session(tmp_path):
    reserve = runtime_reserve()
    plan = plan_for("qwen3.6-35b-a3b-nvfp4", "4gb", None, reserve.reserve_bytes)
    cap_process_memory(plan.budget_bytes)
    model = build_random_model("qwen3.6-35b-a3b-nvfp4", "cuda", torch.bfloat16, plan.expert_slots)
    tokenizer = real_tokenizer(tmp_path)

    def session():
        return ChatSession(
            model,
            tokenizer,
            context_tokens=plan.kv_tokens,
            sampling=GREEDY,
            prefill_chunk_tokens=plan.prefill_chunk_tokens,
        )

    long_chat, replies, peaks = session(), [], []
    torch.cuda.reset_peak_memory_stats()
    for turn in range(TURNS):
        replies.append(list(long_chat.send(f"Turn {turn}: tell me about the number {turn * 7}."))[-1].answer)
        if turn % 10 == 9:  # a regenerate restores the host snapshot and answers the same
            assert list(long_chat.regenerate())[-1].answer == replies[-1]
        peaks.append(measured_peak()["peak_process_bytes"])
    print(
        f"\nsoak: {TURNS} turns; "
        f"peak {max(peaks) / 2**30:.3f} GiB of {plan.budget_bytes / 2**30:.2f}; "
        f"turns 10-{TURNS}: {(peaks[-1] - peaks[9]) / 2**20:+.1f} MiB"
    )
    assert max(peaks) <= plan.budget_bytes, [p / 2**30 for p in peaks]
    assert peaks[-1] - peaks[9] < 64 * 2**20  # no growth with the turns
    del long_chat  # its KV cache makes room for the fresh session's
    gc.collect()
    torch.cuda.empty_cache()
    fresh = session()
    for turn in range(TURNS):
        assert list(fresh.send(f"Turn {turn}: tell me about the number {turn * 7}."))[-1].answer == replies[turn]
