"""The memory planner: presets fit their budgets, the arithmetic matches hand-computed sizes, errors give numbers."""

import json
from dataclasses import replace

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import engine
from engine.checkpoint import normalise_key
from engine.checkpoint.formats import IGNORED_ROLES
from engine.checkpoint.safetensors_file import SafetensorsFile
from engine.runtime.footprint import footprint_from_checkpoint, footprint_from_synthetic
from engine.runtime.planner import (
    CHAT_MAX_CHUNK,
    DEFAULT_RUNTIME_RESERVE_BYTES,
    GIB,
    MIB,
    PREFILL_CHUNK_MAX,
    REPLY_RESERVE_TOKENS,
    RULES,
    USES,
    PlanError,
    plan_memory,
    preset_budget_bytes,
    runtime_reserve_bytes,
)
from engine.runtime.workspace import prefill_workspace
from engine.testing.tiny_checkpoints import write_tiny_checkpoint

QWEN3_6 = "qwen3.6-35b-a3b-nvfp4"
GUARANTEED_PROMPT_4GB = 16384  # issue 3's floor for the 4 GB plan
TARGET_PROMPT = 32768  # issue 3's aim
BUDGETS_GIB = (4, 8, 12)
SWEEP_STEP = 64 * MIB
HEADER_BYTES = {"BF16": 2, "F32": 4, "U8": 1, "F8_E4M3": 1}  # dtypes the tiny checkpoints store
BYTE_FIELDS = (
    "projection_bytes",
    "shared_mlp_bytes",
    "small_bytes",
    "lm_head_bytes",
    "embedding_bytes",
    "expert_layer_bytes",
    "routed_expert_bytes",
    "moe_layers",
    "kv_bytes_per_token",
    "gdn_state_bytes",
)


@pytest.fixture(scope="module")
def qwen36():
    return footprint_from_synthetic(QWEN3_6, "bf16")  # the figures below; test_fp8_kv_cache_plans: FP8


def _gib(n):
    return f"{n / GIB:.2f} GiB"


# ---- footprints ----------------------------------------------------------------------------


def test_qwen36_footprint_matches_hand_computed_sizes(qwen36):
    def nvfp4(out, inp):  # codes, fp8 block scales, fp32 global scale
        return out * inp // 2 + out * inp // 16 + 4

    def fp8(out, inp):  # fp8 weight, fp32 scale
        return out * inp + 4

    expert = 2 * nvfp4(512, 2048) + nvfp4(2048, 512)
    # a cache slot holds the runtime's record: gate and up joined with a float32 global scale per row, down
    # with one per row too (every tensor 64-byte aligned, which these sizes already are)
    record = (1024 * 1024 + 1024 * 128 + 1024 * 4) + (2048 * 256 + 2048 * 32 + 2048 * 4)
    assert qwen36.expert_layer_bytes == 256 * record == 456_130_560  # the stored experts: 452,987,904
    assert qwen36.routed_expert_bytes == 40 * 256 * expert
    assert qwen36.kv_bytes_per_token == 10 * 2 * 2 * 256 * 2 == 20 * 1024  # only 10 of 40 layers keep KV
    assert qwen36.gdn_state_bytes == 30 * (32 * 128 * 128 * 4 + 8192 * 3 * 2)
    attention = fp8(8192, 2048) + 2 * fp8(512, 2048) + fp8(2048, 4096)
    gdn = fp8(8192, 2048) + fp8(4096, 2048) + fp8(2048, 4096) + 2 * 32 * 2048 * 2
    assert qwen36.projection_bytes == 10 * attention + 30 * gdn
    assert qwen36.shared_mlp_bytes == 40 * expert  # one shared expert per layer, the shape of a routed one
    assert qwen36.lm_head_bytes == nvfp4(248320, 2048)  # nvidia's export quantises the head too
    assert qwen36.embedding_bytes == 248320 * 2048 * 2  # bf16, and it stays in host RAM
    assert qwen36.resident_bytes == (
        qwen36.projection_bytes + qwen36.shared_mlp_bytes + qwen36.small_bytes + qwen36.lm_head_bytes
    )
    assert (qwen36.hidden_size, qwen36.vocab_size, qwen36.max_context) == (2048, 248320, 262144)


def test_qwen3_30b_footprint():
    fp = footprint_from_synthetic("qwen3-30b-a3b")
    assert fp.kv_bytes_per_token == 48 * 2 * 4 * 128 * 2
    assert fp.expert_layer_bytes == 128 * 3 * 2048 * 768 * 2
    assert fp.gdn_state_bytes == 0 and fp.shared_mlp_bytes == 0
    assert fp.max_context == 40960


def _header_bytes(folder):
    """Bytes of the text model's tensors, read with the safetensors library, by routed-expert layer and the rest."""
    routed, other = {}, 0
    for path in folder.glob("*.safetensors"):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                name = normalise_key(key)
                if name is None or name.rpartition(".")[2] in IGNORED_ROLES:
                    continue
                view = f.get_slice(key)
                nbytes = HEADER_BYTES[view.get_dtype()]
                for d in view.get_shape():
                    nbytes *= d
                if ".mlp.experts." in name:
                    layer = int(name.split(".")[1])
                    routed[layer] = routed.get(layer, 0) + nbytes
                else:
                    other += nbytes
    return routed, other


@pytest.mark.parametrize("arch,fmt", [("qwen3_5_moe", "nvfp4"), ("qwen3_5_moe", "bf16"), ("qwen3_moe", "bf16")])
def test_checkpoint_footprint_counts_every_tensor_from_headers_only(tiny_checkpoint, monkeypatch, arch, fmt):
    folder = tiny_checkpoint(arch, fmt)

    def no_data(self, name):
        raise AssertionError(f"footprint_from_checkpoint read the data of {name}")

    with monkeypatch.context() as patched:
        patched.setattr(SafetensorsFile, "tensor", no_data)
        fp = footprint_from_checkpoint(folder)
    routed, other = _header_bytes(folder)
    assert fp.moe_layers == len(routed)
    assert fp.routed_expert_bytes == sum(routed.values())
    assert fp.resident_bytes + fp.embedding_bytes == other
    # a layer of cache slots is what the runtime packs (gate and up joined, a global scale per row), not less
    executor = engine.load_model(folder, "cpu", expert_cache_slots=fp.experts_per_layer).expert_executor
    assert fp.expert_layer_bytes == fp.experts_per_layer * executor.cache.layout.record_bytes
    assert fp.expert_layer_bytes >= max(routed.values())


def test_tied_head_is_the_resident_embedding(tmp_path):
    folder = write_tiny_checkpoint(tmp_path, "qwen3_moe", "bf16")
    tensors = load_file(folder / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if not k.startswith("lm_head.")}, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, tie_word_embeddings=True)))
    fp = footprint_from_checkpoint(folder)
    assert fp.lm_head_bytes == fp.embedding_bytes == 320 * 64 * 2  # tiny vocab x hidden, bf16


def test_synthetic_tiny_equals_the_tiny_nvfp4_checkpoint(tiny_checkpoint):
    from_files = footprint_from_checkpoint(tiny_checkpoint("qwen3_5_moe", "nvfp4"))
    described = footprint_from_synthetic("tiny")
    assert {f: getattr(from_files, f) for f in BYTE_FIELDS} == {f: getattr(described, f) for f in BYTE_FIELDS}


def test_unknown_synthetic_model():
    with pytest.raises(KeyError, match="qwen3-30b-a3b"):
        footprint_from_synthetic("qwen9")


def test_preset_budgets():
    assert [preset_budget_bytes(p) for p in ("4gb", "8gb", "12gb", "auto")] == [4 * GIB, 8 * GIB, 12 * GIB, None]


# ---- presets -------------------------------------------------------------------------------


@pytest.mark.parametrize("use", USES)
@pytest.mark.parametrize("budget_gib", BUDGETS_GIB)
@pytest.mark.parametrize("preset", ["4gb", "8gb", "12gb"])
def test_presets_fit_the_budget_or_say_why(qwen36, preset, budget_gib, use):
    budget = budget_gib * GIB
    try:
        plan = plan_memory(qwen36, budget, preset, use=use)
    except PlanError as error:
        assert preset != f"{budget_gib}gb", f"the {preset} preset must fit its own budget: {error}"
        assert _gib(budget) in str(error)
        return
    assert plan.breakdown["total"] <= budget
    assert plan.breakdown["total"] == sum(v for k, v in plan.breakdown.items() if k != "total")
    assert plan.expert_slots == plan.expert_cache_layers * 256
    assert plan.breakdown["expert_cache"] == plan.expert_cache_layers * qwen36.expert_layer_bytes
    assert plan.breakdown["kv_cache"] == plan.kv_tokens * 20 * 1024
    assert plan.breakdown["prefill_workspace"] == prefill_workspace(qwen36.config, plan.prefill_chunk_tokens)["total"]
    assert plan.max_prompt_tokens == min(plan.kv_tokens, qwen36.max_context) - REPLY_RESERVE_TOKENS


def test_4gb_plan_is_the_field_report_fix_with_a_long_prompt(qwen36):
    plan = plan_memory(qwen36, 4 * GIB, "4gb")
    assert plan.expert_cache_layers == 1 and plan.expert_slots == 256 and not plan.prefill_overlap
    # with nvidia's real layout (NVFP4 LM head: 1.57 GiB resident) the 32,768 goal and the largest chunk both fit,
    # and what is left goes to KV
    assert plan.max_prompt_tokens >= GUARANTEED_PROMPT_4GB, plan.format_table()
    assert plan.max_prompt_tokens == 49664 and plan.prefill_chunk_tokens == RULES["4gb"].long_chunk == 2048
    # a 4 GB card has less than a layer beyond the prompt: chat and long context are one plan
    assert replace(plan_memory(qwen36, 4 * GIB, "4gb", use="long-context"), use="chat") == plan


def test_8gb_and_12gb_plans(qwen36):
    long8 = plan_memory(qwen36, 8 * GIB, "8gb", use="long-context")
    chat8 = plan_memory(qwen36, 8 * GIB, "8gb")
    chat12 = plan_memory(qwen36, 12 * GIB, "12gb", use="chat")
    assert chat8.use == "chat" and long8.use == "long-context"
    assert long8.expert_cache_layers == 2 and not long8.prefill_overlap
    # a long context spends what it has to spare on the largest chunk (fewer expert bytes a prompt token) and KV
    assert long8.prefill_chunk_tokens == PREFILL_CHUNK_MAX and long8.max_prompt_tokens > 4 * TARGET_PROMPT
    # a chat keeps the 32K-token prompt and 2,048-token chunks and spends the rest on cache layers
    assert chat8.max_prompt_tokens == chat12.max_prompt_tokens == TARGET_PROMPT
    assert chat8.prefill_chunk_tokens == chat12.prefill_chunk_tokens == CHAT_MAX_CHUNK < PREFILL_CHUNK_MAX
    assert 2 < chat8.expert_cache_layers < chat12.expert_cache_layers and not chat12.prefill_overlap
    assert chat8.headroom_bytes < qwen36.expert_layer_bytes and chat12.headroom_bytes < qwen36.expert_layer_bytes


def test_a_long_context_past_the_models_positions_buys_layers(qwen36):
    """12gb holds KV for all 262,144 positions with memory to spare: the spare goes to cache layers, not idle."""
    plan = plan_memory(qwen36, 12 * GIB, "12gb", use="long-context")
    assert plan.kv_tokens == qwen36.max_context and plan.max_prompt_tokens == qwen36.max_context - REPLY_RESERVE_TOKENS
    assert plan.expert_cache_layers > RULES["12gb"].min_layers
    assert 0 <= plan.headroom_bytes < qwen36.expert_layer_bytes


@pytest.mark.parametrize("use", USES)
@pytest.mark.parametrize("preset", ["4gb", "8gb", "12gb"])
def test_a_bigger_budget_never_gives_less(qwen36, preset, use):
    previous = None
    for budget in range(3 * GIB, 20 * GIB, SWEEP_STEP):
        try:
            plan = plan_memory(qwen36, budget, preset, use=use)
        except PlanError:
            assert previous is None, f"{preset} fitted {previous} but not {budget} bytes"
            continue
        now = (plan.max_prompt_tokens, plan.expert_cache_layers, plan.prefill_chunk_tokens)
        if previous is not None:
            assert all(a >= b for a, b in zip(now, previous)), (budget, now, previous)
        previous = now
    assert previous is not None


def test_workspace_is_bounded_by_the_chunk_not_the_prompt(qwen36):
    short = dict(expert_cache_layers=1, prefill_overlap=False, prefill_chunk_tokens=256, kv_tokens=4096)
    long = dict(short, kv_tokens=32768)
    assert (
        plan_memory(qwen36, 8 * GIB, "custom", short).breakdown["prefill_workspace"]
        == plan_memory(qwen36, 8 * GIB, "custom", long).breakdown["prefill_workspace"]
    )
    totals = [prefill_workspace(qwen36.config, chunk)["total"] for chunk in (128, 256, 512, 1024)]
    assert totals == sorted(totals) and totals[-1] < 8 * totals[0]


def test_auto_picks_by_budget(qwen36):
    at4 = plan_memory(qwen36, 4 * GIB, "auto")
    assert (at4.policy, at4.expert_cache_layers, at4.prefill_overlap) == ("4gb", 1, False)
    at8 = plan_memory(qwen36, 8 * GIB, "auto")
    assert not at8.prefill_overlap and at8.expert_cache_layers >= 2 and at8.max_prompt_tokens >= TARGET_PROMPT
    at12 = plan_memory(qwen36, 12 * GIB, "auto")
    assert at12.expert_cache_layers == plan_memory(qwen36, 12 * GIB, "12gb").expert_cache_layers
    assert at12.expert_cache_layers > at8.expert_cache_layers
    assert at4.preset == at8.preset == "auto"


def test_qwen3_30b_does_not_fit_4gb_and_says_why():
    fp = footprint_from_synthetic("qwen3-30b-a3b")
    with pytest.raises(PlanError) as error:
        plan_memory(fp, 4 * GIB, "4gb")
    message = str(error.value)
    assert "4.00 GiB" in message and "needs at least" in message and "more than the budget" in message
    plan = plan_memory(fp, 12 * GIB, "12gb")
    assert plan.breakdown["total"] <= 12 * GIB and plan.max_prompt_tokens <= fp.max_context - REPLY_RESERVE_TOKENS


def test_reserve_of_a_bigger_gpu_is_honoured(qwen36):
    h200 = runtime_reserve_bytes(132, 2048, 9)
    # context, graphs, local memory, slack, graph pool, and two cuBLAS workspaces of Hopper's 32 MiB
    assert h200 == (544 + 24 + 264 + 64 + 16 + 2 * 32) * MIB
    plan = plan_memory(qwen36, 4 * GIB, "4gb", reserve_bytes=h200)
    assert plan.breakdown["runtime_reserve"] == h200 and plan.breakdown["total"] <= 4 * GIB
    assert plan.max_prompt_tokens < plan_memory(qwen36, 4 * GIB, "4gb").max_prompt_tokens


# ---- custom plans and errors ---------------------------------------------------------------


def test_custom_plan_that_fits(qwen36):
    custom = dict(expert_cache_layers=3, prefill_overlap=True, prefill_chunk_tokens=512, kv_tokens=65536)
    plan = plan_memory(qwen36, 8 * GIB, "custom", custom)
    chosen = (plan.expert_cache_layers, plan.prefill_overlap, plan.prefill_chunk_tokens, plan.kv_tokens)
    assert chosen == (3, True, 512, 65536)
    assert plan.max_prompt_tokens == 65536 - REPLY_RESERVE_TOKENS


def test_custom_plan_over_budget_gives_the_numbers(qwen36):
    custom = dict(expert_cache_layers=1, prefill_overlap=False, prefill_chunk_tokens=256, kv_tokens=65536)
    needed = (
        qwen36.resident_bytes
        + qwen36.expert_layer_bytes
        + 65536 * qwen36.kv_bytes_per_token
        + qwen36.gdn_state_bytes
        + prefill_workspace(qwen36.config, 256)["total"]
        + DEFAULT_RUNTIME_RESERVE_BYTES
    )
    with pytest.raises(PlanError) as error:
        plan_memory(qwen36, 4 * GIB, "custom", custom)
    message = str(error.value)
    assert _gib(needed) in message and _gib(4 * GIB) in message
    assert "kv_tokens to at most" in message


def test_overlap_needs_two_layers(qwen36):
    custom = dict(expert_cache_layers=1, prefill_overlap=True, prefill_chunk_tokens=256, kv_tokens=8192)
    with pytest.raises(PlanError, match="at least 2 expert-cache layers"):
        plan_memory(qwen36, 12 * GIB, "custom", custom)


@pytest.mark.parametrize(
    "custom,match",
    [
        (dict(expert_cache_layers=1, prefill_overlap=False, prefill_chunk_tokens=256), "missing kv_tokens"),
        (
            dict(expert_cache_layers=1, prefill_overlap=False, prefill_chunk_tokens=256, kv_tokens=8192, x=1),
            "unknown x",
        ),
        (dict(expert_cache_layers=0, prefill_overlap=False, prefill_chunk_tokens=256, kv_tokens=8192), "from 1 to 40"),
        (dict(expert_cache_layers=1, prefill_overlap="yes", prefill_chunk_tokens=256, kv_tokens=8192), "true or false"),
        (dict(expert_cache_layers=1, prefill_overlap=False, prefill_chunk_tokens=256, kv_tokens=10**6), "262,144"),
    ],
)
def test_custom_values_are_checked(qwen36, custom, match):
    with pytest.raises(PlanError, match=match):
        plan_memory(qwen36, 12 * GIB, "custom", custom)


def test_an_unknown_use_is_refused(qwen36):
    with pytest.raises(PlanError, match="unknown use 'gaming'; choose one of chat, long-context"):
        plan_memory(qwen36, 8 * GIB, "8gb", use="gaming")


@pytest.mark.parametrize(
    "budget,preset,custom,match",
    [
        (4 * GIB, "6gb", None, "unknown preset"),
        (0, "4gb", None, "positive"),
        (4 * GIB, "custom", None, "custom preset needs"),
        (4 * GIB, "4gb", dict(kv_tokens=1), "custom values go with"),
    ],
)
def test_bad_requests(qwen36, budget, preset, custom, match):
    with pytest.raises(PlanError, match=match):
        plan_memory(qwen36, budget, preset, custom)


def test_plan_error_is_a_value_error():
    assert issubclass(PlanError, ValueError)


# ---- output --------------------------------------------------------------------------------


def test_plan_renders_as_json_summary_and_table(qwen36):
    plan = plan_memory(qwen36, 4 * GIB, "4gb")
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["breakdown"]["total"] == plan.breakdown["total"] and data["max_prompt_tokens"] == plan.max_prompt_tokens
    assert data["headroom_bytes"] == 4 * GIB - plan.breakdown["total"]
    assert "\n" not in plan.summary() and f"{plan.max_prompt_tokens:,}" in plan.summary()
    assert data["use"] == "chat" and "4gb for chat" in plan.summary()
    table = plan.format_table()
    assert "preset 4gb for chat" in table
    for label in (
        "resident weights",
        "expert cache",
        "KV cache",
        "GDN state",
        "prefill workspace",
        "runtime reserve",
        "total",
    ):
        assert label in table
    assert json.loads(json.dumps(qwen36.to_dict()))["kv_bytes_per_token"] == 20480


def test_checkpoint_without_routed_experts_is_refused(tmp_path):
    from engine.errors import CheckpointError
    from engine.testing.tiny_checkpoints import write_tiny_checkpoint

    folder = write_tiny_checkpoint(tmp_path, "qwen3_moe", "bf16", text_overrides={"mlp_only_layers": [0, 1, 2]})
    with pytest.raises(CheckpointError, match="has no routed-expert weights"):
        footprint_from_checkpoint(folder)
