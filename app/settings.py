"""The app's settings in QSettings (the platform's own store), with typed accessors and defaults."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from pathlib import Path

from PySide6.QtCore import QSettings

from app.paths import data_folder
from engine.api import BACKENDS, DEFAULT_MAX_SNAPSHOTS, DEFAULT_USE, USES, SamplingParams

log = logging.getLogger(__name__)

DEFAULTS = {
    "preset": "auto",  # 4gb | 8gb | 12gb | auto | custom
    "plan_use": DEFAULT_USE,  # what the plan gives the memory beyond a 32K-token prompt: engine.api.USES
    "custom_plan": {"expert_cache_layers": 1, "prefill_overlap": False, "prefill_chunk_tokens": 256, "kv_tokens": 8192},
    "vram_gib": 0.0,  # 0: the card's free memory (auto) or the preset's size
    "context_tokens": 8192,
    "sampling": {},  # overrides of the model's generation_config.json (temperature, top_p, ...)
    "enable_thinking": True,
    "turn_snapshots": DEFAULT_MAX_SNAPSHOTS,  # restore points a chat keeps for regenerate and edit
    "theme": "light",  # light | dark
    "model_folders": [],  # folders the user added with "Open folder…"
    "last_model": "",  # "" means the built-in demo model
    "cpu_threads": 0,  # 0: physical cores
    "pin_budget_gib": 0.0,  # 0: sized from free RAM
    "chat_states_ram_gib": 2.0,  # host RAM for chats' and API prompts' engine states (resume without a prefill)
    "chat_states_disk_gib": 8.0,  # disk for the states RAM cannot hold, kept across restarts; 0: none
    "expert_backend": "auto",  # where a GPU run's expert-cache misses run: engine.experts.backend.BACKENDS
    "hf_endpoint": "",  # a Hub mirror's address; "" means HF_ENDPOINT or huggingface.co (the token is never here)
    "hub_offline": False,  # never contact the Hub
    "cpu_notice_seen": "",  # the CPU-mode reason the user last acknowledged; a different one is shown again
    "download_folder": "",  # where Download… puts models; "" means engine.hub.default_models_dir()
    "chat_engine": "",  # which engine answers chats: "" the local one, else a remote engine's id (app.remote_store)
    "api_server": False,  # serve the loaded model over HTTP (app.api_server) while the app runs
    "api_port": 1919,
    "api_key": "",  # "" means no key (loopback only); kept here, never logged (SECRET_SETTINGS)
    "api_allow_lan": False,  # listen on every interface (needs a key) instead of 127.0.0.1
    "window_geometry": "",  # QMainWindow.saveGeometry() in base64 (size, position, maximized); "" sizes to the screen
    "chat_splitter": [],  # the Chat page's [conversation list, chat] widths; [] means the default
}
SECRET_SETTINGS = frozenset({"api_key"})  # a refused value of these is not quoted in the warning


REMOTE_ENGINES_FILE = "remote-engines.json"
MIN_CONTEXT_TOKENS = 2048
MAX_CONTEXT_TOKENS = 262144  # the longest context of the models MoE Desk runs
PRESETS = ("4gb", "8gb", "12gb", "auto", "custom")
THEME_NAMES = ("light", "dark")
MAX_TURN_SNAPSHOTS = 64  # each is a copy of the model's recurrent state in host RAM


def _whole(value, low: int, high: float = math.inf) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _number(value, low: float = 0.0, high: float = math.inf) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and low <= value <= high
    )


def _custom_plan(value) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == set(DEFAULTS["custom_plan"])
        and _whole(value["expert_cache_layers"], 0)
        and isinstance(value["prefill_overlap"], bool)
        and _whole(value["prefill_chunk_tokens"], 1)
        and _whole(value["kv_tokens"], 1)
    )


def _sampling(value) -> bool:
    if not isinstance(value, dict) or not set(value) <= {f.name for f in dataclasses.fields(SamplingParams)}:
        return False
    try:
        SamplingParams(**value).validate()
    except (TypeError, ValueError):  # TypeError: text compared with a number
        return False
    return all(_number(v, -math.inf) for k, v in value.items() if k != "stop") and (
        value.get("seed") is None or _whole(value["seed"], 0)
    )


def _strings(value) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


# what each stored value must be, checked when it is read: (test, the allowed values in words)
CHECKS = {
    "preset": (lambda v: v in PRESETS, f"one of {', '.join(PRESETS)}"),
    "plan_use": (lambda v: v in USES, f"one of {', '.join(USES)}"),
    "custom_plan": (_custom_plan, f"a plan with the keys {', '.join(DEFAULTS['custom_plan'])}"),
    "vram_gib": (_number, "a number of GiB, 0 or more"),
    "context_tokens": (
        lambda v: _whole(v, MIN_CONTEXT_TOKENS, MAX_CONTEXT_TOKENS),
        f"a whole number of tokens from {MIN_CONTEXT_TOKENS} to {MAX_CONTEXT_TOKENS}",
    ),
    "sampling": (_sampling, "sampling settings the engine accepts"),
    "enable_thinking": (lambda v: isinstance(v, bool), "true or false"),
    "turn_snapshots": (lambda v: _whole(v, 1, MAX_TURN_SNAPSHOTS), f"a whole number from 1 to {MAX_TURN_SNAPSHOTS}"),
    "theme": (lambda v: v in THEME_NAMES, f"one of {', '.join(THEME_NAMES)}"),
    "model_folders": (_strings, "a list of folders"),
    "last_model": (lambda v: isinstance(v, str), "a folder"),
    "cpu_threads": (
        lambda v: _whole(v, 0, max_cpu_threads()),
        "a whole number from 0 (physical cores) to this machine's thread count",
    ),
    "pin_budget_gib": (_number, "a number of GiB, 0 or more"),
    "chat_states_ram_gib": (_number, "a number of GiB, 0 or more"),
    "chat_states_disk_gib": (_number, "a number of GiB, 0 or more"),
    "expert_backend": (lambda v: v in BACKENDS, f"one of {', '.join(BACKENDS)}"),
    "hf_endpoint": (lambda v: isinstance(v, str), "an address"),
    "hub_offline": (lambda v: isinstance(v, bool), "true or false"),
    "cpu_notice_seen": (lambda v: isinstance(v, str), "text"),
    "download_folder": (lambda v: isinstance(v, str), "a folder"),
    "chat_engine": (lambda v: isinstance(v, str), "a remote engine's id, or empty for the local engine"),
    "api_server": (lambda v: isinstance(v, bool), "true or false"),
    "api_port": (lambda v: _whole(v, 1, 65535), "a port from 1 to 65535"),
    "api_key": (lambda v: isinstance(v, str), "text"),
    "api_allow_lan": (lambda v: isinstance(v, bool), "true or false"),
    "window_geometry": (lambda v: isinstance(v, str), "saved window geometry"),
    "chat_splitter": (
        lambda v: isinstance(v, list) and len(v) in (0, 2) and all(_whole(x, 0) for x in v),
        "two widths in pixels",
    ),
}


def max_cpu_threads() -> int:
    """The most CPU threads a setting may ask for: the machine's logical CPUs (more crash inside torch)."""
    return os.cpu_count() or 1


def load_options(settings: "AppSettings") -> dict:
    """What the engine worker needs to open a model, from the settings."""
    return {
        key: settings.get(key)
        for key in (
            "context_tokens",
            "cpu_threads",
            "preset",
            "plan_use",
            "vram_gib",
            "custom_plan",
            "pin_budget_gib",
            "expert_backend",
            "turn_snapshots",
            "chat_states_ram_gib",
            "chat_states_disk_gib",
        )
    }


class AppSettings:
    """Typed settings: a stored value that is unreadable or out of range reads as its default, with a warning."""

    def __init__(self, store: QSettings | None = None):
        self._store = store or QSettings("MoE Desk", "MoE Desk")
        self.warnings: list[str] = []  # what was refused so far, for the Logs page
        self._on_warning = None
        self._warned: set[tuple[str, str]] = set()

    def report_warnings(self, on_warning) -> None:
        """Hand every warning so far, and each later one, to on_warning(level, message)."""
        self._on_warning = on_warning
        for message in self.warnings:
            on_warning("warning", message)

    def get(self, key: str):
        raw = self._store.value(key)
        default = json.loads(json.dumps(DEFAULTS[key]))  # a fresh copy of lists and dicts
        if raw is None:
            return default
        check, allowed = CHECKS[key]
        try:
            value = json.loads(raw)
        except (TypeError, ValueError):
            value = raw  # a hand-edited or foreign value, shown in the warning as found
        else:
            if check(value):
                return value
        self._warn(key, raw, allowed)
        return default

    def _warn(self, key: str, raw, allowed: str) -> None:
        if (key, str(raw)) in self._warned:  # once per bad value, however often it is read
            return
        self._warned.add((key, str(raw)))
        found = "unreadable" if key in SECRET_SETTINGS else f"{raw!r:.80}"
        message = (
            f"setting {key} in {self._store.fileName()} is {found}, not {allowed}; using the default "
            f"{json.dumps(DEFAULTS[key])} (change it on the Settings page to store a valid one)"
        )
        log.warning(message)
        self.warnings.append(message)
        if self._on_warning is not None:
            self._on_warning("warning", message)

    def remote_engines_path(self) -> Path:
        """Where the remote engines are kept (app.remote_store): beside an INI settings file, else in the data
        folder (the registry and macOS's property lists have no folder to sit beside)."""
        if self._store.format() == QSettings.Format.IniFormat:
            return Path(self._store.fileName()).parent / REMOTE_ENGINES_FILE
        return data_folder() / REMOTE_ENGINES_FILE

    def set(self, key: str, value) -> None:
        if key not in DEFAULTS:
            raise KeyError(f"unknown setting {key!r}")
        self._store.setValue(key, json.dumps(value))
        self._store.sync()
