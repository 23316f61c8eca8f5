"""engine.hub and `python -m engine pull`: the real huggingface_hub client against a local fake Hub.

The fake Hub (engine/testing/hub_server.py) serves tiny checkpoints on 127.0.0.1 the way the Hub does (model
info with sizes and hashes, resolve with redirects and ranges, its error codes), counts the bytes it sends,
and can drop a connection mid-file, lie about a size or corrupt a file.
"""

from __future__ import annotations

import collections
import errno
import hashlib
import json
import os
import shutil
import stat
import threading

import pytest
from hub_fixtures import GATED, NO_WEIGHTS, NOT_MOE, QWEN3, SHARD1, SHARD2, TINY, TOKEN

from engine import hub
from engine.cli import main
from engine.errors import CheckpointError
from engine.loader import load_model
from engine.runtime.footprint import footprint_from_checkpoint
from engine.runtime.tokenizer import ChatTokenizer

ENGINE_FILES = {
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
    "hf_quant_config.json",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    SHARD1,
    SHARD2,
}


@pytest.fixture
def every_piece(monkeypatch):
    """Progress is reported for every piece received (normally at most ten times a second)."""
    monkeypatch.setattr(hub.downloader, "PROGRESS_INTERVAL_S", 0.0)


def _plan(fake_hub, tmp_path, repo=TINY, **hub_options):
    client = hub.Hub(fake_hub.endpoint, **hub_options)
    plan = hub.plan_download(client, repo, "main", models_dir=tmp_path / "models")
    fake_hub.wait_quiet()  # an earlier, interrupted download's server thread may still be counting
    fake_hub.served.clear()  # from here on, `served` and `requests` are what the download itself fetched
    fake_hub.requests.clear()
    return client, plan


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---- listing and fit ---------------------------------------------------------------------------------


def test_plan_lists_only_what_the_engine_needs_with_sizes_and_fit(fake_hub, tmp_path, tiny_checkpoint):
    _, plan = _plan(fake_hub, tmp_path)
    source = tiny_checkpoint("qwen3_5_moe", "nvfp4", shards=2)
    assert {f.path for f in plan.files} == ENGINE_FILES
    assert set(plan.skipped) == {
        "README.md",
        ".gitattributes",
        "original/consolidated.safetensors",
        "preprocessor_config.json",
    }
    assert plan.files[-1].path == "config.json"  # placed last: an unfinished folder is never taken for a model
    assert plan.total_bytes == sum((source / name).stat().st_size for name in ENGINE_FILES)
    assert plan.need_bytes == plan.total_bytes and plan.have_bytes == 0 and not plan.complete
    assert plan.folder == tmp_path / "models" / "Org--Tiny-MoE"
    assert {f.path: f.sha256 for f in plan.files if f.sha256} == {n: _sha256(source / n) for n in (SHARD1, SHARD2)}
    assert plan.disk_ok and plan.free_bytes > 0
    # the fit from the config and the headers on the Hub is the planner's fit of the same files on disk
    assert plan.fit == hub.fit_of(footprint_from_checkpoint(source), plan.fit.basis)
    assert plan.fit.fits == {"4gb": True, "8gb": True, "12gb": True}
    assert plan.fit.ram_bytes > 0.6 * (source / SHARD1).stat().st_size
    assert not plan.folder.exists()  # planning writes nothing


def test_curated_models_have_a_fit_without_any_network():
    repos = [m.repo_id for m in hub.CURATED_MODELS]
    assert {
        "nvidia/Qwen3.6-35B-A3B-NVFP4",
        "Qwen/Qwen3.6-35B-A3B",
        "Qwen/Qwen3.6-35B-A3B-FP8",
        "Qwen/Qwen3.5-35B-A3B",
        "Qwen/Qwen3-30B-A3B",
    } <= set(repos)
    fits = {m.repo_id: hub.curated_fit(m) for m in hub.CURATED_MODELS}
    nvfp4, bf16 = fits["nvidia/Qwen3.6-35B-A3B-NVFP4"], fits["Qwen/Qwen3.6-35B-A3B"]
    assert nvfp4.fits == {"4gb": True, "8gb": True, "12gb": True}
    assert bf16.fits["4gb"] is False and "does not fit" in bf16.errors["4gb"]
    assert nvfp4.ram_bytes < fits["Qwen/Qwen3.6-35B-A3B-FP8"].ram_bytes < bf16.ram_bytes
    assert 19 * 2**30 < nvfp4.ram_bytes < 22 * 2**30


# ---- downloading -------------------------------------------------------------------------------------


def test_full_download_then_load(fake_hub, tmp_path):
    client, plan = _plan(fake_hub, tmp_path)
    seen = []
    folder = hub.download(client, plan, progress=seen.append)
    assert folder == plan.folder
    assert {p.name for p in folder.iterdir()} == ENGINE_FILES | {hub.RECORD_FILE}  # no .download/ left
    assert sum(fake_hub.served.values()) == plan.total_bytes  # each byte fetched once
    assert [p.done for p in seen] == sorted(p.done for p in seen)
    assert seen[-1].state == "done" and seen[-1].done == seen[-1].total == plan.total_bytes
    assert seen[-1].files_done == len(plan.files)
    record = hub.download_record(folder)
    assert record["repo_id"] == TINY and record["commit"] == plan.commit and set(record["files"]) == ENGINE_FILES
    model = load_model(folder)
    assert tuple(model.score([1, 2, 3]).shape) == (3, 320)
    assert ChatTokenizer.from_folder(folder).encode("Hello")
    # asked again, nothing is fetched: every file is verified and in place
    again = hub.plan_download(client, TINY, "main", models_dir=tmp_path / "models", with_fit=False)
    assert again.complete and again.need_bytes == 0
    fake_hub.wait_quiet()  # the planning requests' server threads may still be counting their bytes
    fake_hub.served.clear()
    hub.download(client, again)
    assert sum(fake_hub.served.values()) == 0


def test_connection_dropped_mid_file_resumes_from_the_bytes_that_arrived(fake_hub, tmp_path):
    client, plan = _plan(fake_hub, tmp_path)
    fake_hub.drop_after[SHARD1] = 100_000
    states = []
    hub.download(client, plan, progress=lambda p: states.append(p.state), retry_wait_s=0.01)
    size = (plan.folder / SHARD1).stat().st_size
    assert fake_hub.served[SHARD1] == size  # 100,000 bytes, then the rest: nothing fetched twice
    assert any(method == "GET" and rng == "bytes=100000-" for method, _, rng, _ in fake_hub.requests)
    assert "retrying" in states
    assert _sha256(plan.folder / SHARD1) == next(f.sha256 for f in plan.files if f.path == SHARD1)
    load_model(plan.folder)


def test_network_down_keeps_the_partial_file_and_a_later_run_resumes_it(fake_hub, tmp_path, tiny_checkpoint):
    client, plan = _plan(fake_hub, tmp_path)
    fake_hub.drop_after[SHARD1] = 100_000
    fake_hub.down_after_drop = True
    with pytest.raises(hub.HubError) as failure:
        hub.download(client, plan, retry_wait_s=0.01)
    assert failure.value.kind == "network"
    assert "connection to 127.0.0.1:" in str(failure.value) and SHARD1 in str(failure.value)
    assert "kept" in str(failure.value)
    partial = plan.folder / hub.STAGING_DIR / (SHARD1 + hub.INCOMPLETE_SUFFIX)
    assert partial.stat().st_size == 100_000
    assert not (plan.folder / SHARD1).exists() and not (plan.folder / "config.json").exists()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(plan.folder)  # a half download is never taken for a model
    assert hub.partial_download(plan.folder)

    # the app (or the network) comes back later: a new client and a new plan pick up the partial file
    fake_hub.down = fake_hub.down_after_drop = False
    client, resumed = _plan(fake_hub, tmp_path)
    assert resumed.have_bytes >= 100_000 and resumed.need_bytes == resumed.total_bytes - resumed.have_bytes
    hub.download(client, resumed)
    assert fake_hub.served[SHARD1] == (plan.folder / SHARD1).stat().st_size - 100_000
    assert not hub.partial_download(plan.folder)
    load_model(plan.folder)


def test_interrupted_download_resumes_without_refetching(fake_hub, tmp_path, every_piece):
    client, plan = _plan(fake_hub, tmp_path)
    control = hub.DownloadControl()

    def stop_in_shard(p):
        if p.file == SHARD1 and 0 < p.file_done < p.file_size:
            control.interrupt()

    with pytest.raises(hub.DownloadCancelled) as stopped:
        hub.download(client, plan, progress=stop_in_shard, control=control)
    assert not stopped.value.discarded
    fake_hub.wait_quiet()
    first = fake_hub.served[SHARD1]
    partial = plan.folder / hub.STAGING_DIR / (SHARD1 + hub.INCOMPLETE_SUFFIX)
    kept = partial.stat().st_size
    assert 0 < kept < next(f.size for f in plan.files if f.path == SHARD1) and kept <= first

    client, resumed = _plan(fake_hub, tmp_path)
    done_before = {f.path for f in resumed.files if f.done}
    assert done_before == {f.path for f in plan.files if not f.path.endswith(".safetensors")} - {"config.json"}
    hub.download(client, resumed)
    assert fake_hub.served[SHARD1] == (plan.folder / SHARD1).stat().st_size - kept
    assert all(fake_hub.served[name] == 0 for name in done_before)
    load_model(plan.folder)


def test_pause_holds_and_resume_continues_where_it_stopped(fake_hub, tmp_path, every_piece):
    client, plan = _plan(fake_hub, tmp_path)
    control = hub.DownloadControl()
    seen = []

    def pause_once(p):
        seen.append(p)
        if (
            p.file == SHARD1
            and 0 < p.file_done < p.file_size
            and not control.paused
            and all(q.state != "paused" for q in seen)
        ):
            control.pause()
            threading.Timer(0.2, control.resume).start()

    hub.download(client, plan, progress=pause_once, control=control)
    paused = [p for p in seen if p.state == "paused"]
    assert len(paused) == 1 and seen[-1].state == "done"
    # the connection closed at the pause; the GET after it asks for the bytes from where the file stood
    resumed = [rng for _, path, rng, _ in fake_hub.requests if path.endswith(SHARD1) and rng]
    assert resumed == [f"bytes={paused[0].file_done}-"]
    assert _sha256(plan.folder / SHARD1) == next(f.sha256 for f in plan.files if f.path == SHARD1)


def test_cancel_deletes_the_partial_download(fake_hub, tmp_path, every_piece):
    client, plan = _plan(fake_hub, tmp_path)
    control = hub.DownloadControl()
    (tmp_path / "models").mkdir()

    def cancel_in_shard(p):
        if p.file == SHARD2 and 0 < p.file_done < p.file_size:
            control.cancel()

    with pytest.raises(hub.DownloadCancelled) as cancelled:
        hub.download(client, plan, progress=cancel_in_shard, control=control)
    assert cancelled.value.discarded
    assert not plan.folder.exists()  # no half file, no finished shard, no folder that could pass for a model
    assert list((tmp_path / "models").iterdir()) == []


# ---- errors in plain words ---------------------------------------------------------------------------


def test_unknown_repo_is_404_in_plain_words(fake_hub, tmp_path):
    with pytest.raises(hub.HubError) as error:
        hub.plan_download(hub.Hub(fake_hub.endpoint), "Org/No-Such-Model", models_dir=tmp_path)
    assert error.value.kind == "not_found"
    assert str(error.value).startswith("There is no model Org/No-Such-Model on 127.0.0.1:")


def test_unknown_revision(fake_hub, tmp_path):
    with pytest.raises(hub.HubError) as error:
        hub.plan_download(hub.Hub(fake_hub.endpoint), TINY, "v9", models_dir=tmp_path)
    assert error.value.kind == "revision" and "has no revision 'v9'" in str(error.value)


def test_invalid_repo_id(fake_hub, tmp_path):
    with pytest.raises(hub.HubError) as error:
        hub.plan_download(hub.Hub(fake_hub.endpoint), "not a repo!", models_dir=tmp_path)
    assert error.value.kind == "invalid" and "ORGANISATION/NAME" in str(error.value)


def test_gated_repo_is_401_until_a_token_with_access_is_saved(fake_hub, tmp_path, hf_home):
    with pytest.raises(hub.HubError) as error:
        hub.plan_download(hub.Hub(fake_hub.endpoint), GATED, models_dir=tmp_path)
    assert error.value.kind == "gated"
    assert f"{GATED} is gated" in str(error.value) and "Token field" in str(error.value)
    assert any(status_path.endswith("config.json") for _, status_path, _, _ in fake_hub.requests)

    with pytest.raises(hub.HubError, match="your token has no access"):
        hub.plan_download(hub.Hub(fake_hub.endpoint, token="hf_wrong"), GATED, models_dir=tmp_path)

    assert not hub.has_saved_token()
    path = hub.save_token(TOKEN)
    assert path == hf_home / "token" and path.read_text() == TOKEN and hub.has_saved_token()
    if os.name == "posix":
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    client = hub.Hub(fake_hub.endpoint)  # no token given: the one huggingface_hub stored is used
    plan = hub.plan_download(client, GATED, models_dir=tmp_path)
    assert plan.gated
    hub.download(client, plan)
    load_model(plan.folder)
    assert any(auth == f"Bearer {TOKEN}" for _, _, _, auth in fake_hub.requests)
    cdn = [auth for _, path, _, auth in fake_hub.requests if path.startswith("/lfs/")]
    assert cdn and all(auth is None for auth in cdn)  # the token stays on the Hub: not sent to the CDN


def _refused_as_mismatch(fake_hub, tmp_path, message_start: str):
    """Download, expect a mismatch refusal starting with `message_start`, and no copy of SHARD2 kept."""
    client, plan = _plan(fake_hub, tmp_path)
    with pytest.raises(hub.HubError) as error:
        hub.download(client, plan)
    assert error.value.kind == "mismatch" and str(error.value).startswith(message_start)
    assert not (plan.folder / SHARD2).exists()
    assert not (plan.folder / hub.STAGING_DIR / (SHARD2 + hub.INCOMPLETE_SUFFIX)).exists()
    return plan


def test_size_mismatch_is_refused_and_nothing_is_kept(fake_hub, tmp_path):
    fake_hub.size_lies[SHARD2] = 1000
    plan = _refused_as_mismatch(fake_hub, tmp_path, f"{SHARD2} does not match the Hub's listing: the server sends")
    assert not (plan.folder / "config.json").exists()


def test_hash_mismatch_is_refused_and_the_bad_copy_removed(fake_hub, tmp_path):
    fake_hub.corrupt.add(SHARD2)
    _refused_as_mismatch(fake_hub, tmp_path, f"{SHARD2} arrived damaged: its SHA-256 does not match")
    # the next try (the mirror fixed) fetches only that file again
    fake_hub.corrupt.clear()
    client, plan = _plan(fake_hub, tmp_path)
    hub.download(client, plan)
    assert set(fake_hub.served) == {SHARD2, "config.json"}


def test_small_file_hash_is_checked_too(fake_hub, tmp_path):
    fake_hub.corrupt.add("tokenizer.json")
    client, plan = _plan(fake_hub, tmp_path)
    with pytest.raises(hub.HubError, match="tokenizer.json arrived damaged: its git blob id does not match"):
        hub.download(client, plan)


def test_not_enough_disk_is_refused_before_anything_is_written(fake_hub, tmp_path, monkeypatch):
    client, plan = _plan(fake_hub, tmp_path)
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 * 2**30, 10 * 2**30 - 5_000_000, 5_000_000))
    plan_again = hub.plan_download(client, TINY, models_dir=tmp_path / "models", with_fit=False)
    assert not plan_again.disk_ok and plan_again.free_bytes == 5_000_000
    fake_hub.wait_quiet()  # the planning requests' server threads may still be counting their bytes
    fake_hub.served.clear()
    with pytest.raises(hub.HubError) as error:
        hub.download(client, plan)
    assert error.value.kind == "disk"
    assert str(error.value).startswith("Not enough disk space in")
    assert "this download needs" in str(error.value) and "5.00 MB is free" in str(error.value)
    assert not plan.folder.exists() and sum(fake_hub.served.values()) == 0


def test_disk_filling_up_mid_download_is_a_plain_error(fake_hub, tmp_path, monkeypatch):
    client, plan = _plan(fake_hub, tmp_path)
    real_open = open

    class FullDisk:
        def __init__(self, handle):
            self.handle = handle

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            self.handle.close()

    def fake_open(path, mode="r", *args, **kwargs):
        handle = real_open(path, mode, *args, **kwargs)
        return FullDisk(handle) if "a" in mode and str(path).endswith(SHARD1 + hub.INCOMPLETE_SUFFIX) else handle

    monkeypatch.setattr(hub.downloader, "open", fake_open, raising=False)
    with pytest.raises(hub.HubError) as error:
        hub.download(client, plan)
    assert error.value.kind == "disk" and str(error.value).startswith("The disk is full:")


def test_offline_mode_and_network_down(fake_hub, tmp_path, monkeypatch):
    with pytest.raises(hub.HubError) as error:
        hub.plan_download(hub.Hub(fake_hub.endpoint, offline=True), TINY, models_dir=tmp_path)
    assert error.value.kind == "offline" and str(error.value).startswith("Offline mode is on")
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(hub.HubError, match="HF_HUB_OFFLINE"):
        hub.plan_download(hub.Hub(fake_hub.endpoint), TINY, models_dir=tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    closed = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(hub.HubError) as error:
        hub.plan_download(hub.Hub(closed), TINY, models_dir=tmp_path)
    assert error.value.kind == "network" and str(error.value).startswith("Cannot reach 127.0.0.1:")
    assert fake_hub.requests == []


def test_repos_the_engine_cannot_run_are_refused_before_downloading(fake_hub, tmp_path):
    client = hub.Hub(fake_hub.endpoint)
    with pytest.raises(hub.HubError) as error:
        hub.plan_download(client, NOT_MOE, models_dir=tmp_path)
    assert error.value.kind == "unsupported" and "model_type 'llama' is not supported" in str(error.value)
    with pytest.raises(hub.HubError) as error:
        hub.plan_download(client, NO_WEIGHTS, models_dir=tmp_path)
    assert error.value.kind == "unsupported" and "no .safetensors weights" in str(error.value)


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the CLI -----------------------------------------------------------------------------------------


def test_cli_pull_then_chat_ready(fake_hub, tmp_path, capsys):
    target = tmp_path / "qwen3"
    code = main(["pull", QWEN3, "--endpoint", fake_hub.endpoint, "--local-dir", str(target)])
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith(f"{QWEN3} @ main (commit ") and str(target) in lines[0]
    assert lines[1].startswith("needs about ") and "VRAM presets that fit: 4 GB yes  8 GB yes  12 GB yes" in lines[1]
    assert any("model.safetensors" in line for line in lines[2:])
    assert lines[-1] == f"done: {target} (try it: python -m engine chat --model {target})"
    load_model(target)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["pull", "Org/No-Such-Model"], "error: There is no model Org/No-Such-Model on 127.0.0.1:"),
        (["pull", GATED], f"error: {GATED} is gated"),
        (["pull", TINY, "--offline"], "error: Offline mode is on"),
        (["pull", TINY, "--revision", "v9"], f"error: {TINY} has no revision 'v9'"),
    ],
)
def test_cli_pull_errors_are_one_line(argv, message, fake_hub, tmp_path, capsys):
    code = main(argv + ["--endpoint", fake_hub.endpoint, "--local-dir", str(tmp_path / "m")])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith(message)


def test_cli_pull_size_mismatch(fake_hub, tmp_path, capsys):
    fake_hub.size_lies[SHARD1] = 10
    code = main(["pull", TINY, "--endpoint", fake_hub.endpoint, "--local-dir", str(tmp_path / "m")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and err[0].startswith(f"error: {SHARD1} does not match the Hub's listing")


def test_no_token_in_messages_or_files_we_write(fake_hub, tmp_path, capsys):
    secret = "hf_secret_never_printed"
    with pytest.raises(hub.HubError) as error:
        hub.plan_download(hub.Hub(fake_hub.endpoint, token=secret), GATED, models_dir=tmp_path)
    assert secret not in str(error.value)
    client, plan = _plan(fake_hub, tmp_path, token=secret)
    hub.download(client, plan)
    for path in plan.folder.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes()
    assert json.loads((plan.folder / hub.RECORD_FILE).read_text())["repo_id"] == TINY


def test_the_fake_hub_speaks_what_the_clients_own_download_expects(fake_hub, tmp_path, tiny_checkpoint):
    """huggingface_hub's own hf_hub_download (HEAD for the metadata, LFS redirects, X-Linked-* headers) works
    against the fake Hub, so the tests above exercise the protocol the real Hub speaks."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url

    source = tiny_checkpoint("qwen3_5_moe", "nvfp4", shards=2)
    for name in ("config.json", SHARD1):
        path = hf_hub_download(TINY, name, endpoint=fake_hub.endpoint, local_dir=tmp_path / "hf")
        assert _sha256(tmp_path / "hf" / name) == _sha256(source / name) and path.endswith(name)
    meta = get_hf_file_metadata(hf_hub_url(TINY, SHARD1, endpoint=fake_hub.endpoint))
    assert meta.size == (source / SHARD1).stat().st_size and meta.etag == _sha256(source / SHARD1)
    assert meta.commit_hash == fake_hub.repos[TINY].commit
