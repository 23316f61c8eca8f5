"""Download a plan's files with resume, pause, cancel, retries and hash checks."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from engine.hub.client import RETRY_WAIT_S, Hub, _first_line, _status_message, _transient, retry_wait
from engine.hub.control import DownloadControl
from engine.hub.display import format_size
from engine.hub.errors import DownloadCancelled, HubError
from engine.hub.folder import (
    CONFIG_FILE,
    INCOMPLETE_SUFFIX,
    RECORD_FILE,
    STAGING_DIR,
    STATE_FILE,
    _incomplete_path,
    _known_hashes,
    _read_json,
    free_disk_bytes,
)
from engine.hub.names import check_file_names
from engine.hub.plan import DownloadPlan, PlanFile, plan_download

MAX_RETRIES = 4  # consecutive network failures of one file with no byte received in between
PROGRESS_INTERVAL_S = 0.1
SPEED_WINDOW_S = 5.0


@dataclass
class Progress:
    file: str
    file_done: int
    file_size: int
    done: int  # bytes of all needed files that are here (finished or partial)
    total: int
    files_done: int
    files_total: int
    speed: float  # bytes per second over the last few seconds; 0 until measured
    eta_s: float | None
    state: str  # downloading | paused | retrying | verifying | done

    def to_dict(self) -> dict:
        return asdict(self)


class _Meter:
    """Bytes received over the last few seconds, for the speed and the ETA."""

    def __init__(self):
        self.received = 0
        self.samples: deque[tuple[float, int]] = deque()

    def add(self, n: int) -> None:
        self.received += n

    def speed(self) -> float:
        now = time.monotonic()
        self.samples.append((now, self.received))
        while len(self.samples) > 2 and now - self.samples[0][0] > SPEED_WINDOW_S:
            self.samples.popleft()
        t0, b0 = self.samples[0]
        return (self.received - b0) / (now - t0) if now - t0 > 0.2 else 0.0

    def restart(self) -> None:
        self.samples.clear()


class _Download:
    def __init__(
        self,
        hub: Hub,
        plan: DownloadPlan,
        progress: Callable[[Progress], None] | None,
        control: DownloadControl,
        retry_wait_s: float,
    ):
        self.hub, self.plan, self.control = hub, plan, control
        self.report = progress or (lambda p: None)
        self.retry_wait_s = retry_wait_s
        self.meter = _Meter()
        self.last_report = 0.0
        self.staging = plan.folder / STAGING_DIR
        self.state = {
            "repo_id": plan.repo_id,
            "revision": plan.revision,
            "commit": plan.commit,
            "placed": {},
            "partial": {},
        }

    # ---- bookkeeping

    def _save_state(self) -> None:
        path = self.staging / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=1), encoding="utf-8")
        os.replace(tmp, path)

    def _progress(self, f: PlanFile, state: str = "downloading", force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last_report < PROGRESS_INTERVAL_S:
            return
        self.last_report = now
        speed = self.meter.speed()
        remaining = self.plan.need_bytes
        self.report(
            Progress(
                file=f.path,
                file_done=f.have,
                file_size=f.size,
                done=self.plan.have_bytes,
                total=self.plan.total_bytes,
                files_done=sum(x.done for x in self.plan.files),
                files_total=len(self.plan.files),
                speed=speed,
                eta_s=remaining / speed if speed > 0 else None,
                state=state,
            )
        )

    def _check(self, f: PlanFile) -> bool:
        """Raise when stopping; return True when paused (the caller closes its connection first)."""
        if self.control.stopping:
            raise DownloadCancelled(self.plan.folder, self.control.stopping == "cancel")
        return self.control.paused

    def _wait_paused(self, f: PlanFile) -> None:
        self._progress(f, "paused", force=True)
        self.control.wait_while_paused()
        self._check(f)
        self.meter.restart()
        self._progress(f, "downloading", force=True)

    # ---- the whole download

    def run(self) -> Path:
        plan = self.plan
        try:
            plan.folder.mkdir(parents=True, exist_ok=True)
            self.staging.mkdir(exist_ok=True)
            placed, partial = _known_hashes(plan.folder)
            wanted = {f.path: f.hash_key for f in plan.files}
            self.state["placed"] = {p: h for p, h in placed.items() if wanted.get(p) == h}
            self.state["partial"] = {p: h for p, h in partial.items() if wanted.get(p) == h}
            self._clear_stale_partials()
            record = _read_json(plan.folder / RECORD_FILE)
            if record.get("commit") != plan.commit:
                # another version was here: it stops being a model until this one is complete
                (plan.folder / CONFIG_FILE).unlink(missing_ok=True)
                (plan.folder / RECORD_FILE).unlink(missing_ok=True)
            self._save_state()
            for f in plan.files:
                if not f.done:
                    with self.hub.errors(plan.repo_id, plan.revision, f.path):
                        self._file(f)
            self._finish()
        except DownloadCancelled:
            if self.control.stopping == "cancel":
                self._discard()
            raise
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
                raise HubError(
                    "disk",
                    f"The disk is full: {plan.folder} cannot take more. What arrived is kept; "
                    f"free up space and resume.",
                ) from None
            raise HubError("disk", f"Cannot write the download in {plan.folder}: {exc.strerror or exc}.") from None
        return plan.folder

    def _clear_stale_partials(self) -> None:
        for path in list(self.staging.rglob("*" + INCOMPLETE_SUFFIX)):
            name = path.relative_to(self.staging).as_posix()[: -len(INCOMPLETE_SUFFIX)]
            if name not in self.state["partial"]:
                path.unlink(missing_ok=True)
        for f in self.plan.files:
            if not f.done and f.path not in self.state["partial"]:
                f.have = 0

    def _finish(self) -> None:
        plan = self.plan
        record = {
            "repo_id": plan.repo_id,
            "revision": plan.revision,
            "commit": plan.commit,
            "files": {f.path: {"size": f.size, "hash": f.hash_key} for f in plan.files},
            "completed": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        tmp = plan.folder / (RECORD_FILE + ".tmp")
        tmp.write_text(json.dumps(record, indent=1), encoding="utf-8")
        os.replace(tmp, plan.folder / RECORD_FILE)
        shutil.rmtree(self.staging, ignore_errors=True)
        last = plan.files[-1] if plan.files else PlanFile("", 0)
        self._progress(last, "done", force=True)

    def _discard(self) -> None:
        """Cancel: delete what this download wrote; the folder goes too when nothing else is in it."""
        shutil.rmtree(self.staging, ignore_errors=True)
        for f in self.plan.files:
            (self.plan.folder / f.path).unlink(missing_ok=True)
        (self.plan.folder / RECORD_FILE).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.plan.folder.rmdir()
        for f in self.plan.files:
            f.have, f.done = 0, False

    # ---- one file

    def _file(self, f: PlanFile) -> None:
        import httpx2
        from huggingface_hub.errors import HfHubHTTPError

        incomplete = _incomplete_path(self.plan.folder, f.path)
        incomplete.parent.mkdir(parents=True, exist_ok=True)
        if f.path not in self.state["partial"]:
            incomplete.unlink(missing_ok=True)
            self.state["partial"][f.path] = f.hash_key
            self._save_state()
        open(incomplete, "ab").close()
        f.have = incomplete.stat().st_size
        if f.have > f.size:  # cannot be this file: start again
            incomplete.unlink()
            f.have = 0
        self._progress(f, force=True)
        failures = 0
        while f.have < f.size:
            if self._check(f):
                self._wait_paused(f)
            before = f.have
            try:
                self._fetch(f, incomplete)
            except (httpx2.TransportError, ConnectionError, TimeoutError, HfHubHTTPError) as exc:
                if isinstance(exc, HfHubHTTPError) and not _transient(exc):
                    raise
                failures = 0 if f.have > before else failures + 1
                if failures > MAX_RETRIES:
                    kept = f"{format_size(f.have)} of {format_size(f.size)} arrived and are kept"
                    if isinstance(exc, HfHubHTTPError):
                        status = _status_message(self.hub, exc.response.status_code, f.path, failures)
                        raise HubError(
                            "server", f"{status} {kept[0].upper()}{kept[1:]}; the download resumes from them."
                        ) from None
                    raise HubError(
                        "network",
                        f"The connection to {self.hub.host} was lost while downloading "
                        f"{f.path} ({kept}): {_first_line(exc)}. Check the network, then resume.",
                    )
                self._progress(f, "retrying", force=True)
                self.control.sleep(retry_wait(exc, failures, self.retry_wait_s))
        self._progress(f, "verifying", force=True)
        self._verify(f, incomplete)
        target = self.plan.folder / f.path
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(incomplete, target)
        f.done = True
        self.state["partial"].pop(f.path, None)
        self.state["placed"][f.path] = f.hash_key
        self._save_state()
        self._progress(f, force=True)

    def _fetch(self, f: PlanFile, incomplete: Path) -> None:
        """One GET from the bytes we have to the end of the file (or until paused)."""
        with self.hub.stream(self.plan.repo_id, self.plan.commit, f.path, start=f.have) as response:
            if response.status_code == 200 and f.have:  # the server ignored the range: start again
                f.have = 0
                mode = "wb"
            else:
                mode = "ab"
            total = _length_from(response, f.have)
            if total is not None and total != f.size:
                incomplete.unlink(missing_ok=True)
                f.have = 0
                raise HubError(
                    "mismatch",
                    f"{f.path} does not match the Hub's listing: the server sends "
                    f"{total:,} bytes where the listing says {f.size:,}. Nothing of it was "
                    f"kept; try again later (the repo may be changing right now).",
                )
            with open(incomplete, mode) as out:
                # pieces as they arrive (at most the socket's read size): the flag is checked after each, and
                # nothing received is held back in a buffer when the connection dies
                for chunk in response.iter_bytes():
                    if f.have + len(chunk) > f.size:
                        out.close()
                        incomplete.unlink(missing_ok=True)
                        f.have = 0
                        raise HubError(
                            "mismatch",
                            f"{f.path} is larger than the {f.size:,} bytes the Hub lists; "
                            f"the copy was removed. Try again later.",
                        )
                    out.write(chunk)
                    f.have += len(chunk)
                    self.meter.add(len(chunk))
                    self._progress(f)
                    if self._check(f):
                        return  # paused: close this connection; the next GET starts from here
        if f.have < f.size:  # a clean end before the listed size
            got = f.have
            incomplete.unlink(missing_ok=True)
            f.have = 0
            raise HubError(
                "mismatch",
                f"{f.path} ended after {got:,} bytes, but the Hub lists {f.size:,}. The "
                f"copy was removed; try again later.",
            )

    def _verify(self, f: PlanFile, incomplete: Path) -> None:
        size = incomplete.stat().st_size
        if size != f.size:
            incomplete.unlink(missing_ok=True)
            f.have = 0
            raise HubError(
                "mismatch",
                f"{f.path} has {size:,} bytes after downloading, but the Hub lists "
                f"{f.size:,}. The copy was removed; try again.",
            )
        if f.sha256:
            digest, kind, expected = hashlib.sha256(), "SHA-256", f.sha256
        elif f.blob_id:
            digest, kind, expected = hashlib.sha1(), "git blob id", f.blob_id
            digest.update(b"blob %d\0" % f.size)
        else:
            return
        with open(incomplete, "rb") as handle:
            while block := handle.read(8 * 1024 * 1024):
                digest.update(block)
                if self.control.stopping:
                    raise DownloadCancelled(self.plan.folder, self.control.stopping == "cancel")
        if digest.hexdigest() != expected.lower():
            incomplete.unlink(missing_ok=True)
            f.have = 0
            raise HubError(
                "mismatch",
                f"{f.path} arrived damaged: its {kind} does not match the one the Hub lists. "
                f"The copy was removed; try again (if it keeps happening, the mirror serves "
                f"a different file).",
            )


def _length_from(response, start: int) -> int | None:
    """The whole file's length according to the response: Content-Range's total, else start + Content-Length."""
    content_range = response.headers.get("Content-Range")
    if content_range and "/" in content_range:
        total = content_range.rsplit("/", 1)[1].strip()
        return int(total) if total.isdigit() else None
    length = response.headers.get("Content-Length")
    if length is not None and length.isdigit() and response.headers.get("Content-Encoding", "identity") == "identity":
        return int(length) + (start if response.status_code == 206 else 0)
    return None


def download(
    hub: Hub,
    plan: DownloadPlan,
    progress: Callable[[Progress], None] | None = None,
    control: DownloadControl | None = None,
    retry_wait_s: float = RETRY_WAIT_S,
) -> Path:
    """Fetch every file of the plan that is not here yet, resuming partial ones; returns the model folder.

    Raises HubError (plain message) or DownloadCancelled. Refuses at once when the disk is too small."""
    hub.check_online()
    check_file_names(plan.repo_id, [f.path for f in plan.files])
    plan.free_bytes = free_disk_bytes(plan.folder)
    if not plan.disk_ok:
        raise HubError("disk", plan.disk_message())
    return _Download(hub, plan, progress, control or DownloadControl(), retry_wait_s).run()


def pull(
    repo_id: str,
    revision: str = "main",
    local_dir: str | Path | None = None,
    *,
    endpoint: str | None = None,
    token: str | None = None,
    offline: bool = False,
    progress: Callable[[Progress], None] | None = None,
    control: DownloadControl | None = None,
    on_plan: Callable[[DownloadPlan], None] | None = None,
) -> Path:
    """Plan and download in one call (what `python -m engine pull` does)."""
    hub = Hub(endpoint, token, offline)
    plan = plan_download(hub, repo_id, revision, local_dir, control=control)
    if on_plan is not None:
        on_plan(plan)
    return download(hub, plan, progress, control)
