"""Models from the Hugging Face Hub: list a repo's files, check the fit and the disk, download with resume.

No Qt here: the CLI (`python -m engine pull`) and the app's download dialog both drive this module.

How it uses the real `huggingface_hub` client:
- the file list, sizes and hashes come from `HfApi(endpoint=...).model_info(repo, files_metadata=True)`;
- every byte is fetched through the client's shared HTTP session (`get_session()`, so its offline switch,
  proxies and client factory apply), with its headers (`build_hf_headers`: user agent, and the token from
  the argument or from where `huggingface_hub` stores it), its URLs (`hf_hub_url`, honouring the endpoint
  of a mirror) and its error mapping (`hf_raise_for_status`: unknown repo, gated repo, missing revision).
- The bytes themselves are streamed by our own ranged GETs rather than `hf_hub_download`: this version of
  the client downloads each file to a process-unique temporary name that it deletes on any failure, so it
  cannot resume after the app or the connection dies, and it cannot be paused or cancelled mid-file. Our
  loop checks a pause/cancel flag between chunks, resumes a file from its `.incomplete` bytes with
  `Range: bytes=N-`, and verifies each finished file's size and hash (the SHA-256 the Hub lists for LFS
  files, the git blob id for small files) before it is put in place.

Where files go: a plain folder per model (default `default_models_dir()/ORG--NAME`), because that is what
the engine opens and what the app's library lists. Bytes in flight live in `FOLDER/.download/`
(`PATH.incomplete` plus `state.json`, which names the commit and the hash each partial file belongs to);
a verified file is renamed into the folder; `config.json` is placed last, so a folder is only taken for
a model once every weight is there. A finished download leaves `FOLDER/.moedesk-download.json` (repo,
revision, commit, files and hashes) and no `.download/`.

What a server says is not trusted: every file name to be written must be a plain relative name on Windows and
POSIX alike; a safetensors header may claim at most what the local reader accepts (MAX_HEADER_BYTES) and a
config file at most MAX_SMALL_FILE_BYTES; a read never keeps more bytes than it asked for; an HTML page or
wrong-shaped JSON is named as "not the Hub's API". Planning requests are retried on 429/5xx (Retry-After obeyed
up to a cap) and run on a helper thread, so a stop (Ctrl-C, Cancel) ends planning at once even while a read is
stalled; every read has a timeout.
"""

from __future__ import annotations

import contextlib
import email.utils
import errno
import fnmatch
import hashlib
import http
import json
import os
import shutil
import struct
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Callable
from urllib.parse import urlparse

from engine.checkpoint import INDEX_FILE, Checkpoint, LayoutShard
from engine.checkpoint.safetensors_file import MAX_HEADER_BYTES
from engine.config import read_config
from engine.errors import CheckpointError

STAGING_DIR = ".download"
STATE_FILE = "state.json"
RECORD_FILE = ".moedesk-download.json"
INCOMPLETE_SUFFIX = ".incomplete"
CONFIG_FILE = "config.json"
# What the engine reads from a checkpoint folder besides the weights; everything else in a repo is skipped.
NEEDED_FILES = (CONFIG_FILE, "generation_config.json", "hf_quant_config.json", INDEX_FILE, "tokenizer.json",
                "tokenizer_config.json", "chat_template.jinja", "chat_template.json", "special_tokens_map.json")
WEIGHT_PATTERN = "*.safetensors"
SIZE_PRESETS = ("4gb", "8gb", "12gb")
HEADER_PROBE_BYTES = 512 * 1024  # first request for a safetensors header; most headers fit
DISK_MARGIN_BYTES = 256 * 1024 * 1024  # left free after a download, for the system and the app
MAX_RETRIES = 4  # consecutive network failures of one file with no byte received in between
RETRY_WAIT_S = 1.0  # first wait before a retry; doubles each time, at most 8 s
PROGRESS_INTERVAL_S = 0.1
SPEED_WINDOW_S = 5.0
TIMEOUT_S = 10.0  # connect and read timeout: a stalled connection fails (and is retried) after this long
REQUEST_TRIES = 4  # tries of one planning request while the server answers 429 or 5xx
RETRY_AFTER_MAX_S = 30.0  # the longest wait a server's Retry-After is obeyed for
MAX_SMALL_FILE_BYTES = 64 * 1024 * 1024  # the most a config or index file read while planning may be
STOP_POLL_S = 0.2  # how often a wait for the network looks at the stop flag (signal handlers run in between)
# Windows gives these names (with any extension) to devices: a file called so cannot be written there.
WINDOWS_DEVICE_NAMES = frozenset({"CON", "PRN", "AUX", "NUL", "CONIN$", "CONOUT$"}
                                 | {f"{port}{n}" for port in ("COM", "LPT") for n in (*"123456789", "¹", "²", "³")})
WINDOWS_FORBIDDEN_CHARS = frozenset('<>:"|?*\\')


class HubError(Exception):
    """A failure to report in plain words. kind: offline, invalid, not_found, revision, gated, network, disk,
    mismatch, unsupported, server."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class DownloadCancelled(Exception):
    """The download stopped because it was asked to. discarded: its files were deleted (Cancel); otherwise what
    arrived is kept and the same download resumes from it (an interrupted CLI run). folder None: it stopped
    while planning, before anything was written."""

    def __init__(self, folder: Path | None, discarded: bool):
        self.folder, self.discarded = folder, discarded
        if folder is None:
            kept = "nothing was downloaded yet"
        else:
            kept = "nothing was kept" if discarded else f"what arrived is kept in {folder}"
        super().__init__(f"download cancelled; {kept}")


# ---- curated models ----------------------------------------------------------------------------

@dataclass(frozen=True)
class CuratedModel:
    repo_id: str
    format: str
    synthetic: str  # the engine.synthetic description of its shapes and formats (for the fit before any file)
    note: str


CURATED_MODELS = (
    CuratedModel("nvidia/Qwen3.6-35B-A3B-NVFP4", "nvfp4", "qwen3.6-35b-a3b-nvfp4",
                 "NVFP4 experts, FP8 projections: the smallest, fits a 4 GB card"),
    CuratedModel("Qwen/Qwen3.6-35B-A3B-FP8", "fp8", "qwen3.6-35b-a3b-fp8", "FP8 (128x128 blocks)"),
    CuratedModel("Qwen/Qwen3.6-35B-A3B", "bf16", "qwen3.6-35b-a3b", "the original bf16 release"),
    CuratedModel("Qwen/Qwen3.5-35B-A3B", "bf16", "qwen3.6-35b-a3b", "bf16; the same shapes as Qwen3.6-35B-A3B"),
    CuratedModel("Qwen/Qwen3-30B-A3B", "bf16", "qwen3-30b-a3b", "bf16; no Gated DeltaNet, 128 experts"),
)


@dataclass
class Fit:
    """What a model needs: host RAM for its weights, and which VRAM presets the planner can place it in."""

    weight_bytes: int  # all the weights the engine reads (vision tower and MTP head excluded)
    ram_bytes: int  # host RAM the weights take: routed experts and embedding always, the rest on the CPU path
    fits: dict[str, bool]
    errors: dict[str, str]  # why a preset does not fit
    basis: str  # where the numbers come from

    def to_dict(self) -> dict:
        return asdict(self)


def fit_of(footprint, basis: str) -> Fit:
    from engine.runtime.planner import PlanError, plan_memory, preset_budget_bytes

    weights = footprint.resident_bytes + footprint.embedding_bytes + footprint.routed_expert_bytes
    fits, errors = {}, {}
    for preset in SIZE_PRESETS:
        try:
            plan_memory(footprint, preset_budget_bytes(preset), preset)
            fits[preset] = True
        except PlanError as exc:
            fits[preset], errors[preset] = False, str(exc)
    return Fit(weight_bytes=weights, ram_bytes=weights, fits=fits, errors=errors, basis=basis)


def curated_fit(model: CuratedModel) -> Fit:
    """The fit of a curated model from its built-in description: no network, no file."""
    from engine.runtime.planner import footprint_from_synthetic

    return fit_of(footprint_from_synthetic(model.synthetic), f"the built-in description {model.synthetic!r}")


# ---- where models go, tokens --------------------------------------------------------------------

def default_models_dir() -> Path:
    """Where downloads go unless told otherwise: $MOEDESK_MODELS_DIR, else MoE Desk's folder in the user's data."""
    if os.environ.get("MOEDESK_MODELS_DIR"):
        return Path(os.environ["MOEDESK_MODELS_DIR"]).expanduser()
    if sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Application Support"
    else:
        base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return base / "MoE Desk" / "models"


def folder_name(repo_id: str, revision: str = "main") -> str:
    """ORG--NAME, plus --REVISION for anything but main (a folder per revision)."""
    name = repo_id.replace("/", "--")
    if revision and revision != "main":
        name += "--" + "".join(c if c.isalnum() or c in "-_." else "-" for c in revision)
    return name


def save_token(token: str) -> Path:
    """Store a Hub token where huggingface_hub reads it (its token file under HF_HOME); returns that path.

    Written directly rather than through `huggingface_hub.login`, which first checks the token against
    huggingface.co itself: that fails behind a mirror and offline. The token is never logged."""
    from huggingface_hub import constants

    token = token.strip()
    if not token:
        raise ValueError("the token is empty")
    path = Path(constants.HF_TOKEN_PATH)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(token)
    return path


def has_saved_token() -> bool:
    """Whether huggingface_hub has a token to send (its token file or HF_TOKEN)."""
    from huggingface_hub import get_token

    try:
        return bool(get_token())
    except Exception:  # an unreadable token file counts as none
        return False


def client_offline() -> bool:
    """Whether huggingface_hub itself is in offline mode (HF_HUB_OFFLINE)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


# ---- the plan -----------------------------------------------------------------------------------

@dataclass
class PlanFile:
    path: str
    size: int
    sha256: str | None = None  # LFS files
    blob_id: str | None = None  # the git blob id of small files
    have: int = 0  # bytes already here: the whole file, or the part in .download/
    done: bool = False

    @property
    def hash_key(self) -> str:
        return self.sha256 or self.blob_id or f"size:{self.size}"


@dataclass
class DownloadPlan:
    repo_id: str
    revision: str
    commit: str
    endpoint: str
    folder: Path
    files: list[PlanFile]
    skipped: list[str] = field(default_factory=list)  # files of the repo the engine does not need
    gated: bool = False
    free_bytes: int = 0  # on the disk that holds the folder
    fit: Fit | None = None
    fit_note: str = ""  # why there is no fit, when there is none

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def have_bytes(self) -> int:
        return sum(f.have for f in self.files)

    @property
    def need_bytes(self) -> int:
        return self.total_bytes - self.have_bytes

    @property
    def complete(self) -> bool:
        return all(f.done for f in self.files)

    @property
    def disk_ok(self) -> bool:
        return self.need_bytes == 0 or self.need_bytes + DISK_MARGIN_BYTES <= self.free_bytes

    def disk_message(self) -> str:
        return (f"Not enough disk space in {_existing_ancestor(self.folder)}: this download needs "
                f"{format_size(self.need_bytes)} more and only {format_size(self.free_bytes)} is free "
                f"({format_size(DISK_MARGIN_BYTES)} is kept free for the system). Free up space or choose "
                f"another download folder.")

    def to_dict(self) -> dict:
        return {"repo_id": self.repo_id, "revision": self.revision, "commit": self.commit,
                "endpoint": self.endpoint, "folder": str(self.folder),
                "files": [{"path": f.path, "size": f.size, "have": f.have, "done": f.done} for f in self.files],
                "skipped": list(self.skipped), "gated": self.gated, "total_bytes": self.total_bytes,
                "have_bytes": self.have_bytes, "need_bytes": self.need_bytes, "free_bytes": self.free_bytes,
                "disk_ok": self.disk_ok, "disk_message": "" if self.disk_ok else self.disk_message(),
                "complete": self.complete, "fit": self.fit.to_dict() if self.fit else None,
                "fit_note": self.fit_note}


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


class DownloadControl:
    """Pause, resume and cancel a download from any thread; the download checks it between chunks."""

    def __init__(self):
        self._cond = threading.Condition()
        self._paused = False
        self._stop: str | None = None  # "cancel" (delete the files) or "interrupt" (keep them)

    def pause(self) -> None:
        with self._cond:
            self._paused = True
            self._cond.notify_all()

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def cancel(self) -> None:
        """Stop and delete what this download wrote."""
        self._set_stop("cancel")

    def interrupt(self) -> None:
        """Stop and keep what arrived, so the same download resumes from it."""
        self._set_stop("interrupt")

    def _set_stop(self, how: str) -> None:
        with self._cond:
            self._stop = self._stop or how
            self._cond.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def stopping(self) -> str | None:
        return self._stop

    def wait_while_paused(self) -> None:
        with self._cond:
            while self._paused and self._stop is None:
                self._cond.wait()

    def sleep(self, seconds: float) -> None:
        """Wait, but wake at once for a pause, a resume or a stop."""
        deadline = time.monotonic() + seconds
        with self._cond:
            while self._stop is None and (left := deadline - time.monotonic()) > 0:
                # in slices: on Windows a Ctrl-C handler runs only once the wait returns
                if self._cond.wait(min(left, STOP_POLL_S)):
                    return

    def call(self, fn: Callable):
        """Return fn() run on a helper thread, or raise DownloadCancelled as soon as a stop is asked.

        A blocked socket read cannot be woken from another thread, so the caller does not wait for it: an
        abandoned request ends on its own at its read timeout and its result is dropped."""
        outcome: dict = {}

        def run() -> None:
            try:
                outcome["value"] = fn()
            except BaseException as exc:  # handed to the waiting thread, which raises it
                outcome["error"] = exc
            with self._cond:
                outcome["done"] = True
                self._cond.notify_all()

        threading.Thread(target=run, name="hub-request", daemon=True).start()
        with self._cond:
            while "done" not in outcome and self._stop is None:
                self._cond.wait(STOP_POLL_S)  # in slices, as in sleep()
        if "done" not in outcome:
            raise DownloadCancelled(None, self._stop == "cancel")
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]


# ---- talking to the Hub -------------------------------------------------------------------------

class Hub:
    """One Hub (or mirror) with one token choice. token None: the token huggingface_hub has stored, if any.
    sleep: how retries wait (tests pass a recorder); None: the download control's stoppable wait."""

    def __init__(self, endpoint: str | None = None, token: str | None = None, offline: bool = False,
                 timeout: float = TIMEOUT_S, sleep: Callable[[float], None] | None = None,
                 retry_wait_s: float = RETRY_WAIT_S):
        from huggingface_hub import constants

        self.endpoint = (endpoint or "").strip().rstrip("/") or constants.ENDPOINT
        self.token = token or None
        self.offline = offline
        self.timeout = timeout
        self.sleep = sleep
        self.retry_wait_s = retry_wait_s

    def wait(self, control: DownloadControl, seconds: float) -> None:
        """Wait before a retry; raise DownloadCancelled when a stop was asked meanwhile."""
        if self.sleep is not None:
            self.sleep(seconds)
        else:
            control.sleep(seconds)
        if control.stopping:
            raise DownloadCancelled(None, control.stopping == "cancel")

    def request(self, control: DownloadControl | None, what: str, fn: Callable):
        """fn() (one request about `what`), stoppable through `control`; answers of 429 and 5xx are tried
        REQUEST_TRIES times, waiting as Retry-After asks (capped) or backing off."""
        from huggingface_hub.errors import HfHubHTTPError

        control = control or DownloadControl()
        for attempt in range(1, REQUEST_TRIES + 1):
            try:
                return control.call(fn)
            except HfHubHTTPError as exc:
                if not _transient(exc):
                    raise
                if attempt == REQUEST_TRIES:
                    raise HubError("server", _status_message(self, exc.response.status_code, what, attempt)) from None
                self.wait(control, retry_wait(exc, attempt, self.retry_wait_s))

    @property
    def host(self) -> str:
        return urlparse(self.endpoint).netloc or self.endpoint

    def check_online(self) -> None:
        if self.offline:
            raise HubError("offline", "Offline mode is on, so MoE Desk does not contact the Hub. Turn offline mode "
                                      "off to download.")
        if client_offline():
            raise HubError("offline", "Offline mode is on (the HF_HUB_OFFLINE environment variable is set), so "
                                      "nothing can be downloaded. Unset HF_HUB_OFFLINE to download.")

    def model_info(self, repo_id: str, revision: str, control: DownloadControl | None = None):
        """The repo's info with its files' sizes and hashes; an answer that is not the Hub's is a HubError."""
        from huggingface_hub import HfApi
        from huggingface_hub.errors import HFValidationError

        def ask():
            try:
                return HfApi(endpoint=self.endpoint, token=self.token).model_info(
                    repo_id, revision=revision, files_metadata=True, timeout=self.timeout)
            except HFValidationError:
                raise
            except json.JSONDecodeError as exc:
                page = exc.doc.lstrip()[:1] == "<"
                raise HubError("server", _not_the_hub(self, "an HTML page" if page else "an answer that is not "
                                                                                          "JSON")) from None
            except (ValueError, TypeError, KeyError, AttributeError):
                raise HubError("server", _not_the_hub(self, "JSON that is not a model's file list")) from None

        self.check_online()
        with self.errors(repo_id, revision):
            return self.request(control, f"the file list of {repo_id}", ask)

    def _headers(self) -> dict:
        from huggingface_hub.utils import build_hf_headers

        headers = build_hf_headers(token=self.token, library_name="moedesk", library_version=_version())
        headers["Accept-Encoding"] = "identity"  # the sizes and ranges are of the file itself
        return headers

    @contextlib.contextmanager
    def stream(self, repo_id: str, commit: str, path: str, start: int = 0, end: int | None = None):
        """A GET of the file at a commit from byte `start` (to `end`, inclusive), redirects followed. The caller
        maps errors with `errors()`; an error status raises the client's own exception types."""
        import httpx2
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import get_session, hf_raise_for_status

        self.check_online()
        url = hf_hub_url(repo_id, path, revision=commit, endpoint=self.endpoint)
        headers = self._headers()
        if start or end is not None:
            headers["Range"] = f"bytes={start}-{'' if end is None else end}"
        with get_session().stream("GET", url, headers=headers, follow_redirects=True,
                                  timeout=httpx2.Timeout(self.timeout)) as response:
            hf_raise_for_status(response)
            if response.headers.get("Content-Type", "").startswith("text/html") and \
                    not path.lower().endswith((".html", ".htm")):
                raise HubError("server", _not_the_hub(self, f"an HTML page where {path} should be"))
            yield response

    def read(self, repo_id: str, commit: str, path: str, start: int, end: int,
             control: DownloadControl | None = None) -> bytes:
        """Bytes `start` to `end` (inclusive) of a file, in memory: never more, whatever the server sends."""
        def fetch() -> bytes:
            wanted = end - start + 1
            data = bytearray()
            with self.stream(repo_id, commit, path, start, end) as response:
                skip = start if response.status_code == 200 else 0  # the server ignored the range
                for chunk in response.iter_bytes():
                    if skip:
                        dropped = min(skip, len(chunk))
                        chunk, skip = chunk[dropped:], skip - dropped
                    data += chunk[:wanted - len(data)]
                    if len(data) >= wanted:
                        break
            return bytes(data)

        with self.errors(repo_id, commit, path):
            return self.request(control, f"{path} of {repo_id}", fetch)

    @contextlib.contextmanager
    def errors(self, repo_id: str, revision: str, path: str | None = None):
        """Turn the client's exceptions into a HubError with a plain message."""
        import httpx2
        from huggingface_hub import errors as hf_errors

        try:
            yield
        except HubError:
            raise
        except hf_errors.OfflineModeIsEnabled:
            raise HubError("offline", "Offline mode is on (HF_HUB_OFFLINE is set), so nothing can be downloaded. "
                                      "Unset HF_HUB_OFFLINE to download.") from None
        except hf_errors.HFValidationError as exc:
            raise HubError("invalid", f"{repo_id!r} is not a Hub repo id: write it as ORGANISATION/NAME, e.g. "
                                      f"Qwen/Qwen3-30B-A3B ({_first_line(exc)}).") from None
        except hf_errors.GatedRepoError:
            raise HubError("gated", _gated_message(repo_id, self)) from None
        except hf_errors.RepositoryNotFoundError:
            access = "your token has no access to it" if self.token or has_saved_token() else "needs a token"
            raise HubError("not_found", f"There is no model {repo_id} on {self.host}, or it is private and {access}. "
                                        f"Check the name (ORGANISATION/NAME).") from None
        except hf_errors.RevisionNotFoundError:
            raise HubError("revision", f"{repo_id} has no revision {revision!r} on {self.host}. Leave the "
                                       f"revision at main, or give a branch, tag or commit that exists.") from None
        except hf_errors.RemoteEntryNotFoundError:
            raise HubError("server", f"{self.host} lists {path} in {repo_id} but does not serve it; try again "
                                     f"later.") from None
        except hf_errors.HfHubHTTPError as exc:
            status = exc.response.status_code if exc.response is not None else 0
            raise HubError("server", _status_message(self, status, f"{path} of {repo_id}" if path else repo_id,
                                                     1)) from None
        except (httpx2.TransportError, httpx2.HTTPError, ConnectionError, TimeoutError) as exc:
            raise HubError("network", _network_message(self, exc)) from None


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("moedesk")
    except Exception:  # running from a checkout that was never installed
        return "dev"


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def _gated_message(repo_id: str, hub: Hub) -> str:
    page = f"{hub.endpoint}/{repo_id}"
    if hub.token or has_saved_token():
        return (f"{repo_id} is gated and your token has no access to it yet. Open {page}, accept the conditions "
                f"with the account the token belongs to, then try again.")
    return (f"{repo_id} is gated: open {page}, accept its conditions, then paste an access token of that "
            f"account (huggingface.co/settings/tokens) in the Token field, or log in with `hf auth login`.")


def _network_message(hub: Hub, exc: BaseException) -> str:
    import httpx2

    if isinstance(exc, (httpx2.ReadTimeout, httpx2.WriteTimeout)):
        return (f"{hub.host} stopped answering (nothing arrived for {hub.timeout:g} s). Check the network "
                f"connection, or the endpoint (mirror) setting, and try again.")
    return (f"Cannot reach {hub.host} ({_first_line(exc)}). Check the network connection, or the endpoint "
            f"(mirror) setting.")


def _status_message(hub: Hub, status: int, what: str, tries: int) -> str:
    """What an HTTP error answer means, for the status codes no other message covers."""
    try:
        phrase = f" ({http.HTTPStatus(status).phrase})"
    except ValueError:
        phrase = ""
    times = f", {tries} times in a row" if tries > 1 else ""
    if status >= 500:
        advice = ("the Hub (or the mirror) is failing on its side. Try again later; if it keeps happening, "
                  "check the endpoint (mirror) setting")
    else:
        advice = "try again later, or check the endpoint (mirror) setting"
    return f"{hub.host} answered HTTP {status}{phrase} for {what}{times}: {advice}."


def _not_the_hub(hub: Hub, what: str) -> str:
    return (f"The Hub endpoint {hub.endpoint} answered something that is not the Hub's API ({what}): check your "
            f"network (a Wi-Fi login page may be answering in its place) or the endpoint (mirror) setting, then "
            f"try again.")


def format_size(n: int | float) -> str:
    """Decimal units, the way disks and the Hub count: 61.07 GB."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def format_duration(seconds: float | None) -> str:
    """An ETA the way people read one: 45s, 12m05s, 2h07m; "?" when unknown."""
    if seconds is None:
        return "?"
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


# ---- planning -----------------------------------------------------------------------------------

def needed_files(paths: list[str]) -> tuple[list[str], list[str]]:
    """(what the engine needs, what it does not) of a repo's file paths: the configs, the tokenizer, the chat
    template and the top-level safetensors weights."""
    needed = [p for p in paths if p in NEEDED_FILES or ("/" not in p and fnmatch.fnmatch(p, WEIGHT_PATTERN))]
    return needed, [p for p in paths if p not in needed]


def unsafe_name_reason(name: str) -> str | None:
    """Why a repo's file name cannot be written as a file inside the model folder on Windows or POSIX (it
    leaves the folder, names a drive, a device or a data stream, or the system would rename it); None if safe."""
    if not name:
        return "it is empty"
    if any(ord(c) < 32 for c in name):
        return "it contains a control character"
    bad = sorted(WINDOWS_FORBIDDEN_CHARS.intersection(name))
    if bad:
        return f"it contains {' '.join(bad)}, which Windows does not allow in a file name"
    posix, windows = PurePosixPath(name), PureWindowsPath(name)
    if posix.is_absolute() or windows.is_absolute() or windows.drive or windows.root:
        return "it is an absolute path"
    parts = name.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return "it is not a plain relative path (an empty, '.' or '..' part)"
    for part in parts:
        if part[-1] in ". ":
            return f"{part!r} ends with a dot or a space, which Windows drops"
        if part.split(".")[0].rstrip(" ").upper() in WINDOWS_DEVICE_NAMES:
            return f"{part!r} is a device name on Windows"
        if len(part.encode("utf-8")) > 255:
            return "a part of it is longer than 255 bytes"
    return None


def check_file_names(repo_id: str, names) -> None:
    """Refuse the repo (HubError) when one of the file names it would write is unsafe on some system."""
    for name in names:
        reason = unsafe_name_reason(name)
        if reason is not None:
            raise HubError("unsupported", f"{repo_id} lists a file MoE Desk will not write: {name!r} ({reason}). "
                                          f"A model's files have plain relative names, so this repo is broken or "
                                          f"hostile; nothing was downloaded. Choose another model.")


def _checked_listing(hub: Hub, info) -> tuple[str | None, dict]:
    """(commit, {path: sibling}) of a model info, refusing values of the wrong type (an answer not from the Hub)."""
    def count(value) -> bool:
        return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)

    wrong = HubError("server", _not_the_hub(hub, "JSON that is not a model's file list"))
    if info.sha is not None and not isinstance(info.sha, str) or not isinstance(info.siblings or [], list):
        raise wrong
    siblings = {}
    for s in info.siblings or []:
        lfs = s.lfs
        if not isinstance(s.rfilename, str) or not count(s.size) or not (s.blob_id is None or isinstance(
                s.blob_id, str)) or lfs is not None and (not count(lfs.size) or not isinstance(lfs.sha256, str)):
            raise wrong
        siblings[s.rfilename] = s
    return info.sha, siblings


def plan_download(hub: Hub, repo_id: str, revision: str = "main", folder: str | Path | None = None,
                  models_dir: str | Path | None = None, with_fit: bool = True,
                  control: DownloadControl | None = None) -> DownloadPlan:
    """What downloading `repo_id` at `revision` involves: the files and sizes from the Hub, what is already
    here, the free disk, and (with_fit) the RAM/VRAM fit from the config and the safetensors headers.

    A stop asked through `control` ends it at once with DownloadCancelled (folder None)."""
    repo_id, revision = repo_id.strip(), (revision or "main").strip() or "main"
    if not repo_id:
        raise HubError("invalid", "Give a repo id, e.g. Qwen/Qwen3-30B-A3B.")
    info = hub.model_info(repo_id, revision, control)
    commit, siblings = _checked_listing(hub, info)
    commit = commit or revision
    wanted, skipped = needed_files(sorted(siblings))
    check_file_names(repo_id, wanted)
    weights = [p for p in wanted if fnmatch.fnmatch(p, WEIGHT_PATTERN)]
    if not weights:
        raise HubError("unsupported", f"{repo_id} has no .safetensors weights at its top level: MoE Desk runs "
                                      f"Hugging Face safetensors checkpoints (GGUF, .bin and other formats are not "
                                      f"supported).")
    if CONFIG_FILE not in wanted:
        raise HubError("unsupported", f"{repo_id} has no config.json, so it is not a model folder MoE Desk can "
                                      f"open.")
    small = {}
    for name in (CONFIG_FILE, "hf_quant_config.json", INDEX_FILE):
        if name in siblings:
            size = _listed_size(hub, siblings[name])
            if size > MAX_SMALL_FILE_BYTES:
                raise HubError("unsupported", f"{repo_id}'s {name} is listed as {format_size(size)}, far more than "
                                              f"a config file takes (at most {format_size(MAX_SMALL_FILE_BYTES)} "
                                              f"is read): the repo is broken. Choose another model.")
            # also where a gated repo without access is found out
            small[name] = hub.read(repo_id, commit, name, 0, size - 1, control) if size else b""
    if INDEX_FILE in small:
        try:
            listed = set(json.loads(small[INDEX_FILE])["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError):
            raise HubError("unsupported", f"{repo_id}'s {INDEX_FILE} is not a valid safetensors index.") from None
        missing = sorted(listed - set(weights))
        if missing:
            raise HubError("unsupported", f"{repo_id}'s {INDEX_FILE} names {missing[0]}, which the repo does not "
                                          f"have.")
        skipped += [p for p in weights if p not in listed]
        wanted = [p for p in wanted if p not in weights or p in listed]
    files = []
    for path in wanted:
        sibling = siblings[path]
        lfs = sibling.lfs
        files.append(PlanFile(path, _listed_size(hub, sibling), sha256=lfs.sha256 if lfs is not None else None,
                              blob_id=None if lfs is not None else sibling.blob_id))
    target = Path(folder).expanduser() if folder else Path(models_dir or default_models_dir()) / folder_name(
        repo_id, revision)
    plan = DownloadPlan(repo_id, revision, commit, hub.endpoint, target, files, sorted(skipped),
                        gated=bool(getattr(info, "gated", False)))
    plan.files = _order(plan.files)
    _mark_local(plan)
    plan.free_bytes = free_disk_bytes(target)
    if with_fit:
        plan.fit, plan.fit_note = _remote_fit(hub, plan, small, control)
    return plan


def _listed_size(hub: Hub, sibling) -> int:
    size = sibling.lfs.size if sibling.lfs is not None else sibling.size
    if size is None:
        raise HubError("server", f"{hub.host} did not give the size of {sibling.rfilename}; try again later.")
    return int(size)


def _order(files: list[PlanFile]) -> list[PlanFile]:
    """Small files first, then the weights, and config.json last: a folder without config.json is not a model,
    so an unfinished download is never taken for one."""
    return sorted(files, key=lambda f: (f.path == CONFIG_FILE, fnmatch.fnmatch(f.path, WEIGHT_PATTERN), f.path))


def free_disk_bytes(folder: Path) -> int:
    return shutil.disk_usage(_existing_ancestor(folder)).free


def _existing_ancestor(folder: Path) -> Path:
    folder = Path(folder).expanduser().absolute()
    while not folder.exists() and folder.parent != folder:
        folder = folder.parent
    return folder


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _known_hashes(folder: Path) -> tuple[dict, dict]:
    """({path: hash_key} of files that a download verified and placed here, {path: hash_key} of partial files)."""
    record = _read_json(folder / RECORD_FILE)
    state = _read_json(folder / STAGING_DIR / STATE_FILE)
    placed = {p: v.get("hash") for p, v in (record.get("files") or {}).items() if isinstance(v, dict)}
    placed.update({p: h for p, h in (state.get("placed") or {}).items()})
    partial = {p: h for p, h in (state.get("partial") or {}).items()}
    return placed, partial


def _mark_local(plan: DownloadPlan) -> None:
    """Set `have`/`done` from what is in the folder: a file counts as done only if one of our downloads
    verified it (same hash) and its size is right; partial bytes count if they belong to the same file version."""
    placed, partial = _known_hashes(plan.folder)
    for f in plan.files:
        target = plan.folder / f.path
        if placed.get(f.path) == f.hash_key and target.is_file() and target.stat().st_size == f.size:
            f.have, f.done = f.size, True
            continue
        incomplete = _incomplete_path(plan.folder, f.path)
        if partial.get(f.path) == f.hash_key and incomplete.is_file():
            f.have = min(incomplete.stat().st_size, f.size)


def _incomplete_path(folder: Path, path: str) -> Path:
    return folder / STAGING_DIR / (path + INCOMPLETE_SUFFIX)


# ---- the fit before downloading -----------------------------------------------------------------

def _header_shard(header: dict, path: Path) -> LayoutShard:
    """A safetensors file known only by its header (fetched with a range request)."""
    entries = {k: v for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}
    return LayoutShard({k: (v["dtype"], tuple(int(d) for d in v["shape"])) for k, v in entries.items()}, path)


def _safetensors_header(hub: Hub, plan: DownloadPlan, f: PlanFile, control: DownloadControl | None) -> dict:
    probe = hub.read(plan.repo_id, plan.commit, f.path, 0, min(f.size, HEADER_PROBE_BYTES) - 1, control) \
        if f.size >= 8 else b""
    if len(probe) < 8:
        raise CheckpointError(Path(f.path), "is too short to be a safetensors file")
    (length,) = struct.unpack("<Q", probe[:8])
    if length > MAX_HEADER_BYTES:
        # the engine refuses such a file when it opens it, so downloading it would be in vain
        raise HubError("unsupported", f"{plan.repo_id}'s {f.path} claims a safetensors header of "
                                      f"{format_size(length)}, more than the {format_size(MAX_HEADER_BYTES)} a "
                                      f"safetensors file may have: the file is damaged or not a real checkpoint, "
                                      f"and MoE Desk could not open it. Nothing was downloaded; choose another "
                                      f"model.")
    if length > f.size - 8:
        raise CheckpointError(Path(f.path), "has a corrupt safetensors header")
    if 8 + length > len(probe):
        probe += hub.read(plan.repo_id, plan.commit, f.path, len(probe), 8 + length - 1, control)
    try:
        header = json.loads(probe[8:8 + length].decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(Path(f.path), f"has a corrupt safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(Path(f.path), "has a corrupt safetensors header")
    return header


def _remote_fit(hub: Hub, plan: DownloadPlan, small: dict[str, bytes],
                control: DownloadControl | None) -> tuple[Fit | None, str]:
    """The fit from config.json and the safetensors headers (a few range requests, no weight data)."""
    with tempfile.TemporaryDirectory(prefix="moedesk-fit-") as tmp:
        folder = Path(tmp)
        for name in (CONFIG_FILE, "hf_quant_config.json"):
            if name in small:
                (folder / name).write_bytes(small[name])
        try:
            config = read_config(folder)
        except CheckpointError as exc:
            raise HubError("unsupported", f"{plan.repo_id} is not a model MoE Desk runs: "
                                          f"{exc.cause}{f' ({exc.hint})' if exc.hint else ''}.") from None
        try:
            shards = [_header_shard(_safetensors_header(hub, plan, f, control), Path(f.path))
                      for f in plan.files if fnmatch.fnmatch(f.path, WEIGHT_PATTERN)]
            footprint = footprint_from_headers(folder, config, shards)
        except CheckpointError as exc:
            return None, f"the fit cannot be worked out before downloading: {exc}"
        except KeyError as exc:
            return None, f"the fit cannot be worked out before downloading: unknown tensor dtype {exc.args[0]!r}"
    return fit_of(footprint, "the config and safetensors headers on the Hub"), ""


def footprint_from_headers(folder: Path, config, shards: list):
    """The planner's ModelFootprint from tensor headers alone, classified by the planner's own rules."""
    from engine.runtime.planner import footprint_of

    return footprint_of(Checkpoint(folder, config.quantization_config, shards=shards), config, folder)


# ---- downloading --------------------------------------------------------------------------------

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
    def __init__(self, hub: Hub, plan: DownloadPlan, progress: Callable[[Progress], None] | None,
                 control: DownloadControl, retry_wait_s: float):
        self.hub, self.plan, self.control = hub, plan, control
        self.report = progress or (lambda p: None)
        self.retry_wait_s = retry_wait_s
        self.meter = _Meter()
        self.last_report = 0.0
        self.staging = plan.folder / STAGING_DIR
        self.state = {"repo_id": plan.repo_id, "revision": plan.revision, "commit": plan.commit,
                      "placed": {}, "partial": {}}

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
        self.report(Progress(file=f.path, file_done=f.have, file_size=f.size, done=self.plan.have_bytes,
                             total=self.plan.total_bytes, files_done=sum(x.done for x in self.plan.files),
                             files_total=len(self.plan.files), speed=speed,
                             eta_s=remaining / speed if speed > 0 else None, state=state))

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
                raise HubError("disk", f"The disk is full: {plan.folder} cannot take more. What arrived is kept; "
                                       f"free up space and resume.") from None
            raise HubError("disk", f"Cannot write the download in {plan.folder}: "
                                   f"{exc.strerror or exc}.") from None
        return plan.folder

    def _clear_stale_partials(self) -> None:
        for path in list(self.staging.rglob("*" + INCOMPLETE_SUFFIX)):
            name = path.relative_to(self.staging).as_posix()[:-len(INCOMPLETE_SUFFIX)]
            if name not in self.state["partial"]:
                path.unlink(missing_ok=True)
        for f in self.plan.files:
            if not f.done and f.path not in self.state["partial"]:
                f.have = 0

    def _finish(self) -> None:
        plan = self.plan
        record = {"repo_id": plan.repo_id, "revision": plan.revision, "commit": plan.commit,
                  "files": {f.path: {"size": f.size, "hash": f.hash_key} for f in plan.files},
                  "completed": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
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
                        raise HubError("server", f"{status} {kept[0].upper()}{kept[1:]}; the download resumes "
                                                 f"from them.") from None
                    raise HubError("network", f"The connection to {self.hub.host} was lost while downloading "
                                              f"{f.path} ({kept}): {_first_line(exc)}. Check the network, then resume.")
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
                raise HubError("mismatch", f"{f.path} does not match the Hub's listing: the server sends "
                                           f"{total:,} bytes where the listing says {f.size:,}. Nothing of it was "
                                           f"kept; try again later (the repo may be changing right now).")
            with open(incomplete, mode) as out:
                # pieces as they arrive (at most the socket's read size): the flag is checked after each, and
                # nothing received is held back in a buffer when the connection dies
                for chunk in response.iter_bytes():
                    if f.have + len(chunk) > f.size:
                        out.close()
                        incomplete.unlink(missing_ok=True)
                        f.have = 0
                        raise HubError("mismatch", f"{f.path} is larger than the {f.size:,} bytes the Hub lists; "
                                                   f"the copy was removed. Try again later.")
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
            raise HubError("mismatch", f"{f.path} ended after {got:,} bytes, but the Hub lists {f.size:,}. The "
                                       f"copy was removed; try again later.")

    def _verify(self, f: PlanFile, incomplete: Path) -> None:
        size = incomplete.stat().st_size
        if size != f.size:
            incomplete.unlink(missing_ok=True)
            f.have = 0
            raise HubError("mismatch", f"{f.path} has {size:,} bytes after downloading, but the Hub lists "
                                       f"{f.size:,}. The copy was removed; try again.")
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
            raise HubError("mismatch", f"{f.path} arrived damaged: its {kind} does not match the one the Hub lists. "
                                       f"The copy was removed; try again (if it keeps happening, the mirror serves "
                                       f"a different file).")


def _transient(exc) -> bool:
    """An HTTP error worth retrying: rate limited, or the server (or a proxy) failing for a moment."""
    status = exc.response.status_code if getattr(exc, "response", None) is not None else 0
    return status in (408, 429) or status >= 500


def retry_wait(exc: BaseException, attempt: int, base_s: float) -> float:
    """Seconds to wait after failed try number `attempt`: what the answer's Retry-After asks (at most
    RETRY_AFTER_MAX_S), else base_s doubled for each earlier failure, at most 8 s."""
    response = getattr(exc, "response", None)
    asked = response.headers.get("Retry-After", "").strip() if response is not None else ""
    if asked.isdigit():
        return min(float(asked), RETRY_AFTER_MAX_S)
    if asked:
        with contextlib.suppress(TypeError, ValueError):
            when = email.utils.parsedate_to_datetime(asked)
            return min(max(when.timestamp() - time.time(), 0.0), RETRY_AFTER_MAX_S)
    return min(base_s * 2 ** max(attempt - 1, 0), 8.0)


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


def download(hub: Hub, plan: DownloadPlan, progress: Callable[[Progress], None] | None = None,
             control: DownloadControl | None = None, retry_wait_s: float = RETRY_WAIT_S) -> Path:
    """Fetch every file of the plan that is not here yet, resuming partial ones; returns the model folder.

    Raises HubError (plain message) or DownloadCancelled. Refuses at once when the disk is too small."""
    hub.check_online()
    check_file_names(plan.repo_id, [f.path for f in plan.files])
    plan.free_bytes = free_disk_bytes(plan.folder)
    if not plan.disk_ok:
        raise HubError("disk", plan.disk_message())
    return _Download(hub, plan, progress, control or DownloadControl(), retry_wait_s).run()


def pull(repo_id: str, revision: str = "main", local_dir: str | Path | None = None, *, endpoint: str | None = None,
         token: str | None = None, offline: bool = False, progress: Callable[[Progress], None] | None = None,
         control: DownloadControl | None = None, on_plan: Callable[[DownloadPlan], None] | None = None) -> Path:
    """Plan and download in one call (what `python -m engine pull` does)."""
    hub = Hub(endpoint, token, offline)
    plan = plan_download(hub, repo_id, revision, local_dir, control=control)
    if on_plan is not None:
        on_plan(plan)
    return download(hub, plan, progress, control)


def download_record(folder: str | Path) -> dict:
    """The record a finished download left in a model folder ({} when there is none)."""
    return _read_json(Path(folder) / RECORD_FILE)


def partial_download(folder: str | Path) -> bool:
    """Whether a download into `folder` was started and not finished (so it can resume)."""
    return (Path(folder) / STAGING_DIR / STATE_FILE).is_file()
