"""Model builders by text model_type."""

from engine.models import qwen3_5_moe, qwen3_moe

BUILDERS = {"qwen3_5_moe_text": qwen3_5_moe.build, "qwen3_moe": qwen3_moe.build}
