"""The curated models the download dialog offers, and the RAM/VRAM fit of a model."""

from __future__ import annotations

from dataclasses import asdict, dataclass

SIZE_PRESETS = ("4gb", "8gb", "12gb")


@dataclass(frozen=True)
class CuratedModel:
    repo_id: str
    format: str
    synthetic: str  # the engine.synthetic description of its shapes and formats (for the fit before any file)
    note: str


CURATED_MODELS = (
    CuratedModel(
        "nvidia/Qwen3.6-35B-A3B-NVFP4",
        "nvfp4",
        "qwen3.6-35b-a3b-nvfp4",
        "NVFP4 experts, FP8 projections: the smallest, fits a 4 GB card",
    ),
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
    from engine.runtime.footprint import footprint_from_synthetic

    return fit_of(footprint_from_synthetic(model.synthetic), f"the built-in description {model.synthetic!r}")
