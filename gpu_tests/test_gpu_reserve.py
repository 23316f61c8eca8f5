"""The runtime reserve measured on this card, and a model held to a plan made with it: the process's measured peak
(allocator peak plus what lies outside the allocator) stays within the plan's budget."""

import gc
import json
import subprocess
import sys
from pathlib import Path

import torch

from engine.loader import load_model
from engine.runtime import reserve
from engine.runtime.footprint import footprint_from_checkpoint
from engine.runtime.placement import gpu_dtype
from engine.runtime.planner import CUDA_STACK_BYTES_PER_THREAD, MIB, plan_memory
from engine.runtime.vram import cap_process_memory, measured_peak

SPARE_BYTES = 48 * MIB  # beyond the reserve: the tiny model's tensors and a 4,096-token KV cache need a few MiB
DECODE_STEPS = 16


MEASURE = (
    "import json; from engine.runtime.reserve import runtime_reserve; print(json.dumps(runtime_reserve().to_dict()))"
)


def test_the_reserve_is_measured_here_and_a_plan_made_with_it_holds(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("MOEDESK_MODELS_DIR", str(tmp_path / "models"))  # a cache file of the test's own
    # measured in a fresh process, as the app's first start does: this one has CUDA started by earlier tests,
    # so NVML's reading before CUDA (the baseline) is no longer to be had here
    done = subprocess.run(
        [sys.executable, "-c", MEASURE],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    fresh = json.loads(done.stdout)
    props = torch.cuda.get_device_properties(0)
    formula = reserve.formula_estimate(torch.device("cuda", 0), "for comparison")
    print(f"\nmeasured {fresh}\nformula {formula.to_dict()}")
    assert fresh["measured"] and not fresh["others_included"], fresh["source"]
    local_memory = props.multi_processor_count * props.max_threads_per_multi_processor * CUDA_STACK_BYTES_PER_THREAD
    assert (
        local_memory
        < fresh["measured_outside_bytes"]
        <= reserve.MAX_PLAUSIBLE_OUTSIDE_FACTOR * formula.outside_allocator_bytes
    )
    assert reserve.reserve_file().exists()
    reserve.forget_in_process()
    found = reserve.runtime_reserve()  # from the file the fresh process cached
    assert found.to_dict() == fresh

    folder = tiny_checkpoint("qwen3_5_moe", "nvfp4", False)
    plan = plan_memory(
        footprint_from_checkpoint(folder),
        found.reserve_bytes + SPARE_BYTES,
        "4gb",
        reserve_bytes=found.reserve_bytes,
        reserve_source=found.source,
    )
    assert plan.reserve_measured and plan.breakdown["runtime_reserve"] == found.reserve_bytes
    gc.collect()
    torch.cuda.empty_cache()
    cap = cap_process_memory(plan.budget_bytes)
    try:
        assert cap.outside_estimate_bytes == found.outside_allocator_bytes
        torch.cuda.reset_peak_memory_stats()
        model = load_model(folder, "cuda", gpu_dtype(), expert_cache_slots=plan.expert_slots, expert_backend="offload")
        state = model.new_state(plan.kv_tokens)
        prompt = torch.randint(2, 320, (plan.max_prompt_tokens,), generator=torch.Generator().manual_seed(3))
        for start in range(0, len(prompt), plan.prefill_chunk_tokens):
            token = int(model.forward(prompt[start : start + plan.prefill_chunk_tokens], state).argmax())
        for _ in range(DECODE_STEPS):  # captured as CUDA graphs after the first
            token = int(model.forward([token], state).argmax())
        torch.cuda.synchronize()
        peak = measured_peak()
        print(f"plan {plan.summary()}\npeak {peak}")
        assert peak["peak_process_bytes"] <= plan.budget_bytes
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        reserve.forget_in_process()
