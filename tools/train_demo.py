"""Train MoE Desk's built-in demo model and write it as a Qwen3.6-style checkpoint folder.

    python tools/train_demo.py --out DIR [--minutes M | --steps N] [--device cuda|cpu] [--seed 0] [--tiny]

1. Trains a byte-level BPE tokenizer (Qwen3.5's pre-tokenisation: every digit is its own token) on generated
   conversations (tools/demo_data.py) and writes tokenizer.json, tokenizer_config.json, chat_template.jinja.
2. Builds a tiny `transformers.Qwen3_5MoeForCausalLM` (Gated DeltaNet and gated-attention layers, routed
   experts plus a shared expert) and trains it with AdamW and a cosine schedule (bf16 autocast on CUDA) on
   a stream of synthetic conversations, for --steps steps or a --minutes budget.
3. Measures greedy accuracy on "What is A + B?" / "What is A - B?" (thinking on) for random problems of the
   training side and for problems held out of training, with transformers' generate, on the weights
   rounded to bf16 exactly as they are saved.
4. Writes the checkpoint in the layout of the Qwen3.6 release: the qwen3_5_moe vision-language config with
   the text model under text_config, bf16 safetensors shards (at most 15 MB each) with the language model
   under model.language_model. and the routed experts fused per layer, generation_config.json, a README.md
   model card and train_log.json with the measured numbers.

Runs with transformers >= 5.17 and needs nothing from this repository's engine.
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
    for token in data["added_tokens"]:  # Qwen marks the thinking tags as ordinary added tokens
        if token["content"] in ("<think>", "</think>"):
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
            str(ids[token]): {"content": token, "lstrip": False, "normalized": False, "rstrip": False,
                              "single_word": False, "special": token not in ("<think>", "</think>")}
            for token in D.SPECIAL_TOKENS},
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
        shape = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                     layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                     linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                     linear_num_value_heads=4, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                     num_experts=4, num_experts_per_tok=2, mrope_section=[1, 1, 2])
    else:
        shape = dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                     layer_types=["linear_attention", "full_attention"] * 4,
                     linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=2,
                     linear_num_value_heads=4, moe_intermediate_size=128, shared_expert_intermediate_size=256,
                     num_experts=8, num_experts_per_tok=2, mrope_section=[3, 3, 2])
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
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": mrope_section, "mrope_interleaved": True},
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
    vision = dict(model_type="qwen3_5_moe_vision", depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                  in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                  out_hidden_size=text["hidden_size"], num_position_embeddings=64, hidden_act="gelu_pytorch_tanh",
                  initializer_range=0.02, deepstack_visual_indexes=[])
    return {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
            "dtype": "bfloat16", "tie_word_embeddings": False, "text_config": dict(text, dtype="bfloat16"),
            "vision_config": vision}


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

    def __init__(self, tokenizer_json: str, seed: int, batch_size: int, batches_per_chunk: int, pad_id: int,
                 chunks: int = 10**9):
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
            group = samples[i:i + self.batch_size]
            length = -(-max(len(ids) for ids, _ in group) // 8) * 8
            input_ids = torch.full((len(group), length), self.pad_id, dtype=torch.long)
            labels = torch.full((len(group), length), IGNORE, dtype=torch.long)
            for row, (ids, lab) in enumerate(group):
                input_ids[row, :len(ids)] = torch.tensor(ids)
                labels[row, :len(lab)] = torch.tensor(lab)
            batches.append((input_ids, labels))
        rng.shuffle(batches)
        return batches


def batch_stream(dataset: ChunkDataset, workers: int):
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, shuffle=False, num_workers=workers,
                                         prefetch_factor=4 if workers else None, persistent_workers=workers > 0)
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
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else torch.autocast("cpu", enabled=False))
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
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                                 ignore_index=IGNORE)
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
            log(f"calibrated: {per_step * 1000:.1f} ms/step, training for {total} steps in {args.minutes} min "
                f"(reproduce the schedule with --steps {total})")
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
    return {"steps": step, "planned_steps": total, "seconds": round(seconds, 1), "final_loss": round(final, 5),
            "history": history}


def round_to_bf16(model) -> None:
    """Make the weights exactly what the bf16 checkpoint will hold, so the evaluation measures the release."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(p.dtype))


# --------------------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------------------


@torch.no_grad()
def generate_replies(model, tokenizer, prompts: list[str], eos_ids: list[int], pad_id: int, max_new_tokens: int,
                     batch_size: int = 256, sampling: dict | None = None) -> list[str]:
    """Replies with transformers' generate, greedy unless `sampling` gives do_sample settings. Prompts are
    batched only with prompts of the same token length, so no padding is involved."""
    decoding = dict(sampling) if sampling else {"do_sample": False}
    model.eval()
    device = next(model.parameters()).device
    encoded = [tokenizer.encode(p, add_special_tokens=False).ids for p in prompts]
    by_length: dict[int, list[int]] = {}
    for i, ids in enumerate(encoded):
        by_length.setdefault(len(ids), []).append(i)
    replies = [""] * len(prompts)
    for indices in by_length.values():
        for j in range(0, len(indices), batch_size):
            part = indices[j:j + batch_size]
            input_ids = torch.tensor([encoded[i] for i in part], device=device)
            out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                 max_new_tokens=max_new_tokens, eos_token_id=eos_ids, pad_token_id=pad_id,
                                 **decoding)
            for row, i in enumerate(part):
                new = out[row, input_ids.shape[1]:].tolist()
                cut = next((k for k, t in enumerate(new) if t in eos_ids), len(new))
                replies[i] = tokenizer.decode(new[:cut], skip_special_tokens=False)
    return replies


def arithmetic_accuracy(model, tokenizer, problems, eos_ids, pad_id, thinking: bool = True, sampling=None):
    prompts = [D.prompt_text(f"What is {a} {op} {b}?", enable_thinking=thinking) for a, b, op in problems]
    replies = generate_replies(model, tokenizer, prompts, eos_ids, pad_id, max_new_tokens=240 if thinking else 24,
                               sampling=sampling)
    right = [D.is_correct(r, *p) for r, p in zip(replies, problems)]
    wrong = [{"problem": f"{a} {op} {b}", "reply": r[-200:]} for (a, b, op), r, ok in zip(problems, replies, right)
             if not ok]
    return sum(right) / max(1, len(right)), wrong


APP_SAMPLING = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}  # generation_config.json's
CHAT_PROBES = [("Hello!", True), ("Who are you?", True), ("What can you do?", True), ("Thanks!", True),
               ("What is the capital of France?", True), ("How are you?", False), ("What is 457 + 386?", True),
               ("What is 386 - 457?", True), ("What is 12 + 7?", False)]


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
    log(f"greedy accuracy, thinking on, 0-999: {seen_rate:.1%} on {len(seen)} training-side problems, "
        f"{held_rate:.1%} on {len(held)} held-out problems; thinking off, 0-99: {small_rate:.1%} on {len(small)}")
    torch.manual_seed(args.seed)
    sampled = seen[:max(10, len(seen) // 2)]
    sampled_rate, _ = arithmetic_accuracy(model, tokenizer, sampled, eos_ids, pad_id, sampling=APP_SAMPLING)
    log(f"sampled accuracy (the app's defaults: {APP_SAMPLING}), thinking on, 0-999: {sampled_rate:.1%} on "
        f"{len(sampled)} training-side problems")
    for item in (seen_wrong + held_wrong)[:5]:
        log(f"  wrong: {item['problem']}: {item['reply']!r}")
    probes = []
    for question, thinking in CHAT_PROBES:
        reply = generate_replies(model, tokenizer, [D.prompt_text(question, thinking)], eos_ids, pad_id, 240)[0]
        probes.append({"prompt": question, "thinking": thinking, "reply": reply})
        log(f"  [{'think' if thinking else 'no think'}] {question!r} -> {reply!r}")
    return {"pairs": len(seen), "seen_accuracy": seen_rate, "held_out_accuracy": held_rate,
            "sampled_accuracy": sampled_rate, "sampled_pairs": len(sampled),
            "no_think_0_99_accuracy": small_rate, "no_think_0_99_pairs": len(small),
            "seen_wrong": seen_wrong[:20], "held_out_wrong": held_wrong[:20], "probes": probes,
            "seconds": round(time.perf_counter() - start, 1)}


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
            [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]]) for e in order])
        out[f"{prefix}.down_proj"] = torch.stack([experts[e]["down_proj"] for e in order])
    renamed = {}
    for key, tensor in out.items():
        if key.startswith("model."):
            key = "model.language_model." + key[len("model."):]
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
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    return files


def reload_check(folder: Path, model, tokenizer) -> dict:
    """Load the written folder with transformers' vision-language class and compare its logits with the
    trained model's (both float32, the trained weights already rounded to bf16)."""
    from transformers import Qwen3_5MoeForConditionalGeneration

    device = next(model.parameters()).device
    loaded = Qwen3_5MoeForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32).to(device).eval()
    ids = tokenizer.encode(D.prompt_text("What is 457 + 386?") + D.arithmetic_reasoning(457, 386, "+"),
                           add_special_tokens=False).ids
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
    tr, a = run["train"], run["args"]
    kinds = text["layer_types"]

    def pct(x):
        return "not measured" if x is None else f"{x:.1%}"

    invoked = f"--seed {a['seed']} " + (f"--steps {a['steps']}" if a.get("steps") else f"--minutes {a['minutes']:g}")
    repeat = "" if a.get("steps") else (f" The time budget was calibrated to {tr['planned_steps']} steps; "
                                        f"`--steps {tr['planned_steps']}` repeats that schedule.")
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
        f"per digit) and Qwen3.5's chat template with thinking support.\n\n"
        "## What it can do\n\n"
        "- Small talk: greetings, \"how are you\", thanks, goodbye.\n"
        "- Say what it is: MoE Desk's built-in demo model; real models are downloaded from the Models page.\n"
        "- Add and subtract whole numbers from 0 to 999 (\"What is 457 + 386?\", \"What is 386 - 457?\"). With "
        "thinking on it works the sum digit by digit in its `<think>` block, ones first, with carries and "
        "borrows; with thinking off it answers directly and is reliable only for small numbers.\n\n"
        "## What it is not\n\n"
        "It knows nothing else: no facts, no languages, no code, no multiplication, no numbers above 999. "
        "Questions outside its range get a fixed reply pointing to the Models page, or nonsense. It is a test "
        "fixture and a demonstration, not an assistant.\n\n"
        "## How it was trained\n\n"
        f"`python tools/train_demo.py --out <folder> {invoked}` on {run['device_name']} ({run['software']}): "
        f"{tr['steps']} steps of {a['batch_size']} synthetic conversations (tools/demo_data.py: "
        f"{D.MIX['arithmetic']:.0%} arithmetic with reasoning; the rest small talk, questions about itself, "
        f"direct answers for numbers up to 99 and multi-turn chats), AdamW with peak learning rate {a['lr']} and a "
        f"cosine schedule, bf16 autocast. Training took {tr['seconds']:.0f} s, final training loss "
        f"{tr['final_loss']}.{repeat} A fixed 2 % of all (A, B, operator) problems (`demo_data.is_held_out`) "
        f"never appears in the training data.\n\n"
        "## Measured accuracy\n\n"
        "Prompt \"What is A + B?\" / \"What is A - B?\", A and B uniform in 0-999, the weights as stored "
        "(bf16), run through transformers' generate:\n\n"
        f"- greedy, thinking on: {pct(ev.get('seen_accuracy'))} of {ev.get('pairs', 0)} random problems from the "
        f"training side, {pct(ev.get('held_out_accuracy'))} of {ev.get('pairs', 0)} problems held out of "
        f"training\n"
        f"- sampled with generation_config.json's defaults (temperature 0.6, top-p 0.95, top-k 20), thinking on: "
        f"{pct(ev.get('sampled_accuracy'))} of {ev.get('sampled_pairs', 0)} training-side problems\n"
        f"- greedy, thinking off, numbers up to 99: {pct(ev.get('no_think_0_99_accuracy'))} of "
        f"{ev.get('no_think_0_99_pairs', 0)} problems\n\n"
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
    tokenizer = train_tokenizer(args.seed, args.vocab_size)
    ids = write_tokenizer(tokenizer, out)
    vocab = tokenizer.get_vocab_size()
    log(f"tokenizer: {vocab} tokens, special ids {ids}")

    text = text_config(vocab, ids, args.tiny)
    model = build_model(text).to(device)
    params = count_parameters(model)
    log(f"model: {params['total']:,} parameters ({params['active_per_token']:,} active per token), "
        f"{text['num_hidden_layers']} layers {text['layer_types']}, experts implementation "
        f"{getattr(model.config, '_experts_implementation', None)}")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"

    import tokenizers
    import transformers
    software = (f"Python {platform.python_version()}, torch {torch.__version__}, transformers "
                f"{transformers.__version__}, tokenizers {tokenizers.__version__}")
    log(software)
    dataset = ChunkDataset(tokenizer.to_str(), args.seed, args.batch_size, 16, ids["<|endoftext|>"])
    result = train(model, dataset, args, device, log)
    log(f"trained for {result['seconds']:.0f} s on {device_name}, {result['steps']} steps, "
        f"final loss {result['final_loss']:.4f}")

    round_to_bf16(model)
    model.eval()
    evaluation = None if args.no_eval else evaluate(model, tokenizer, ids, args, log)

    tensors = release_tensors(model)
    files = save_shards(tensors, out)
    config = checkpoint_config(text)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": None, "pad_token_id": ids["<|endoftext|>"],
         "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "do_sample": True, "temperature": 0.6,
         "top_p": 0.95, "top_k": 20}, indent=2))
    disk = sum(f.stat().st_size for f in files)
    log(f"wrote {len(files)} shard(s), {disk / 1e6:.2f} MB of weights, to {out}")
    check = None
    try:
        check = reload_check(out, model, tokenizer)
        log(f"reloaded with Qwen3_5MoeForConditionalGeneration: max |logit difference| {check['max_abs_logit_diff']:.2e}")
    except Exception as exc:  # the checkpoint is written either way; report what failed
        log(f"reload check failed: {type(exc).__name__}: {exc}")
        check = {"error": f"{type(exc).__name__}: {exc}"}

    run = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
           "device_name": device_name, "software": software, "text_config": text, "parameters": params,
           "weights_bytes": disk, "train": result, "eval": evaluation, "reload_check": check,
           "total_seconds": round(time.perf_counter() - wall, 1), "log": lines}
    (out / "README.md").write_text(model_card(text, params, run))
    (out / "train_log.json").write_text(json.dumps(run, indent=2))
    print(f"done in {run['total_seconds']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
