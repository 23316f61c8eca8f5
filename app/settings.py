"""The app's settings in QSettings (the platform's own store), with typed accessors and defaults."""

from __future__ import annotations

import json

from PySide6.QtCore import QSettings

from engine.experts.split import BACKENDS

DEFAULTS = {
    "preset": "auto",  # 4gb | 8gb | 12gb | auto | custom
    "custom_plan": {"expert_cache_layers": 1, "prefill_overlap": False, "prefill_chunk_tokens": 256,
                    "kv_tokens": 8192},
    "vram_gib": 0.0,  # 0: the card's free memory (auto) or the preset's size
    "context_tokens": 8192,
    "sampling": {},  # overrides of the model's generation_config.json (temperature, top_p, ...)
    "enable_thinking": True,
    "theme": "light",  # light | dark
    "model_folders": [],  # folders the user added with "Open folder…"
    "last_model": "",  # "" means the built-in demo model
    "cpu_threads": 0,  # 0: physical cores
    "pin_budget_gib": 0.0,  # 0: sized from free RAM
    "expert_backend": "auto",  # where a GPU run's expert-cache misses run: engine.experts.split.BACKENDS
    "hf_endpoint": "",  # a Hub mirror's address; "" means HF_ENDPOINT or huggingface.co (the token is never here)
    "hub_offline": False,  # never contact the Hub
    "cpu_notice_seen": "",  # the CPU-mode reason the user last acknowledged; a different one is shown again
    "download_folder": "",  # where Download… puts models; "" means engine.hub.default_models_dir()
}


def load_options(settings: "AppSettings") -> dict:
    """What the engine worker needs to open a model, from the settings."""
    options = {key: settings.get(key) for key in ("context_tokens", "cpu_threads", "preset", "vram_gib",
                                                   "custom_plan", "pin_budget_gib", "expert_backend")}
    if options["expert_backend"] not in BACKENDS:  # a hand-edited value: run what the Settings page shows instead
        options["expert_backend"] = DEFAULTS["expert_backend"]
    return options


class AppSettings:
    def __init__(self, store: QSettings | None = None):
        self._store = store or QSettings("MoE Desk", "MoE Desk")

    def get(self, key: str):
        raw = self._store.value(key)
        default = DEFAULTS[key]
        if raw is None:
            return json.loads(json.dumps(default))  # a fresh copy of lists and dicts
        try:
            return json.loads(raw)
        except (TypeError, ValueError):
            return default  # a hand-edited or foreign value: fall back rather than crash

    def set(self, key: str, value) -> None:
        if key not in DEFAULTS:
            raise KeyError(f"unknown setting {key!r}")
        self._store.setValue(key, json.dumps(value))
        self._store.sync()
