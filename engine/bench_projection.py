"""The bench's model of a step (issue 22, part 5): what a decode token or a prefill chunk moves through each
tier (GPU-resident weights at VRAM bandwidth, missed experts over PCIe, CPU experts at host DRAM bandwidth), the
PCIe-streaming bounds and combined ceiling a run's rows are set against, and a projection of a measured run onto
other cards. The projection is modelled, not measured: it is checked against the run it starts from, and prints
its error.

Decode, a token: the GPU's own step (measured with every expert a hit: `fixed` routing) plus its missed experts'
transfer (transfer_seconds). The ceiling (decode_ceiling) takes the larger of the two, as if they overlapped
fully; the projection adds them, as the measured decodes show they mostly do not (the check says how well).
On another card the GPU step keeps the run's fixed cost (launches, synchronisation) and reads its bytes at
that card's VRAM bandwidth instead: resident weights, the hits' experts and the KV cache.

Prefill, a chunk: every MoE layer's experts cross the link once, and the GPU computes; the run's 4,096-token
row gives the run's GPU compute time a token, taken as the floor on another card, which may instead be bound by
its tensor throughput (2 x the weights a token multiplies, at TENSOR_EFFICIENCY of its dense bf16 peak).
Plans with prefill overlap take the larger of transfer and compute, the others their sum.

The step's formulas and the cards live in engine/runtime/step_model.py, which a plan's expected decode speed
(engine/runtime/decode_estimate.py) shares.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

from engine.runtime.footprint import ModelFootprint
from engine.runtime.step_model import (
    CARDS,
    RUN_GPU_VRAM_BYTES_PER_S,
    Card,
    card_gpu_step,
    decode_step_seconds,
    gpu_bytes_per_token,
    transfer_seconds,
)

DRAM_EFFICIENCY = 0.7  # of a host's peak DRAM bandwidth, what streaming reads reach (STREAM-like)
TENSOR_EFFICIENCY = 0.5  # of a card's dense bf16 tensor peak (FP32 accumulate), what grouped GEMMs reach
CHECK_PROMPT = 4096  # the prompt whose prefill row gives the compute time a token, and whose decode is projected
MODELLED = (
    "modelled, not measured: the bytes a token moves through each tier at the card's figures, and the "
    "step components measured on the run's GPU"
)


def missed_share(decode: dict) -> float:
    """Of a decode's routed experts, the share not computed from the GPU cache: the misses, or what the CPU
    computed (the cpu backend counts those as cache hits, yet reads them from host memory)."""
    return max(1.0 - decode["decode_expert_cache_hit_rate"], decode.get("decode_cpu_expert_share", 0.0))


def backend_used(decode: dict, backend: str | None, default: str) -> str:
    """The backend that paced a decode: auto's is the one its trial chose."""
    used = backend or default
    if used == "auto":
        used = decode.get("decode_auto_trial", {}).get("chosen", used)
    return used


def pcie_bounds(row: dict, bandwidth: float, expert_bytes: int) -> dict:
    """Ratios of measured speed to the PCIe-streaming bounds at the measured bandwidth of the banks' memory:
    each prefill chunk streams every MoE layer's experts once; a decode token streams what it missed."""
    chunks = -(-row["prompt_tokens"] // row["prefill_chunk_tokens"])
    prefill_bound = row["prompt_tokens"] / (chunks * expert_bytes / bandwidth)
    bounds = {
        "prefill_pcie_bound_tokens_per_s": prefill_bound,
        "prefill_vs_bound": row["prefill_tokens_per_s"] / prefill_bound,
    }
    bounds.update(_decode_bound(row, bandwidth))
    for decode in row.get("decode_by_backend", {}).values():
        decode.update(_decode_bound({**decode, "decode_tokens": row["decode_tokens"]}, bandwidth))
    return bounds


def _decode_bound(decode: dict, bandwidth: float) -> dict:
    """A decode token streams what it missed and the GPU computes (the CPU's share is not bounded by PCIe)."""
    copied = decode.get("decode_expert_bytes_copied", 0)
    if not decode["decode_tokens"] or not copied:
        return {}
    bound = decode["decode_tokens"] / (copied / bandwidth)
    return {"decode_pcie_bound_tokens_per_s": bound, "decode_vs_bound": decode["decode_tokens_per_s"] / bound}


def decode_ceiling(
    miss_bytes_per_token: float,
    gpu_step_seconds: float,
    pcie_bytes_per_s: float,
    cpu_bytes_per_s: float | None,
    backend: str,
) -> float:
    """The fastest decode (tokens/s) the hardware allows a backend: a token's missed expert bytes cross PCIe
    (offload), are read by the CPU (cpu) or both at once (hybrid), beside the GPU's own step; whichever of the
    two takes longer sets the pace (an upper bound: they could at best overlap fully)."""
    transfer = transfer_seconds(miss_bytes_per_token, pcie_bytes_per_s, cpu_bytes_per_s, backend)
    return 1.0 / max(gpu_step_seconds, transfer)


def add_ceilings(result: dict, record_bytes: int, moe_layers: int, top_k: int, gpu_step: float | None = None) -> None:
    """Each decode of the run against its combined ceiling, where a `fixed` row measured the GPU's own step
    (or `gpu_step`, seconds measured by another run, where this one's cache cannot hold a fixed routing)."""
    fixed = [r for r in result["runs"] if r.get("routing") == "fixed" and "decode_tokens_per_s" in r]
    if fixed and fixed[0].get("decode_expert_cache_hit_rate", 0.0) >= 0.99:
        gpu_step, result["gpu_step_source"] = 1.0 / fixed[0]["decode_tokens_per_s"], "this run's fixed routing"
    elif gpu_step is not None:
        result["gpu_step_source"] = "given (--gpu-step-ms)"
    else:
        return
    result["gpu_step_seconds"] = gpu_step
    pcie = result["expert_link_bytes_per_s"]
    cpu = result.get("calibration", {}).get("cpu_bytes_per_s")
    for row in result["runs"]:
        for backend, decode in (row.get("decode_by_backend") or {None: row}).items():
            if "decode_expert_cache_hit_rate" not in decode:
                continue
            misses = missed_share(decode) * moe_layers * top_k * record_bytes
            used = backend_used(decode, backend, result["expert_backend"])
            ceiling = decode_ceiling(misses, gpu_step, pcie, cpu, used)
            decode["decode_ceiling_tokens_per_s"] = ceiling
            decode["decode_vs_ceiling"] = decode["decode_tokens_per_s"] / ceiling


def matmul_weights_per_token(footprint: ModelFootprint) -> int:
    """Weights a prompt token multiplies: projections of every layer, the shared and the active routed experts
    (the LM head runs on the last token only)."""
    c = footprint.config
    heads = c.num_attention_heads * c.head_dim
    full = c.hidden_size * (2 * heads + 2 * c.num_key_value_heads * c.head_dim) + heads * c.hidden_size  # 2: gate
    value = c.linear_num_value_heads * c.linear_value_head_dim
    linear = (
        c.hidden_size * (2 * c.linear_num_key_heads * c.linear_key_head_dim + 2 * value + 2 * c.linear_num_value_heads)
        + value * c.hidden_size
    )
    mlp = 3 * c.hidden_size * (c.num_experts_per_tok * c.moe_intermediate_size + c.shared_expert_intermediate_size)
    return c.num_attention_layers * full + c.num_linear_attention_layers * linear + footprint.moe_layers * mlp


def card_cpu_rate(card: Card, per_thread_bytes_per_s: float) -> float:
    """CPU expert reads on the card's host: the run's rate a thread, up to what its DRAM streams."""
    return min(card.cpu_threads * per_thread_bytes_per_s, DRAM_EFFICIENCY * card.dram_bytes_per_s)


def prefill_seconds(
    tokens: int,
    chunk: int,
    chunk_bytes: float,
    link_bytes_per_s: float,
    compute_seconds_per_token: float,
    overlap: bool,
) -> float:
    """A modelled prefill: per chunk, `chunk_bytes` of experts over the link, and the GPU's compute; their
    larger with overlap, their sum without."""
    full, rest = divmod(tokens, chunk)
    seconds = 0.0
    for size in [chunk] * full + ([rest] if rest else []):
        transfer, compute = chunk_bytes / link_bytes_per_s, size * compute_seconds_per_token
        seconds += max(transfer, compute) if overlap else transfer + compute
    return seconds


@dataclass(frozen=True)
class Rates:
    """A run's measured rates (or a card's modelled ones) that the formulas take."""

    gpu_step: float  # seconds, the GPU's own decode step at this context with this cache
    pcie: float
    cpu: float | None
    prefill_compute: float  # seconds a prompt token on the GPU


def _decodes(result: dict):
    """(row, backend, decode) for each decode of the run's forced-routing rows but `fixed`."""
    for row in result["runs"]:
        if row.get("routing") in ("fixed", "model") or "decode_by_backend" not in row:
            continue
        for backend, decode in row["decode_by_backend"].items():
            if "decode_expert_cache_hit_rate" in decode:
                yield row, backend, decode


def copy_rate(result: dict, link_bytes_per_s: float) -> float:
    """The rate expert copies cross a link at in the run's setting: with pageable records no faster than the
    executor's calibrated pageable copy (staged through a bounce buffer by the host: far below the bare link)."""
    calibration = result.get("calibration") or {}
    if result.get("pageable_experts") and calibration.get("pageable_bytes_per_s"):
        return min(calibration["pageable_bytes_per_s"], link_bytes_per_s)
    return link_bytes_per_s


def link_rate(result: dict) -> float:
    """The rate the run's own expert copies crossed at (its measured or held link)."""
    return copy_rate(result, result["expert_link_bytes_per_s"])


def run_vram_bytes_per_s(result: dict) -> float:
    """The VRAM bandwidth of the GPU the run was measured on, where known (else infinite: its whole step is then
    taken as fixed cost, which no card's bandwidth changes)."""
    name = result.get("device_name", "")
    return next((rate for model, rate in RUN_GPU_VRAM_BYTES_PER_S.items() if model in name), float("inf"))


def streamed_chunk_bytes(result: dict, footprint: ModelFootprint) -> float:
    """Expert bytes a prefill chunk copies: every MoE layer's but the ones the cache keeps between chunks
    (`prefill_kept_layers` of the run), as from a prompt's second chunk on."""
    return (footprint.moe_layers - result.get("prefill_kept_layers", 0)) * footprint.expert_layer_bytes


def _prefill_compute(result: dict, chunk_bytes: float) -> float | None:
    """The GPU's compute time a prompt token, from the run's CHECK_PROMPT row (its transfer taken out where
    the plan does not overlap them: with overlap the row is compute-bound or the link's)."""
    plan = result["plan"]
    row = next(
        (
            r
            for r in result["runs"]
            if r.get("prompt_tokens") == CHECK_PROMPT and r.get("routing") == "uniform" and "prefill_tokens_per_s" in r
        ),
        None,
    )
    if row is None:
        return None
    chunks = -(-CHECK_PROMPT // plan["prefill_chunk_tokens"])
    seconds = CHECK_PROMPT / row["prefill_tokens_per_s"]
    if not plan["prefill_overlap"]:
        seconds -= chunks * chunk_bytes / link_rate(result)
    return max(seconds, 0.0) / CHECK_PROMPT


def _model_decode(decode: dict, backend: str, result: dict, footprint: ModelFootprint, rates: Rates) -> float:
    """The formula's decode (tokens/s) for one measured decode's misses, at `rates`."""
    record = footprint.expert_layer_bytes / footprint.experts_per_layer
    miss_bytes = missed_share(decode) * footprint.moe_layers * footprint.config.num_experts_per_tok * record
    used = backend_used(decode, backend, result["expert_backend"])
    return 1.0 / decode_step_seconds(rates.gpu_step, miss_bytes, rates.pcie, rates.cpu, used)


def _error_summary(errors: list[float]) -> dict:
    """How many rows, their median and largest error in size, and the mean error with its sign."""
    magnitudes = [abs(e) for e in errors]
    return {
        "rows": len(errors),
        "median_abs_error": statistics.median(magnitudes) if errors else None,
        "max_abs_error": max(magnitudes) if errors else None,
        "mean_signed_error": statistics.fmean(errors) if errors else None,
    }


def check(result: dict, footprint: ModelFootprint) -> dict:
    """The formulas against the run's own measurements at its own rates: each decode (every routing but
    `fixed`, every backend) and each prompt's prefill; errors are modelled / measured - 1."""
    chunk_bytes = streamed_chunk_bytes(result, footprint)
    calibration = result.get("calibration") or {}
    rates = Rates(
        result["gpu_step_seconds"],
        link_rate(result),
        calibration.get("cpu_bytes_per_s"),
        _prefill_compute(result, chunk_bytes) or 0.0,
    )
    decodes, by_backend = [], {}
    for row, backend, decode in _decodes(result):
        modelled = _model_decode(decode, backend, result, footprint, rates)
        error = modelled / decode["decode_tokens_per_s"] - 1.0
        decodes.append(
            {
                "routing": row["routing"],
                "backend": backend,
                "measured": decode["decode_tokens_per_s"],
                "modelled": modelled,
                "error": error,
            }
        )
        by_backend.setdefault(backend, []).append(error)
    prefills = []
    plan = result["plan"]
    if rates.prefill_compute:
        for row in result["runs"]:
            if row.get("routing") != "uniform" or "prefill_tokens_per_s" not in row:
                continue
            seconds = prefill_seconds(
                row["prompt_tokens"],
                plan["prefill_chunk_tokens"],
                chunk_bytes,
                rates.pcie,
                rates.prefill_compute,
                plan["prefill_overlap"],
            )
            modelled = row["prompt_tokens"] / seconds
            prefills.append(
                {
                    "prompt_tokens": row["prompt_tokens"],
                    "measured": row["prefill_tokens_per_s"],
                    "modelled": modelled,
                    "error": modelled / row["prefill_tokens_per_s"] - 1.0,
                }
            )
    return {
        "decode": decodes,
        "decode_error": _error_summary([d["error"] for d in decodes]),
        "decode_error_by_backend": {b: _error_summary(e) for b, e in by_backend.items()},
        "prefill": prefills,
        "prefill_error": _error_summary([p["error"] for p in prefills if p["prompt_tokens"] != CHECK_PROMPT]),
        "prefill_compute_seconds_per_token": rates.prefill_compute,
    }


def project_card(
    result: dict, footprint: ModelFootprint, card: Card, checked: dict, prompts: tuple[int, ...] = (512, 4096, 16384)
) -> dict:
    """Decode (each backend, each routing the run measured) and prefill on `card`, by the formulas at its
    figures, and each scaled by the measured / modelled ratio of the same row on the run's GPU."""
    calibration = result.get("calibration") or {}
    chunk_bytes = streamed_chunk_bytes(result, footprint)
    context = CHECK_PROMPT + max((r.get("decode_tokens", 0) for r in result["runs"]), default=0) // 2
    run_fixed_bytes = gpu_bytes_per_token(footprint, 1.0, context)  # the fixed step: every expert a hit
    per_thread = (
        calibration["cpu_bytes_per_s"] / calibration["cpu_threads"]
        if calibration.get("cpu_bytes_per_s") and calibration.get("cpu_threads")
        else None
    )
    cpu = card_cpu_rate(card, per_thread) if per_thread else None
    compute = max(
        checked["prefill_compute_seconds_per_token"],
        2 * matmul_weights_per_token(footprint) / (TENSOR_EFFICIENCY * card.tensor_flops),
    )
    link = copy_rate(result, card.pcie_bytes_per_s)
    measured = {(d["routing"], d["backend"]): d for d in checked["decode"]}
    decode = {}
    for row, backend, d in _decodes(result):
        hits = 1.0 - missed_share(d)
        step = card_gpu_step(
            result["gpu_step_seconds"],
            run_fixed_bytes,
            run_vram_bytes_per_s(result),
            gpu_bytes_per_token(footprint, hits, context),
            card,
        )
        modelled = _model_decode(d, backend, result, footprint, Rates(step, link, cpu, compute))
        on_run = measured[(row["routing"], backend)]
        decode.setdefault(row["routing"], {})[backend] = {
            "modelled": modelled,
            "scaled_by_measured": modelled * on_run["measured"] / on_run["modelled"],
        }
    plan = result["plan"]
    prefill = {}
    run_prefill = {p["prompt_tokens"]: p for p in checked["prefill"]}
    for tokens in prompts:
        seconds = prefill_seconds(
            tokens, plan["prefill_chunk_tokens"], chunk_bytes, link, compute, plan["prefill_overlap"]
        )
        entry = {"modelled": tokens / seconds, "time_to_first_token_s": seconds}
        if tokens in run_prefill:
            entry["scaled_by_measured"] = entry["modelled"] / (1.0 + run_prefill[tokens]["error"])
        prefill[tokens] = entry
    return {
        "card": asdict(card),
        "pageable_experts": bool(result.get("pageable_experts")),
        "link_bytes_per_s": link,
        "cpu_bytes_per_s": cpu,
        "prefill_compute_seconds_per_token": compute,
        "decode_tokens_per_s": decode,
        "prefill_tokens_per_s": prefill,
    }


def projection(result: dict, footprint: ModelFootprint, cards: tuple[Card, ...] = CARDS) -> dict | None:
    """The run's formula check and its projection onto the cards of its preset; None where the run lacks a
    GPU step or a plan (the decode model needs both)."""
    if "gpu_step_seconds" not in result or not result.get("plan") or "expert_link_bytes_per_s" not in result:
        return None
    checked = check(result, footprint)
    preset = result["plan"]["preset"]
    return {
        "note": MODELLED,
        "check": checked,
        "cards": [project_card(result, footprint, card, checked) for card in cards if card.preset == preset],
    }
