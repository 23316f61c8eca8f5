"""Model downloads off the GUI thread: a QObject on its own QThread that drives engine.hub.

Like the EngineWorker, it talks to the GUI only through queued signals of plain data (dicts and strings),
plus `pause()`, `resume()`, `cancel()` and `interrupt()`, which are safe from any thread and take effect
between two pieces of a file. The token never passes through here: the dialog stores it where
huggingface_hub keeps it (engine.hub.save_token) and the client reads it from there.

Lifetime: Python's garbage collector must never be what deletes the worker or its QThread. A collection runs on
whichever thread happens to allocate (this download thread, the engine's), at any moment: one that freed the
last reference to a worker whose thread still runs, or to a running QThread, deleted them under that thread
("QThread: Destroyed while thread is still running" aborts; a worker deleted mid-slot crashes). So the
DownloadThread is a child of the application, which keeps it and, through it, the worker's Python object alive
whatever happens to the dialog's references; once the thread has ended, the GUI thread deletes both, the worker
first. Both go on the GUI thread and only after wait(): deleted on the ending thread as Qt's deleteLater pattern
does, the worker's ~QObject calls virtuals on its senders (the QThread, the dialog) that PySide resolves through
their Python objects, which the GUI thread may be destroying at that moment (a crash seen in testing).
"""

from __future__ import annotations

import traceback

from PySide6.QtCore import QCoreApplication, QObject, QThread, Signal, Slot
from shiboken6 import Shiboken


class DownloadWorker(QObject):
    planned = Signal(dict)  # engine.hub.DownloadPlan.to_dict(): files, sizes, free disk, fit
    progress = Signal(dict)  # engine.hub.Progress.to_dict(): file and total bytes, speed, ETA, state
    finished = Signal(str)  # the model folder, complete and verified
    failed = Signal(str, str)  # kind (engine.hub.HubError.kind, or "error"), message in plain words
    cancelled = Signal(bool)  # True: the partial download was deleted; False: kept, to resume later
    busyChanged = Signal(bool)
    log = Signal(str, str)  # level, message (never the token)

    def __init__(self):
        super().__init__()
        from engine.api import DownloadControl

        self._control = DownloadControl()

    # ---- any thread --------------------------------------------------------------------------------

    def new_request(self) -> None:
        """Called on the GUI thread before queueing check() or download(): a fresh pause/cancel switch, so a
        Cancel pressed while the request waits in the queue already applies to it."""
        from engine.api import DownloadControl

        self._control = DownloadControl()

    def pause(self) -> None:
        self._control.pause()

    def resume(self) -> None:
        self._control.resume()

    def cancel(self) -> None:
        """Stop and delete what this download wrote."""
        self._control.cancel()

    def interrupt(self) -> None:
        """Stop and keep what arrived (the dialog closing): the same download resumes from it."""
        self._control.interrupt()

    @property
    def paused(self) -> bool:
        return self._control.paused

    # ---- worker thread (queued) --------------------------------------------------------------------

    @Slot(dict)
    def check(self, request: dict) -> None:
        """Plan only: the file list, sizes, what is here already, the free disk and the fit."""
        self._run(request, download=False)

    @Slot(dict)
    def download(self, request: dict) -> None:
        """Plan, then download (unless the disk is too small), reporting progress."""
        self._run(request, download=True)

    def _run(self, request: dict, download: bool) -> None:
        from engine.api import DownloadCancelled, Hub, HubError, plan_download
        from engine.api import download as download_files

        control = self._control
        self.busyChanged.emit(True)
        try:
            if control.stopping:
                raise DownloadCancelled(request.get("models_dir") or "", control.stopping == "cancel")
            client = Hub(request.get("endpoint") or None, None, bool(request.get("offline")))
            plan = plan_download(
                client,
                request["repo_id"],
                request.get("revision") or "main",
                models_dir=request.get("models_dir") or None,
                control=control,
            )
            self.planned.emit(plan.to_dict())
            if not download:
                return
            if control.stopping:
                raise DownloadCancelled(plan.folder, control.stopping == "cancel")
            self.log.emit(
                "info",
                f"downloading {plan.repo_id}@{plan.revision} ({plan.commit[:12]}) from "
                f"{client.host} into {plan.folder}",
            )
            folder = download_files(client, plan, lambda p: self.progress.emit(p.to_dict()), control)
            self.log.emit("info", f"downloaded {plan.repo_id} into {folder}")
            self.finished.emit(str(folder))
        except HubError as exc:
            self.log.emit("error", f"download: {exc}")
            self.failed.emit(exc.kind, str(exc))
        except DownloadCancelled as exc:
            self.log.emit(
                "info",
                "download cancelled"
                if exc.discarded or exc.folder is None
                else f"download stopped; what arrived is kept in {exc.folder} and resumes next time",
            )
            self.cancelled.emit(exc.discarded)
        except Exception as exc:  # a bug must not take the app down; the log keeps the traceback
            self.log.emit("error", traceback.format_exc())
            self.failed.emit("error", f"The download failed unexpectedly: {exc!r}. The log page has the details.")
        finally:
            self.busyChanged.emit(False)


class DownloadThread(QThread):
    """The thread a DownloadWorker runs on; it owns the worker until it deletes it, then itself, once it has
    ended (see the module's docstring). `stop()` ends it, keeping what a download in progress fetched."""

    def __init__(self, worker: DownloadWorker):
        super().__init__(QCoreApplication.instance())  # the application owns it, not a Python reference
        self.setObjectName("downloads")
        self._worker = worker  # lives as long as this thread's wrapper, which the application keeps
        worker.moveToThread(self)
        self.finished.connect(self._ended)  # queued: emitted on the ending thread, this object lives on the GUI's

    @Slot()
    def stop(self) -> None:
        """Stop a download in progress at its next piece (keeping what arrived) and end the thread's loop."""
        if self.isFinished():
            return
        self._worker.resume()  # a paused download must wake up to stop
        self._worker.interrupt()
        self.quit()

    @Slot()
    def _ended(self) -> None:
        """GUI thread, after `finished`: the thread has left its loop; once it has returned too, delete the worker
        (nothing can run it any more) and then this thread."""
        self.wait()  # at most the instant between emitting finished and returning
        if Shiboken.isValid(self._worker):
            Shiboken.delete(self._worker)
        self.deleteLater()


def start_download_worker() -> tuple[DownloadWorker, DownloadThread]:
    """A DownloadWorker moved to a new, started DownloadThread."""
    worker = DownloadWorker()
    thread = DownloadThread(worker)
    thread.start()
    return worker, thread
