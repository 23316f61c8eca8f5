"""Train MoE Desk's built-in demo model and write it as a Qwen3.6-style checkpoint folder.

    python tools/train_demo.py --out DIR [--minutes M | --steps N] [--device cuda|cpu] [--seed 0] [--tiny]

A smoke run on a CPU (under a minute): --tiny --steps 3 --device cpu --batch-size 4 --workers 0 --no-eval
--vocab-size 400 --tokenizer-conversations 1000.

1. Trains a byte-level BPE tokenizer (Qwen3.5's pre-tokenisation: every digit is its own token; the chat and
   tool markup as single added tokens) on generated conversations (tools/demo_data.py) and writes
   tokenizer.json, tokenizer_config.json, chat_template.jinja.
2. Builds a tiny `transformers.Qwen3_5MoeForCausalLM` (Gated DeltaNet and gated-attention layers, routed
   experts plus a shared expert) and trains it with AdamW and a cosine schedule (bf16 autocast on CUDA) on
   a stream of synthetic conversations, for --steps steps or a --minutes budget.
3. Measures greedy accuracy on "What is A + B?" / "What is A - B?" (thinking on) for random problems of the
   training side and for problems held out of training, in the fifth turn of 5-turn chats (the model's own
   replies as history, rendered as the app does), and on multiply-tool round trips (the call parses, its
   arguments are right, the answer after the tool's result is the product), with transformers' generate, on
   the weights rounded to bf16 exactly as they are saved.
4. Writes the checkpoint in the layout of the Qwen3.6 release: the qwen3_5_moe vision-language config with
   the text model under text_config, bf16 safetensors shards (at most 15 MB each) with the language model
   under model.language_model. and the routed experts fused per layer, generation_config.json, a README.md
   model card and train_log.json with the measured numbers.

Runs with transformers >= 5.17; of this repository's engine it uses only ChatTokenizer, which renders every
conversation through the chat template exactly as the app and the server do.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # hub kernels cannot be fetched; the torch fallbacks are used
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the data workers fork

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tools import demo_data as D  # noqa: E402

SHARD_LIMIT_BYTES = 15_000_000
IGNORE = -100


# --------------------------------------------------------------------------------------------------------
# Tokenizer files
# --------------------------------------------------------------------------------------------------------


def train_tokenizer(seed: int, vocab_size: int, conversations: int = 20000):
    return D.build_tokenizer(D.tokenizer_corpus(seed, conversations), vocab_size)


def write_tokenizer(tokenizer, folder: Path) -> dict[str, int]:
    """tokenizer.json, tokenizer_config.json and chat_template.jinja, as Qwen ships them; returns special ids."""
    data = json.loads(tokenizer.to_str())
    for token in data["added_tokens"]:  # Qwen marks the thinking and tool tags as ordinary added tokens
        if token["content"] in D.NOT_SPECIAL_TOKENS:
            token["special"] = False
    (folder / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False, indent=2), encoding="utf-8")
    ids = {token: tokenizer.token_to_id(token) for token in D.SPECIAL_TOKENS}
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "added_tokens_decoder": {
            str(ids[token]): {
                "content": token,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": token not in D.NOT_SPECIAL_TOKENS,
            }
            for token in D.SPECIAL_TOKENS
        },
        "chat_template": D.CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2), encoding="utf-8")
    (folder / "chat_template.jinja").write_text(D.CHAT_TEMPLATE, encoding="utf-8")
    return ids


# --------------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------------


def text_config(vocab_size: int, ids: dict[str, int], tiny: bool = False) -> dict:
    """The text model's settings, as they go into config.json's text_config."""
    if tiny:  # for smoke tests on a CPU
        shape = dict(
            hidden_size=64,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            num_experts=4,
            num_experts_per_tok=2,
            mrope_section=[1, 1, 2],
        )
    else:
        shape = dict(
            hidden_size=256,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            layer_types=["linear_attention", "full_attention"] * 4,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            moe_intermediate_size=128,
            shared_expert_intermediate_size=256,
            num_experts=8,
            num_experts_per_tok=2,
            mrope_section=[3, 3, 2],
        )
    mrope_section = shape.pop("mrope_section")
    return dict(
        model_type="qwen3_5_moe_text",
        vocab_size=vocab_size,
        **shape,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        attention_bias=False,
        attention_dropout=0.0,
        linear_conv_kernel_dim=4,
        # A short-context model: a smaller base than the release's 1e7 gives the 16 rotary dimensions
        # frequencies that resolve positions within a few hundred tokens.
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": mrope_section,
            "mrope_interleaved": True,
        },
        initializer_range=0.02,
        output_router_logits=False,
        router_aux_loss_coef=0.001,
        use_cache=True,
        bos_token_id=None,
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )


def build_model(config: dict):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    settings = {k: v for k, v in config.items() if k != "model_type"}
    return Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**settings))


def checkpoint_config(text: dict) -> dict:
    """config.json of the Qwen3.6 release: the vision-language wrapper, a minimal vision tower (the checkpoint
    holds no vision weights; the demo model reads text only)."""
    vision = dict(
        model_type="qwen3_5_moe_vision",
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        in_channels=3,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=text["hidden_size"],
        num_position_embeddings=64,
        hidden_act="gelu_pytorch_tanh",
        initializer_range=0.02,
        deepstack_visual_indexes=[],
    )
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "dtype": "bfloat16",
        "tie_word_embeddings": False,
        "text_config": dict(text, dtype="bfloat16"),
        "vision_config": vision,
    }


def count_parameters(model) -> dict[str, int]:
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    per_token_experts = experts * model.config.num_experts_per_tok // model.config.num_experts
    return {"total": total, "routed_experts": experts, "active_per_token": total - experts + per_token_experts}


# --------------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------------


class ChunkDataset(torch.utils.data.Dataset):
    """Item c is a list of `batches_per_chunk` (input_ids, labels) batches built from conversations seeded by
    (seed, c): batches of similar lengths (sorted within the chunk, then shuffled), padded to their longest."""

    def __init__(
        self, tokenizer_json: str, seed: int, batch_size: int, batches_per_chunk: int, pad_id: int, chunks: int = 10**9
    ):
        self.tokenizer_json, self.seed, self.batch_size = tokenizer_json, seed, batch_size
        self.batches_per_chunk, self.pad_id, self.chunks = batches_per_chunk, pad_id, chunks
        self._tokenizer = None

    def __len__(self):
        return self.chunks

    def tokenizer(self):
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_str(self.tokenizer_json)
        return self._tokenizer

    def __getitem__(self, chunk: int):
        rng = random.Random(self.seed * 1_000_003 + chunk)
        n = self.batch_size * self.batches_per_chunk
        segments = [D.training_segments(D.conversation(rng)) for _ in range(n)]
        flat = [text for conv in segments for text, _ in conv]
        encoded = iter(self.tokenizer().encode_batch(flat, add_special_tokens=False))
        samples = []
        for conv in segments:
            ids, labels = [], []
            for _, target in conv:
                piece = next(encoded).ids
                ids += piece
                labels += piece if target else [IGNORE] * len(piece)
            samples.append((ids, labels))
        samples.sort(key=lambda s: len(s[0]))
        batches = []
        for i in range(0, n, self.batch_size):
            group = samples[i : i + self.batch_size]
            length = -(-max(len(ids) for ids, _ in group) // 8) * 8
            input_ids = torch.full((len(group), length), self.pad_id, dtype=torch.long)
            labels = torch.full((len(group), length), IGNORE, dtype=torch.long)
            for row, (ids, lab) in enumerate(group):
                input_ids[row, : len(ids)] = torch.tensor(ids)
                labels[row, : len(lab)] = torch.tensor(lab)
            batches.append((input_ids, labels))
        rng.shuffle(batches)
        return batches


def batch_stream(dataset: ChunkDataset, workers: int):
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=None,
        shuffle=False,
        num_workers=workers,
        prefetch_factor=4 if workers else None,
        persistent_workers=workers > 0,
    )
    for chunk in loader:
        yield from chunk


# --------------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------------


def learning_rate(step: int, total: int, peak: float, warmup: int, floor: float = 0.05) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model, lr: float, weight_decay: float):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in name or name.endswith(("A_log", "dt_bias")) else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kwargs = {"fused": True} if next(model.parameters()).is_cuda else {}
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98), eps=1e-8, **kwargs)


def train(model, dataset: ChunkDataset, args, device: torch.device, log) -> dict:
    model.train()
    optimizer = make_optimizer(model, args.lr, args.weight_decay)
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    )
    budget = args.minutes * 60 if args.minutes else None
    total = args.steps or 10**9  # fixed after calibration when only a time budget is given
    # the step time is measured over steps [calibrate_from, calibrate_at), after start-up and first-batch costs
    calibrate_from, calibrate_at = 30, max(args.warmup, 80)
    stream = batch_stream(dataset, args.workers)
    losses, history = [], []
    start = time.perf_counter()
    calibration_start = None
    step = 0
    while step < total:
        input_ids, labels = next(stream)
        input_ids, labels = input_ids.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        lr = learning_rate(step, total if args.steps or step >= calibrate_at else 10**9, args.lr, args.warmup)
        for group in optimizer.param_groups:
            group["lr"] = lr
        with autocast:
            out = model(input_ids=input_ids, use_cache=False, output_router_logits=True)
        logits = out.logits[:, :-1].float()
        targets = labels[:, 1:]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE
        )
        aux = out.aux_loss if out.aux_loss is not None else 0.0
        (loss + model.config.router_aux_loss_coef * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        step += 1
        if budget and not args.steps and step == calibrate_from:
            if device.type == "cuda":
                torch.cuda.synchronize()
            calibration_start = (time.perf_counter(), step)
        if budget and not args.steps and step == calibrate_at:
            if device.type == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            t0, s0 = calibration_start
            per_step = (now - t0) / (step - s0)
            total = step + max(1, int((budget - (now - start)) / per_step * 0.97))
            log(
                f"calibrated: {per_step * 1000:.1f} ms/step, training for {total} steps in {args.minutes} min "
                f"(reproduce the schedule with --steps {total})"
            )
        if step % args.log_every == 0 or step == total:
            mean = float(torch.stack(losses).mean())
            losses.clear()
            elapsed = time.perf_counter() - start
            history.append({"step": step, "loss": round(mean, 5), "lr": lr, "seconds": round(elapsed, 1)})
            log(f"step {step}/{total if total < 10**9 else '?'}  loss {mean:.4f}  lr {lr:.2e}  {elapsed:.0f} s")
        if budget and time.perf_counter() - start > budget * 1.08:
            log("time budget exhausted before the planned steps; stopping")
            break
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    final = history[-1]["loss"] if history else float("nan")
    if losses:
        final = float(torch.stack(losses).mean())
    return {
        "steps": step,
        "planned_steps": total,
        "seconds": round(seconds, 1),
        "final_loss": round(final, 5),
        "history": history,
    }


def round_to_bf16(model) -> None:
    """Make the weights exactly what the bf16 checkpoint will hold, so the evaluation measures the release."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(p.dtype))


# --------------------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------------------


@torch.no_grad()
def generate_replies(
    model,
    tokenizer,
    prompts: list[str],
    eos_ids: list[int],
    pad_id: int,
    max_new_tokens: int,
    batch_size: int = 256,
    sampling: dict | None = None,
    left_pad: bool = False,
) -> list[str]:
    """Replies with transformers' generate, greedy unless `sampling` gives do_sample settings. Prompts are
    batched only with prompts of the same token length, so no padding is involved; with left_pad, prompts
    of similar lengths are batched, padded on the left and masked (long chats rarely share a length)."""
    decoding = dict(sampling) if sampling else {"do_sample": False}
    model.eval()
    device = next(model.parameters()).device
    encoded = [tokenizer.encode(p, add_special_tokens=False).ids for p in prompts]
    if left_pad:
        order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
        groups = [order[j : j + batch_size] for j in range(0, len(order), batch_size)]
    else:
        by_length: dict[int, list[int]] = {}
        for i, ids in enumerate(encoded):
            by_length.setdefault(len(ids), []).append(i)
        groups = [
            indices[j : j + batch_size] for indices in by_length.values() for j in range(0, len(indices), batch_size)
        ]
    replies = [""] * len(prompts)
    for part in groups:
        width = max(len(encoded[i]) for i in part)
        input_ids = torch.full((len(part), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, i in enumerate(part):
            input_ids[row, width - len(encoded[i]) :] = torch.tensor(encoded[i])
            attention_mask[row, width - len(encoded[i]) :] = 1
        out = model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            max_new_tokens=max_new_tokens,
            eos_token_id=eos_ids,
            pad_token_id=pad_id,
            **decoding,
        )
        for row, i in enumerate(part):
            new = out[row, width:].tolist()
            cut = next((k for k, t in enumerate(new) if t in eos_ids), len(new))
            replies[i] = tokenizer.decode(new[:cut], skip_special_tokens=False)
    return replies


def arithmetic_accuracy(model, tokenizer, problems, eos_ids, pad_id, thinking: bool = True, sampling=None, tools=None):
    prompts = [D.prompt_text(f"What is {a} {op} {b}?", enable_thinking=thinking, tools=tools) for a, b, op in problems]
    replies = generate_replies(
        model, tokenizer, prompts, eos_ids, pad_id, max_new_tokens=240 if thinking else 24, sampling=sampling
    )
    right = [D.is_correct(r, *p) for r, p in zip(replies, problems)]
    wrong = [
        {"problem": f"{a} {op} {b}", "reply": r[-200:]} for (a, b, op), r, ok in zip(problems, replies, right) if not ok
    ]
    return sum(right) / max(1, len(right)), wrong


def chat_replies(
    model, tokenizer, chats: list[list[tuple[int, int, str]]], eos_ids, pad_id
) -> tuple[list[list[bool]], list[list[dict]]]:
    """Greedy replies, thinking on, to chats that ask "What is A op B?" once per turn, each generated after the
    model's own earlier replies rendered as the app's session keeps them (reasoning included,
    preserve_thinking); per chat, whether each turn's answer is right, and the messages."""
    chat = D.renderer()
    histories: list[list[dict]] = [[] for _ in chats]
    right: list[list[bool]] = [[] for _ in chats]
    for turn in range(len(chats[0])):
        for history, problems in zip(histories, chats):
            a, b, op = problems[turn]
            history.append({"role": "user", "content": f"What is {a} {op} {b}?"})
        prompts = [
            chat.render(h, add_generation_prompt=True, enable_thinking=True, preserve_thinking=True) for h in histories
        ]
        replies = generate_replies(model, tokenizer, prompts, eos_ids, pad_id, max_new_tokens=240, left_pad=True)
        for history, problems, reply, marks in zip(histories, chats, replies, right):
            marks.append(D.is_correct(reply, *problems[turn]))
            reasoning, answer = D.split_reply(reply)
            history.append({"role": "assistant", "content": answer, "reasoning_content": reasoning})
    return right, histories


def tool_accuracy(model, tokenizer, problems: list[tuple[int, int]], eos_ids, pad_id, thinking: bool = True) -> dict:
    """Greedy multiply-tool round trips for "What is A * B?" with demo_data.MULTIPLY_TOOL offered: the first
    reply must be one call of multiply in the template's format (parsed) with a = A and b = B (arguments
    right); the tool then runs on the arguments the model wrote, and the reply after its result must end in
    A * B (answer right)."""
    chat, tools = D.renderer(), [D.MULTIPLY_TOOL]
    options = dict(enable_thinking=thinking, tools=tools)
    users = [{"role": "user", "content": f"What is {a} * {b}?"} for a, b in problems]
    calls = generate_replies(
        model,
        tokenizer,
        [chat.render([u], **options) for u in users],
        eos_ids,
        pad_id,
        max_new_tokens=160,
        left_pad=True,
    )
    parsed, arguments_right, followed = [False] * len(problems), [False] * len(problems), []
    follow_prompts = []
    for k, ((a, b), user, reply) in enumerate(zip(problems, users, calls)):
        reasoning, answer = D.split_reply(reply)
        read = D.parse_tool_calls(answer)
        if read is None or len(read[1]) != 1 or read[1][0]["name"] != "multiply":
            continue
        parsed[k] = True
        arguments = read[1][0]["arguments"]
        arguments_right[k] = arguments == {"a": a, "b": b}
        if set(arguments) != {"a", "b"} or not all(type(v) is int for v in arguments.values()):
            continue  # a calculator could not run this call
        message = {
            "role": "assistant",
            "content": read[0],
            "tool_calls": [{"type": "function", "function": {"name": "multiply", "arguments": arguments}}],
        }
        if reasoning:
            message["reasoning_content"] = reasoning
        result = {"role": "tool", "content": str(arguments["a"] * arguments["b"])}
        follow_prompts.append(chat.render([user, message, result], **options))
        followed.append(k)
    finals = generate_replies(model, tokenizer, follow_prompts, eos_ids, pad_id, max_new_tokens=80, left_pad=True)
    answer_right = [False] * len(problems)
    for k, reply in zip(followed, finals):
        a, b = problems[k]
        answer_right[k] = D.split_reply(reply)[1] == D.product_answer(a, b)
    n = max(1, len(problems))
    round_trip = [p and r and f for p, r, f in zip(parsed, arguments_right, answer_right)]
    wrong = [
        {"problem": f"{a} * {b}", "call": c[-200:]} for (a, b), c, ok in zip(problems, calls, round_trip) if not ok
    ]
    return {
        "parsed": sum(parsed) / n,
        "arguments_right": sum(arguments_right) / n,
        "answer_right": sum(answer_right) / n,
        "round_trip": sum(round_trip) / n,
        "pairs": len(problems),
        "wrong": wrong[:20],
        "example": {"call": calls[0], "answer": finals[0] if finals else None},
    }


CHAT_TURNS = 5
# The chat of the field report: the demo model got 345 + 678 wrong in its fifth turn and right in a fresh chat
FIFTH_TURN_PROBE = [(457, 386, "+"), (902, 18, "-"), (64, 35, "+"), (500, 123, "-"), (345, 678, "+")]
APP_SAMPLING = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}  # generation_config.json's
CHAT_PROBES = [
    ("Hello!", True),
    ("Who are you?", True),
    ("What can you do?", True),
    ("Thanks!", True),
    ("What is the capital of France?", True),
    ("How are you?", False),
    ("What is 457 + 386?", True),
    ("What is 386 - 457?", True),
    ("What is 12 + 7?", False),
    ("What is 23 times 47?", True),
]


def evaluate(model, tokenizer, ids: dict[str, int], args, log) -> dict:
    eos_ids, pad_id = [ids["<|im_end|>"], ids["<|endoftext|>"]], ids["<|endoftext|>"]
    rng = random.Random(args.seed + 12345)
    seen = D.sample_problems(rng, args.eval_pairs, held_out=False)
    held = D.sample_problems(rng, args.eval_pairs, held_out=True)
    small = D.sample_problems(rng, max(10, args.eval_pairs // 4), held_out=False, max_value=99)
    start = time.perf_counter()
    seen_rate, seen_wrong = arithmetic_accuracy(model, tokenizer, seen, eos_ids, pad_id)
    held_rate, held_wrong = arithmetic_accuracy(model, tokenizer, held, eos_ids, pad_id)
    small_rate, _ = arithmetic_accuracy(model, tokenizer, small, eos_ids, pad_id, thinking=False)
    log(
        f"greedy accuracy, thinking on, 0-999: {seen_rate:.1%} on {len(seen)} training-side problems, "
        f"{held_rate:.1%} on {len(held)} held-out problems; thinking off, 0-99: {small_rate:.1%} on {len(small)}"
    )
    torch.manual_seed(args.seed)
    sampled = seen[: max(10, len(seen) // 2)]
    sampled_rate, _ = arithmetic_accuracy(model, tokenizer, sampled, eos_ids, pad_id, sampling=APP_SAMPLING)
    log(
        f"sampled accuracy (the app's defaults: {APP_SAMPLING}), thinking on, 0-999: {sampled_rate:.1%} on "
        f"{len(sampled)} training-side problems"
    )
    for item in (seen_wrong + held_wrong)[:5]:
        log(f"  wrong: {item['problem']}: {item['reply']!r}")
    chat_problems = D.sample_problems(rng, CHAT_TURNS * max(4, args.eval_pairs // 4), held_out=False)
    chats = [chat_problems[i : i + CHAT_TURNS] for i in range(0, len(chat_problems), CHAT_TURNS)]
    marks, histories = chat_replies(model, tokenizer, [FIFTH_TURN_PROBE] + chats, eos_ids, pad_id)
    probe_reply, marks, histories = histories[0][-1], marks[1:], histories[1:]  # the probe is not scored
    per_turn = [sum(m[t] for m in marks) / len(marks) for t in range(CHAT_TURNS)]
    all_turns = sum(all(m) for m in marks) / len(marks)
    chat_wrong = [
        {"problem": f"{a} {op} {b}", "reply": h[-1]["content"]}
        for (a, b, op), h, m in zip((c[-1] for c in chats), histories, marks)
        if not m[-1]
    ]
    log(
        f"{CHAT_TURNS}-turn chats, greedy, thinking on: per turn {', '.join(f'{r:.1%}' for r in per_turn)}; "
        f"every turn right in {all_turns:.1%} of {len(chats)} chats"
    )
    log(f"  fifth turn of the field report's chat, 345 + 678 -> {probe_reply['content']!r}")
    tool_rng = random.Random(args.seed + 54321)
    tool_pairs = [
        (tool_rng.randint(0, D.MAX_OPERAND), tool_rng.randint(0, D.MAX_OPERAND))
        for _ in range(max(4, args.eval_pairs // 2))
    ]
    tool = tool_accuracy(model, tokenizer, tool_pairs, eos_ids, pad_id)
    tool_no_think = tool_accuracy(
        model, tokenizer, tool_pairs[: max(4, len(tool_pairs) // 2)], eos_ids, pad_id, thinking=False
    )
    for label, figures in (("thinking on", tool), ("thinking off", tool_no_think)):
        log(
            f"multiply tool, greedy, {label}: call parsed {figures['parsed']:.1%}, arguments right "
            f"{figures['arguments_right']:.1%}, answer from the result right {figures['answer_right']:.1%}, "
            f"whole round trip {figures['round_trip']:.1%} of {figures['pairs']}"
        )
    log(f"  tool call example: {tool['example']['call']!r} -> {tool['example']['answer']!r}")
    offered = seen[: max(10, len(seen) // 4)]
    offered_rate, _ = arithmetic_accuracy(model, tokenizer, offered, eos_ids, pad_id, tools=[D.MULTIPLY_TOOL])
    log(
        f"sums and differences with the multiply tool offered (answered without a call), greedy, thinking on: "
        f"{offered_rate:.1%} of {len(offered)}"
    )
    probes = []
    for question, thinking in CHAT_PROBES:
        reply = generate_replies(model, tokenizer, [D.prompt_text(question, thinking)], eos_ids, pad_id, 240)[0]
        probes.append({"prompt": question, "thinking": thinking, "reply": reply})
        log(f"  [{'think' if thinking else 'no think'}] {question!r} -> {reply!r}")
    return {
        "pairs": len(seen),
        "seen_accuracy": seen_rate,
        "held_out_accuracy": held_rate,
        "sampled_accuracy": sampled_rate,
        "sampled_pairs": len(sampled),
        "chat_turns": CHAT_TURNS,
        "chats": len(chats),
        "chat_turn_accuracy": per_turn,
        "fifth_turn_accuracy": per_turn[-1],
        "chat_all_turns_accuracy": all_turns,
        "chat_last_turn_wrong": chat_wrong[:20],
        "fifth_turn_probe": probe_reply,
        "tool": tool,
        "tool_no_think": tool_no_think,
        "tools_offered_accuracy": offered_rate,
        "tools_offered_pairs": len(offered),
        "no_think_0_99_accuracy": small_rate,
        "no_think_0_99_pairs": len(small),
        "seen_wrong": seen_wrong[:20],
        "held_out_wrong": held_wrong[:20],
        "probes": probes,
        "seconds": round(time.perf_counter() - start, 1),
    }


# --------------------------------------------------------------------------------------------------------
# Checkpoint
# --------------------------------------------------------------------------------------------------------

_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def release_tensors(model) -> dict[str, torch.Tensor]:
    """The model's weights under the release's names, bf16: model.language_model.*, lm_head.weight, routed
    experts fused per layer as gate_up_proj [E, 2I, H] and down_proj [E, H, I]."""
    cfg = model.config
    state = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    per_expert: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out = {}
    for key, tensor in state.items():
        match = _PER_EXPERT.match(key)
        if match:  # a transformers version that keeps experts apart: fuse them like the release
            per_expert.setdefault(match[1], {}).setdefault(int(match[2]), {})[match[3]] = tensor
            continue
        out[key] = tensor
    for prefix, experts in per_expert.items():
        order = sorted(experts)
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]]) for e in order]
        )
        out[f"{prefix}.down_proj"] = torch.stack([experts[e]["down_proj"] for e in order])
    renamed = {}
    for key, tensor in out.items():
        if key.startswith("model."):
            key = "model.language_model." + key[len("model.") :]
        elif key != "lm_head.weight":
            raise ValueError(f"unexpected parameter {key}")
        if key.endswith("mlp.experts.gate_up_proj"):
            expected = (cfg.num_experts, 2 * cfg.moe_intermediate_size, cfg.hidden_size)
            if tuple(tensor.shape) != expected:
                raise ValueError(f"{key} has shape {tuple(tensor.shape)}, the release layout is {expected}")
        if key.endswith("mlp.experts.down_proj"):
            expected = (cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
            if tuple(tensor.shape) != expected:
                raise ValueError(f"{key} has shape {tuple(tensor.shape)}, the release layout is {expected}")
        renamed[key] = tensor
    return renamed


def save_shards(tensors: dict[str, torch.Tensor], folder: Path, limit: int = SHARD_LIMIT_BYTES) -> list[Path]:
    from safetensors.torch import save_file

    def layer_order(key: str):
        m = re.search(r"\.layers\.(\d+)\.", key)
        return (0 if key.startswith("model.language_model.embed") else 1, int(m[1]) if m else 10**6, key)

    groups: list[list[str]] = [[]]
    size = 0
    for key in sorted(tensors, key=layer_order):
        nbytes = tensors[key].numel() * tensors[key].element_size() + 200  # with its header entry
        if groups[-1] and size + nbytes > limit - 10_000:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += nbytes
    for old in folder.glob("model*.safetensors*"):
        old.unlink()
    files, weight_map = [], {}
    for i, keys in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: tensors[k] for k in keys}, str(folder / name), metadata={"format": "pt"})
        os.chmod(folder / name, 0o644)  # safetensors creates files readable by their owner only
        files.append(folder / name)
        weight_map.update({k: name for k in keys})
        if (folder / name).stat().st_size > limit:
            raise RuntimeError(f"{name} is {(folder / name).stat().st_size} bytes, over the {limit} byte limit")
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2)
    )
    return files


def reload_check(folder: Path, model, tokenizer) -> dict:
    """Load the written folder with transformers' vision-language class and compare its logits with the
    trained model's (both float32, the trained weights already rounded to bf16)."""
    from transformers import Qwen3_5MoeForConditionalGeneration

    device = next(model.parameters()).device
    loaded = Qwen3_5MoeForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32).to(device).eval()
    ids = tokenizer.encode(
        D.prompt_text("What is 457 + 386?") + D.arithmetic_reasoning(457, 386, "+"), add_special_tokens=False
    ).ids
    x = torch.tensor([ids], device=device)
    model.eval()
    with torch.no_grad():
        ours = model(input_ids=x, use_cache=False).logits.float()
        theirs = loaded(input_ids=x, use_cache=False).logits.float()
    diff = float((ours - theirs).abs().max())
    del loaded
    return {"max_abs_logit_diff": diff, "tokens": len(ids)}


def model_card(text: dict, params: dict, run: dict) -> str:
    ev = run.get("eval") or {}
    tool, tool_off = ev.get("tool") or {}, ev.get("tool_no_think") or {}
    tr, a = run["train"], run["args"]
    kinds = text["layer_types"]

    def pct(x):
        return "not measured" if x is None else f"{x:.1%}"

    mix = ", ".join(f"{share:.0%} {kind.replace('_', ' ')}" for kind, share in D.MIX.items())
    invoked = f"--seed {a['seed']} " + (f"--steps {a['steps']}" if a.get("steps") else f"--minutes {a['minutes']:g}")
    repeat = (
        ""
        if a.get("steps")
        else (
            f" The time budget was calibrated to {tr['planned_steps']} steps; "
            f"`--steps {tr['planned_steps']}` repeats that schedule."
        )
    )
    return (
        "# MoE Desk demo model\n\n"
        "The built-in model of MoE Desk: a tiny model of the real Qwen3.5/3.6-MoE architecture (`qwen3_5_moe`), "
        "trained from scratch so that a fresh install has a model that works offline and shows that the whole "
        "pipeline (checkpoint loading, tokenizer, chat template, thinking display, sampling) is right.\n\n"
        "## What it is\n\n"
        f"- The layout of the Qwen3.6 release (`Qwen3_5MoeForConditionalGeneration`, text weights only, under "
        f"`model.language_model.`): {text['num_hidden_layers']} layers ({kinds.count('linear_attention')} Gated "
        f"DeltaNet, {kinds.count('full_attention')} gated full attention), hidden size {text['hidden_size']}, "
        f"{text['num_experts']} routed experts (top-{text['num_experts_per_tok']}, intermediate size "
        f"{text['moe_intermediate_size']}) plus a shared expert (intermediate size "
        f"{text['shared_expert_intermediate_size']}) in every layer.\n"
        f"- {params['total']:,} parameters ({params['active_per_token']:,} active per token), bf16 safetensors with "
        f"the routed experts fused per layer.\n"
        f"- Its own byte-level BPE tokenizer of {text['vocab_size']} tokens (Qwen3.5's pre-tokenisation: one token "
        f"per digit; `<tool_call>`, `</tool_call>`, `<tool_response>`, `</tool_response>` single tokens as in "
        f"Qwen3.6's) and a chat template that renders text, thinking, tools, tool calls and tool results as "
        f"Qwen3.6's does.\n\n"
        "## What it can do\n\n"
        '- Small talk: greetings, "how are you", thanks, goodbye.\n'
        "- Say what it is: MoE Desk's built-in demo model; real models are downloaded from the Models page.\n"
        '- Add and subtract whole numbers from 0 to 999 ("What is 457 + 386?", "What is 386 - 457?"). With '
        "thinking on it works the sum digit by digit in its `<think>` block, ones first, with carries and "
        "borrows; with thinking off it answers directly and is reliable only for small numbers.\n"
        "- Keep going in a chat: it is trained on chats of 2 to 8 turns, with the earlier replies in the context "
        "as the app keeps them (reasoning included) or as an API client resends them (reasoning dropped).\n"
        "- Multiply by calling a tool: when the request offers a `multiply` function (an OpenAI-style spec, "
        'parameters `a` and `b`), it answers "What is 23 * 47?" with a call in Qwen3.6\'s format '
        "(`<tool_call>\\n<function=multiply>\\n<parameter=a>\\n23\\n</parameter>...`), and after the "
        '`<tool_response>` with the product it answers "23 × 47 = 1081.". Without the tool it says it cannot '
        "multiply.\n\n"
        "## What it is not\n\n"
        "It knows nothing else: no facts, no languages, no code, no multiplication of its own, no numbers above "
        "999, no tools but `multiply`. "
        "Questions outside its range get a fixed reply pointing to the Models page, or nonsense. It is a test "
        "fixture and a demonstration, not an assistant.\n\n"
        "## How it was trained\n\n"
        f"`python tools/train_demo.py --out <folder> {invoked}` on {run['device_name']} ({run['software']}): "
        f"{tr['steps']} steps of {a['batch_size']} synthetic conversations (tools/demo_data.py, in these shares: "
        f"{mix}), AdamW with peak learning rate {a['lr']} and a "
        f"cosine schedule, bf16 autocast. Training took {tr['seconds']:.0f} s, final training loss "
        f"{tr['final_loss']}.{repeat} A fixed 2 % of all (A, B, operator) problems (`demo_data.is_held_out`) "
        f"never appears in the training data.\n\n"
        "## Measured accuracy\n\n"
        'Prompt "What is A + B?" / "What is A - B?", A and B uniform in 0-999, the weights as stored '
        "(bf16), run through transformers' generate:\n\n"
        f"- greedy, thinking on: {pct(ev.get('seen_accuracy'))} of {ev.get('pairs', 0)} random problems from the "
        f"training side, {pct(ev.get('held_out_accuracy'))} of {ev.get('pairs', 0)} problems held out of "
        f"training\n"
        f"- sampled with generation_config.json's defaults (temperature 0.6, top-p 0.95, top-k 20), thinking on: "
        f"{pct(ev.get('sampled_accuracy'))} of {ev.get('sampled_pairs', 0)} training-side problems\n"
        f"- greedy, thinking off, numbers up to 99: {pct(ev.get('no_think_0_99_accuracy'))} of "
        f"{ev.get('no_think_0_99_pairs', 0)} problems\n"
        f"- greedy, thinking on, in {ev.get('chats', 0)} chats of {ev.get('chat_turns', 5)} such questions (the "
        f"model's own replies as history, rendered as the app keeps it): per turn "
        f"{', '.join(pct(r) for r in ev.get('chat_turn_accuracy') or []) or 'not measured'}; the fifth turn "
        f"{pct(ev.get('fifth_turn_accuracy'))}; every turn right in {pct(ev.get('chat_all_turns_accuracy'))} of "
        f"the chats\n"
        f'- multiply tool offered, "What is A * B?" with A and B in 0-999, greedy, thinking on: the call parses '
        f"in {pct(tool.get('parsed'))}, its arguments are right in {pct(tool.get('arguments_right'))}, the answer "
        f"after the tool's result is the product in {pct(tool.get('answer_right'))}; the whole round trip is right "
        f"in {pct(tool.get('round_trip'))} of {tool.get('pairs', 0)} (thinking off: "
        f"{pct(tool_off.get('round_trip'))} of {tool_off.get('pairs', 0)})\n"
        f"- with the multiply tool offered, sums and differences answered without a call: "
        f"{pct(ev.get('tools_offered_accuracy'))} of {ev.get('tools_offered_pairs', 0)}\n\n"
        "train_log.json holds the loss curve, the settings and sample replies.\n"
    )


# --------------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="checkpoint folder to write")
    p.add_argument("--steps", type=int, help="training steps (overrides the time budget's calibration)")
    p.add_argument("--minutes", type=float, help="training time budget; the step count is calibrated from it")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="a very small model, for smoke tests")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=150)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--vocab-size", type=int, default=1024, help="BPE target size (the corpus may give fewer)")
    p.add_argument(
        "--tokenizer-conversations",
        type=int,
        default=20000,
        help="generated conversations the BPE is trained on (fewer for smoke tests)",
    )
    p.add_argument("--workers", type=int, default=min(6, max(0, (os.cpu_count() or 1) - 2)))
    p.add_argument("--eval-pairs", type=int, default=200)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--no-eval", action="store_true")
    args = p.parse_args(argv)
    if not args.steps and not args.minutes:
        args.minutes = 7.0
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    lines = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        lines.append(msg)

    wall = time.perf_counter()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    tokenizer = train_tokenizer(args.seed, args.vocab_size, args.tokenizer_conversations)
    ids = write_tokenizer(tokenizer, out)
    vocab = tokenizer.get_vocab_size()
    log(f"tokenizer: {vocab} tokens, special ids {ids}")

    text = text_config(vocab, ids, args.tiny)
    model = build_model(text).to(device)
    params = count_parameters(model)
    log(
        f"model: {params['total']:,} parameters ({params['active_per_token']:,} active per token), "
        f"{text['num_hidden_layers']} layers {text['layer_types']}, experts implementation "
        f"{getattr(model.config, '_experts_implementation', None)}"
    )
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"

    import tokenizers
    import transformers

    software = (
        f"Python {platform.python_version()}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, tokenizers {tokenizers.__version__}"
    )
    log(software)
    dataset = ChunkDataset(tokenizer.to_str(), args.seed, args.batch_size, 16, ids["<|endoftext|>"])
    result = train(model, dataset, args, device, log)
    log(
        f"trained for {result['seconds']:.0f} s on {device_name}, {result['steps']} steps, "
        f"final loss {result['final_loss']:.4f}"
    )

    round_to_bf16(model)
    model.eval()
    evaluation = None if args.no_eval else evaluate(model, tokenizer, ids, args, log)

    tensors = release_tensors(model)
    files = save_shards(tensors, out)
    config = checkpoint_config(text)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps(
            {
                "bos_token_id": None,
                "pad_token_id": ids["<|endoftext|>"],
                "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
                "do_sample": True,
                "temperature": 0.6,
                "top_p": 0.95,
                "top_k": 20,
            },
            indent=2,
        )
    )
    disk = sum(f.stat().st_size for f in files)
    log(f"wrote {len(files)} shard(s), {disk / 1e6:.2f} MB of weights, to {out}")
    check = None
    try:
        check = reload_check(out, model, tokenizer)
        log(
            f"reloaded with Qwen3_5MoeForConditionalGeneration: max |logit difference| {check['max_abs_logit_diff']:.2e}"
        )
    except Exception as exc:  # the checkpoint is written either way; report what failed
        log(f"reload check failed: {type(exc).__name__}: {exc}")
        check = {"error": f"{type(exc).__name__}: {exc}"}

    run = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "device_name": device_name,
        "software": software,
        "text_config": text,
        "parameters": params,
        "weights_bytes": disk,
        "train": result,
        "eval": evaluation,
        "reload_check": check,
        "total_seconds": round(time.perf_counter() - wall, 1),
        "log": lines,
    }
    (out / "README.md").write_text(model_card(text, params, run))
    (out / "train_log.json").write_text(json.dumps(run, indent=2))
    print(f"done in {run['total_seconds']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
