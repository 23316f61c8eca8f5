"""Print issue 22's side-by-side table (docs/BENCHMARKS.md) from one device run's results folder:
`python tools/gpu/side_by_side.py RESULTS_DIR [--routing uniform]`.

It reads MoE Desk's `engine bench --json` results (bench_<preset>.json, bench_laptop_<pinned|pageable>.json, as
tools/gpu/issue19_runs.sh writes them) and llama.cpp's (llama_<preset>_{prefill,decode}.json: llama-bench -o
json; .vram: the measured peak; _fit.json: the --n-cpu-moe chosen; llama_laptop_*: the 4gb fit at 8 threads, as
tools/gpu/issue22_runs.sh writes them).
Per preset: MoE Desk's best backend and `auto` against llama.cpp, decode tok/s (128 tokens after a 4,096-token
prompt), prefill tok/s and TTFT at 512, 4,096 and 16,384 tokens, peak VRAM, and the ratios the goal asks for
(decode >= 1.5x, prefill >= 3x llama.cpp's).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

PRESETS = ("4gb", "8gb", "12gb")
PROMPTS = (512, 4096, 16384)
DECODE_AFTER = 4096
DECODE_GOAL, PREFILL_GOAL = 1.5, 3.0
PRESET_THREADS, LAPTOP_THREADS = 16, 8
GIB = 2**30


@dataclass
class Row:
    """One engine's figures at one preset; None where it has none."""

    engine: str
    decode: float | None = None
    prefill: dict[int, float] = field(default_factory=dict)
    ttft: dict[int, float] = field(default_factory=dict)
    peak_bytes: int | None = None
    budget_bytes: int | None = None


def load_json(path: Path) -> dict | list | None:
    """A JSON file, or None where it is absent or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def load_llama_bench(path: Path) -> list[dict]:
    """llama-bench's JSON rows, the finished ones too where the run was cut short (its array left open)."""
    try:
        text = path.read_text()
    except OSError:
        return []
    try:
        return json.loads(text)
    except ValueError:
        end = text.rfind("}")  # the last finished test object (print_test writes each whole)
        try:
            return json.loads(text[: end + 1] + "]") if end > 0 else []
        except ValueError:
            return []


def ours_rows(result: dict, routing: str) -> list[Row]:
    """MoE Desk's best backend and auto at one preset, from its bench result under `routing`."""
    runs = [r for r in result["runs"] if r.get("routing") == routing and "prefill_tokens_per_s" in r]
    budget = (result.get("plan") or {}).get("budget_bytes")
    peaks = [r["peak_process_bytes"] for r in result["runs"] if "peak_process_bytes" in r]
    common = {
        "prefill": {r["prompt_tokens"]: r["prefill_tokens_per_s"] for r in runs if r["prompt_tokens"] in PROMPTS},
        "ttft": {r["prompt_tokens"]: r["time_to_first_token_s"] for r in runs if r["prompt_tokens"] in PROMPTS},
        "peak_bytes": max(peaks) if peaks else None,
        "budget_bytes": budget,
    }
    decoded = next((r for r in runs if r.get("decode_by_backend")), None)
    if decoded is None:
        return [Row("MoE Desk", **common)]
    by_backend = decoded["decode_by_backend"]
    fixed = {name: d for name, d in by_backend.items() if name != "auto"}
    rows = []
    if fixed:
        best = max(fixed, key=lambda name: fixed[name]["decode_tokens_per_s"])
        rows.append(Row(f"MoE Desk, best backend ({best})", fixed[best]["decode_tokens_per_s"], **common))
    if "auto" in by_backend:
        chosen = by_backend["auto"].get("decode_auto_trial", {}).get("chosen", "?")
        rows.append(Row(f"MoE Desk, auto (chose {chosen})", by_backend["auto"]["decode_tokens_per_s"], **common))
    return rows


def baseline_row(result: dict) -> Row | None:
    """The transformers + accelerate row the bench ran under the same cap (--hf-baseline), if it ran."""
    baseline = result.get("baseline") or {}
    if "decode_tokens_per_s" not in baseline:
        return None
    prompt = baseline["prompt_tokens"]
    return Row(f"transformers + accelerate ({prompt}-token prompt)", baseline["decode_tokens_per_s"])


def llama_row(folder: Path, preset: str, threads: int) -> Row | None:
    """llama.cpp's figures at one preset and thread count, or None where it did not run."""
    prefill = [
        r
        for r in load_llama_bench(folder / f"llama_{preset}_prefill.json")
        if r["n_threads"] == threads and r["n_gen"] == 0 and r["n_depth"] == 0
    ]
    decode = [
        r
        for r in load_llama_bench(folder / f"llama_{preset}_decode.json")
        if r["n_threads"] == threads and r["n_prompt"] == 0 and r["n_gen"] > 0
    ]
    if not prefill and not decode:
        return None
    fit = load_json(folder / f"llama_{preset}_fit.json") or {}
    peaks = [
        int(text)
        for name in ("prefill", "decode")
        if (text := _read(folder / f"llama_{preset}_{name}.vram")).strip().isdigit()
    ]
    n_cpu_moe = (prefill or decode)[0]["n_cpu_moe"]
    return Row(
        f"llama.cpp, --n-cpu-moe {n_cpu_moe}, -ub {(prefill or decode)[0]['n_ubatch']}, {threads} threads",
        decode[0]["avg_ts"] if decode else None,
        {r["n_prompt"]: r["avg_ts"] for r in prefill},
        {r["n_prompt"]: r["avg_ns"] / 1e9 for r in prefill},
        max(peaks) if peaks else None,
        fit.get("budget_bytes"),
    )


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _ratio(ours: float | None, theirs: float | None, goal: float) -> str:
    if ours is None or not theirs:
        return "-"
    ratio = ours / theirs
    return f"{ratio:.2f}x {'meets' if ratio >= goal else 'short of'} {goal:g}x"


def _number(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def table(sections: list[tuple[str, list[Row], Row | None]]) -> str:
    """The markdown table: each section's MoE Desk rows with their ratios to its llama.cpp row, then that row."""
    head = (
        "| preset | engine | decode tok/s | prefill tok/s 512 / 4,096 / 16,384 | TTFT s 512 / 4,096 / 16,384 "
        "| peak VRAM GiB | decode vs llama.cpp | prefill vs llama.cpp 512 / 4,096 / 16,384 |"
    )
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for label, ours, theirs in sections:
        for row in ours + ([theirs] if theirs is not None else []):
            peak = "-" if row.peak_bytes is None else f"{row.peak_bytes / GIB:.2f}"
            if row.peak_bytes is not None and row.budget_bytes and row.peak_bytes > row.budget_bytes:
                peak += " (over budget)"
            is_ours = row is not theirs
            decode_ratio = _ratio(row.decode, theirs.decode, DECODE_GOAL) if is_ours and theirs else ""
            prefill_ratio = (
                " / ".join(_ratio(row.prefill.get(p), theirs.prefill.get(p), PREFILL_GOAL) for p in PROMPTS)
                if is_ours and theirs
                else ""
            )
            lines.append(
                f"| {label} | {row.engine} | {_number(row.decode)} | "
                + " / ".join(_number(row.prefill.get(p), 0) for p in PROMPTS)
                + " | "
                + " / ".join(_number(row.ttft.get(p), 2) for p in PROMPTS)
                + f" | {peak} | {decode_ratio} | {prefill_ratio} |"
            )
    return "\n".join(lines)


def sections(folder: Path, routing: str) -> list[tuple[str, list[Row], Row | None]]:
    """The presets and the laptop emulation that have results in `folder`, in the table's order."""
    found = []
    for preset in PRESETS:
        result = load_json(folder / f"bench_{preset}.json")
        ours = ours_rows(result, routing) if result else []
        baseline = baseline_row(result) if result else None
        theirs = llama_row(folder, preset, PRESET_THREADS)
        if ours or theirs:
            found.append((preset, ours, theirs))
        if baseline is not None:
            found.append((preset, [baseline], theirs))
    laptop_llama = llama_row(folder, "laptop", LAPTOP_THREADS)
    if laptop_llama is not None:
        laptop_llama.engine += ", link not held (llama.cpp has no such throttle)"
    for records in ("pinned", "pageable"):
        result = load_json(folder / f"bench_laptop_{records}.json")
        if result:
            found.append((f"4gb laptop, 6.5 GB/s, 8 threads, {records}", ours_rows(result, routing), laptop_llama))
    return found


def ubatch_lines(folder: Path) -> list[str]:
    """llama.cpp's prefill at each batch size the `llamaub` part measured, with its peak VRAM."""
    lines = []
    for path in sorted(folder.glob("llama_ub*.json"), key=lambda p: int(p.stem.removeprefix("llama_ub") or 0)):
        rows = load_llama_bench(path)
        peak = _read(path.with_suffix(".vram")).strip()
        peak_text = f"{int(peak) / GIB:.2f} GiB" if peak.isdigit() else "unmeasured"
        if rows:
            lines.append(
                f"llama.cpp -ub/-b {rows[0]['n_ubatch']}: prefill {rows[0]['avg_ts']:,.0f} tok/s at "
                f"{rows[0]['n_prompt']:,} tokens, every expert on the CPU, peak {peak_text}"
            )
    return lines


def main(argv: list[str]) -> int:
    """Print the table for a results folder; say what is missing rather than fail."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--routing", default="uniform", help="MoE Desk's forced routing to compare (default uniform)")
    args = parser.parse_args(argv)
    found = sections(args.folder, args.routing)
    batches = ubatch_lines(args.folder)
    if not found and not batches:
        print(
            f"side_by_side: no bench_<preset>.json or llama_<preset>_*.json in {args.folder}; run "
            f"tools/gpu/issue22_runs.sh there first",
            file=sys.stderr,
        )
        return 1
    print("\n\n".join(part for part in (table(found) if found else "", "\n".join(batches)) if part))
    print(
        f"\nMoE Desk: routing {args.routing}, decode {DECODE_AFTER:,}-token prompt first; llama.cpp: llama-bench "
        f"decode after -d {DECODE_AFTER}, TTFT = its prompt-only test's mean time (avg_ns), peak VRAM = "
        f"nvidia-smi memory.used above the idle GPU, sampled every 100 ms."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
