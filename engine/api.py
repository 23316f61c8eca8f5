"""The engine's face for the app: every class, function, error and constant app/ uses, and nothing more.

app/ imports the engine only as `from engine.api import NAME` (tests/test_import_direction.py checks it), so the
table below is what the app relies on, and the engine may rearrange anything behind it. It holds the errors the
app shows, the bundled resources and folders, the memory planner and its constants (the Engine page's plan), a
plan's expected decode speed, the placement and loading of a model, the chat session with its tokenizer, sampling,
prefix cache and events, the local API server's queue and settings, and the Hub downloads.

A name loads its home module when it is first taken, not on `import engine.api`: the app takes some late (the
server, the Hub client, the session) so that it starts fast. It is looked up in its home each time, so a test that
replaces a name there replaces it here too."""

from __future__ import annotations

import importlib

# home module -> the names the face takes from it
_HOMES: dict[str, tuple[str, ...]] = {
    "engine.errors": ("CheckpointError",),
    "engine.resources": ("DEMO_MODEL", "RESOURCES"),
    "engine.paths": ("default_models_dir",),
    "engine.checkpoint": ("INDEX_FILE",),
    "engine.checkpoint.safetensors_file": ("SafetensorsFile",),
    "engine.checkpoint.quant_config": ("read_hf_quant_config",),
    "engine.experts.backend": ("BACKENDS",),
    "engine.loader": ("load_model",),
    "engine.runtime.planner": (
        "BREAKDOWN_LABELS",
        "DEFAULT_RESERVE_SOURCE",
        "DEFAULT_USE",
        "USES",
        "KV_TOKEN_GRANULE",
        "OVERLAP_MIN_LAYERS",
        "PREFILL_CHUNK_MAX",
        "PREFILL_CHUNK_MIN",
        "REPLY_RESERVE_TOKENS",
        "MemoryPlan",
        "PlanError",
        "plan_memory",
        "preset_budget_bytes",
    ),
    "engine.runtime.footprint": ("ModelFootprint", "footprint_from_checkpoint", "footprint_from_synthetic"),
    "engine.runtime.decode_estimate": ("estimate_decode",),
    "engine.runtime.workspace": ("prefill_workspace",),
    "engine.runtime.placement": (
        "Placement",
        "can_switch_plan",
        "gpu_status",
        "load_placed",
        "plan_placement",
        "switch_plan",
    ),
    "engine.runtime.reserve": ("reference_estimate", "runtime_reserve"),
    "engine.runtime.vram": ("outside_allocator_bytes", "process_usage_bytes"),
    "engine.runtime.events": ("ReasoningDelta", "TurnFinished", "TurnStats"),
    "engine.runtime.sampling": ("MAX_SEED", "SamplingParams"),
    "engine.runtime.session": ("DEFAULT_MAX_SNAPSHOTS", "ChatSession"),
    "engine.runtime.prefix_cache": ("PrefixCache",),
    "engine.runtime.state_files": ("StateFolder",),
    "engine.runtime.tokenizer": ("ChatTokenizer",),
    "engine.server.http": ("ServerContext", "unix_now"),
    "engine.server.worker": ("EngineWorker", "Stopped"),
    "engine.server.serve": ("ServerSettings", "listen"),
    "engine.hub": (
        "CONFIG_FILE",
        "CURATED_MODELS",
        "DownloadCancelled",
        "DownloadControl",
        "Hub",
        "HubError",
        "client_offline",
        "curated_fit",
        "download",
        "download_record",
        "folder_name",
        "format_duration",
        "has_saved_token",
        "partial_download",
        "plan_download",
        "save_token",
    ),
}
_HOME_OF = {name: home for home, names in _HOMES.items() for name in names}
__all__ = sorted(_HOME_OF)


def __getattr__(name: str):
    """Take `name` from its home module, importing that module the first time."""
    home = _HOME_OF.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


def __dir__() -> list[str]:
    """The face's names, for dir() and completion."""
    return sorted({*globals(), *__all__})
