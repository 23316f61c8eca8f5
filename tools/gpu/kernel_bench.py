"""Check and time engine/kernels/triton_linear.py on a CUDA GPU: `python3 tools/gpu/kernel_bench.py` from
the repository root (torch with CUDA and triton; no pytest).

Every case is first checked against the reference (engine/kernels/reference.py) in float32 on the same device:
bf16 inputs, bf16 output, pass when max |out - ref| / max |ref| <= TOLERANCE. A failing case is reported and the
run goes on. Timings: the median of many calls after warm-up, CUDA events, weights rotated over copies that
together exceed the L2 cache (so the weight bytes come from HBM as in decode);
  eager us  each call timed on its own (host launch cost included),
  graph us  per call inside a replayed CUDA graph of many calls (device time),
  GB/s      quantised weight bytes read (codes + scales of the slots used) / graph time,
  bf16 us   torch.matmul (bmm for groups) of the same shape with dense bf16 weights, graph time.
Options: --quick (fewer repetitions), --only SUBSTRING (cases whose name contains it).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from engine.checkpoint.formats import DENSE, FP8_BLOCK, FP8_TENSOR, NVFP4, NVFP4_CT, StoredWeight  # noqa: E402
from engine.kernels import reference  # noqa: E402
from engine.kernels.groups import ExpertGroups  # noqa: E402

TOLERANCE = 1e-2  # bf16 activations and a bf16 output (2^-9 relative rounding) against float32 math
L2_BYTES = 128 << 20  # rotate over weight copies that add up to at least this (the H200 has 60 MB of L2)
MAX_COPIES = 64


# ------------------------------------------------------------------------------------------- weights (any device)


def _scales_fp8(shape, device, gen):
    """Block scales in a realistic range (2^-4 .. 2^3), stored as float8_e4m3fn."""
    return torch.exp2(torch.rand(shape, generator=gen, device=device) * 7 - 4).to(torch.float8_e4m3fn)


def nvfp4_tensors(n, k, device, gen, lead=(), per_row=True, compressed=False):
    codes = torch.randint(0, 256, (*lead, n, k // 2), generator=gen, device=device, dtype=torch.uint8)
    scales = _scales_fp8((*lead, n, k // 16), device, gen)
    if compressed:
        return {
            "weight_packed": codes,
            "weight_scale": scales,
            "weight_global_scale": torch.full((1,), 2688.0, device=device),
        }
    scale_2 = (torch.rand((*lead, n) if per_row else (), generator=gen, device=device) + 0.5) * 1e-3
    return {"weight": codes, "weight_scale": scales, "weight_scale_2": scale_2}


def fp8_tensors(n, k, device, gen, lead=(), per_row=True):
    weight = (torch.randn((*lead, n, k), generator=gen, device=device) * 64).to(torch.float8_e4m3fn)
    scale = (torch.rand((*lead, n) if per_row else (), generator=gen, device=device) + 0.5) * 1e-3
    return {"weight": weight, "weight_scale": scale}


def fp8_block_tensors(n, k, device, gen, block=(128, 128)):
    weight = (torch.randn((n, k), generator=gen, device=device) * 64).to(torch.float8_e4m3fn)
    scale = (torch.rand((-(-n // block[0]), -(-k // block[1])), generator=gen, device=device) + 0.5) * 1e-3
    return {"weight": weight, "weight_scale_inv": scale}


def dense_tensors(n, k, device, gen, lead=(), dtype=torch.bfloat16):
    return {"weight": (torch.randn((*lead, n, k), generator=gen, device=device) * 0.05).to(dtype)}


def stack_in_pool(parts: list[dict[str, torch.Tensor]], slots: int, align: int = 256):
    """Stacked views of `parts` (each a role -> [S, ...] tensor) inside one uint8 byte pool of `slots` records,
    as the expert cache keeps them: per slot one record with every tensor of every part, so each view's slot
    stride is the record size, not its own size. Returns the pool and, per part, role -> strided view."""
    layout, offset = [], 0
    for index, part in enumerate(parts):
        for role, t in part.items():
            inner = tuple(t.shape[1:])
            nbytes = math.prod(inner) * t.element_size()
            layout.append((index, role, t, inner, offset, nbytes))
            offset += -(-nbytes // align) * align
    record = offset + align  # a spare stretch: the slot stride is no product of any tensor's sizes
    device = parts[0][next(iter(parts[0]))].device
    pool = torch.zeros(slots * record, dtype=torch.uint8, device=device)
    records = pool.view(slots, record)
    views = [dict() for _ in parts]
    for index, role, t, inner, offset, nbytes in layout:
        view = records[:, offset : offset + nbytes].view(t.dtype).unflatten(1, inner)
        view.copy_(t)
        views[index][role] = view
    return pool, views


def stored(fmt, tensors, shape, name="w", block=(128, 128)) -> StoredWeight:
    return StoredWeight(fmt, tensors, tuple(shape), name, block)


def weight_bytes(w: StoredWeight, slots_used: int | None = None) -> int:
    total = 0
    for t in w.tensors.values():
        size = t.numel() * t.element_size()
        if slots_used is not None and t.dim() >= 1 and t.shape[0] == w.shape[0]:
            size = size // t.shape[0] * slots_used
        total += size
    return total


def groups_of(sizes: list[int], slots: list[int]) -> ExpertGroups:
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + size)
    return ExpertGroups(list(slots), offsets)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


# ------------------------------------------------------------------------------------------------- timing (cuda)


def _median_event_us(fn, reps):
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1000.0


def time_call(calls: list, reps: int, graph_calls: int = 32) -> tuple[float, float]:
    """(eager us, graph us) per call; `calls` rotate (one per weight copy)."""
    counter = [0]

    def one():
        calls[counter[0] % len(calls)]()
        counter[0] += 1

    for _ in range(3 * len(calls)):
        one()
    torch.cuda.synchronize()
    eager = _median_event_us(one, reps)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            one()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(graph_calls):
            one()
    graph.replay()
    torch.cuda.synchronize()
    per_replay = _median_event_us(graph.replay, max(5, reps // 8))
    return eager, per_replay / graph_calls


# ------------------------------------------------------------------------------------------------------ the cases


class Result:
    def __init__(self, name, shape, fmt, rows):
        self.name, self.shape, self.fmt, self.rows = name, shape, fmt, rows
        self.error = self.eager = self.graph = self.bf16 = self.gbs = None
        self.ok, self.note = False, ""


def _copies(nbytes: int) -> int:
    return max(1, min(MAX_COPIES, -(-L2_BYTES // max(1, nbytes))))


def linear_case(tl_mod, name, fmt, n, k, rows, reps, gen, device="cuda", **kw) -> Result:
    res = Result(name, f"{n}x{k}", fmt, rows)
    try:
        make = {
            NVFP4: lambda: nvfp4_tensors(n, k, device, gen, per_row=kw.get("per_row", True)),
            NVFP4_CT: lambda: nvfp4_tensors(n, k, device, gen, compressed=True),
            FP8_TENSOR: lambda: fp8_tensors(n, k, device, gen, per_row=kw.get("per_row", True)),
            FP8_BLOCK: lambda: fp8_block_tensors(n, k, device, gen),
        }[fmt]
        first = stored(fmt, make(), (n, k))
        nbytes = weight_bytes(first)
        x = torch.randn(rows, k, generator=gen, device=device).to(torch.bfloat16)
        expected = reference.linear(x.float(), first)
        got = tl_mod.linear(x, first)
        again = tl_mod.linear(x, first)  # the first call compiles; later ones take the cached launch
        res.error = max(rel_error(got, expected), rel_error(again, expected))
        res.ok = got.dtype == x.dtype and got.shape == expected.shape and res.error <= TOLERANCE
        if device != "cuda":
            return res
        weights = [first] + [stored(fmt, make(), (n, k)) for _ in range(_copies(nbytes) - 1)]
        res.eager, res.graph = time_call([lambda w=w: tl_mod.linear(x, w) for w in weights], reps)
        res.gbs = nbytes / (res.graph * 1e-6) / 1e9
        dense = [w.dequantize(torch.bfloat16) for w in weights[: _copies(n * k * 2)]]
        _, res.bf16 = time_call([lambda d=d: torch.matmul(x, d.T) for d in dense], reps)
    except Exception:  # noqa: BLE001 - report and go on
        res.note = traceback.format_exc(limit=3).strip().splitlines()[-1]
    return res


def grouped_case(tl_mod, name, fmt, n, k, sizes, slots_total, reps, gen, device="cuda") -> Result:
    """One stacked weight of `slots_total` slots in a byte pool (records that also hold a second weight, as an
    expert's gate_up and down share a record); groups of `sizes` rows on distinct, shuffled slots."""
    rows = sum(sizes)
    res = Result(name, f"{len(sizes)}x{rows // max(1, len(sizes))}r {n}x{k}", fmt, rows)
    try:
        lead = (slots_total,)
        make = {
            NVFP4: lambda nn, kk: nvfp4_tensors(nn, kk, device, gen, lead=lead),
            FP8_TENSOR: lambda nn, kk: fp8_tensors(nn, kk, device, gen, lead=lead),
            DENSE: lambda nn, kk: dense_tensors(nn, kk, device, gen, lead=lead),
        }[fmt]
        _pool, (main, _other) = stack_in_pool([make(n, k), make(k, n)], slots_total)
        weight = stored(fmt, main, (slots_total, n, k))
        x = torch.randn(rows, k, generator=gen, device=device).to(torch.bfloat16)
        n_groups = len(sizes)
        choices = [
            torch.randperm(slots_total, generator=torch.Generator().manual_seed(seed))[:n_groups].tolist()
            for seed in range(8 if n_groups < slots_total else 1)
        ]
        groups = [groups_of(sizes, slots) for slots in choices]
        expected = reference.grouped_linear(x.float(), weight, groups[0])
        got = tl_mod.grouped_linear(x, weight, groups[0])
        again = tl_mod.grouped_linear(x, weight, groups[0])  # compiled, then the cached launch
        res.error = max(rel_error(got, expected), rel_error(again, expected))
        res.ok = got.dtype == x.dtype and got.shape == expected.shape and res.error <= TOLERANCE
        if device != "cuda":
            return res
        nbytes = weight_bytes(weight, slots_used=sum(1 for s in sizes if s))
        res.eager, res.graph = time_call([lambda g=g: tl_mod.grouped_linear(x, weight, g) for g in groups], reps)
        res.gbs = nbytes / (res.graph * 1e-6) / 1e9
        per_group = sizes[0]
        if all(s == per_group for s in sizes):  # bmm over equal groups with gathered dense bf16 weights
            xs = x.view(n_groups, per_group, k)
            dense = torch.randn(n_groups, n, k, generator=gen, device=device).to(torch.bfloat16)
            copies = min(_copies(dense.numel() * 2), 4)
            denses = [dense] + [torch.randn_like(dense) for _ in range(copies - 1)]
            _, res.bf16 = time_call([lambda d=d: torch.bmm(xs, d.transpose(1, 2)) for d in denses], reps)
    except Exception:  # noqa: BLE001
        res.note = traceback.format_exc(limit=3).strip().splitlines()[-1]
    return res


def all_cases(tl_mod, reps, device="cuda", small=False):
    """(name, thunk) of every case; small: tiny shapes for a CPU dry run under TRITON_INTERPRET=1."""
    gen = torch.Generator(device=device).manual_seed(0)
    s = (lambda n: max(16, n // 64)) if small else (lambda n: n)
    slots = 8 if small else 256
    cases = []
    for n, k in ((512, 2048), (2048, 512)):
        cases.append(
            (
                f"linear nvfp4 {n}x{k} M=1",
                lambda n=n, k=k: linear_case(tl_mod, "linear", NVFP4, s(n), s(k), 1, reps, gen, device),
            )
        )
    cases.append(
        (
            "linear nvfp4 scalar-scale2 512x2048 M=1",
            lambda: linear_case(tl_mod, "linear s2", NVFP4, s(512), s(2048), 1, reps, gen, device, per_row=False),
        )
    )
    cases.append(
        (
            "linear nvfp4_ct 512x2048 M=1",
            lambda: linear_case(tl_mod, "linear", NVFP4_CT, s(512), s(2048), 1, reps, gen, device),
        )
    )
    for n, k in ((8192, 2048), (2048, 4096), (12288, 2048)):
        cases.append(
            (
                f"linear fp8 {n}x{k} M=1",
                lambda n=n, k=k: linear_case(tl_mod, "linear", FP8_TENSOR, s(n), s(k), 1, reps, gen, device),
            )
        )
    cases.append(
        (
            "linear fp8_block 8192x2048 M=1",
            lambda: linear_case(tl_mod, "linear", FP8_BLOCK, s(8192), s(2048), 1, reps, gen, device),
        )
    )
    for rows in (4, 16):
        cases.append(
            (
                f"linear nvfp4 512x2048 M={rows}",
                lambda rows=rows: linear_case(tl_mod, "linear", NVFP4, s(512), s(2048), rows, reps, gen, device),
            )
        )
        cases.append(
            (
                f"linear fp8 8192x2048 M={rows}",
                lambda rows=rows: linear_case(tl_mod, "linear", FP8_TENSOR, s(8192), s(2048), rows, reps, gen, device),
            )
        )
    for rows in (256, 2048):
        m = rows if not small else rows // 64
        cases.append(
            (
                f"linear nvfp4 512x2048 M={rows}",
                lambda m=m: linear_case(tl_mod, "linear", NVFP4, s(512), s(2048), m, reps, gen, device),
            )
        )
        cases.append(
            (
                f"linear fp8 8192x2048 M={rows}",
                lambda m=m: linear_case(tl_mod, "linear", FP8_TENSOR, s(8192), s(2048), m, reps, gen, device),
            )
        )
        cases.append(
            (
                f"linear fp8_block 8192x2048 M={rows}",
                lambda m=m: linear_case(tl_mod, "linear", FP8_BLOCK, s(8192), s(2048), m, reps, gen, device),
            )
        )
    for n, k in ((1024, 2048), (2048, 512)):
        cases.append(
            (
                f"grouped nvfp4 decode 8x1 {n}x{k}",
                lambda n=n, k=k: grouped_case(
                    tl_mod, "grouped decode", NVFP4, s(n), s(k), [1] * 8, slots, reps, gen, device
                ),
            )
        )
    for n, k in ((1024, 2048), (2048, 512)):
        for per_group in (8, 64):
            groups_n = slots if not small else 4
            rows_each = per_group if not small else per_group // 4
            cases.append(
                (
                    f"grouped nvfp4 prefill {groups_n}x{per_group} {n}x{k}",
                    lambda n=n, k=k, g=groups_n, r=rows_each: grouped_case(
                        tl_mod, "grouped prefill", NVFP4, s(n), s(k), [r] * g, slots, reps, gen, device
                    ),
                )
            )
    cases.append(
        (
            "grouped fp8 decode 8x1 1024x2048",
            lambda: grouped_case(
                tl_mod, "grouped decode", FP8_TENSOR, s(1024), s(2048), [1] * 8, slots, reps, gen, device
            ),
        )
    )
    cases.append(
        (
            "grouped fp8 prefill 256x8 1024x2048",
            lambda: grouped_case(
                tl_mod,
                "grouped prefill",
                FP8_TENSOR,
                s(1024),
                s(2048),
                [8] * (slots if not small else 4),
                slots,
                reps,
                gen,
                device,
            ),
        )
    )
    for n, k in ((1024, 2048), (2048, 512)):
        cases.append(
            (
                f"grouped dense-bf16 decode 8x1 {n}x{k}",
                lambda n=n, k=k: grouped_case(
                    tl_mod, "grouped decode", DENSE, s(n), s(k), [1] * 8, slots, reps, gen, device
                ),
            )
        )
    cases.append(
        (
            "grouped nvfp4 uneven 1024x2048",
            lambda: grouped_case(
                tl_mod, "grouped uneven", NVFP4, s(1024), s(2048), [3, 0, 17, 1, 40, 0, 5, 2], slots, reps, gen, device
            ),
        )
    )
    return cases


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", default="")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: this script checks and times the CUDA kernels")
        return 2
    from engine.kernels import triton_linear as tl_mod

    print(
        f"torch {torch.__version__}, triton {__import__('triton').__version__}, {torch.cuda.get_device_name()}, "
        f"capability {torch.cuda.get_device_capability()}",
        flush=True,
    )
    reps = 40 if args.quick else 200
    results, failures = [], 0
    for name, thunk in all_cases(tl_mod, reps):
        if args.only and args.only not in name:
            continue
        res = thunk()
        res.name = name
        results.append(res)
        status = "ok" if res.ok else "FAIL"
        failures += not res.ok
        print(f"{status:4} {name}: rel.err {_fmt(res.error, '.2e')} {res.note}", flush=True)
    print()
    header = f"{'case':44} {'fmt':10} {'rows':>5} {'eager us':>9} {'graph us':>9} {'GB/s':>7} {'bf16 us':>8} check"
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r.name:44} {r.fmt:10} {r.rows:5d} {_fmt(r.eager, '9.1f')} {_fmt(r.graph, '9.2f')} "
            f"{_fmt(r.gbs, '7.0f')} {_fmt(r.bf16, '8.2f')} "
            f"{'ok' if r.ok else 'FAIL ' + _fmt(r.error, '.1e') + ' ' + r.note}"
        )
    print(
        f"\n{len(results) - failures}/{len(results)} cases within {TOLERANCE:g} of the reference"
        + (f"; {failures} FAILED" if failures else "")
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
