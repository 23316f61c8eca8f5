"""Test doubles for the app: a worker with the EngineWorker's signals whose replies the test scripts."""

from __future__ import annotations

from PySide6.QtCore import QObject, Signal, Slot

DEFAULT_STATS = {
    "stop_reason": "eos",
    "new_tokens": 42,
    "time_to_first_token_s": 0.12,
    "decode_tokens_per_s": 23.4,
    "prefill_tokens": 17,
    "prompt_tokens": 17,
    "error": None,
}


class FakeWorker(QObject):
    """Same signals as EngineWorker; `send` records the request, and the test plays the reply with
    start_reply / stream / finish (or reply for all three)."""

    loadStarted = Signal(str)
    loaded = Signal(dict)
    loadFailed = Signal(str)
    replyStarted = Signal()
    reasoningDelta = Signal(str)
    answerDelta = Signal(str)
    progress = Signal(dict)
    replyFinished = Signal(dict)
    busyChanged = Signal(bool)
    log = Signal(str, str)
    unloaded = Signal()
    reserveMeasured = Signal(dict)
    planSwitched = Signal(dict)
    planSwitchFailed = Signal(str)

    def __init__(self):
        super().__init__()
        self.sent: list[tuple[list, str, dict]] = []  # (history, text, options) per send
        self.continued: list[tuple[list, dict]] = []  # (history, options) per continue_reply
        self.load_calls: list[tuple[str, dict]] = []
        self.switch_calls: list[dict] = []  # options per switch_plan
        self.stop_calls = 0
        self.reserve_requests = 0

    @Slot(str, dict)
    def load(self, path: str, options: dict) -> None:
        self.load_calls.append((path, options))

    @Slot(dict)
    def switch_plan(self, options: dict) -> None:
        self.switch_calls.append(options)

    @Slot()
    def measure_reserve(self) -> None:
        self.reserve_requests += 1

    @Slot()
    def unload(self) -> None:
        self.unloaded.emit()

    @Slot(list, str, dict)
    def send(self, history: list, text: str, options: dict) -> None:
        self.sent.append((history, text, options))

    @Slot(list, dict)
    def continue_reply(self, history: list, options: dict) -> None:
        self.continued.append((history, options))

    def stop(self) -> None:
        self.stop_calls += 1

    def start_reply(self) -> None:
        self.busyChanged.emit(True)
        self.replyStarted.emit()

    def stream(self, reasoning: list[str] = (), answer: list[str] = ()) -> None:
        for text in reasoning:
            self.reasoningDelta.emit(text)
        for text in answer:
            self.answerDelta.emit(text)

    def finish(self, answer: str, reasoning: str = "", **stats) -> None:
        self.replyFinished.emit({"answer": answer, "reasoning": reasoning, "stats": {**DEFAULT_STATS, **stats}})
        self.busyChanged.emit(False)

    def reply(self, answer: str, reasoning: str = "", **stats) -> None:
        """A whole reply: started, streamed in two halves each, finished."""
        self.start_reply()
        self.stream(
            [reasoning[: len(reasoning) // 2], reasoning[len(reasoning) // 2 :]] if reasoning else [],
            [answer[: len(answer) // 2], answer[len(answer) // 2 :]],
        )
        self.finish(answer, reasoning, **stats)
