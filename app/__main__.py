"""Start MoE Desk: `python -m app` (or `moedesk`), or `python -m app --smoke-test OUT.png`.

The Qt event loop runs asyncio through qasync, so app-level sequences (the smoke test, later
downloads) are plain coroutines awaiting Qt signals.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
from pathlib import Path

SMOKE_QUESTION = "What is 2 + 3?"
SMOKE_TIMEOUT_S = 300
SMOKE_PRESET = "4gb"


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="moedesk", description="MoE Desk: local MoE chat")
    parser.add_argument("--model", type=Path, help="model folder to load (default: the last one, or the demo model)")
    parser.add_argument(
        "--smoke-test",
        type=Path,
        metavar="OUT.png",
        help="open the window offscreen, ask the model one question, save a screenshot, exit",
    )
    return parser.parse_args(argv)


def wait_for(signal, timeout_s: float) -> asyncio.Future:
    """A future resolved with the arguments of the next emission of a Qt signal."""
    loop = asyncio.get_event_loop()
    future = loop.create_future()

    def resolve(args):
        if not future.done():
            future.set_result(args)

    def fire(*args):
        # a plain callable runs on the emitting thread (the engine's for worker signals): hand over to the loop
        signal.disconnect(fire)
        loop.call_soon_threadsafe(resolve, args)

    signal.connect(fire)
    return asyncio.ensure_future(asyncio.wait_for(future, timeout_s))


async def smoke_test(window, out: Path) -> int:
    """Ask the loaded model one question; screenshot the Chat and Engine pages; 0 only if a reply arrived."""
    if window.model_info is None and window.load_error is None:  # both are set on this thread: no race
        loaded = wait_for(window.modelReady, SMOKE_TIMEOUT_S)
        failed = wait_for(window.modelFailed, SMOKE_TIMEOUT_S)
        await asyncio.wait([loaded, failed], return_when=asyncio.FIRST_COMPLETED)
        for pending in (loaded, failed):
            pending.cancel()
    if window.load_error is not None or window.model_info is None:
        print(f"smoke test: the model did not load: {window.load_error or 'timed out'}", file=sys.stderr)
        return 1
    await asyncio.sleep(0.2)  # the worker's busyChanged(False) follows loaded
    finished = wait_for(window.worker.replyFinished, SMOKE_TIMEOUT_S)
    window.show_page("Chat")
    if window.store.messages(window.chat_page.current_conversation_id()):
        window.chat_page.new_chat()
    window.chat_page.input.setPlainText(SMOKE_QUESTION)
    window.chat_page.send_current()
    (result,) = await finished
    await asyncio.sleep(0.5)  # let the throttled transcript catch up before the picture
    out.parent.mkdir(parents=True, exist_ok=True)
    window.grab().save(str(out))
    user_preset = window.settings.get("preset")
    window.engine_page.set_preset(SMOKE_PRESET)  # without a GPU, Auto has no free memory to plan from
    window.show_page("Engine")
    await asyncio.sleep(0.2)
    window.grab().save(str(out.with_name(out.stem + "-engine" + out.suffix)))
    window.engine_page.set_preset(user_preset)
    reply = (result.get("answer") or "") + (result.get("reasoning") or "")
    stats = result.get("stats", {})
    print(f"smoke test: reply {reply!r}, stop {stats.get('stop_reason')}, screenshot {out}")
    return 0 if reply.strip() and stats.get("stop_reason") != "error" else 1


def private_settings(user_settings, path: Path):
    """A copy of the user's settings in its own INI file, so a smoke run (its preset, its offscreen window
    geometry) changes nothing of the user's."""
    from PySide6.QtCore import QSettings

    from app.settings import DEFAULTS, AppSettings

    private = AppSettings(QSettings(str(path), QSettings.Format.IniFormat))
    for key in DEFAULTS:
        if key not in ("window_geometry", "chat_splitter"):
            private.set(key, user_settings.get(key))
    return private


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.smoke_test:
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    import qasync
    from PySide6.QtWidgets import QApplication

    from app.about import DESKTOP_FILE_NAME, app_icon, app_version
    from app.main_window import MainWindow
    from app.paths import conversations_db
    from app.settings import AppSettings
    from app.storage import open_conversations
    from app.store_dialog import ask_about_store
    from app.theme import apply_theme

    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setOrganizationName("MoE Desk")
    app.setApplicationName("MoE Desk")
    app.setApplicationVersion(app_version())
    app.setDesktopFileName(DESKTOP_FILE_NAME)  # ties the window to the installed moedesk.desktop (Wayland app id)
    app.setWindowIcon(app_icon())
    settings = AppSettings()
    database = conversations_db()
    if args.smoke_test:  # its chat and settings go to a scratch folder, never the user's history
        scratch = Path(tempfile.mkdtemp(prefix="moedesk-smoke-"))
        settings, database = private_settings(settings, scratch / "settings.ini"), scratch / "chats.sqlite3"
    apply_theme(app, settings.get("theme"))
    store, store_note = open_conversations(database, ask_about_store)
    if store is None:
        print(store_note, file=sys.stderr)
        return 1
    loop = qasync.QEventLoop(app)
    asyncio.set_event_loop(loop)
    window = MainWindow(store, settings, args.model)
    if store_note:
        window.logs_page.add_record("warning", store_note)
    window.show()
    with loop:
        if args.smoke_test:
            code = loop.run_until_complete(smoke_test(window, args.smoke_test))
            window.close()
            store.close()
            shutil.rmtree(scratch, ignore_errors=True)  # the run's chat and settings copy, nobody's to keep
            return code
        closed = asyncio.Event()
        app.lastWindowClosed.connect(closed.set)
        loop.run_until_complete(closed.wait())
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
