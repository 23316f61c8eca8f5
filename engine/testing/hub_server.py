"""A local stand-in for the Hugging Face Hub, for tests: the part of its HTTP protocol the client uses.

    with FakeHub() as hub:
        hub.add_repo("Org/Tiny-MoE", folder)          # or files={"config.json": b"..."}
        engine.hub.pull("Org/Tiny-MoE", endpoint=hub.endpoint)

It serves on 127.0.0.1 only:
- GET /api/models/ORG/NAME[/revision/REV]: the repo's info (id, sha, gated, siblings with size, blobId and,
  for *.safetensors, lfs {sha256, size, pointerSize}), as `HfApi.model_info(files_metadata=True)` reads it;
- HEAD and GET /ORG/NAME/resolve/REV/PATH: the file, with ETag, X-Repo-Commit, Content-Length, Accept-Ranges
  and Range requests (206 + Content-Range); LFS files answer with a 302 (X-Linked-Size, X-Linked-Etag) to
  /lfs/SHA256 on a second server, another origin like the Hub's CDN, so the client must follow a redirect
  off the Hub and must not send its token there;
- errors the way the Hub marks them: 404 + X-Error-Code RepoNotFound / RevisionNotFound / EntryNotFound,
  401 + X-Error-Code GatedRepo for a gated repo without a valid `Authorization: Bearer` token.
Faults for tests: `drop_after` (close the connection after N bytes of a file, once; with `down_after_drop`
every later connection is closed unanswered, as when the network goes down), `size_lies` (the listing
claims a different size), `corrupt` (one byte of the served file flipped), `ignore_ranges` (whole files, 200,
whatever Range asks), `throttle` (a slow network), and
`served` / `requests`, which count what went over the wire.
A hostile or failing Hub: `faults[KEY] = Fault(...)` answers the model info (KEY `API`), one file's resolve
(KEY its path) or every request (KEY `ANY`) with an HTTP status (and Retry-After), an HTML page (a captive
portal), a body of your choice (wrong-shaped JSON), or a stall (nothing sent until the hub stops; `stalled` is
set while a request hangs), for the next `times` requests (after letting `after` through) or, with times 0,
every one.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LFS_PATTERN = ".safetensors"
API, ANY = "api", "*"  # fault keys: the model-info route, every route
PORTAL_PAGE = (
    b"<!DOCTYPE html><html><head><title>Hotel Wi-Fi</title></head>"
    b"<body><form>Accept the terms to get online</form></body></html>"
)


@dataclass
class Fault:
    """How the fake Hub misbehaves on a route, instead of answering it."""

    status: int = 0  # answer with this HTTP status and a short JSON error
    retry_after: str | None = None  # the Retry-After header of that answer
    html: bool = False  # answer 200 with a captive portal's HTML page
    body: bytes | None = None  # answer 200 with this JSON body
    stall: bool = False  # send nothing until the fake Hub stops
    times: int = 1  # how many requests it spoils; 0: every one
    after: int = 0  # how many requests it lets through first


@dataclass
class FakeRepo:
    repo_id: str
    files: dict[str, bytes]
    commit: str
    gated: bool = False
    revisions: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit

    def is_lfs(self, path: str) -> bool:
        return path.endswith(LFS_PATTERN)


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub:
    def __init__(self, valid_tokens: tuple[str, ...] = ("hf_test_token",)):
        self.repos: dict[str, FakeRepo] = {}
        self.valid_tokens = set(valid_tokens)
        self.drop_after: dict[str, int] = {}  # file path -> bytes sent before the connection is dropped (once)
        self.size_lies: dict[str, int] = {}  # file path -> bytes the listing adds to its real size
        self.corrupt: set[str] = set()  # file paths served with one byte flipped
        self.ignore_ranges = False  # answer every GET with the whole file (200), as some mirrors and proxies do
        self.throttle: tuple[int, float] | None = None  # (bytes per write, seconds between writes)
        self.down_after_drop = False  # after a drop, every connection is closed unanswered (the network is down)
        self.down = False
        self.faults: dict[str, Fault] = {}  # API, ANY or a file path -> how its requests are answered
        self.stalled = threading.Event()  # set while a request is held by a stall fault
        self._release = threading.Event()  # set at stop(): stalled requests end
        self.served: Counter = Counter()  # file path -> body bytes sent
        self.requests: list[tuple[str, str, str | None, str | None]] = []  # (method, path, Range, Authorization)
        self.lock = threading.Lock()
        self._bodies_in_flight = 0  # responses still writing their body: `served` may yet grow
        self._quiet = threading.Condition(self.lock)
        self._servers: list[ThreadingHTTPServer] = []  # the Hub, then its "CDN"

    def wait_quiet(self, timeout: float = 10.0) -> None:
        """Wait until no response is still writing a body, so `served` counts everything a client got (a client
        that stopped reading returns before the server thread notices)."""
        with self._quiet:
            if not self._quiet.wait_for(lambda: self._bodies_in_flight == 0, timeout):
                raise TimeoutError(f"the fake Hub was still sending after {timeout} s")

    # ---- set up

    def add_repo(
        self, repo_id: str, folder: str | Path | None = None, files: dict[str, bytes] | None = None, gated: bool = False
    ) -> FakeRepo:
        content = dict(files or {})
        if folder is not None:
            folder = Path(folder)
            content.update(
                {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
            )
        digest = hashlib.sha1(repo_id.encode())
        for path in sorted(content):
            digest.update(path.encode() + hashlib.sha256(content[path]).digest())
        repo = FakeRepo(repo_id, content, digest.hexdigest(), gated)
        repo.revisions["main"] = repo.commit
        self.repos[repo_id] = repo
        return repo

    @property
    def endpoint(self) -> str:
        assert self._servers, "start() the server first"
        return f"http://127.0.0.1:{self._servers[0].server_address[1]}"

    @property
    def cdn_endpoint(self) -> str:
        assert self._servers, "start() the server first"
        return f"http://127.0.0.1:{self._servers[1].server_address[1]}"

    def start(self) -> "FakeHub":
        hub = self

        class Handler(_Handler):
            fake = hub

        for name in ("fake-hub", "fake-hub-cdn"):
            server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
            server.daemon_threads = True
            threading.Thread(target=server.serve_forever, args=(0.05,), name=name, daemon=True).start()
            self._servers.append(server)
        return self

    def stop(self) -> None:
        self._release.set()
        for server in self._servers:
            server.shutdown()
            server.server_close()
        self._servers = []

    def __enter__(self) -> "FakeHub":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- what the repo looks like

    def sibling(self, repo: FakeRepo, path: str) -> dict:
        data = repo.files[path]
        size = len(data) + self.size_lies.get(path, 0)
        entry = {"rfilename": path, "size": size, "blobId": git_blob_id(data)}
        if repo.is_lfs(path):
            entry["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": size, "pointerSize": 134}
        return entry

    def take_fault(self, key: str) -> Fault | None:
        """The fault that spoils this request of `key` (its own first, else ANY's), used up once."""
        with self.lock:
            for name in (key, ANY):
                fault = self.faults.get(name)
                if fault is not None and fault.after:
                    fault.after -= 1
                    return None
                if fault is not None:
                    if fault.times == 1:
                        del self.faults[name]
                    elif fault.times > 1:
                        fault.times -= 1
                    return fault
        return None

    def body(self, path: str, data: bytes) -> bytes:
        if path in self.corrupt and data:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        return data


_API = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+?)(?:/revision/(?P<rev>[^/]+))?/?$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")
_LFS = re.compile(r"^/lfs/(?P<sha>[0-9a-f]{64})$")


class _Handler(BaseHTTPRequestHandler):
    fake: FakeHub
    server_version = "FakeHub/1.0"

    def log_message(self, format, *args):  # quiet: tests read `requests` instead
        pass

    def do_HEAD(self):
        self._route(head=True)

    def do_GET(self):
        self._route(head=False)

    # ---- routing

    def _route(self, head: bool) -> None:
        path = urlsplit(self.path).path
        if self.fake.down:
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        with self.fake.lock:
            self.fake.requests.append(
                (self.command, unquote(path), self.headers.get("Range"), self.headers.get("Authorization"))
            )
        try:
            if match := _API.match(path):
                self._api(unquote(match["repo"]), unquote(match["rev"] or "main"), head)
            elif match := _RESOLVE.match(path):
                self._resolve(unquote(match["repo"]), unquote(match["rev"]), unquote(match["path"]), head)
            elif match := _LFS.match(path):
                self._lfs(match["sha"], head)
            else:
                self._error(404, "NotFound", "Not found")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away (a cancel, a pause): nothing to answer

    def _repo(self, repo_id: str, revision: str) -> tuple[FakeRepo, str] | None:
        repo = self.fake.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found")
            return None
        commit = repo.revisions.get(revision) or (revision if revision == repo.commit else None)
        if commit is None:
            self._error(404, "RevisionNotFound", "Invalid rev id: " + revision)
            return None
        return repo, commit

    def _spoiled(self, key: str, head: bool) -> bool:
        """Answer with the fault of `key`, if there is one; True when it was answered that way."""
        fault = self.fake.take_fault(key)
        if fault is None:
            return False
        if fault.stall:
            self.fake.stalled.set()
            self.fake._release.wait()
            self.close_connection = True
        elif fault.status:
            headers = {"Content-Type": "application/json"}
            if fault.retry_after is not None:
                headers["Retry-After"] = fault.retry_after
            self._send(
                fault.status, json.dumps({"error": "the fake Hub fails on purpose"}).encode(), headers, head, None
            )
        elif fault.html:
            self._send(200, PORTAL_PAGE, {"Content-Type": "text/html; charset=utf-8"}, head, None)
        else:
            self._send(200, fault.body or b"", {"Content-Type": "application/json"}, head, None)
        return True

    def _api(self, repo_id: str, revision: str, head: bool) -> None:
        if self._spoiled(API, head):
            return
        found = self._repo(repo_id, revision)
        if found is None:
            return
        repo, commit = found
        info = {
            "_id": "0" * 24,
            "id": repo.repo_id,
            "modelId": repo.repo_id,
            "author": repo.repo_id.split("/")[0],
            "sha": commit,
            "private": False,
            "disabled": False,
            "gated": "manual" if repo.gated else False,
            "tags": [],
            "downloads": 0,
            "likes": 0,
            "lastModified": "2026-01-01T00:00:00.000Z",
            "createdAt": "2026-01-01T00:00:00.000Z",
            "siblings": [self.fake.sibling(repo, p) for p in sorted(repo.files)],
        }
        self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, head, None)

    def _authorised(self, repo: FakeRepo) -> bool:
        if not repo.gated:
            return True
        auth = self.headers.get("Authorization") or ""
        return auth.startswith("Bearer ") and auth[len("Bearer ") :] in self.fake.valid_tokens

    def _resolve(self, repo_id: str, revision: str, path: str, head: bool) -> None:
        if self._spoiled(path, head):
            return
        found = self._repo(repo_id, revision)
        if found is None:
            return
        repo, commit = found
        if not self._authorised(repo):
            self._error(
                401,
                "GatedRepo",
                f"Access to model {repo_id} is restricted. You must have access to it "
                f"and be authenticated to access it. Please log in.",
            )
            return
        if path not in repo.files:
            self._error(404, "EntryNotFound", f'{path} does not exist on "{revision}"')
            return
        data = repo.files[path]
        headers = {"X-Repo-Commit": commit, "Accept-Ranges": "bytes"}
        if repo.is_lfs(path):
            sha = hashlib.sha256(data).hexdigest()
            headers.update(
                {
                    "Location": f"{self.fake.cdn_endpoint}/lfs/{sha}",
                    "X-Linked-Size": str(len(data)),
                    "X-Linked-Etag": f'"{sha}"',
                    "ETag": f'"{git_blob_id(data)}"',
                    "Content-Length": "0",
                }
            )
            self.send_response(302)
            for key, value in headers.items():
                self.send_header(key, value)
            self.end_headers()
            return
        headers["ETag"] = f'"{git_blob_id(data)}"'
        self._send_file(path, data, headers, head)

    def _lfs(self, sha: str, head: bool) -> None:
        for repo in self.fake.repos.values():
            for path, data in repo.files.items():
                if repo.is_lfs(path) and hashlib.sha256(data).hexdigest() == sha:
                    self._send_file(path, data, {"ETag": f'"{sha}"', "Accept-Ranges": "bytes"}, head)
                    return
        self._error(404, "NotFound", "no such object")

    # ---- answers

    def _send_file(self, path: str, data: bytes, headers: dict, head: bool) -> None:
        data = self.fake.body(path, data)
        total = len(data)
        start, end, status = 0, total - 1, 200
        wanted = None if self.fake.ignore_ranges else self.headers.get("Range")
        if wanted:
            match = re.fullmatch(r"bytes=(\d*)-(\d*)", wanted.strip())
            if match is None or not match[1]:
                self._error(416, "RangeNotSatisfiable", "bad range")
                return
            start = int(match[1])
            end = min(int(match[2]), total - 1) if match[2] else total - 1
            if start >= total or start > end:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{total}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            status = 206
            headers = dict(headers, **{"Content-Range": f"bytes {start}-{end}/{total}"})
        headers["Content-Type"] = "application/octet-stream"
        self._send(status, data[start : end + 1], headers, head, path)

    def _send(self, status: int, body: bytes, headers: dict, head: bool, path: str | None) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if head:
            return
        drop = None
        if path is not None:
            with self.fake.lock:
                drop = self.fake.drop_after.pop(path, None)
        with self.fake.lock:
            self.fake._bodies_in_flight += 1
        try:
            self._send_body(body, path, drop)
        finally:
            with self.fake.lock:
                self.fake._bodies_in_flight -= 1
                self.fake._quiet.notify_all()

    def _send_body(self, body: bytes, path: str | None, drop: int | None) -> None:
        step, pause = self.fake.throttle or (64 * 1024, 0.0)
        sent = 0
        while sent < len(body):
            piece = body[sent : sent + step]
            if drop is not None and sent + len(piece) >= drop:
                piece = piece[: max(drop - sent, 0)]
                self._write(piece, path)
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)  # the connection dies mid-file
                self.close_connection = True
                self.fake.down = self.fake.down_after_drop
                return
            self._write(piece, path)
            sent += len(piece)
            if pause and path is not None:
                time.sleep(pause)

    def _write(self, piece: bytes, path: str | None) -> None:
        self.wfile.write(piece)
        if path is not None:
            with self.fake.lock:
                self.fake.served[path] += len(piece)

    def _error(self, status: int, code: str, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        self._send(
            status,
            body,
            {"X-Error-Code": code, "X-Error-Message": message, "Content-Type": "application/json"},
            self.command == "HEAD",
            None,
        )
