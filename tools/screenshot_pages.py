"""Screenshot every page of the main window as a screen of one size and scaling shows it, in one theme.

    QT_SCALE_FACTOR=1.25 .venv/bin/python -m tools.screenshot_pages OUT_FOLDER 1366x768 light|dark [PREFIX]

WIDTHxHEIGHT is the screen in device pixels and QT_SCALE_FACTOR its scaling: the window fills the screen's logical
size (1366x768 at 125 % is 1093x614), as a maximised window would, less its frame.

The window opens offscreen with the built-in demo model, a private settings file and a private chat store
seeded with one conversation that shows prose, inline code, a quote, a link, a code block and raw HTML from
the model; nothing of the user's is read or written. Files are named PREFIX-PAGE-WIDTHxHEIGHT@SCALE-THEME.png, the
screen's size and scaling.
Exits non-zero when the model does not load in time.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

LOAD_TIMEOUT_MS = 120_000
PAGES = ("Chat", "Models", "Engine", "Logs", "Settings")
SAMPLE_QUESTION = "How do I **reverse** a list in Python? Keep it `short`."
SAMPLE_ANSWER = """Use slicing or `list.reverse()`:

```python
def reversed_copy(items: list) -> list:
    # a new list, the original untouched
    return items[::-1]
```

> `reverse()` changes the list in place and returns `None`.

See the [Python tutorial](https://docs.python.org/3/tutorial/datastructures.html).
Raw HTML from a model stays text: <img src="https://example.com/x.png"> <b>bold?</b>"""


def _seed(store) -> None:
    conversation_id = store.create(enable_thinking=False)
    store.rename(conversation_id, "Reverse a list in Python")
    store.add_message(conversation_id, "user", SAMPLE_QUESTION)
    store.add_message(
        conversation_id,
        "assistant",
        SAMPLE_ANSWER,
        "",
        {"new_tokens": 84, "time_to_first_token_s": 0.21, "decode_tokens_per_s": 23.4, "stop_reason": "eos"},
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out, size, theme = Path(argv[0]), argv[1], argv[2]
    prefix = argv[3] if len(argv) > 3 else "page"
    width, height = (int(v) for v in size.lower().split("x"))
    scratch = Path(tempfile.mkdtemp(prefix="moedesk-pages-"))
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    os.environ["MOEDESK_MODELS_DIR"] = str(scratch / "models")
    os.environ["HF_HUB_OFFLINE"] = "1"

    from PySide6.QtCore import QEventLoop, QSettings, QTimer
    from PySide6.QtWidgets import QApplication

    from app.main_window import MainWindow
    from app.settings import AppSettings
    from app.storage import ConversationStore
    from app.theme import apply_theme

    app = QApplication.instance() or QApplication(sys.argv[:1])
    settings = AppSettings(QSettings(str(scratch / "settings.ini"), QSettings.Format.IniFormat))
    settings.set("theme", theme)
    settings.set("preset", "4gb")  # without a GPU, Auto has no free memory to plan from
    apply_theme(app, theme)
    store = ConversationStore(scratch / "chats.sqlite3")
    _seed(store)
    window = MainWindow(store, settings)
    scale = float(os.environ.get("QT_SCALE_FACTOR", "1"))
    window.resize(round(width / scale), round(height / scale))
    window.show()
    wait = QEventLoop()
    window.modelReady.connect(wait.quit)
    window.modelFailed.connect(wait.quit)
    QTimer.singleShot(LOAD_TIMEOUT_MS, wait.quit)
    if window.model_info is None and window.load_error is None:
        wait.exec()
    if window.model_info is None:
        print(f"the demo model did not load: {window.load_error or 'timed out'}", file=sys.stderr)
        return 1
    window.dismiss_cpu_notice()  # acknowledged once by every user; the pages are what is shown
    out.mkdir(parents=True, exist_ok=True)
    for page in PAGES:
        window.show_page(page)
        pause = QEventLoop()
        QTimer.singleShot(300, pause.quit)  # layouts and the throttled transcript settle
        pause.exec()
        path = out / f"{prefix}-{page.lower()}-{width}x{height}@{scale:g}x-{theme}.png"
        window.grab().save(str(path))
        print(path)
    window.close()
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
