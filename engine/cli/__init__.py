"""`python -m engine`: chat, generate, plan, bench and pull from the command line.

Every error a user can make ends in one line on stderr and a non-zero exit code. Each command lives in its own
module, its options next to what it runs; `COMMANDS` lists them in the order `--help` shows them.
"""

from __future__ import annotations

import argparse
import codecs
import io
import sys

from engine.cli import bench, bench_agent, bench_resume, chat, plan, pull, serve
from engine.cli.common import EXIT_FAILED, EXIT_USAGE, CliError, Parser
from engine.errors import CheckpointError

COMMANDS = (chat, plan, bench, bench_agent, bench_resume, serve, pull)


def build_parser() -> argparse.ArgumentParser:
    """Build the parser of every command, each one's `run` set as its default."""
    parser = Parser(prog="python -m engine", description="MoE Desk engine: chat, generate, plan")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for command in COMMANDS:
        command.register(commands)
    return parser


def _printable_output() -> None:
    """Let a terminal or pipe that is not UTF-8 show what it cannot encode as escapes instead of failing."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper) and codecs.lookup(stream.encoding).name != "utf-8":
            stream.reconfigure(errors="backslashreplace")


def main(argv: list[str] | None = None) -> int:
    """Run the command argv names; return its exit code, with every user error as one line on stderr."""
    _printable_output()
    try:
        args = build_parser().parse_args(argv)
        return args.run(args)
    except CliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
