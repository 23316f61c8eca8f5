"""engine.hub against a hostile or failing Hub: nothing a server sends crashes, hangs or escapes the model folder.

The fake Hub (engine/testing/hub_server.py) is told to misbehave through `faults`: error statuses (once, or
always), Retry-After, captive-portal HTML, wrong-shaped JSON and stalled connections; hostile repos are plain
repos with bad file names or headers that claim too much. Retries wait through an injected `sleep` that only
records, so no test sleeps through a backoff.
"""

from __future__ import annotations

import email.utils
import signal
import struct
import threading
import time

import pytest
from hub_fixtures import QWEN3, SHARD1, SHARD2, TINY

from engine import hub
from engine.checkpoint import safetensors_file
from engine.cli import main
from engine.testing.hub_server import ANY, API, Fault

HOSTILE = "Org/Hostile"
WAIT_S = 10.0  # how long a test waits for a thread or the fake Hub before calling it a hang


def _hub(fake_hub, **options):
    """A client of the fake Hub whose retry waits are recorded, not slept: (client, the waits)."""
    waits = []
    return hub.Hub(fake_hub.endpoint, sleep=waits.append, **options), waits


def _hostile_repo(fake_hub, tiny_checkpoint, files: dict[str, bytes]):
    """The tiny Qwen3 repo (one shard, no index) plus `files` (names it has not got)."""
    return fake_hub.add_repo(HOSTILE, tiny_checkpoint("qwen3_moe", "bf16"), files=files)


def _plan_error(client, repo, tmp_path, **options) -> hub.HubError:
    with pytest.raises(hub.HubError) as error:
        hub.plan_download(client, repo, "main", models_dir=tmp_path / "models", **options)
    assert not (tmp_path / "models").exists()  # refused before anything was written
    return error.value


# ---- a header that claims too much -------------------------------------------------------------------


@pytest.mark.parametrize("claimed", [safetensors_file.MAX_HEADER_BYTES + 1, 2**30])
def test_a_shard_claiming_a_huge_header_is_refused_without_fetching_it(claimed, fake_hub, tmp_path, tiny_checkpoint):
    name = "model-extra.safetensors"
    shard = struct.pack("<Q", claimed) + b'{"' + b"x" * 1000
    _hostile_repo(fake_hub, tiny_checkpoint, {name: shard})
    fake_hub.size_lies[name] = 2 * claimed  # the listing backs the claim, so only the cap stops it
    client, _ = _hub(fake_hub)
    error = _plan_error(client, HOSTILE, tmp_path)
    assert error.kind == "unsupported"
    assert str(error).startswith(
        f"{HOSTILE}'s {name} claims a safetensors header of {hub.format_size(claimed)}, "
        f"more than the {hub.format_size(safetensors_file.MAX_HEADER_BYTES)}"
    )
    assert "choose another model" in str(error)
    shard_requests = [rng for _, path, rng, _ in fake_hub.requests if path.endswith(name)]
    assert shard_requests == [f"bytes=0-{hub.HEADER_PROBE_BYTES - 1}"]  # the probe, and nothing more


def test_the_remote_and_local_header_caps_are_one_constant():
    assert hub.remote_fit.MAX_HEADER_BYTES is safetensors_file.MAX_HEADER_BYTES


def test_a_config_file_listed_as_huge_is_not_read(fake_hub, tmp_path):
    fake_hub.size_lies["config.json"] = hub.MAX_SMALL_FILE_BYTES
    client, _ = _hub(fake_hub)
    error = _plan_error(client, QWEN3, tmp_path)
    assert error.kind == "unsupported" and str(error).startswith(f"{QWEN3}'s config.json is listed as ")
    assert not any(path.endswith("config.json") for _, path, _, _ in fake_hub.requests)


def test_a_server_ignoring_ranges_gives_the_same_fit(fake_hub, tmp_path, monkeypatch):
    """Whole files (200) answer the header reads; only the asked bytes are kept, taken from the right offset."""
    client, _ = _hub(fake_hub)
    expected = hub.plan_download(client, TINY, models_dir=tmp_path / "models").fit
    monkeypatch.setattr(hub.remote_fit, "HEADER_PROBE_BYTES", 16)  # so the rest of each header is a second, offset read
    fake_hub.ignore_ranges = True
    fake_hub.requests.clear()
    assert hub.plan_download(client, TINY, models_dir=tmp_path / "models").fit == expected
    assert any((rng or "").startswith("bytes=16-") for _, _, rng, _ in fake_hub.requests)


# ---- file names that would leave the folder ----------------------------------------------------------


@pytest.mark.parametrize(
    "name, reason",
    [
        ("C:\\evil.safetensors", "Windows does not allow"),
        ("..\\..\\evil.safetensors", "Windows does not allow"),
        ("evil\\..\\..\\x.safetensors", "Windows does not allow"),
        ("\\\\server\\share\\x.safetensors", "Windows does not allow"),
        ("C:evil.safetensors", "Windows does not allow"),
        ("model.safetensors:stream.safetensors", "Windows does not allow"),
        ("CON.safetensors", "is a device name on Windows"),
        ("nul.safetensors", "is a device name on Windows"),
        ("COM1.safetensors", "is a device name on Windows"),
        ("LPT9 .safetensors", "is a device name on Windows"),
    ],
)
def test_a_repo_listing_an_unsafe_file_name_is_refused(name, reason, fake_hub, tmp_path, tiny_checkpoint):
    _hostile_repo(fake_hub, tiny_checkpoint, {name: b"\0" * 16})
    client, _ = _hub(fake_hub)
    error = _plan_error(client, HOSTILE, tmp_path)
    assert error.kind == "unsupported"
    assert str(error).startswith(f"{HOSTILE} lists a file MoE Desk will not write: {name!r} (")
    assert reason in str(error) and "nothing was downloaded" in str(error)
    assert not any(method == "GET" and "/resolve/" in path for method, path, _, _ in fake_hub.requests)


@pytest.mark.parametrize(
    "name",
    [
        "/etc/passwd",
        "../evil",
        "a/../../evil",
        "a//b",
        "./a",
        "",
        "a\0b",
        "a\nb",
        "C:\\x",
        "C:x",
        "\\\\srv\\s\\x",
        "x:ads",
        "dir./x",
        "x.",
        "x ",
        "CON",
        "con.txt",
        "Aux.json",
        "COM¹",
        "CONIN$",
        "a" * 256,
        "a<b",
        'a"b',
        "a|b",
        "a?b",
        "a*b",
    ],
)
def test_unsafe_names_for_either_path_convention(name):
    assert hub.unsafe_name_reason(name) is not None


@pytest.mark.parametrize(
    "name",
    [
        "config.json",
        "model-00001-of-00002.safetensors",
        "sub/dir/file.json",
        "CONFIG.json.bak",
        "console.json",
        "com10.json",
        "a b.json",
        ".gitattributes",
        "é.json",
    ],
)
def test_safe_names_pass(name):
    assert hub.unsafe_name_reason(name) is None


def test_download_refuses_a_plan_with_an_unsafe_name_before_writing(fake_hub, tmp_path):
    client, _ = _hub(fake_hub)
    plan = hub.plan_download(client, QWEN3, models_dir=tmp_path / "models", with_fit=False)
    plan.files.insert(0, hub.PlanFile("..\\..\\evil.json", 4))
    with pytest.raises(hub.HubError, match=r"will not write: '\.\.\\\\\.\.\\\\evil\.json'"):
        hub.download(client, plan)
    assert not plan.folder.exists()


# ---- transient and persistent server errors ----------------------------------------------------------


@pytest.mark.parametrize("key", [API, SHARD1])
@pytest.mark.parametrize(
    "status, retry_after, waited",
    [
        (503, None, hub.RETRY_WAIT_S),  # no Retry-After: the first backoff step
        (503, "2", 2.0),
        (429, "3600", hub.RETRY_AFTER_MAX_S),  # obeyed only up to the cap
        (502, "soon", hub.RETRY_WAIT_S),  # not a number nor a date: backoff
    ],
)
def test_one_transient_error_while_planning_is_retried(key, status, retry_after, waited, fake_hub, tmp_path):
    fake_hub.faults[key] = Fault(status=status, retry_after=retry_after)
    client, waits = _hub(fake_hub)
    plan = hub.plan_download(client, TINY, models_dir=tmp_path / "models")
    assert waits == [waited]
    assert plan.fit is not None and plan.fit.fits["4gb"]
    assert key not in fake_hub.faults  # the fault was met


def test_retry_after_as_a_date_is_obeyed_up_to_the_cap(fake_hub, tmp_path):
    fake_hub.faults[SHARD2] = Fault(status=503, retry_after=email.utils.formatdate(time.time() + 5, usegmt=True))
    client, waits = _hub(fake_hub)
    hub.plan_download(client, TINY, models_dir=tmp_path / "models")
    assert len(waits) == 1 and 0 <= waits[0] <= 5


def test_a_persistent_500_while_planning_says_the_server_failed(fake_hub, tmp_path):
    fake_hub.faults[API] = Fault(status=500, times=0)
    client, waits = _hub(fake_hub)
    error = _plan_error(client, TINY, tmp_path)
    assert error.kind == "server"
    assert (
        f"answered HTTP 500 (Internal Server Error) for the file list of {TINY}, {hub.REQUEST_TRIES} times "
        f"in a row" in str(error)
    )
    assert "Try again later" in str(error) and "endpoint (mirror)" in str(error)
    assert waits == [hub.RETRY_WAIT_S * 2**n for n in range(hub.REQUEST_TRIES - 1)]


def test_a_persistent_500_while_downloading_is_not_called_a_lost_connection(fake_hub, tmp_path):
    client, _ = _hub(fake_hub)
    plan = hub.plan_download(client, TINY, models_dir=tmp_path / "models", with_fit=False)
    fake_hub.faults[SHARD1] = Fault(status=500, times=0)
    with pytest.raises(hub.HubError) as error:
        hub.download(client, plan, retry_wait_s=0.0)
    message = str(error.value)
    assert error.value.kind == "server" and "lost" not in message
    assert message.startswith(
        f"{client.host} answered HTTP 500 (Internal Server Error) for {SHARD1}, "
        f"{hub.MAX_RETRIES + 1} times in a row: the Hub (or the mirror) is failing"
    )
    assert "arrived and are kept" in message


def test_a_client_error_is_not_retried(fake_hub, tmp_path):
    fake_hub.faults[SHARD1] = Fault(status=403)
    client, waits = _hub(fake_hub)
    error = _plan_error(client, TINY, tmp_path)
    assert waits == [] and error.kind == "server"
    assert f"answered HTTP 403 (Forbidden) for {SHARD1} of {TINY}" in str(error)


# ---- answers that are not the Hub's ------------------------------------------------------------------


def _not_the_hub(fake_hub, what: str) -> str:
    return f"The Hub endpoint {fake_hub.endpoint} answered something that is not the Hub's API ({what}): check"


def test_a_captive_portal_is_named_as_such(fake_hub, tmp_path):
    fake_hub.faults[ANY] = Fault(html=True, times=0)
    client, _ = _hub(fake_hub)
    error = _plan_error(client, TINY, tmp_path)
    assert error.kind == "server" and str(error).startswith(_not_the_hub(fake_hub, "an HTML page"))
    assert "network" in str(error) and "endpoint (mirror)" in str(error)


def test_an_html_page_instead_of_a_file_is_not_saved_as_the_file(fake_hub, tmp_path):
    client, _ = _hub(fake_hub)
    plan = hub.plan_download(client, TINY, models_dir=tmp_path / "models", with_fit=False)
    fake_hub.faults[SHARD2] = Fault(html=True, times=0)
    with pytest.raises(hub.HubError) as error:
        hub.download(client, plan)
    assert str(error.value).startswith(_not_the_hub(fake_hub, f"an HTML page where {SHARD2} should be"))
    assert not (plan.folder / SHARD2).exists() and not (plan.folder / "config.json").exists()


@pytest.mark.parametrize(
    "body, what",
    [
        (b"[1, 2]", "JSON that is not a model's file list"),
        (b'{"siblings": []}', "JSON that is not a model's file list"),
        (b'{"id": "Org/X", "siblings": 5}', "JSON that is not a model's file list"),
        (b'{"id": "Org/X", "siblings": ["config.json"]}', "JSON that is not a model's file list"),
        (b'{"id": "Org/X", "sha": 7, "siblings": []}', "JSON that is not a model's file list"),
        (b'{"id": "Org/X", "siblings": [{"rfilename": 7}]}', "JSON that is not a model's file list"),
        (
            b'{"id": "Org/X", "siblings": [{"rfilename": "model.safetensors", "size": "big"}]}',
            "JSON that is not a model's file list",
        ),
        (
            b'{"id": "Org/X", "siblings": [{"rfilename": "model.safetensors", "size": -1}]}',
            "JSON that is not a model's file list",
        ),
        (
            b'{"id": "Org/X", "siblings": [{"rfilename": "a.safetensors", "lfs": {"size": 1, "sha256": 2, '
            b'"pointerSize": 3}}]}',
            "JSON that is not a model's file list",
        ),
        (b"hello", "an answer that is not JSON"),
        (b"", "an answer that is not JSON"),
    ],
)
def test_wrong_shaped_json_is_one_clear_error(body, what, fake_hub, tmp_path):
    fake_hub.faults[API] = Fault(body=body)
    client, _ = _hub(fake_hub)
    error = _plan_error(client, TINY, tmp_path)
    assert error.kind == "server" and str(error).startswith(_not_the_hub(fake_hub, what))


def test_cli_pull_behind_a_captive_portal_is_one_line(fake_hub, tmp_path, capsys):
    fake_hub.faults[ANY] = Fault(html=True, times=0)
    code = main(["pull", TINY, "--endpoint", fake_hub.endpoint, "--local-dir", str(tmp_path / "m")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and err[0].startswith("error: " + _not_the_hub(fake_hub, "an HTML page"))


# ---- stalled connections -----------------------------------------------------------------------------


@pytest.mark.parametrize("key", [API, SHARD1])
def test_a_stalled_read_while_planning_times_out_in_plain_words(key, fake_hub, tmp_path):
    fake_hub.faults[key] = Fault(stall=True, times=0)
    client, _ = _hub(fake_hub, timeout=0.3)
    error = _plan_error(client, TINY, tmp_path)
    assert error.kind == "network"
    assert str(error).startswith(f"{client.host} stopped answering (nothing arrived for 0.3 s). Check the network")


def test_a_stalled_read_while_downloading_times_out_and_keeps_what_arrived(fake_hub, tmp_path):
    client, _ = _hub(fake_hub, timeout=0.3)
    plan = hub.plan_download(client, TINY, models_dir=tmp_path / "models", with_fit=False)
    fake_hub.faults[SHARD1] = Fault(stall=True, times=0)
    with pytest.raises(hub.HubError) as error:
        hub.download(client, plan, retry_wait_s=0.0)
    assert error.value.kind == "network" and f"while downloading {SHARD1}" in str(error.value)


def _plan_in_thread(client, tmp_path, control):
    """plan_download on a thread: (the thread, a dict that receives its exception)."""
    outcome = {}

    def run():
        try:
            hub.plan_download(client, TINY, models_dir=tmp_path / "models", control=control)
        except BaseException as exc:  # the test inspects it
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


@pytest.mark.parametrize("key", [API, SHARD1])
@pytest.mark.parametrize("stop", ["cancel", "interrupt"])
def test_planning_against_a_stalled_server_stops_when_asked(key, stop, fake_hub, tmp_path):
    fake_hub.faults[key] = Fault(stall=True, times=0)
    client, _ = _hub(fake_hub, timeout=60.0)  # the read timeout is not what ends it
    control = hub.DownloadControl()
    thread, outcome = _plan_in_thread(client, tmp_path, control)
    assert fake_hub.stalled.wait(WAIT_S)
    getattr(control, stop)()
    thread.join(WAIT_S)
    assert not thread.is_alive()
    error = outcome["error"]
    assert isinstance(error, hub.DownloadCancelled) and error.folder is None
    assert str(error) == "download cancelled; nothing was downloaded yet"
    assert not (tmp_path / "models").exists()


def test_a_stop_during_a_retry_wait_ends_planning(fake_hub, tmp_path):
    fake_hub.faults[API] = Fault(status=503, retry_after="30", times=0)
    control = hub.DownloadControl()
    client = hub.Hub(fake_hub.endpoint, sleep=lambda seconds: control.cancel())
    with pytest.raises(hub.DownloadCancelled):
        hub.plan_download(client, TINY, models_dir=tmp_path / "models", control=control)


def _ctrl_c_on_the_main_thread() -> None:
    """SIGINT to the main thread, as a terminal's Ctrl-C reaches a process: a blocked read there is interrupted."""
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


def _pull_pressing_ctrl_c(fake_hub, folder, presses) -> int:
    """`python -m engine pull` of TINY into `folder` on this (the main) thread, while `presses` runs beside it."""
    presser = threading.Thread(target=presses, daemon=True)
    presser.start()
    code = main(["pull", TINY, "--endpoint", fake_hub.endpoint, "--local-dir", str(folder)])
    presser.join(WAIT_S)
    return code


def test_ctrl_c_stops_cli_pull_against_a_stalled_server(fake_hub, tmp_path, capsys):
    """The CLI's own SIGINT handler (it runs on the main thread, as in a terminal) ends planning; exit code 130."""
    fake_hub.faults[API] = Fault(stall=True, times=0)

    def press_ctrl_c():
        if fake_hub.stalled.wait(WAIT_S):
            signal.raise_signal(signal.SIGINT)

    code = _pull_pressing_ctrl_c(fake_hub, tmp_path / "m", press_ctrl_c)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 130 and err == ["error: interrupted; nothing was downloaded"]
    assert not (tmp_path / "m").exists()


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="signals to a thread are POSIX")
def test_ctrl_c_mid_download_keeps_what_arrived(fake_hub, tmp_path, capsys):
    folder = tmp_path / "m"
    partial = folder / hub.STAGING_DIR / (SHARD1 + hub.INCOMPLETE_SUFFIX)
    fake_hub.throttle = (32 * 1024, 0.02)  # several pieces per shard: the stop lands between two

    def press_once_bytes_arrived():
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and not (partial.is_file() and partial.stat().st_size > 0):
            time.sleep(0.01)
        _ctrl_c_on_the_main_thread()

    code = _pull_pressing_ctrl_c(fake_hub, folder, press_once_bytes_arrived)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 130
    assert err == [f"error: interrupted; what arrived is kept in {folder}: run the same command again to resume"]
    assert partial.stat().st_size > 0 and hub.partial_download(folder)


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="signals to a thread are POSIX")
def test_a_second_ctrl_c_does_not_wait_for_a_stalled_download(fake_hub, tmp_path, capsys):
    fake_hub.faults[SHARD2] = Fault(stall=True, times=0, after=1)  # the header probe passes, the download stalls

    def press_twice():
        if fake_hub.stalled.wait(WAIT_S):
            _ctrl_c_on_the_main_thread()  # asks the download to stop at its next piece, which never comes
            time.sleep(0.1)
            _ctrl_c_on_the_main_thread()

    code = _pull_pressing_ctrl_c(fake_hub, tmp_path / "m", press_twice)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 130 and err == ["error: interrupted; what arrived is kept: run the same command again to resume"]


# ---- the CLI's usage messages ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, points_at",
    [
        (["pull", TINY, "--bogus"], "(see python -m engine pull --help)"),
        (["pull"], "(see python -m engine pull --help)"),
        (["bogus"], "(see python -m engine --help)"),
    ],
)
def test_usage_errors_point_at_the_right_help(argv, points_at, capsys):
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].endswith(points_at) and "engine engine" not in err[0]
