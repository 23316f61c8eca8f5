"""The FP8 KV cache's error against the unquantised one, on the CPU: logits and greedy text.

    python -m tools.fp8_kv_error [--tokens 256] [--json]

Two models: the built-in demo model (a chat prompt through its own tokenizer and template), and a tiny random
checkpoint in nvidia/Qwen3.6-35B-A3B-NVFP4's real layout (engine/testing/tiny_checkpoints.py, random prompt ids).
Each is loaded twice, kv_cache_dtype "fp8" and "bf16" (on the CPU the unquantised cache holds float32, the compute
dtype). The unquantised run prefills the prompt and decodes `--tokens` greedy tokens; the FP8 run is fed the same
tokens (teacher-forced), so its logits are compared on identical inputs: max |diff| and max |diff| / max |logit|.
A free-running greedy FP8 decode then says how many of the tokens agree, and where the first one differs.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

import engine
from engine.resources import DEMO_MODEL
from engine.runtime.tokenizer import ChatTokenizer
from engine.testing.tiny_checkpoints import write_tiny_checkpoint

DEMO_PROMPT = "What is 487 + 356?"
REPLICA_PROMPT_TOKENS = 150


def greedy(model, prompt: list[int], tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens after `prompt` (a state sized for them) and the logits each was chosen from."""
    state = model.new_state(len(prompt) + tokens)
    logits = [model.forward(prompt, state)]
    out = []
    for _ in range(tokens):
        out.append(int(logits[-1].argmax()))
        if len(out) < tokens:
            logits.append(model.forward([out[-1]], state))
    return out, logits


def forced(model, prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """The logits after `prompt` and after each of `tokens` but the last, fed in that order."""
    state = model.new_state(len(prompt) + len(tokens))
    logits = [model.forward(prompt, state)]
    logits += [model.forward([t], state) for t in tokens[:-1]]
    return logits


def compare(folder: Path, prompt: list[int], tokens: int) -> dict:
    """FP8 against the unquantised KV cache on one checkpoint: logits on the same tokens, and greedy agreement."""
    fp8, plain = (engine.load_model(folder, kv_cache_dtype=kv) for kv in ("fp8", "bf16"))
    reference, reference_logits = greedy(plain, prompt, tokens)
    fp8_logits = forced(fp8, prompt, reference)
    diff = max(float((a - b).abs().max()) for a, b in zip(fp8_logits, reference_logits))
    scale = max(float(b.abs().max()) for b in reference_logits)
    free, _ = greedy(fp8, prompt, tokens)
    first = next((i for i, (a, b) in enumerate(zip(free, reference)) if a != b), None)
    eos = next((i for i, t in enumerate(reference) if t in plain.config.eos_token_id), None)
    return {
        "prompt_tokens": len(prompt),
        "decode_tokens": tokens,
        "logits_max_abs_diff": diff,
        "logits_max_rel_diff": diff / scale,
        "greedy_tokens_equal": sum(a == b for a, b in zip(free, reference)),
        "first_different_token": first,
        "reply_tokens_to_eos": eos,  # None: no end of turn in the reference's tokens
        "reply_equal_to_eos": eos is not None and free[: eos + 1] == reference[: eos + 1],
        "greedy_argmax_equal_teacher_forced": sum(
            int(a.argmax()) == int(b.argmax()) for a, b in zip(fp8_logits, reference_logits)
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256, help="greedy tokens to decode")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    tokenizer = ChatTokenizer.from_folder(DEMO_MODEL)
    demo_prompt, _ = tokenizer.encode_chat([{"role": "user", "content": DEMO_PROMPT}], add_generation_prompt=True)
    results = {"demo": compare(DEMO_MODEL, demo_prompt, args.tokens)}
    with tempfile.TemporaryDirectory() as where:
        replica = write_tiny_checkpoint(Path(where) / "tiny-nvfp4", "qwen3_5_moe", "nvfp4")
        ids = torch.randint(2, 320, (REPLICA_PROMPT_TOKENS,), generator=torch.Generator().manual_seed(5)).tolist()
        results["tiny_nvfp4_real_layout"] = compare(replica, ids, args.tokens)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for name, r in results.items():
            print(
                f"{name}: logits max |diff| {r['logits_max_abs_diff']:.4g} ({100 * r['logits_max_rel_diff']:.2f} % "
                f"of max |logit|) over {r['prompt_tokens']} prompt + {r['decode_tokens']} decoded tokens; greedy "
                f"{r['greedy_tokens_equal']}/{r['decode_tokens']} tokens equal, first different: "
                f"{r['first_different_token']}; teacher-forced argmax equal {r['greedy_argmax_equal_teacher_forced']}; "
                f"reply to its end of turn ({r['reply_tokens_to_eos']} tokens) equal: {r['reply_equal_to_eos']}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
