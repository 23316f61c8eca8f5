"""`pull`: download a model from the Hugging Face Hub with a status line, resuming an unfinished one."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from engine.cli.common import EXIT_FAILED, EXIT_INTERRUPTED


def register(commands) -> None:
    """Add the pull command."""
    pull = commands.add_parser("pull", help="download a model from the Hugging Face Hub (resumes an unfinished one)")
    pull.add_argument("repo_id", help="the model's repo, e.g. nvidia/Qwen3.6-35B-A3B-NVFP4")
    pull.add_argument("--revision", default="main", help="branch, tag or commit (default: main)")
    pull.add_argument(
        "--local-dir",
        type=Path,
        help="the model folder to fill (default: ORG--NAME in MoE Desk's "
        "models folder, which the app lists; $MOEDESK_MODELS_DIR "
        "sets it)",
    )
    pull.add_argument("--endpoint", help="a Hub mirror's address (default: $HF_ENDPOINT or huggingface.co)")
    pull.add_argument("--offline", action="store_true", help="refuse to contact the Hub (as HF_HUB_OFFLINE=1 does)")
    pull.set_defaults(run=run_pull)


def run_pull(args) -> int:
    """Download with one status line (rewritten in place on a terminal, a line per file otherwise).

    The token is huggingface_hub's own (`hf auth login` or HF_TOKEN); Ctrl-C stops and keeps what arrived
    (a second Ctrl-C stops without waiting for a stalled read), and running the same command again resumes."""
    from engine import hub

    out = sys.stdout
    tty = out.isatty()
    state = {"file": None, "last": 0.0, "width": 0}

    def show_plan(plan) -> None:
        have = f", {hub.format_size(plan.have_bytes)} already here" if plan.have_bytes else ""
        print(
            f"{plan.repo_id} @ {plan.revision} (commit {plan.commit[:12]}): {len(plan.files)} files, "
            f"{hub.format_size(plan.total_bytes)}{have} -> {plan.folder}",
            file=out,
        )
        if plan.fit is not None:
            presets = "  ".join(f"{p.removesuffix('gb')} GB {'yes' if ok else 'no'}" for p, ok in plan.fit.fits.items())
            print(
                f"needs about {hub.format_size(plan.fit.ram_bytes)} of RAM; VRAM presets that fit: {presets}", file=out
            )
        elif plan.fit_note:
            print(plan.fit_note, file=out)
        out.flush()

    def show(p) -> None:
        now = time.monotonic()
        line = (
            f"[{100 * p.done / max(p.total, 1):5.1f}%] {p.files_done}/{p.files_total} {p.file} "
            f"{hub.format_size(p.file_done)}/{hub.format_size(p.file_size)}"
        )
        if p.state == "downloading" and p.speed > 0:
            line += f"  {hub.format_size(p.speed)}/s  ETA {hub.format_duration(p.eta_s)}"
        elif p.state != "downloading":
            line += f"  ({p.state})"
        if tty:
            if now - state["last"] >= 0.2 or p.state in ("verifying", "done"):
                out.write("\r" + line.ljust(state["width"]))
                state["width"] = len(line)
                state["last"] = now
        elif (
            p.state in ("retrying", "done")
            or (p.file != state["file"] and p.file_done == 0)
            or now - state["last"] >= 10
        ):
            out.write(line + "\n")
            state["last"] = now
        state["file"] = p.file
        out.flush()

    control = hub.DownloadControl()

    def on_interrupt(*_) -> None:
        if control.stopping:  # the second Ctrl-C: do not wait for the download to reach its next piece
            raise KeyboardInterrupt
        control.interrupt()

    previous = signal.signal(signal.SIGINT, on_interrupt)
    try:
        folder = hub.pull(
            args.repo_id,
            args.revision,
            args.local_dir,
            endpoint=args.endpoint,
            offline=args.offline,
            progress=show,
            control=control,
            on_plan=show_plan,
        )
    except hub.HubError as exc:
        if tty:
            out.write("\n")
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except (hub.DownloadCancelled, KeyboardInterrupt) as exc:
        if tty:
            out.write("\n")
        folder = getattr(exc, "folder", "")
        kept = (
            "nothing was downloaded"
            if folder is None
            else f"what arrived is kept{f' in {folder}' if folder else ''}: run the same command again to resume"
        )
        print(f"error: interrupted; {kept}", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        signal.signal(signal.SIGINT, previous)
    if tty:
        out.write("\n")
    print(f"done: {folder} (try it: python -m engine chat --model {folder})", file=out)
    return 0
