"""Model downloads off the GUI thread: a QObject on its own QThread that drives engine.hub.

Like the EngineWorker, it talks to the GUI only through queued signals of plain data (dicts and strings),
plus `pause()`, `resume()`, `cancel()` and `interrupt()`, which are safe from any thread and take effect
between two pieces of a file. The token never passes through here: the dialog stores it where
huggingface_hub keeps it (engine.hub.save_token) and the client reads it from there.
"""

from __future__ import annotations

import traceback

from PySide6.QtCore import QObject, QThread, Signal, Slot

from app.engine_worker import start_on_thread


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
        from engine.hub import DownloadControl

        self._control = DownloadControl()

    # ---- any thread --------------------------------------------------------------------------------

    def new_request(self) -> None:
        """Called on the GUI thread before queueing check() or download(): a fresh pause/cancel switch, so a
        Cancel pressed while the request waits in the queue already applies to it."""
        from engine.hub import DownloadControl

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
        from engine import hub

        control = self._control
        self.busyChanged.emit(True)
        try:
            if control.stopping:
                raise hub.DownloadCancelled(request.get("models_dir") or "", control.stopping == "cancel")
            client = hub.Hub(request.get("endpoint") or None, None, bool(request.get("offline")))
            plan = hub.plan_download(client, request["repo_id"], request.get("revision") or "main",
                                     models_dir=request.get("models_dir") or None)
            self.planned.emit(plan.to_dict())
            if not download:
                return
            if control.stopping:
                raise hub.DownloadCancelled(plan.folder, control.stopping == "cancel")
            self.log.emit("info", f"downloading {plan.repo_id}@{plan.revision} ({plan.commit[:12]}) from "
                                  f"{client.host} into {plan.folder}")
            folder = hub.download(client, plan, lambda p: self.progress.emit(p.to_dict()), control)
            self.log.emit("info", f"downloaded {plan.repo_id} into {folder}")
            self.finished.emit(str(folder))
        except hub.HubError as exc:
            self.log.emit("error", f"download: {exc}")
            self.failed.emit(exc.kind, str(exc))
        except hub.DownloadCancelled as exc:
            self.log.emit("info", "download cancelled" if exc.discarded else
                          f"download stopped; what arrived is kept in {exc.folder} and resumes next time")
            self.cancelled.emit(exc.discarded)
        except Exception as exc:  # a bug must not take the app down; the log keeps the traceback
            self.log.emit("error", traceback.format_exc())
            self.failed.emit("error", f"The download failed unexpectedly: {exc!r}. The log page has the details.")
        finally:
            self.busyChanged.emit(False)


def start_download_worker() -> tuple[DownloadWorker, QThread]:
    """A DownloadWorker moved to a new, started QThread."""
    worker = DownloadWorker()
    return worker, start_on_thread(worker, "downloads")
