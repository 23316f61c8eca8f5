"""Hub: one Hub (or mirror) spoken to through huggingface_hub, with retries and plain-word errors."""

from __future__ import annotations

import contextlib
import email.utils
import http
import json
import time
from typing import Callable
from urllib.parse import urlparse

from engine.hub.control import DownloadControl
from engine.hub.errors import DownloadCancelled, HubError
from engine.hub.tokens import client_offline, has_saved_token

TIMEOUT_S = 10.0  # connect and read timeout: a stalled connection fails (and is retried) after this long
REQUEST_TRIES = 4  # tries of one planning request while the server answers 429 or 5xx
RETRY_WAIT_S = 1.0  # first wait before a retry; doubles each time, at most 8 s
RETRY_AFTER_MAX_S = 30.0  # the longest wait a server's Retry-After is obeyed for


class Hub:
    """One Hub (or mirror) with one token choice. token None: the token huggingface_hub has stored, if any.
    sleep: how retries wait (tests pass a recorder); None: the download control's stoppable wait."""

    def __init__(
        self,
        endpoint: str | None = None,
        token: str | None = None,
        offline: bool = False,
        timeout: float = TIMEOUT_S,
        sleep: Callable[[float], None] | None = None,
        retry_wait_s: float = RETRY_WAIT_S,
    ):
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
            raise HubError(
                "offline",
                "Offline mode is on, so MoE Desk does not contact the Hub. Turn offline mode off to download.",
            )
        if client_offline():
            raise HubError(
                "offline",
                "Offline mode is on (the HF_HUB_OFFLINE environment variable is set), so "
                "nothing can be downloaded. Unset HF_HUB_OFFLINE to download.",
            )

    def model_info(self, repo_id: str, revision: str, control: DownloadControl | None = None):
        """The repo's info with its files' sizes and hashes; an answer that is not the Hub's is a HubError."""
        from huggingface_hub import HfApi
        from huggingface_hub.errors import HFValidationError

        def ask():
            try:
                return HfApi(endpoint=self.endpoint, token=self.token).model_info(
                    repo_id, revision=revision, files_metadata=True, timeout=self.timeout
                )
            except HFValidationError:
                raise
            except json.JSONDecodeError as exc:
                page = exc.doc.lstrip()[:1] == "<"
                raise HubError(
                    "server", _not_the_hub(self, "an HTML page" if page else "an answer that is not JSON")
                ) from None
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
        with get_session().stream(
            "GET", url, headers=headers, follow_redirects=True, timeout=httpx2.Timeout(self.timeout)
        ) as response:
            hf_raise_for_status(response)
            if response.headers.get("Content-Type", "").startswith("text/html") and not path.lower().endswith(
                (".html", ".htm")
            ):
                raise HubError("server", _not_the_hub(self, f"an HTML page where {path} should be"))
            yield response

    def read(
        self, repo_id: str, commit: str, path: str, start: int, end: int, control: DownloadControl | None = None
    ) -> bytes:
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
                    data += chunk[: wanted - len(data)]
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
            raise HubError(
                "offline",
                "Offline mode is on (HF_HUB_OFFLINE is set), so nothing can be downloaded. "
                "Unset HF_HUB_OFFLINE to download.",
            ) from None
        except hf_errors.HFValidationError as exc:
            raise HubError(
                "invalid",
                f"{repo_id!r} is not a Hub repo id: write it as ORGANISATION/NAME, e.g. "
                f"Qwen/Qwen3-30B-A3B ({_first_line(exc)}).",
            ) from None
        except hf_errors.GatedRepoError:
            raise HubError("gated", _gated_message(repo_id, self)) from None
        except hf_errors.RepositoryNotFoundError:
            access = "your token has no access to it" if self.token or has_saved_token() else "needs a token"
            raise HubError(
                "not_found",
                f"There is no model {repo_id} on {self.host}, or it is private and {access}. "
                f"Check the name (ORGANISATION/NAME).",
            ) from None
        except hf_errors.RevisionNotFoundError:
            raise HubError(
                "revision",
                f"{repo_id} has no revision {revision!r} on {self.host}. Leave the "
                f"revision at main, or give a branch, tag or commit that exists.",
            ) from None
        except hf_errors.RemoteEntryNotFoundError:
            raise HubError(
                "server", f"{self.host} lists {path} in {repo_id} but does not serve it; try again later."
            ) from None
        except hf_errors.HfHubHTTPError as exc:
            status = exc.response.status_code if exc.response is not None else 0
            raise HubError(
                "server", _status_message(self, status, f"{path} of {repo_id}" if path else repo_id, 1)
            ) from None
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
        return (
            f"{repo_id} is gated and your token has no access to it yet. Open {page}, accept the conditions "
            f"with the account the token belongs to, then try again."
        )
    return (
        f"{repo_id} is gated: open {page}, accept its conditions, then paste an access token of that "
        f"account (huggingface.co/settings/tokens) in the Token field, or log in with `hf auth login`."
    )


def _network_message(hub: Hub, exc: BaseException) -> str:
    import httpx2

    if isinstance(exc, (httpx2.ReadTimeout, httpx2.WriteTimeout)):
        return (
            f"{hub.host} stopped answering (nothing arrived for {hub.timeout:g} s). Check the network "
            f"connection, or the endpoint (mirror) setting, and try again."
        )
    return (
        f"Cannot reach {hub.host} ({_first_line(exc)}). Check the network connection, or the endpoint (mirror) setting."
    )


def _status_message(hub: Hub, status: int, what: str, tries: int) -> str:
    """What an HTTP error answer means, for the status codes no other message covers."""
    try:
        phrase = f" ({http.HTTPStatus(status).phrase})"
    except ValueError:
        phrase = ""
    times = f", {tries} times in a row" if tries > 1 else ""
    if status >= 500:
        advice = (
            "the Hub (or the mirror) is failing on its side. Try again later; if it keeps happening, "
            "check the endpoint (mirror) setting"
        )
    else:
        advice = "try again later, or check the endpoint (mirror) setting"
    return f"{hub.host} answered HTTP {status}{phrase} for {what}{times}: {advice}."


def _not_the_hub(hub: Hub, what: str) -> str:
    return (
        f"The Hub endpoint {hub.endpoint} answered something that is not the Hub's API ({what}): check your "
        f"network (a Wi-Fi login page may be answering in its place) or the endpoint (mirror) setting, then "
        f"try again."
    )


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
