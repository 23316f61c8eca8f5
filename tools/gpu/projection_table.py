"""Print the modelled projection onto real cards (engine/bench_projection.py) and its check against the runs:
`python -m tools.gpu.projection_table BENCH.json [BENCH.json ...]` (results of `engine bench --json`; older
ones without a "projection" key are projected here the same way).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from engine.bench_projection import projection
from engine.runtime.footprint import footprint_from_synthetic


def projected(result: dict) -> dict | None:
    """The result's projection, computed now where the run predates it."""
    return result.get("projection") or projection(result, footprint_from_synthetic(result["model"]))


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.0f} %"


def check_lines(name: str, checked: dict) -> list[str]:
    """One markdown row per backend: the formula's error against the run's measured decodes, and prefill's."""
    lines = []
    for backend, summary in checked["decode_error_by_backend"].items():
        lines.append(
            f"| {name} | decode, {backend} | {summary['rows']} | {_percent(summary['median_abs_error'])} "
            f"| {_percent(summary['max_abs_error'])} | {_percent(summary['mean_signed_error'])} |"
        )
    prefill = checked["prefill_error"]
    if prefill["rows"]:
        lines.append(
            f"| {name} | prefill (other prompts than 4,096) | {prefill['rows']} | "
            f"{_percent(prefill['median_abs_error'])} | {_percent(prefill['max_abs_error'])} | "
            f"{_percent(prefill['mean_signed_error'])} |"
        )
    return lines


def card_lines(name: str, card: dict, routing: str = "uniform") -> list[str]:
    """One markdown row per backend of a projected card: decode (formula, scaled) and prefill at 512/4k/16k."""
    prefill = card["prefill_tokens_per_s"]
    prefills = " / ".join(f"{prefill[p]['modelled']:,.0f}" for p in sorted(prefill, key=int))
    ttft = " / ".join(f"{prefill[p]['time_to_first_token_s']:.1f}" for p in sorted(prefill, key=int))
    lines = []
    for backend, decode in card["decode_tokens_per_s"].get(routing, {}).items():
        if backend == "auto":
            continue  # auto runs one of the others
        lines.append(
            f"| {card['card']['name']} | {name} | {backend} | {decode['modelled']:.1f} | "
            f"{decode['scaled_by_measured']:.1f} | {prefills} | {ttft} |"
        )
    return lines


def main(argv: list[str]) -> int:
    """Print the check table and the cards' table for the given results; say which files could not be read."""
    checks = ["| run | what | rows | median error | largest error | mean signed error |", "|---|---|---|---|---|---|"]
    cards = [
        "| card (modelled) | from run | backend | decode tok/s, formula | decode tok/s, scaled by measured | "
        "prefill tok/s 512 / 4,096 / 16,384 | TTFT s |",
        "|---|---|---|---|---|---|---|",
    ]
    for path in map(Path, argv):
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            print(f"projection_table: cannot read {path} ({exc}); skipped", file=sys.stderr)
            continue
        found = projected(result)
        if found is None:
            print(f"projection_table: {path} has no GPU step or plan to project from; skipped", file=sys.stderr)
            continue
        checks += check_lines(path.stem, found["check"])
        for card in found["cards"]:
            cards += card_lines(path.stem, card)
    print("\n".join(checks) + "\n\n" + "\n".join(cards))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
