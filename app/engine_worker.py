"""The engine's side of the app: a QObject that lives on its own QThread and loads the model.

The GUI talks to it only through queued signals carrying plain data (str, list, dict) and
through `stop()`, which is safe from any thread. A loaded model is used by one thread only, the
engine queue's (engine.server.worker.EngineWorker): the chat window's turns and the local API's
requests wait there in one line and run one at a time, so the window's reply signals are emitted
from that thread. Text deltas are batched so the GUI thread receives a few updates a second per
reply, not one per token.
"""

from __future__ import annotations

import gc
import threading
import time
import traceback
from pathlib import Path

import torch
from PySide6.QtCore import QObject, QThread, Signal, Slot

DELTA_INTERVAL_S = 0.04  # at most ~25 transcript updates a second: smooth to the eye, cheap for the GUI
DEFAULT_CONTEXT_TOKENS = 8192
API_MAX_QUEUE = 16  # API requests that may wait while one runs; past it they get 429 (engine serve's default)


class DeltaBuffer:
    """Reasoning and answer text gathered between two emits of a reply's delta signals, so the GUI thread gets
    a few updates a second however fast the tokens come; `clock` decides when the next emit is due."""

    def __init__(self, reasoning_signal, answer_signal, clock=time.perf_counter):
        self._signals = {"reasoning": reasoning_signal, "answer": answer_signal}
        self._pending: dict[str, list[str]] = {"reasoning": [], "answer": []}
        self._clock = clock
        self._last_emit = float("-inf")  # a reply's first text shows at once, even if the stream then stalls

    def add(self, kind: str, text: str) -> bool:
        """Keep `text` of `kind` ("reasoning" | "answer"); True when an emit is due (call flush)."""
        self._pending[kind].append(text)
        return self._clock() - self._last_emit >= DELTA_INTERVAL_S

    def flush(self) -> None:
        """Emit what is pending, reasoning first (it came first), and start the next interval."""
        for kind, pending in self._pending.items():
            if pending:
                self._signals[kind].emit("".join(pending))
                pending.clear()
        self._last_emit = self._clock()


def context_advice(context: int, asked: int, model_max: int, plan_tokens: int | None) -> str:
    """What would make a context of `context` tokens larger (for the overflow message): "" when nothing can, at the
    model's own maximum; the plan's KV cache when the plan caps it; the setting when the setting does."""
    if context >= model_max:
        return ""
    if plan_tokens is not None and context == plan_tokens and plan_tokens < asked:
        return (
            f"the VRAM plan's KV cache holds {plan_tokens:,} tokens: a larger VRAM preset on the Engine page "
            f"holds more (the model allows up to {model_max:,})"
        )
    return (
        f"raise the context size in Settings (now {asked:,}; the model allows up to {model_max:,}) and load "
        f"the model again"
    )


def state_fingerprint(folder: Path, placement, preset: str) -> str:
    """What a saved state is valid for: this model's files (path, size and time of its config and weights index),
    the VRAM preset, where and in what precision the model runs, and its KV cache's format."""
    parts = [str(folder.resolve())]
    for name in ("config.json", "model.safetensors.index.json", "model.safetensors"):
        try:
            stat = (folder / name).stat()
        except OSError:
            continue
        parts.append(f"{name}:{stat.st_size}:{stat.st_mtime_ns}")
    parts += [preset, placement.device, str(placement.dtype), placement.kv_cache]
    return "|".join(parts)


def _same_conversation(a: list[dict], b: list[dict]) -> bool:
    return [(m["role"], m["content"]) for m in a] == [(m["role"], m["content"]) for m in b]


def _start_turn(session, history: list, text: str, sampling):
    """The session's events answering `text` after `history`: a plain send when the session holds that history,
    an edit when a restore point marks it, else the history prefilled again (another chat, one edited elsewhere,
    or a state an API request has used since)."""
    if _same_conversation(session.messages, history):
        return session.send(text, sampling)
    if _same_conversation(session.messages[: len(history)], history) and session.can_edit(len(history)):
        return session.edit(len(history), text, sampling)
    session.reset(history)
    return session.send(text, sampling)


def _resume_turn(session, history: list, sampling):
    """The session's events continuing the cut reply that ends `history`: from the state when it still ends there,
    else with the history and the reply's text prefilled again."""
    if _same_conversation(session.messages, history) and session.can_resume():
        return session.resume(sampling)
    return session.continue_from(history[:-1], history[-1], sampling)


def _cancelled_stats() -> dict:
    from engine.api import TurnStats

    return TurnStats(0, 0, 0, 0.0, 0.0, 0.0, "cancelled", 0).to_dict()


class _WindowTurn:
    """A chat-window turn as a job of the engine's queue: `run` starts it on the queue's thread when its turn
    comes, `deliver` turns its events into the worker's reply signals there."""

    def __init__(self, worker: "EngineWorker", history: list, text: str | None, options: dict):
        """text None: continue the last reply of `history` (cut by its length limit or Stop)."""
        self.worker, self.history, self.text, self.options = worker, history, text, options
        self.pending = DeltaBuffer(worker.reasoningDelta, worker.answerDelta)
        self.session = None  # the queue's, once the turn runs (the worker's may be gone by an unload meanwhile)
        self.started_at: float | None = None
        self.new_tokens = 0
        self.finished = False

    def run(self, session):
        """Start the turn: the page learns it has begun (it may have waited behind API requests)."""
        worker = self.worker
        self.session, self.started_at = session, time.perf_counter()
        worker.replyStarted.emit()
        sampling = worker._sampling(session, self.options)
        sampling.validate()
        worker._apply(session, self.options)
        if self.text is None:
            return _resume_turn(session, self.history, sampling)
        return _start_turn(session, self.history, self.text, sampling)

    def deliver(self, event) -> None:
        """One event of the turn, an exception that ended it, or None at its end (also when it never ran)."""
        try:
            self._take(event)
        except Exception as exc:  # reading the engine's measures failed, say: the reply ends, the queue lives on
            self._fail(exc)
        if event is None:
            self.session = None  # a plan switch may drop it next: an ended turn keeps no KV cache alive
            self.worker.busyChanged.emit(False)  # the window may send again

    def _take(self, event) -> None:
        from engine.api import ReasoningDelta, TurnFinished

        worker = self.worker
        if event is None:
            if not self.finished:  # stopped while it waited, or the model went away
                self._finish({"answer": "", "reasoning": "", "stats": _cancelled_stats()})
        elif isinstance(event, Exception):  # out of memory or a bug: the reply ends with a reason, the app lives on
            self._fail(event)
        elif isinstance(event, TurnFinished):
            self.pending.flush()
            measures = worker._runtime_measures(self.session)
            self._finish(
                {"answer": event.answer, "reasoning": event.reasoning, "stats": {**event.stats.to_dict(), **measures}}
            )
            worker._log_trial_choice(measures)
            worker._check_peak()
        else:
            self.new_tokens += 1
            if self.pending.add("reasoning" if isinstance(event, ReasoningDelta) else "answer", event.text):
                self.pending.flush()
                session = self.session
                worker.progress.emit(
                    {
                        "new_tokens": self.new_tokens,
                        "decode_tokens_per_s": self.new_tokens / max(time.perf_counter() - self.started_at, 1e-9),
                        "context_used": session.context_used,
                        "context_tokens": session.context_tokens,
                        **worker._runtime_measures(session),
                    }
                )

    def _fail(self, exc: Exception) -> None:
        """Log `exc` with its traceback and end the reply with it, unless it has already ended."""
        self.pending.flush()
        self.worker.log.emit("error", "".join(traceback.format_exception(exc)))
        if not self.finished:
            self._finish(
                {
                    "answer": "",
                    "reasoning": "",
                    "stats": {
                        "stop_reason": "error",
                        "error": f"The reply failed: {exc}. Try a shorter prompt or a larger "
                        f"preset; the log page has the details.",
                    },
                }
            )

    def _finish(self, result: dict) -> None:
        self.finished = True
        self.worker.replyFinished.emit(result)


def _plan_placement(folder: Path, options: dict, loaded=None):
    """Place the model as the plan `options` ask for (preset, VRAM budget, custom plan, use) says; PlanError
    when none fits. `loaded`: the placement of the model loaded, whose GPU memory a plan replacing its plan gets."""
    from engine.api import DEFAULT_USE, plan_placement, preset_budget_bytes

    preset = options.get("preset") or "auto"
    vram_gib = float(options.get("vram_gib") or 0)
    budget = int(vram_gib * 2**30) if vram_gib > 0 else None
    if budget is None and loaded is not None and loaded.device == "cuda" and not preset_budget_bytes(preset):
        # the free VRAM lacks what the loaded model holds, which the budget it was loaded with counted as free
        budget = torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved()
    return plan_placement(
        folder, preset, budget, options.get("custom_plan"), use=options.get("plan_use") or DEFAULT_USE
    )


def _new_session(model, tokenizer, placement, options: dict, states, **keep):
    """Make a chat session of `model` under `placement`: its context the smallest of the one asked, the model's and
    the plan's KV cache, its prefill chunk the plan's; `keep`: ChatSession's other settings (sampling, say)."""
    from engine.api import DEFAULT_MAX_SNAPSHOTS, ChatSession

    model_max = model.config.max_position_embeddings
    asked = int(options.get("context_tokens") or DEFAULT_CONTEXT_TOKENS)
    plan_tokens = placement.plan.kv_tokens if placement.plan is not None else None
    context = min(asked, model_max, plan_tokens or asked)
    if placement.plan is not None:  # the plan fixes the KV cache and the prefill chunk on the GPU
        keep["prefill_chunk_tokens"] = placement.plan.prefill_chunk_tokens
    return ChatSession(
        model,
        tokenizer,
        context_tokens=context,
        max_snapshots=int(options.get("turn_snapshots") or DEFAULT_MAX_SNAPSHOTS),
        state_store=states,
        context_advice=context_advice(context, asked, model_max, plan_tokens),
        **keep,
    )


def _plan_info(session, placement, options: dict) -> dict:
    """Return the model info's entries that a plan decides: the placement, the context, a restore point's size and
    the GPU memory the model's allocator holds (which the card's free memory lacks)."""
    return {
        "context_tokens": session.context_tokens,
        "context_asked_tokens": int(options.get("context_tokens") or DEFAULT_CONTEXT_TOKENS),
        "context_plan_tokens": placement.plan.kv_tokens if placement.plan is not None else None,
        "snapshot_bytes": session.snapshot_bytes,
        "placement": placement.to_dict(),
        **_vram_reserved(session.model),
    }


def _vram_reserved(model) -> dict:
    """{"vram_reserved_bytes": what the allocator holds} for a model on a GPU, else {}: a plan replacing the
    model's gets it besides the free memory."""
    return {"vram_reserved_bytes": torch.cuda.memory_reserved()} if model.device.type == "cuda" else {}


def _server_context(queue, name: str, session, old):
    """Make what the local API serves for `session` on `queue`, listed as started when `old` was."""
    from engine.api import ServerContext

    return ServerContext(queue, name, session.tokenizer, session.sampling, session.context_tokens, old.started)


def _reload_reason(loaded, new) -> str:
    """Say why the model loaded under `loaded` cannot take `new`'s plan in place: its device, dtype or KV cache."""
    if loaded.plan is None:
        return "the loaded model runs on the CPU, where no plan applies"
    if new.plan is None:
        return "it would run on the CPU"
    if new.kv_cache != loaded.kv_cache:
        return f"its KV cache is {new.kv_cache}, the loaded model's {loaded.kv_cache}"
    return f"it computes in {new.dtype}, the loaded model in {loaded.dtype}".replace("torch.", "")


class _PlanSwitch:
    """A switch of the loaded model's plan as a job of the engine's queue: it runs when no reply or API request
    does, and the jobs after it run against the new plan's session."""

    def __init__(self, worker: "EngineWorker", queue, loaded, options: dict):
        self.worker, self.queue, self.loaded, self.options = worker, queue, loaded, options
        self.ran = False

    def run(self, session):
        """Switch (a generator, so the queue's call keeps no reference to the old session while it is dropped)."""
        del session  # the queue's own reference is the one the switch replaces
        self.ran = True
        self.worker._switch_on_queue(self.queue, self.loaded, self.options)
        return
        yield  # pragma: no cover - makes this a generator

    def deliver(self, event) -> None:
        """None at the job's end: say so when it never ran (the model was unloaded, or the app is closing)."""
        if isinstance(event, Exception):  # the switch catches its own: this is a bug in the job itself
            self.worker.log.emit("error", "".join(traceback.format_exception(event)))
            self.worker.planSwitchFailed.emit(f"Switching the plan failed: {event!r}. The log page has the details.")
        elif event is None and not self.ran:
            self.worker.planSwitchFailed.emit("The model was unloaded before its plan could be switched.")


class EngineWorker(QObject):
    loadStarted = Signal(str)  # model folder
    loaded = Signal(dict)  # model info: name, path, model_type, layers, experts, context_tokens, ...
    loadFailed = Signal(str)  # what happened and what to do
    unloaded = Signal()
    replyStarted = Signal()
    reasoningDelta = Signal(str)
    answerDelta = Signal(str)
    progress = Signal(dict)  # new_tokens, decode_tokens_per_s, context_used, context_tokens
    replyFinished = Signal(dict)  # answer, reasoning, stats (TurnStats as a dict)
    busyChanged = Signal(bool)
    planSwitched = Signal(dict)  # the model info after the loaded model took another plan in place
    planSwitchFailed = Signal(str)  # what happened and what to do; the model runs the plan it ran before
    log = Signal(str, str)  # level ("info" | "warning" | "error"), message
    # RuntimeReserve.to_dict() plus gpu_usable and gpu_status (the GPU's name, or why none is usable)
    reserveMeasured = Signal(dict)
    # the engine queue after a job starts or ends: api_busy (an API request runs), requests_served (API requests
    # answered since the model loaded), last_request (engine.server.worker.LastRequest's fields)
    activity = Signal(dict)

    def __init__(self):
        super().__init__()
        self.session = None
        self.queue = None  # engine.server.worker.EngineWorker: the one thread that runs the loaded model
        # what the local API serves (engine.server.http.ServerContext); None while no model is loaded
        self.server_context = None
        self.model_info: dict = {}
        self._trial_logged = False  # auto's choice is logged once per model
        self._job = None  # the window's turn on the queue, waiting or running
        self.states = None  # the loaded model's PrefixCache: chats' and API prompts' states, with a disk tier
        self.placement = None  # the loaded model's engine Placement: where a plan switch starts from
        self._backend = "auto"  # the expert backend the loaded model was asked for
        self._session_options: dict = {}  # the options its session was made with: a failed switch makes it again
        # held while the loaded model is published or dropped: a plan switch ending on the queue's thread never
        # publishes a session after an unload has dropped the model
        self._publishing = threading.Lock()
        self.clock = time.perf_counter  # what load and switch times are measured with

    # ---- any thread -----------------------------------------------------------------------------

    def stop(self) -> None:
        """Cancel the window's reply, running (between layers or tokens) or still waiting behind API requests."""
        job = self._job
        if job is not None:
            job.cancel()

    def shutdown(self) -> None:
        """End the engine queue's thread (the app is closing): what runs is cancelled, what waits is dropped."""
        queue = self.queue
        if queue is not None:
            queue.stop()

    # ---- worker thread (called through queued connections) --------------------------------------

    @Slot()
    def measure_reserve(self) -> None:
        """The runtime reserve plans use here: measured on a usable GPU (the first start, cached after), else the
        reference card's estimate; emitted with whether the GPU runs models."""
        from engine.api import gpu_status, reference_estimate, runtime_reserve

        try:
            usable, status = gpu_status()
            found = runtime_reserve() if usable else reference_estimate()
        except Exception as exc:  # a broken driver must not stop the app: its plans are then the estimate
            self.log.emit("error", traceback.format_exc())
            usable, status, found = False, f"the GPU could not be read ({exc})", reference_estimate()
        self.log.emit(
            "info" if found.measured or not usable else "warning",
            f"runtime reserve {found.reserve_bytes / 2**20:,.0f} MiB: {found.source}",
        )
        self.reserveMeasured.emit(dict(found.to_dict(), gpu_usable=usable, gpu_status=status))

    @Slot(str, dict)
    def load(self, path: str, options: dict) -> None:
        from app.model_library import folder_architecture
        from engine.api import (
            ChatTokenizer,
            CheckpointError,
            ServerContext,
            footprint_from_checkpoint,
            load_placed,
            unix_now,
        )
        from engine.api import (
            EngineWorker as EngineQueue,
        )

        self.loadStarted.emit(path)
        self.busyChanged.emit(True)
        started = self.clock()
        self._release_model()  # the old model's memory is free before the new one is read
        try:
            threads = int(options.get("cpu_threads") or 0)
            if threads > 0:  # 0 keeps torch's default: the physical cores
                torch.set_num_threads(threads)
            placement = self._placement(Path(path), options)
            self.log.emit("info", placement.note)
            pin_gib = float(options.get("pin_budget_gib") or 0)
            backend = options.get("expert_backend") or "auto"
            try:
                model = load_placed(
                    Path(path),
                    placement,
                    int(pin_gib * 2**30) if pin_gib > 0 else None,
                    expert_backend=backend,
                    cpu_threads=threads or None,
                )
            except ValueError as exc:  # the executor refuses settings it cannot run, e.g. a gpu backend too big
                self.session = None
                self.log.emit("error", str(exc))
                self.loadFailed.emit(
                    f"The model cannot run with the expert backend “{backend}”: {exc}.\nChoose "
                    f"another expert backend in Settings (Auto always fits), or a bigger VRAM "
                    f"preset on the Engine page."
                )
                return
            tokenizer = ChatTokenizer.from_folder(Path(path))
            config = model.config
            self.states = states = self._state_store(Path(path), placement, options)
            self.session = session = _new_session(model, tokenizer, placement, options, states)
            self.model_info = {
                "name": Path(path).name,
                "path": str(path),
                "model_type": config.model_type,
                # named as the Models list names it (a text-only config's model_type differs)
                "architecture": folder_architecture(Path(path)) or config.model_type,
                "layers": config.num_hidden_layers,
                "experts": config.num_experts,
                "experts_per_token": config.num_experts_per_tok,
                "vocab_size": config.vocab_size,
                "max_context_tokens": config.max_position_embeddings,
                # read here, off the GUI thread: the Engine page plans with it (an immutable value)
                "footprint": footprint_from_checkpoint(Path(path)),
                **_plan_info(session, placement, options),
                **model.expert_executor.host_report,
            }
            pinned = self.model_info.get("pinned_expert_bytes")
            if pinned is not None:  # the pin budget's outcome is said, never silent
                pageable = self.model_info["pageable_expert_bytes"]
                self.log.emit(
                    "warning" if pageable else "info",
                    f"expert records in host RAM: {pinned / 2**30:.2f} GiB pinned, {pageable / 2**30:.2f} GiB "
                    f"pageable"
                    + (
                        " (over the pin budget: those copies run 3-4x slower; raise the pin "
                        "budget in Settings if RAM allows)"
                        if pageable
                        else ""
                    ),
                )
            self._log_backend(model.expert_executor.stats(), backend)
            self.placement, self._backend, self._session_options = placement, backend, dict(options)
            self.queue = EngineQueue(session, states, max_queue=API_MAX_QUEUE, on_change=self._on_queue_change)
            self.server_context = ServerContext(
                self.queue, self.model_info["name"], tokenizer, session.sampling, session.context_tokens, unix_now()
            )
            _freeze_long_lived()
            self.log.emit("info", f"loaded {path} in {self.clock() - started:.1f} s")
            self.loaded.emit(dict(self.model_info))
        except CheckpointError as exc:
            self.session = None
            self.log.emit("error", str(exc))
            self.loadFailed.emit(f"This folder cannot be opened as a model.\n{exc}")
        except Exception as exc:  # an app must survive any bad folder; the log keeps the traceback
            self.session = None
            self.log.emit("error", traceback.format_exc())
            self.loadFailed.emit(f"Loading failed unexpectedly: {exc!r}. The log page has the details.")
        finally:
            self.busyChanged.emit(False)

    def _release_model(self) -> None:
        """Stop the engine queue (a turn running ends cancelled, those waiting are dropped), drop the session and
        collect it, cycles included, with everything frozen at the last load."""
        with self._publishing:
            self.server_context = None  # the API answers 503 from here on
            queue, self.queue = self.queue, None
            self.placement = None
        if queue is not None:
            queue.stop()
        states, self.states = self.states, None
        if states is not None:
            self._keep_states(states)
        self.session = None
        self.model_info = {}
        self._trial_logged = False
        gc.unfreeze()
        gc.collect()

    def _state_store(self, folder: Path, placement, options: dict):
        """The prefix cache for this model's chats and API prompts: RAM and disk budgets from the settings, the
        disk tier keyed by this model and preset (states of another model or preset are never read)."""
        from app.paths import chat_states_folder
        from engine.api import PrefixCache, StateFolder

        ram = int(float(options.get("chat_states_ram_gib", 2.0)) * 2**30)
        disk = int(float(options.get("chat_states_disk_gib", 8.0)) * 2**30)
        spill = None
        if disk > 0:
            try:
                spill = StateFolder(
                    chat_states_folder(), state_fingerprint(folder, placement, str(options.get("preset", ""))), disk
                )
            except OSError as exc:
                self.log.emit("warning", f"chats' saved states are not kept on disk ({exc}): they live in RAM only")
        return PrefixCache(ram, spill)

    def _keep_states(self, states) -> None:
        """Write the chats' latest states to disk before the model goes, so they resume after a restart."""
        try:
            states.flush()
        except Exception as exc:  # a full disk costs the next resume a prefill, never the unload
            self.log.emit("warning", f"chats' states could not be saved to disk: {exc}")
        if states.spill is not None:
            states.spill.close()

    def _log_backend(self, stats: dict, requested: str) -> None:
        """Which backend computes the cache misses and, when measured, the bandwidths it was chosen from."""
        if "expert_backend" not in stats:  # CPU mode: every expert runs on the CPU, as the placement note says
            return
        trial = stats.get("expert_backend_trial")
        chosen = " (chosen by auto)" if requested == "auto" else ""
        timed = ", ".join(sorted(trial["step_seconds"])) if trial else ""
        running = (
            f"auto: whichever of {timed} decodes fastest over the first tokens"
            if trial
            else stats["expert_backend"] + chosen
        )
        measured = stats.get("calibration")
        pageable = measured.get("pageable_bytes_per_s") if measured else None
        bandwidths = (
            f"; measured PCIe {measured['pcie_bytes_per_s'] / 1e9:.1f} GB/s"
            + (f" ({pageable / 1e9:.1f} GB/s from unpinned RAM)" if pageable else "")
            + f", CPU {measured['cpu_bytes_per_s'] / 1e9:.1f} GB/s with {measured['cpu_threads']} threads"
            if measured
            else ""
        )
        self.log.emit("info", f"expert backend: {running}{bandwidths}")

    def _log_trial_choice(self, stats: dict) -> None:
        """Once per model, when auto's trial has chosen: which backend, from which step times."""
        trial = stats.get("expert_backend_trial")
        if not trial or trial["chosen"] is None or self._trial_logged:
            return
        self._trial_logged = True
        seconds = trial["step_seconds"]
        times = ", ".join(f"{backend} {seconds[backend] * 1000:.1f} ms" for backend in sorted(seconds))
        self.log.emit("info", f"expert backend: auto chose {trial['chosen']} by the median decode step ({times})")

    def _placement(self, folder: Path, options: dict):
        """The GPU under the preset's plan when one fits, else the CPU, with the reason in the log."""
        from engine.api import Placement, PlanError

        try:
            return _plan_placement(folder, options)
        except PlanError as exc:
            self.log.emit("warning", f"no VRAM plan fits, so the model runs on the CPU: {exc}")
            return Placement("cpu", torch.float32, None, f"CPU mode: no VRAM plan fits this model ({exc}).")

    @Slot(dict)
    def switch_plan(self, options: dict) -> None:
        """Give the loaded model the plan `options` ask for without reading its weights again, once the engine
        queue gets to it (after the reply or API request running): planSwitched with the new model info, or
        planSwitchFailed saying why and what to do."""
        from engine.api import Stopped

        queue, loaded = self.queue, self.placement
        if queue is None or loaded is None:
            self.planSwitchFailed.emit("No model is loaded: the plan shown applies to the next one loaded.")
            return
        switch = _PlanSwitch(self, queue, loaded, dict(options))
        try:
            queue.submit(switch.run, switch.deliver, from_api=False)
        except Stopped:  # the app is closing
            self.planSwitchFailed.emit("The engine has stopped: the plan applies when the model is loaded again.")

    def _switch_on_queue(self, queue, loaded, options: dict) -> None:
        """(queue thread) Switch the model running on `queue`, loaded under `loaded`, to the plan `options` ask
        for: its expert cache resized, a new session of the plan's context and chunk, the same states and chats."""
        from engine.api import PlanError, can_switch_plan, switch_plan

        started = self.clock()
        folder = Path(self.model_info.get("path", ""))
        try:
            new = _plan_placement(folder, options, loaded)
        except PlanError as exc:
            self.planSwitchFailed.emit(
                f"No VRAM plan fits this model ({exc}). The model keeps the plan it runs; choose a larger "
                f"preset or VRAM budget."
            )
            return
        except Exception as exc:  # a broken driver, say: the model runs on as it was
            self.log.emit("error", traceback.format_exc())
            self.planSwitchFailed.emit(f"The new plan could not be made: {exc!r}. The log page has the details.")
            return
        if not can_switch_plan(loaded, new):
            self.planSwitchFailed.emit(
                f"This plan needs the model loaded again: {_reload_reason(loaded, new)}. Load the model on the "
                f"Models page to run it; until then it keeps the plan it runs."
            )
            return
        old = queue.session
        model, tokenizer = old.model, old.tokenizer
        keep = {"sampling": old.sampling, "system_prompt": old.system_prompt, "enable_thinking": old.enable_thinking}
        before = (old.context_tokens, old.prefill_chunk_tokens)
        with self._publishing:
            if self.queue is not queue:  # unloaded meanwhile: the queue is stopping, its model going
                return
            self.session = None
        # The old session's KV cache and restore points go before the new plan's memory is taken: the plan
        # budgets one KV cache. The chats are the app's, and their states the prefix cache's: none is lost.
        queue.replace_session(None)
        del old
        gc.unfreeze()  # a cycle frozen at load would keep the old KV cache alive
        gc.collect()
        if model.device.type == "cuda":
            torch.cuda.empty_cache()
        try:
            if not switch_plan(model, loaded, new):
                raise RuntimeError(f"the engine refused to switch from {loaded.note} to {new.note}")
            session = _new_session(model, tokenizer, new, options, queue.prefix_cache, **keep)
        except Exception as exc:  # out of memory, say: the model goes back to the plan it ran
            self.log.emit("error", traceback.format_exc())
            self._switch_back(queue, model, tokenizer, loaded, new, keep, exc)
            return
        # The prefix cache stays: its states hold KV rows and recurrent states, valid for any plan of the same
        # device, dtype and KV format, which a switch keeps. Its disk tier stays keyed by the preset loaded
        # (state_fingerprint), so a later load with the new preset misses these states: a prefill, never a wrong
        # state; re-keying it here would hide the states saved so far from this model's next load.
        queue.replace_session(session)
        info = {**self.model_info, **_plan_info(session, new, options)}
        with self._publishing:
            if self.queue is not queue:
                return
            self.server_context = _server_context(queue, info["name"], session, self.server_context)
            self.session, self.placement, self.model_info = session, new, info
            self._session_options = dict(options)
        _freeze_long_lived()
        self.log.emit("info", new.note)
        self.log.emit(
            "info",
            f"switched the plan in place in {self.clock() - started:.1f} s: expert cache "
            f"{loaded.plan.expert_slots:,} -> {new.plan.expert_slots:,} slots, context {before[0]:,} -> "
            f"{session.context_tokens:,} tokens, prefill chunk {before[1]:,} -> {session.prefill_chunk_tokens:,}",
        )
        self._log_backend(model.expert_executor.stats(), self._backend)  # a resize chooses the backend again
        self.planSwitched.emit(dict(info))

    def _switch_back(self, queue, model, tokenizer, loaded, tried, keep: dict, exc: Exception) -> None:
        """(queue thread) After a failed switch to `tried`, give `model` the expert cache and a session of the plan
        it ran before again; failing that too, leave the queue without a session and ask for a load."""
        from engine.api import switch_plan

        try:
            switch_plan(model, tried, loaded)  # rebuilds the cache whenever the slots differ, half-built or not
            session = _new_session(model, tokenizer, loaded, self._session_options, queue.prefix_cache, **keep)
        except Exception:
            self.log.emit("error", traceback.format_exc())
            self.planSwitchFailed.emit(
                f"Switching the plan failed ({exc!r}) and the model could not go back to its plan: load it "
                f"again on the Models page. The log page has the details."
            )
            return
        queue.replace_session(session)
        with self._publishing:
            if self.queue is queue:
                self.session = session
                self.server_context = _server_context(queue, self.model_info["name"], session, self.server_context)
        _freeze_long_lived()
        self.planSwitchFailed.emit(
            f"Switching the plan failed: {exc!r}. The model runs the plan it ran before; the log page has the details."
        )

    @Slot()
    def unload(self) -> None:
        """Drop the model and its state; the memory goes back to the system."""
        self._release_model()
        self.log.emit("info", "model unloaded")
        self.unloaded.emit()

    @Slot(list, str, dict)
    def send(self, history: list, text: str | None, options: dict) -> None:
        """Answer `text` after `history` (the chat's earlier user/assistant messages) once the engine queue gets
        to it. Regenerate and edit-and-resend are the same call with a shorter history: the session rolls back to
        that turn's snapshot when it has one, and otherwise prefills the history again."""
        from engine.api import Stopped

        queue = self.queue
        if queue is None:
            self.replyFinished.emit(
                {
                    "answer": "",
                    "reasoning": "",
                    "stats": {"stop_reason": "error", "error": "No model is loaded. Open one on the Models page."},
                }
            )
            return
        self.busyChanged.emit(True)
        turn = _WindowTurn(self, history, text, options)
        try:
            self._job = queue.submit(turn.run, turn.deliver, from_api=False)
        except Stopped:  # the app is closing (unloads run on this thread, so none is under way)
            turn.deliver(None)

    @Slot(list, dict)
    def continue_reply(self, history: list, options: dict) -> None:
        """Write more of the reply that ends `history` (cut by its length limit or Stop) once the engine queue gets
        to it; the reply events carry the new text and replyFinished the whole reply."""
        self.send(history, None, options)

    def _on_queue_change(self, queue) -> None:
        """(queue thread) Say what the engine is doing, for the API-busy note and the server's stats."""
        self.activity.emit(
            {
                "api_busy": queue.busy_with_api,
                "requests_served": queue.requests_served,
                "last_request": dict(vars(queue.last)),
            }
        )

    def _apply(self, session, options: dict) -> None:
        session.enable_thinking = bool(options.get("enable_thinking", True))
        system = options.get("system_prompt") or None
        if system != session.system_prompt:
            session.set_system_prompt(system)

    def _sampling(self, session, options: dict):
        from engine.api import SamplingParams

        overrides = dict(options.get("sampling") or {})
        if "stop" in overrides:
            overrides["stop"] = tuple(overrides["stop"])
        return SamplingParams.from_generation_config(session.tokenizer.generation_defaults, **overrides)

    def _check_peak(self) -> None:
        """The plan is a promise: say so in the log when the measured peak broke it."""
        plan = (self.model_info.get("placement") or {}).get("plan")
        if plan is None:
            return
        from engine.api import outside_allocator_bytes

        peak = torch.cuda.max_memory_reserved() + outside_allocator_bytes()
        if peak > plan["budget_bytes"]:
            self.log.emit(
                "warning",
                f"GPU memory peaked at {peak / 2**30:.2f} GiB, over the plan's "
                f"{plan['budget_bytes'] / 2**30:.2f} GiB budget; please report this",
            )

    @staticmethod
    def _runtime_measures(session) -> dict:
        """The expert executor's counters and, on a GPU, the VRAM in use: read on the thread running `session`."""
        measures = session.model.expert_executor.stats()
        if session.model.device.type == "cuda":
            from engine.api import process_usage_bytes

            measures["vram_used_bytes"] = process_usage_bytes()
        return {**measures, **_vram_reserved(session.model)}


def _freeze_long_lived() -> None:
    """Collect once, then move every object alive (the model, torch, Qt, the app) out of the collector's reach.
    A full collection walks them all, ~120 ms on the test machine with nothing but the app imported, and
    stops every thread, the GUI's too; frozen, the passes that fall due mid-reply walk only what came later.
    `_release_model` unfreezes them, so a dropped model's cycles are still collected."""
    gc.collect()
    gc.freeze()


def start_on_thread(worker: QObject, name: str) -> QThread:
    """Move `worker` to a new QThread called `name` and start it: its slots then run there."""
    thread = QThread()
    thread.setObjectName(name)
    worker.moveToThread(thread)
    thread.start()
    return thread


def start_worker() -> tuple[EngineWorker, QThread]:
    """An EngineWorker moved to a new, started QThread."""
    worker = EngineWorker()
    return worker, start_on_thread(worker, "engine")
