"""engine/kernels/sdpa_attention.py on a CUDA GPU: right answers, which SDPA backend runs, peak memory, speed.

Run from the repository root:  python3 tools/gpu/attention_check.py
Shapes are one Qwen3.6 attention layer (Hq=16, Hkv=2, D=256): a chunk of 256 queries after a prefix
(S = 4096, 32768) and one decode step at S = 32768. Every row is caught on its own: a failure is a row of
the table, never the end of the run. Each case runs with torch's default backend choice ("auto") and forced to
one backend with torch.nn.attention.sdpa_kernel; a forced backend that cannot take the inputs errors ("no
kernel"), which is how the table shows what each backend accepts. "auto" names the backend from the aten ops
the profiler saw. bf16 is the H200's dtype; fp16 rows stand in for Turing (sm_75: no flash, no bf16), whose
only fused backend is memory-efficient.

Columns: err/ref = max|out - reference| / max|reference| against engine.kernels.reference in the same dtype
(which rounds q.k to bf16, so expect up to ~1e-2); err/f32 = the same against the reference in float32 from the
same inputs; peak MiB = torch.cuda.max_memory_allocated() growth over the call (the inputs already exist);
plan MiB = what the memory plan budgets for the attention core at this chunk (engine/runtime/planner.py:
output, online-softmax accumulators, one 128-query x 512-key block pair); all-head scores = Hq*T*S*4 bytes,
what must never be allocated.
"""

from __future__ import annotations

import sys
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from engine.kernels import reference  # noqa: E402
from engine.kernels.sdpa_attention import causal_attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 16, 2, 256
CASES = [(256, 4096), (256, 32768), (1, 32768)]  # (T new queries, S total positions)
MODES = {
    "auto": None,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}
BACKEND_OPS = {  # aten op name (substring) -> backend
    "_flash_attention_forward": "flash",
    "_scaled_dot_product_flash_attention": "flash",
    "_efficient_attention_forward": "efficient",
    "_scaled_dot_product_efficient_attention": "efficient",
    "_scaled_dot_product_cudnn_attention": "cudnn",
    "_cudnn_attention_forward": "cudnn",
    "_scaled_dot_product_attention_math": "math",
    "aten::bmm": "math",
}
TOLERANCE = {"ref": 2e-2, "f32": 1e-2}  # bf16; fp16 is tighter but the same bound is used
MIB = 2**20


def plan_budget(new: int) -> int:
    try:
        from engine.runtime.footprint import ACCUMULATOR_BYTES, ACTIVATION_BYTES
        from engine.runtime.workspace import ATTENTION_KEY_BLOCK, ATTENTION_QUERY_BLOCK
    except Exception:  # noqa: BLE001 - the figure is context only
        ACCUMULATOR_BYTES, ACTIVATION_BYTES, ATTENTION_KEY_BLOCK, ATTENTION_QUERY_BLOCK = 4, 2, 512, 128
    width = HEADS * HEAD_DIM
    per_token = (width + 2 * HEADS) * ACCUMULATOR_BYTES + width * ACTIVATION_BYTES
    block_pair = (
        2 * min(new, ATTENTION_QUERY_BLOCK) * HEADS * ATTENTION_KEY_BLOCK * ACCUMULATOR_BYTES
        + 2 * ATTENTION_KEY_BLOCK * HEADS * HEAD_DIM * ACTIVATION_BYTES
    )
    return new * per_token + block_pair


def backend_of(fn) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    seen = {backend for event in prof.events() for op, backend in BACKEND_OPS.items() if op in event.name}
    for backend in ("flash", "efficient", "cudnn", "math"):  # a fused op also shows up as its wrappers
        if backend in seen:
            return backend
    kernels = sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})
    return "?" + (",".join(k[:30] for k in kernels[:3]) if kernels else "")


def measure(fn, repeats: int) -> tuple[torch.Tensor, float, float]:
    """(output, peak extra MiB, ms per call)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / MIB
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return out, peak, (time.perf_counter() - start) / repeats * 1e3


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected.float()).abs().max() / expected.float().abs().max())


def main() -> int:
    print(
        f"torch {torch.__version__}, {torch.cuda.get_device_name()}, "
        f"sm_{''.join(map(str, torch.cuda.get_device_capability()))}",
        flush=True,
    )
    header = (
        f"{'dtype':<5} {'T':>4} {'S':>6} {'mode':<10} {'backend':<10} {'err/ref':>8} {'err/f32':>8} "
        f"{'peak MiB':>9} {'plan MiB':>9} {'ms':>8}  result"
    )
    rows, failures = [header, "-" * len(header)], 0
    for dtype in (torch.bfloat16, torch.float16):
        for new, total in CASES:
            gen = torch.Generator(device="cuda").manual_seed(new * 100003 + total)
            q = torch.randn(new, HEADS, HEAD_DIM, device="cuda", generator=gen).to(dtype)
            k = torch.randn(total, KV_HEADS, HEAD_DIM, device="cuda", generator=gen).to(dtype)
            v = torch.randn(total, KV_HEADS, HEAD_DIM, device="cuda", generator=gen).to(dtype)
            scale = HEAD_DIM**-0.5
            name, plan = str(dtype).removeprefix("torch."), plan_budget(new) / MIB
            scores = HEADS * new * total * 4 / MIB
            try:
                with torch.no_grad():
                    expected = reference.causal_attention(q, k, v, scale)
                    exact = reference.causal_attention(q.float(), k.float(), v.float(), scale)
                    _, ref_peak, ref_ms = measure(lambda: reference.causal_attention(q, k, v, scale), 5)
                rows.append(
                    f"{name:<5} {new:>4} {total:>6} {'reference':<10} {'-':<10} {'':>8} "
                    f"{relative_error(expected, exact):>8.1e} {ref_peak:>9.1f} {plan:>9.1f} {ref_ms:>8.3f}  "
                    f"(all-head scores {scores:.0f} MiB)"
                )
            except Exception as error:  # noqa: BLE001
                rows.append(f"{name:<5} {new:>4} {total:>6} reference  FAILED {type(error).__name__}: {error}"[:200])
                failures += 1
                continue
            for mode, backend in MODES.items():

                def call(backend=backend):
                    if backend is None:
                        return causal_attention(q, k, v, scale)
                    with sdpa_kernel([backend]):
                        return causal_attention(q, k, v, scale)

                prefix = f"{name:<5} {new:>4} {total:>6} {mode:<10}"
                try:
                    with torch.no_grad(), warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        out, peak, ms = measure(call, 20)
                        ran = backend_of(call)
                    err_ref, err_f32 = relative_error(out, expected), relative_error(out, exact)
                    problems = []
                    if out.shape != expected.shape or out.dtype != dtype:
                        problems.append(f"shape/dtype {tuple(out.shape)} {out.dtype}")
                    if not (err_ref < TOLERANCE["ref"] and err_f32 < TOLERANCE["f32"]):
                        problems.append("WRONG")
                    if mode != "math" and peak > plan:
                        problems.append("over plan")
                    failures += bool(problems) and mode == "auto"
                    rows.append(
                        f"{prefix} {ran:<10} {err_ref:>8.1e} {err_f32:>8.1e} {peak:>9.1f} {plan:>9.1f} "
                        f"{ms:>8.3f}  {' '.join(problems) or 'ok'}"
                    )
                except Exception as error:  # noqa: BLE001 - a forced backend that cannot run is a result
                    message = str(error).strip().splitlines()[-1] if str(error).strip() else ""
                    kind = "no kernel" if "No available kernel" in str(error) else type(error).__name__
                    failures += mode == "auto"
                    rows.append(
                        f"{prefix} {'-':<10} {'':>8} {'':>8} {'':>9} {plan:>9.1f} {'':>8}  {kind}: {message[:90]}"
                    )
                    if mode == "auto":
                        traceback.print_exc()
                print(rows[-1], flush=True)
            q = k = v = expected = exact = None  # frees this case's tensors before the next is made
    print("\n".join(["", *rows]))
    print(
        f"\n{failures} failing 'auto'/reference row(s); forced-backend rows are information "
        "(a forced backend over plan or with no kernel is not a failure)"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
