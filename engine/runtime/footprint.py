"""A model's footprint: the bytes of each part a memory plan places (resident weights, expert layers, KV per
token, GDN state), read from a checkpoint's headers or a synthetic model's layout, never from weight data."""

from __future__ import annotations

import functools
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine.checkpoint import Checkpoint, LayoutShard
from engine.checkpoint.formats import IGNORED_ROLES
from engine.checkpoint.quant_config import kv_cache_choice
from engine.checkpoint.source import WeightSource
from engine.config import ModelConfig, read_config
from engine.errors import CheckpointError
from engine.experts.bank import ExpertBank
from engine.experts.packed import expert_matrices
from engine.kernels.record_layout import RecordLayout
from engine.synthetic import SYNTHETIC_MODELS

# ---- element sizes -------------------------------------------------------------------------
BF16_BYTES = 2
FP32_BYTES = 4
INT64_BYTES = 8
ACTIVATION_BYTES = BF16_BYTES  # activations between kernels are bf16 on the GPU
KV_BYTES = {"bf16": BF16_BYTES, "fp8": 1}  # a KV cache value by the cache's dtype (quant_config.kv_cache_choice)
CONV_STATE_BYTES = BF16_BYTES  # the GDN conv window holds activations
ACCUMULATOR_BYTES = FP32_BYTES  # residual stream, GDN scan and recurrent state, softmax, logits


@dataclass(frozen=True)
class ModelFootprint:
    """The bytes of each component a plan places, for one model in its stored formats."""

    name: str
    config: ModelConfig
    projection_bytes: int  # attention and Gated DeltaNet projections
    shared_mlp_bytes: int  # shared experts, and dense MLP layers where a model has them
    small_bytes: int  # routers, shared-expert gates, norms, conv weights, A_log, dt_bias
    lm_head_bytes: int
    embedding_bytes: int  # kept in host RAM
    expert_layer_bytes: int  # one layer of cache slots: experts per layer x the runtime's record of one expert
    routed_expert_bytes: int  # all routed experts, in host RAM
    moe_layers: int
    kv_cache: str = "bf16"  # the KV cache's dtype: "bf16" or "fp8" (quant_config.kv_cache_choice)

    @property
    def resident_bytes(self) -> int:
        """Weights that live on the GPU for the whole session."""
        return self.projection_bytes + self.shared_mlp_bytes + self.small_bytes + self.lm_head_bytes

    @property
    def experts_per_layer(self) -> int:
        return self.config.num_experts

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every full-attention layer, in the KV cache's dtype; GDN layers keep no per-token state."""
        c = self.config
        return c.num_attention_layers * 2 * c.num_key_value_heads * c.head_dim * KV_BYTES[self.kv_cache]

    @property
    def gdn_state_bytes(self) -> int:
        """Recurrent matrices and conv windows of all GDN layers: one sequence, any length."""
        c = self.config
        recurrent = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * ACCUMULATOR_BYTES
        conv = gdn_conv_channels(c) * (c.linear_conv_kernel_dim - 1) * CONV_STATE_BYTES
        return c.num_linear_attention_layers * (recurrent + conv)

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_context(self) -> int:
        return self.config.max_position_embeddings

    def to_dict(self) -> dict:
        fields = {k: v for k, v in asdict(self).items() if k != "config"}
        return dict(
            fields,
            resident_bytes=self.resident_bytes,
            experts_per_layer=self.experts_per_layer,
            kv_bytes_per_token=self.kv_bytes_per_token,
            gdn_state_bytes=self.gdn_state_bytes,
            hidden_size=self.hidden_size,
            vocab_size=self.vocab_size,
            max_context=self.max_context,
        )


def gdn_conv_channels(c: ModelConfig) -> int:
    """Channels of a Gated DeltaNet layer's causal conv: its q, k and v."""
    return 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim


@functools.lru_cache(maxsize=None)
def footprint_from_synthetic(name: str, kv_cache_dtype: str = "auto") -> ModelFootprint:
    """The footprint of a model described in engine.synthetic: its real checkpoint's tensor layout, sized by the
    code that sizes a checkpoint folder, so the two cannot disagree."""
    if name not in SYNTHETIC_MODELS:
        raise KeyError(f"no synthetic model {name!r}; known: {', '.join(SYNTHETIC_MODELS)}")
    model = SYNTHETIC_MODELS[name]
    where = Path(name)
    checkpoint = Checkpoint(where, model.quantization_config, shards=[LayoutShard(model.tensor_layout(), where)])
    return footprint_of(checkpoint, model.config, where, kv_cache_dtype)


# Normalised tensor names (engine.checkpoint.normalise_key) by the component they belong to.
ROUTED_EXPERTS = re.compile(r"^layers\.(\d+)\.mlp\.experts\.")
PROJECTIONS = re.compile(r"^layers\.\d+\.(self_attn|linear_attn)\.\w*proj\w*\.")
ALWAYS_ON_MLP = re.compile(r"^layers\.\d+\.mlp\.(shared_expert|gate_proj|up_proj|down_proj)\.")


def footprint_from_checkpoint(folder: str | Path, kv_cache_dtype: str = "auto") -> ModelFootprint:
    """The footprint of a checkpoint folder, from its safetensors headers only (no weight data is read)."""
    folder = Path(folder).expanduser()
    config = read_config(folder)
    return footprint_of(Checkpoint(folder, config.quantization_config), config, folder, kv_cache_dtype)


def footprint_of(
    checkpoint: Checkpoint, config: ModelConfig, folder: Path, kv_cache_dtype: str = "auto"
) -> ModelFootprint:
    """The footprint of an open checkpoint (a folder's, or shard headers fetched before downloading), its KV cache
    in the dtype the kv_cache_dtype option gives it (auto: FP8 where the checkpoint declares it)."""
    sizes = dict.fromkeys(("projection", "shared", "small", "lm_head", "embedding"), 0)
    expert_layers: dict[int, int] = {}
    for name, nbytes in checkpoint.tensor_bytes():
        if name.rpartition(".")[2] in IGNORED_ROLES:  # activation scales: weight-only compute never loads them
            continue
        routed = ROUTED_EXPERTS.match(name)
        if routed:
            layer = int(routed.group(1))
            expert_layers[layer] = expert_layers.get(layer, 0) + nbytes
        elif PROJECTIONS.match(name):
            sizes["projection"] += nbytes
        elif ALWAYS_ON_MLP.match(name):
            sizes["shared"] += nbytes
        elif name.startswith("lm_head."):
            sizes["lm_head"] += nbytes
        elif name.startswith("embed_tokens."):
            sizes["embedding"] += nbytes
        else:
            sizes["small"] += nbytes
    if not expert_layers:
        raise CheckpointError(
            folder,
            "has no routed-expert weights, so it is not a mixture-of-experts checkpoint the planner can place",
            "choose a Qwen3.5/3.6-MoE or Qwen3-MoE model",
        )
    if config.tie_word_embeddings and not sizes["lm_head"]:  # the head is the embedding table, then resident too
        sizes["lm_head"] = sizes["embedding"]
    largest = max(expert_layers, key=expert_layers.get)
    record_bytes = expert_record_bytes(checkpoint, config, largest)
    return ModelFootprint(
        name=folder.name,
        config=config,
        projection_bytes=sizes["projection"],
        shared_mlp_bytes=sizes["shared"],
        small_bytes=sizes["small"],
        lm_head_bytes=sizes["lm_head"],
        embedding_bytes=sizes["embedding"],
        expert_layer_bytes=config.num_experts * record_bytes,
        routed_expert_bytes=sum(expert_layers.values()),
        moe_layers=len(expert_layers),
        kv_cache=kv_cache_choice(kv_cache_dtype, checkpoint.quant),
    )


def expert_record_bytes(checkpoint: Checkpoint, config: ModelConfig, layer: int) -> int:
    """Bytes of one cache slot: the record the runtime packs an expert of `layer` into (engine/experts/packed.py),
    which joins gate and up and keeps a global scale per row, so it is larger than the expert's stored bytes."""
    source = WeightSource(checkpoint.headers_only(), config, torch.device("meta"), torch.float32)
    bank = ExpertBank(
        source, f"layers.{layer}.mlp.experts", config.num_experts, config.hidden_size, config.moe_intermediate_size
    )
    return RecordLayout.of(expert_matrices(bank, 0)).record_bytes
