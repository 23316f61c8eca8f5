"""Prints a short table of one `engine bench --json` result, or of the rows its stderr logged when the run was
cut short: `python tools/gpu/summarise.py RESULT.json [RESULT.err]`."""

import ast
import json
import sys
from pathlib import Path

GIB = 2**30


def rows_from_log(path: Path) -> list[dict]:
    """The rows a bench printed to stderr as it went (`bench: {...}`)."""
    return [
        ast.literal_eval(line.removeprefix("bench: "))
        for line in path.read_text().splitlines()
        if line.startswith("bench: {")
    ]


def decode_cell(name: str, decode: dict) -> str:
    cell = f"{name} {decode['decode_tokens_per_s']:.1f} h{decode.get('decode_expert_cache_hit_rate', 0):.3f}"
    if "decode_vs_ceiling" in decode:
        cell += f" c{decode['decode_ceiling_tokens_per_s']:.0f}({decode['decode_vs_ceiling']:.2f})"
    if "decode_auto_trial" in decode:
        cell += f" chose {decode['decode_auto_trial'].get('chosen')}"
    return cell


def summarise(result: dict | None, logged: list[dict]) -> str:
    lines = []
    runs = logged
    if result is not None:
        plan = result.get("plan") or {}
        runs = result["runs"]
        lines.append(
            f"build {result.get('build_seconds', 0):.0f} s; floor {result.get('uniform_floor_hit_rate', 0):.3f}; "
            f"budget {plan.get('budget_bytes', 0) / GIB:.2f} GiB; reserve {plan.get('reserve_source')}; "
            f"guarantee {plan.get('max_prompt_tokens')}; gpu step "
            f"{1e3 * result.get('gpu_step_seconds', 0):.2f} ms ({result.get('gpu_step_source')}); "
            f"link {result.get('expert_link_bytes_per_s', 0) / 1e9:.1f} GB/s"
            f"{' (held: --link-gbps)' if result.get('link_limit_bytes_per_s') else ''}; cpu "
            f"{(result.get('calibration') or {}).get('cpu_bytes_per_s', 0) / 1e9:.1f} GB/s"
        )
    for row in runs:
        head = f"{row['prompt_tokens']:>7} {row['routing']:>8}"
        if "skipped" in row or "error" in row:
            lines.append(f"{head} {row.get('skipped') or row.get('error')}")
            continue
        peak = f" peak {row['peak_process_bytes'] / GIB:.2f} GiB" if "peak_process_bytes" in row else ""
        lines.append(
            f"{head} ttft {row['time_to_first_token_s']:.2f} s prefill {row['prefill_tokens_per_s']:.0f}"
            f"{peak}{'' if row.get('peak_within_budget', True) else ' OVER BUDGET'}"
        )
        by_backend = row.get("decode_by_backend") or ({"-": row} if "decode_tokens_per_s" in row else {})
        if by_backend:
            lines.append("          " + "; ".join(decode_cell(name, d) for name, d in by_backend.items()))
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    result = None
    try:
        result = json.loads(Path(argv[0]).read_text())
    except (OSError, ValueError):
        pass
    logged = rows_from_log(Path(argv[1])) if len(argv) > 1 and Path(argv[1]).exists() else []
    print(summarise(result, logged))


if __name__ == "__main__":
    main(sys.argv[1:])
