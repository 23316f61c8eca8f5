"""Time the decode GEMV of the quantised linear kernel over tilings, for the real layout's decode shapes (NVFP4):
`python3 tools/gpu/gemv_sweep.py [NAME PART]` from the repository root on a CUDA machine.

For each shape and each (BN, BK, warps, stages) it checks the output against the current tiling's and prints the
graph time per call (weights rotated past the L2 cache, as in tools/gpu/kernel_bench.py), then the best tiling.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from kernel_bench import _copies, nvfp4_tensors, rel_error, stack_in_pool, stored, time_call, weight_bytes  # noqa: E402

from engine.checkpoint.formats import DENSE, NVFP4  # noqa: E402
from engine.kernels import triton_linear, triton_linear_launch  # noqa: E402
from engine.kernels.triton_linear_kernel import F_DENSE, F_NVFP4  # noqa: E402

# name, out features, in features, slot rows (0: a plain linear), swiglu
SHAPES = [
    ("gdn in_proj qkvz", 12288, 2048, 0, False),
    ("gdn out_proj", 2048, 4096, 0, False),
    ("shared gate_up", 1024, 2048, 0, False),
    ("shared down swiglu", 2048, 512, 0, True),
    ("routed gate_up x8", 1024, 2048, 8, False),
    ("routed down x8 swiglu", 2048, 512, 8, True),
    ("dense router+gate", 257, 2048, -1, False),
    ("dense gdn in_proj_ba", 64, 2048, -1, False),
]
TILINGS = list(itertools.product((4, 8, 16), (512, 1024, 2048), (4, 8), (1, 3)))
DENSE_TILINGS = list(itertools.product((1, 2, 4, 8), (128, 256, 512, 1024), (2, 4, 8), (1, 3)))


def calls_for(n, k, rows, swiglu, gen):
    """(one call per weight copy, bytes per call) of a shape."""
    width = 2 * k if swiglu else k
    if rows < 0:  # a dense bf16 weight: the kernel's GEMV against cuBLAS
        weights = [
            stored(DENSE, {"weight": torch.randn(n, k, generator=gen, device="cuda").to(torch.bfloat16)}, (n, k))
            for _ in range(_copies(n * k * 2))
        ]
        x = torch.randn(1, k, generator=gen, device="cuda").to(torch.bfloat16)
        dense = [w.tensors["weight"] for w in weights]
        _, cublas = time_call([lambda d=d: torch.matmul(x, d.T) for d in dense], 200)
        print(f"dense {n}x{k}: cuBLAS {cublas:.2f} us", flush=True)
        return [lambda w=w: triton_linear.linear(x, w) for w in weights], n * k * 2
    if rows == 0:
        weights = [stored(NVFP4, nvfp4_tensors(n, k, "cuda", gen), (n, k))]
        nbytes = weight_bytes(weights[0])
        weights += [stored(NVFP4, nvfp4_tensors(n, k, "cuda", gen), (n, k)) for _ in range(_copies(nbytes) - 1)]
        x = torch.randn(1, width, generator=gen, device="cuda").to(torch.bfloat16)
        return [lambda w=w: triton_linear.linear(x, w, swiglu=swiglu) for w in weights], nbytes
    slots = 256
    _pool, (main, _other) = stack_in_pool(
        [nvfp4_tensors(n, k, "cuda", gen, lead=(slots,)), nvfp4_tensors(k, n, "cuda", gen, lead=(slots,))], slots
    )
    weight = stored(NVFP4, main, (slots, n, k))
    x = torch.randn(1, width, generator=gen, device="cuda").to(torch.bfloat16).expand(rows, width)
    choices = [
        torch.randperm(slots, generator=torch.Generator().manual_seed(s))[:rows].to("cuda", torch.int32)
        for s in range(16)
    ]
    nbytes = weight_bytes(weight, slots_used=rows)
    return [lambda c=c: triton_linear.slot_linear(x, weight, c, swiglu=swiglu) for c in choices], nbytes


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    chosen = triton_linear_launch._gemv_blocks
    print(f"{'shape':24s} {'BN':>3s} {'BK':>5s} {'w':>2s} {'st':>2s} {'us':>7s} {'GB/s':>6s}")
    only = sys.argv[1] if len(sys.argv) > 1 else ""
    for name, n, k, rows, swiglu in SHAPES:
        if only not in name:
            continue
        calls, nbytes = calls_for(n, k, rows, swiglu, gen)
        triton_linear_launch._gemv_blocks = chosen
        expected = calls[0]()
        _, now = time_call(calls, 200)
        fmt, width = (F_DENSE, torch.empty(0, dtype=torch.bfloat16)) if rows < 0 else (F_NVFP4, None)
        ops = triton_linear_launch.Operands(fmt, width, None, None, (), (), (), False, (1, 1))
        current = chosen(ops, n, k, max(rows, 1), torch.cuda.get_device_properties(0).multi_processor_count)
        print(f"{name:24s} current {current} {now:7.2f} {nbytes / now / 1e3:6.0f}", flush=True)
        best = (now, current)
        for bn, bk, warps, stages in DENSE_TILINGS if rows < 0 else TILINGS:
            if bk > k:
                continue
            tiling = (bn, bk, warps, stages)
            triton_linear_launch._gemv_blocks = lambda *a, t=tiling: t
            error = rel_error(calls[0](), expected)
            if error > 1e-2:
                print(f"{name:24s} {bn:3d} {bk:5d} {warps:2d} {stages:2d} error {error:.3g}")
                continue
            _, us = time_call(calls, 100)
            best = min(best, (us, tiling))
            print(f"{name:24s} {bn:3d} {bk:5d} {warps:2d} {stages:2d} {us:7.2f} {nbytes / us / 1e3:6.0f}", flush=True)
        print(f"{name:24s} BEST {best[1]} {best[0]:.2f} us against {now:.2f} now", flush=True)
    triton_linear_launch._gemv_blocks = chosen


if __name__ == "__main__":
    main()
