"""Entry point of the desktop app. The chat window arrives with the desktop-app issue; until then
this says so instead of pretending, and points at the engine's command line."""

from __future__ import annotations

import sys


def main() -> int:
    print("MoE Desk: the desktop window is not built yet. The engine is usable from Python: "
          "engine.load_model(folder).score(token_ids).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
