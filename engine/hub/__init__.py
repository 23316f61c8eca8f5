"""Models from the Hugging Face Hub: list a repo's files, check the fit and the disk, download with resume.

No Qt here: the CLI (`python -m engine pull`) and the app's download dialog both drive this package.

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

The package, bottom up: errors, display (sizes and durations), control (pause, resume, cancel), tokens,
curated (the curated list and the fit), folder (a model folder's layout and download state), names (safe
file names), client (Hub), remote_fit (the fit from headers on the Hub), plan (DownloadPlan) and downloader.
"""

from engine.hub.client import REQUEST_TRIES, RETRY_AFTER_MAX_S, RETRY_WAIT_S, TIMEOUT_S, Hub, retry_wait
from engine.hub.control import STOP_POLL_S, DownloadControl
from engine.hub.curated import CURATED_MODELS, SIZE_PRESETS, CuratedModel, Fit, curated_fit, fit_of
from engine.hub.display import format_duration, format_size
from engine.hub.downloader import MAX_RETRIES, PROGRESS_INTERVAL_S, SPEED_WINDOW_S, Progress, download, pull
from engine.hub.errors import DownloadCancelled, HubError
from engine.hub.folder import (
    CONFIG_FILE,
    INCOMPLETE_SUFFIX,
    NEEDED_FILES,
    RECORD_FILE,
    STAGING_DIR,
    STATE_FILE,
    WEIGHT_PATTERN,
    download_record,
    folder_name,
    free_disk_bytes,
    partial_download,
)
from engine.hub.names import WINDOWS_DEVICE_NAMES, WINDOWS_FORBIDDEN_CHARS, check_file_names, unsafe_name_reason
from engine.hub.plan import DISK_MARGIN_BYTES, MAX_SMALL_FILE_BYTES, DownloadPlan, PlanFile, needed_files, plan_download
from engine.hub.remote_fit import HEADER_PROBE_BYTES, footprint_from_headers
from engine.hub.tokens import client_offline, has_saved_token, save_token
from engine.paths import default_models_dir

__all__ = [
    "CONFIG_FILE",
    "CURATED_MODELS",
    "CuratedModel",
    "DISK_MARGIN_BYTES",
    "DownloadCancelled",
    "DownloadControl",
    "DownloadPlan",
    "Fit",
    "HEADER_PROBE_BYTES",
    "Hub",
    "HubError",
    "INCOMPLETE_SUFFIX",
    "MAX_RETRIES",
    "MAX_SMALL_FILE_BYTES",
    "NEEDED_FILES",
    "PROGRESS_INTERVAL_S",
    "PlanFile",
    "Progress",
    "RECORD_FILE",
    "REQUEST_TRIES",
    "RETRY_AFTER_MAX_S",
    "RETRY_WAIT_S",
    "SIZE_PRESETS",
    "SPEED_WINDOW_S",
    "STAGING_DIR",
    "STATE_FILE",
    "STOP_POLL_S",
    "TIMEOUT_S",
    "WEIGHT_PATTERN",
    "WINDOWS_DEVICE_NAMES",
    "WINDOWS_FORBIDDEN_CHARS",
    "check_file_names",
    "client_offline",
    "curated_fit",
    "default_models_dir",
    "download",
    "download_record",
    "fit_of",
    "folder_name",
    "footprint_from_headers",
    "format_duration",
    "format_size",
    "free_disk_bytes",
    "has_saved_token",
    "needed_files",
    "partial_download",
    "plan_download",
    "pull",
    "retry_wait",
    "save_token",
    "unsafe_name_reason",
]
