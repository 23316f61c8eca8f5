"""What every command shares: the one-line error, the parser that raises it, and the exit codes."""

from __future__ import annotations

import argparse

EXIT_USAGE, EXIT_FAILED, EXIT_INTERRUPTED = 2, 1, 130


class CliError(Exception):
    """A problem to report in one line."""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's default prints the whole usage block first
        raise CliError(f"{message} (see {self.prog} --help)")

    def parse_args(self, args=None, namespace=None):
        """Parse, pointing an unknown argument after a command at that command's help."""
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            command = getattr(parsed, "command", None)
            where = f"{self.prog} {command}" if command else self.prog
            raise CliError(f"unrecognized arguments: {' '.join(extra)} (see {where} --help)")
        return parsed
