"""The benchmark's side-by-side row: transformers + accelerate, what a Python user would reach for instead.

The same model shape as the synthetic model, in bf16 with random weights (transformers does not run the NVFP4
experts), placed by accelerate's `infer_auto_device_map` with the GPU held to the preset's budget and the rest in
host RAM: accelerate then moves each host-placed layer's weights to the GPU on every forward. This measures the
alternative; it is not the correctness reference (tests/reference.py is). accelerate is not a dependency of MoE
Desk: without it the row says how to get it.
"""

from __future__ import annotations

import time

import torch

from engine.experts.packed import physical_memory_bytes
from engine.synthetic import SYNTHETIC_MODELS, text_config
from engine.testing.random_weights import fill_random


def hf_offload_row(
    name: str, device: str, gpu_bytes: int | None, prompt_tokens: int, decode_tokens: int, seed: int = 0
) -> dict:
    """Prefill `prompt_tokens` and decode `decode_tokens` greedily through transformers, layers beyond
    `gpu_bytes` of GPU memory left in host RAM (device "cpu": all of it on the CPU, in float32)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    row = {
        "baseline": f"transformers + accelerate, {str(dtype).removeprefix('torch.')}, device_map=auto",
        "prompt_tokens": prompt_tokens,
        "decode_tokens": decode_tokens,
    }
    try:
        import transformers
        from accelerate import dispatch_model, infer_auto_device_map
    except ImportError as exc:
        return {**row, "skipped": f"{exc.name} is not installed (pip install accelerate transformers)"}
    started = time.perf_counter()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()  # the peak below is the baseline's alone
    model = _random_model(name, dtype, seed, transformers)
    inputs = "cpu"
    if device == "cuda":
        host = physical_memory_bytes() or 1 << 40
        device_map = infer_auto_device_map(
            model, max_memory={0: gpu_bytes, "cpu": host}, no_split_module_classes=list(model._no_split_modules)
        )
        row["modules_on_gpu"] = sum(1 for where in device_map.values() if where == 0)
        row["modules"] = len(device_map)
        model = dispatch_model(model, device_map)
        # token ids go where the embedding is: accelerate may leave it in host RAM (seen under the 4gb cap)
        embedding = model.get_input_embeddings().weight.device
        inputs = embedding if embedding.type in ("cpu", "cuda") else "cuda"
    row["build_seconds"] = time.perf_counter() - started
    prompt = torch.randint(
        0, model.config.vocab_size, (1, prompt_tokens), generator=torch.Generator().manual_seed(seed)
    ).to(inputs)
    with torch.inference_mode():
        _sync(device)
        began = time.perf_counter()
        out = model(prompt, use_cache=True)
        _sync(device)
        prefill = time.perf_counter() - began
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1).to(inputs)
        began = time.perf_counter()
        for _ in range(decode_tokens):
            out = model(token, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1).to(inputs)
        _sync(device)
        decode = time.perf_counter() - began
    row.update(
        time_to_first_token_s=prefill,
        prefill_tokens_per_s=prompt_tokens / prefill,
        decode_tokens_per_s=decode_tokens / decode if decode_tokens else 0.0,
    )
    if device == "cuda":
        row["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
    return row


def _random_model(name: str, dtype: torch.dtype, seed: int, transformers):
    synthetic = SYNTHETIC_MODELS[name]
    config = transformers.AutoConfig.for_model(synthetic.config.model_type, **text_config(synthetic.config))
    with torch.device("meta"):  # no 35B-value initialisation: shapes only, then storage, then random blocks
        model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    model.to_empty(device="cpu")
    with torch.no_grad():
        fill_random(
            {name: param.data for name, param in model.named_parameters()}, synthetic.config.zero_centered_norms, seed
        )
        for module in model.modules():  # buffers made on the meta device: computed again for real
            if type(module).__name__.endswith("RotaryEmbedding"):
                fresh = type(module)(module.config)
                for buffer_name, buffer in fresh.named_buffers(recurse=False):
                    setattr(module, buffer_name, buffer)
    return model.eval()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
