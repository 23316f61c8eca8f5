"""The decode step (CausalLM.decode_step, run by engine/runtime/graph_runner.py), eagerly on the CPU: the step
the runner captures, with its host actions in place, must give the plain forward's logits, state and cache
traffic."""

import contextlib

import pytest
import torch

import engine
from engine.errors import ContextOverflowError, GraphCaptureError
from engine.runtime.graph_runner import GraphRunner
from engine.step import DecodeStep


def _step_alongside(plain, steps, states, token: int, count: int, tolerance: float = 1e-5) -> int:
    """`count` greedy steps of the plain forward and of `steps` side by side, their logits equal each time (to
    `tolerance` of the largest)."""
    for _ in range(count):
        expected = plain.forward([token], states[0])
        got = steps.step(token, states[1])
        assert torch.allclose(got, expected, rtol=0, atol=tolerance * float(expected.abs().max()))
        assert states[1].position == states[0].position
        token = int(expected.argmax())
    return token


def _cuts(model, state) -> list:
    """The host actions that cut a captured step of `model` on `state`, recorded in a run that skips them (the
    state and the expert cache's bookkeeping take garbage: use fresh ones)."""
    cuts = []
    model.plan_decode()
    embedding = torch.zeros(1, model.config.hidden_size, dtype=model.dtype)
    skipped = DecodeStep(False, cut=cuts.append, queued=lambda action: None)
    model.decode_step(embedding, torch.zeros(1, dtype=torch.long), state, skipped)
    return cuts


LAYOUTS = [("qwen3_5_moe", "nvfp4", False), ("qwen3_5_moe", "bf16", True), ("qwen3_moe", "fp8_block", False)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda case: "-".join(map(str, case)))
@pytest.mark.parametrize("layers_of_slots", [1, 2])
@pytest.mark.parametrize("kv_tokens", [40, None])  # attention inside the segment, or eager on a growing cache
def test_segmented_steps_equal_the_plain_forward(tiny_checkpoint, layout, layers_of_slots, kv_tokens):
    folder = tiny_checkpoint(*layout)
    plain = engine.load_model(folder, expert_cache_slots=8 * layers_of_slots)
    segmented = engine.load_model(folder, expert_cache_slots=8 * layers_of_slots)
    steps = GraphRunner(segmented, use_graphs=False)
    prompt = torch.randint(2, 320, (23,), generator=torch.Generator().manual_seed(5))
    states = plain.new_state(kv_tokens), segmented.new_state(kv_tokens)
    plain.forward(prompt, states[0])
    segmented.forward(prompt, states[1])
    token = _step_alongside(plain, steps, states, 7, 4)
    plain.forward(prompt[:5], states[0])  # a prompt chunk between steps: the host takes the slot table back,
    segmented.forward(prompt[:5], states[1])  # then the next step hands it over again
    _step_alongside(plain, steps, states, token, 2)
    for mine, theirs in zip(states[1].layers, states[0].layers):  # KV caches and recurrent states alike
        if hasattr(mine, "keys"):
            assert mine.length == theirs.length
            assert torch.allclose(mine.keys[: mine.length], theirs.keys[: theirs.length], atol=1e-5)
        else:
            assert torch.allclose(mine.recurrent, theirs.recurrent, atol=1e-5)
    a, b = plain.expert_executor.stats(), segmented.expert_executor.stats()
    assert (a["expert_cache_hits"], a["expert_cache_misses"]) == (b["expert_cache_hits"], b["expert_cache_misses"])


def test_a_step_on_another_state_makes_its_own_actions(tiny_checkpoint):
    """Actions (and, on CUDA, graphs) belong to the state they were made for: switching states and back must not
    mix their tensors up."""
    model = engine.load_model(tiny_checkpoint("qwen3_5_moe", "nvfp4"), expert_cache_slots=8)
    reference = engine.load_model(tiny_checkpoint("qwen3_5_moe", "nvfp4"), expert_cache_slots=8)
    steps = GraphRunner(model, use_graphs=False)
    first, second = model.new_state(20), model.new_state(20)
    ref_first, ref_second = reference.new_state(20), reference.new_state(20)
    for token, (state, ref_state) in zip([3, 9, 4, 11], [(first, ref_first), (second, ref_second)] * 2):
        got = steps.step(token, state)
        expected = reference.forward([token], ref_state)
        assert torch.allclose(got, expected, rtol=0, atol=1e-5 * float(expected.abs().max()))
    assert first.position == second.position == 2


def test_a_full_state_is_refused_before_anything_runs(tiny_checkpoint):
    model = engine.load_model(tiny_checkpoint("qwen3_5_moe", "nvfp4"), expert_cache_slots=8)
    steps = GraphRunner(model, use_graphs=False)
    state = model.new_state(3)
    model.forward([1, 2, 3], state)
    with pytest.raises(ContextOverflowError):
        steps.step(4, state)
    assert state.position == 3


@pytest.mark.parametrize("kv_tokens", [4, None])
def test_cuts_fall_only_at_host_actions(tiny_checkpoint, kv_tokens):
    """Offload: the slots are chosen and the misses copied on the device, so a MoE layer has no host action; an
    attention layer has one (its attention) only when its cache grows (None): a preallocated one is written and
    read at the position on the device. Everything between host actions is one graph."""
    model = engine.load_model(tiny_checkpoint("qwen3_5_moe", "nvfp4"), expert_cache_slots=8)
    cuts = _cuts(model, model.new_state(kv_tokens))
    eager_attention = model.config.layer_types.count("full_attention") if kv_tokens is None else 0
    assert model.expert_executor.decode.slots_on_device == model.config.num_hidden_layers
    assert len(cuts) == eager_attention


def test_the_plan_goes_when_its_state_goes(tiny_checkpoint):
    """The plan (on CUDA, the graphs) holds the state's tensors; a dropped state must not keep them."""
    model = engine.load_model(tiny_checkpoint("qwen3_5_moe", "nvfp4"), expert_cache_slots=8)
    steps = GraphRunner(model, use_graphs=False)
    state = model.new_state(8)
    steps.step(3, state)
    assert steps.state is state
    del state
    assert steps.state is None and steps._key is None


@pytest.mark.parametrize(
    "backend, layout",
    [("cpu", LAYOUTS[0]), ("hybrid", LAYOUTS[0]), ("cpu", LAYOUTS[1]), ("cpu", LAYOUTS[2])],
    ids=lambda v: "-".join(map(str, v)) if isinstance(v, tuple) else v,
)
def test_misses_computed_on_the_cpu_give_the_same_step(tiny_checkpoint, backend, layout):
    """The cpu and hybrid backends, for each stored format: some (cpu: all) misses of a step are computed by the
    CPU threads from the host records and added back as one row, the GPU share keeps its slots."""
    from engine.experts.calibration import Calibration
    from engine.kernels.cpu_experts import CpuExpertKernel

    folder = tiny_checkpoint(*layout)
    plain = engine.load_model(folder, expert_cache_slots=8)
    split = engine.load_model(folder, expert_cache_slots=8)
    executor = split.expert_executor
    executor.cpu_kernel = CpuExpertKernel(executor.cache.layout, "float32")  # on CUDA prepare() makes these
    executor.backend, executor.calibration = backend, Calibration(1e9, 1e9, 0.0, 1)  # hybrid: half the misses
    steps = GraphRunner(split, use_graphs=False)
    states = plain.new_state(30), split.new_state(30)
    prompt = torch.randint(2, 320, (9,), generator=torch.Generator().manual_seed(12))
    plain.forward(prompt, states[0])
    split.forward(prompt, states[1])
    before = executor.stats()
    token = _step_alongside(plain, steps, states, 4, 5)
    stats = executor.stats()
    assert stats["expert_backend"] == backend and stats["cpu_expert_calls"] > 0
    copied = stats["expert_bytes_copied"] - before["expert_bytes_copied"]
    if backend == "cpu":  # every miss on the CPU: decode copies nothing into the cache
        assert copied == 0 and stats["expert_cache_misses"] == before["expert_cache_misses"]
    else:
        assert copied > 0 and 0 < stats["cpu_expert_share"] < 1
    executor.backend = "offload"  # switched at run time (the benchmark does): the steps are remade without a share
    _step_alongside(plain, steps, states, token, 2)
    assert not executor.decode.with_cpu_share and executor.stats()["cpu_expert_calls"] == stats["cpu_expert_calls"]


HELPS = (1e9, 1e9, 0.0, 1)  # a calibration that gives the CPU half of a step's misses
USELESS_BUT_PAGEABLE = (1e9, 1e6, 0.0, 1, 1e9)  # one that gives it none, though the records are pageable
SLOW_PAGEABLE = (50e9, 5e9, 0.0, 1, 2e9)  # pinned copies would win, pageable ones are slow: the CPU helps
ALL = ("hybrid", "cpu", "offload")


@pytest.mark.parametrize(
    "calibration, fastest, timed, host_copies",
    [
        (HELPS, "hybrid", ALL, False),
        (HELPS, "cpu", ALL, False),
        (HELPS, "offload", ALL, False),
        (SLOW_PAGEABLE, "cpu", ALL, True),
        (USELESS_BUT_PAGEABLE, "cpu", ("cpu", "offload"), True),
        (USELESS_BUT_PAGEABLE, "offload", ("cpu", "offload"), False),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_auto_times_the_backends_that_can_win_and_keeps_the_fastest(
    tiny_checkpoint, monkeypatch, calibration, fastest, timed, host_copies
):
    """Where the CPU kernel is ready, auto's decode steps take turns under each candidate (a switch to or from
    offload remakes the steps, cpu and hybrid share theirs; the logits unchanged), timed on the executor's clock,
    and the fastest stays. The records here are pageable (nothing is pinned off CUDA): where the calibration
    gives the CPU nothing, cpu is still timed against offload. With `host_copies` the host copies every layer's
    misses and computes the CPU's share, as for pageable records on CUDA. A prompt between two steps is not a
    step's time."""
    from engine.experts.calibration import Calibration
    from engine.experts.policy import BackendTrial
    from engine.kernels.cpu_experts import CpuExpertKernel

    folder = tiny_checkpoint("qwen3_5_moe", "nvfp4")
    # unquantised KV: the CPU backends' sums differ from offload's in the last bits, which an FP8 cache's rounding
    # can turn into a whole e4m3 step of a key
    plain, auto = (engine.load_model(folder, expert_cache_slots=8, kv_cache_dtype="bf16") for _ in range(2))
    # the CPU share's sums vary from run to run in their last bits (its threads' order); through the bf16 KV
    # cache that has moved logits by 1.0e-5 of the largest here, so the steps are held to ten times that
    tolerance = 1e-4
    executor = auto.expert_executor
    assert not any(packed.pinned for packed in executor.packed.values())
    executor.cpu_kernel = CpuExpertKernel(executor.cache.layout, "float32")  # on CUDA prepare() makes these
    executor.calibration = Calibration(*calibration)
    executor.choose_backend("auto")
    assert executor.backend_trial.candidates == timed
    if host_copies:
        monkeypatch.setattr(executor, "copies_by_kernel", lambda layer: False)
    now, ran = [0.0], []

    def clock():  # called as a step begins: the step before it took 1 ms under the fastest backend, else 2 or 3
        ran.append(executor.backend)
        now[0] += 0.001 if executor.backend == fastest else 0.002 + 0.001 * (len(ran) % 2)
        return now[0]

    executor.clock = clock
    steps = GraphRunner(auto, use_graphs=False)
    states = plain.new_state(80), auto.new_state(80)
    prompt = torch.randint(2, 320, (9,), generator=torch.Generator().manual_seed(8))
    plain.forward(prompt, states[0])
    auto.forward(prompt, states[1])
    token = _step_alongside(plain, steps, states, 4, 5, tolerance)
    plain.forward(prompt[:3], states[0])
    auto.forward(prompt[:3], states[1])
    trial = executor.backend_trial
    token = _step_alongside(plain, steps, states, token, trial.steps - 4, tolerance)  # steps + 1 steps, steps - 1 timed
    assert trial.chosen is None  # a step short: the prompt broke one pair of steps
    assert set(ran) == set(timed) and len(ran) == trial.steps + 1 <= BackendTrial.STEPS + 1
    assert executor.stats()["cpu_expert_calls"] > 0
    _step_alongside(plain, steps, states, token, 3, tolerance)
    assert executor.backend == trial.chosen == fastest
    assert executor.decode.with_cpu_share == (fastest != "offload")
    every_layer = auto.config.num_hidden_layers  # every layer is MoE
    assert executor.decode.slots_on_device == (0 if host_copies else every_layer)
    seconds = executor.stats()["expert_backend_trial"]["step_seconds"]
    assert list(seconds) == list(timed) and seconds[fastest] == pytest.approx(0.001)
    assert all(seconds[other] >= 0.002 for other in timed if other != fastest)


def test_hybrid_s_balance_hears_only_its_own_steps(tiny_checkpoint):
    """cpu and hybrid share the step's graphs, and a step's waits for the CPU are read at the next one: the waits
    of a cpu step of auto's trial (the GPU waits for the CPU in most layers) must not move hybrid's split."""
    from engine.experts.calibration import Calibration
    from engine.kernels.cpu_experts import CpuExpertKernel

    folder = tiny_checkpoint("qwen3_5_moe", "nvfp4")
    plain, model = engine.load_model(folder, expert_cache_slots=8), engine.load_model(folder, expert_cache_slots=8)
    executor = model.expert_executor
    executor.cpu_kernel = CpuExpertKernel(executor.cache.layout, "float32")
    executor.backend, executor.calibration = "hybrid", Calibration(*HELPS)
    steps = GraphRunner(model, use_graphs=False)
    states = plain.new_state(30), model.new_state(30)
    prompt = torch.randint(2, 320, (9,), generator=torch.Generator().manual_seed(10))
    plain.forward(prompt, states[0])
    model.forward(prompt, states[1])
    token = _step_alongside(plain, steps, states, 4, 1)  # the first step makes hybrid's balance, and hears nothing
    heard = []
    update = executor.hybrid_balance.update
    executor.hybrid_balance.update = lambda waited, layers: heard.append(waited) or update(waited, layers)
    token = _step_alongside(plain, steps, states, token, 2)
    assert executor.decode.share_on_device and len(heard) == 2  # each hybrid step hears the one before it
    executor.backend = "cpu"
    token = _step_alongside(plain, steps, states, token, 3)
    executor.backend = "hybrid"
    _step_alongside(plain, steps, states, token, 2)  # the first hears the last cpu step's waits: not passed on
    assert len(heard) == 3


@pytest.mark.parametrize("calibration, calibrated", [(HELPS, "hybrid"), (USELESS_BUT_PAGEABLE, "offload")])
def test_a_failed_capture_hands_decode_to_the_plain_forward_and_ends_auto_s_trial(
    tiny_checkpoint, monkeypatch, calibration, calibrated
):
    """A step that cannot be captured: a warning, the plain forward takes that step and the rest with the same
    logits, and auto's trial, which only graphed steps can time, ends on the calibration's choice."""
    from engine.experts.calibration import Calibration
    from engine.kernels.cpu_experts import CpuExpertKernel

    folder = tiny_checkpoint("qwen3_5_moe", "nvfp4")
    plain, model = engine.load_model(folder, expert_cache_slots=8), engine.load_model(folder, expert_cache_slots=8)
    executor = model.expert_executor
    executor.cpu_kernel = CpuExpertKernel(executor.cache.layout, "float32")
    executor.calibration = Calibration(*calibration)
    executor.choose_backend("auto")
    model.decode_runner = GraphRunner(model, use_graphs=False)  # on CUDA the model makes them
    states = plain.new_state(30), model.new_state(30)
    prompt = torch.randint(2, 320, (9,), generator=torch.Generator().manual_seed(6))
    plain.forward(prompt, states[0])
    model.forward(prompt, states[1])

    def fail(token, state):
        raise GraphCaptureError("an op that cannot be captured")

    token = 5
    for step in range(4):
        if step == 2:
            assert executor.stats()["expert_backend_trial"]["chosen"] is None
            monkeypatch.setattr(model.decode_runner, "step", fail)
        expected = plain.forward([token], states[0])
        with pytest.warns(RuntimeWarning, match="without CUDA graphs") if step == 2 else contextlib.nullcontext():
            got = model.forward([token], states[1])
        assert torch.allclose(got, expected, rtol=0, atol=1e-5 * float(expected.abs().max()))
        token = int(expected.argmax())
    assert model.decode_runner is None and executor.backend == calibrated
    assert "expert_backend_trial" not in executor.stats()


@pytest.mark.parametrize("backend", ["offload", "cpu", "hybrid"])
def test_a_layer_the_host_copies_keeps_every_slot_choice_on_the_host(tiny_checkpoint, monkeypatch, backend):
    """Records beyond the pin budget are copied by the host, which then chooses their slots; the device table
    and the host's bookkeeping cannot both be the truth in one step, so no layer chooses on the device. The CPU's
    share (cpu, hybrid) is then fetched and computed by the host after each router too (as on Windows, without
    Triton), with the same logits."""
    from engine.experts.calibration import Calibration
    from engine.kernels.cpu_experts import CpuExpertKernel

    folder = tiny_checkpoint("qwen3_5_moe", "nvfp4")
    plain = engine.load_model(folder, expert_cache_slots=8)
    mixed = engine.load_model(folder, expert_cache_slots=8)
    executor = mixed.expert_executor
    if backend != "offload":
        executor.cpu_kernel = CpuExpertKernel(executor.cache.layout, "float32")
        executor.backend, executor.calibration = backend, Calibration(1e9, 1e9, 0.0, 1)
    first_moe = next(layer.index for layer in mixed.layers if hasattr(layer.mlp, "route"))
    monkeypatch.setattr(executor, "copies_by_kernel", lambda layer: layer != first_moe)
    steps = GraphRunner(mixed, use_graphs=False)
    states = plain.new_state(30), mixed.new_state(30)
    prompt = torch.randint(2, 320, (9,), generator=torch.Generator().manual_seed(3))
    plain.forward(prompt, states[0])
    mixed.forward(prompt, states[1])
    _step_alongside(plain, steps, states, 5, 4)
    layers = mixed.config.num_hidden_layers
    assert executor.decode.slots_on_device == 0
    assert first_moe not in executor.decode.gathered and len(executor.decode.gathered) == layers - 1
    if backend != "offload":
        assert not executor.decode.share_on_device
        assert executor.stats()["cpu_expert_calls"] > 0
    else:
        a, b = plain.expert_executor.stats(), executor.stats()
        assert (a["expert_cache_hits"], a["expert_cache_misses"]) == (b["expert_cache_hits"], b["expert_cache_misses"])
    # each MoE layer: the ids' mark before its shared expert, the fetch, then (cpu, hybrid) the CPU's share
    assert len(_cuts(mixed, mixed.new_state(30))) == layers * (2 if backend == "offload" else 3)


def test_the_slot_tables_clock_is_renumbered_before_it_runs_out(tiny_checkpoint, monkeypatch):
    """The slot table's ages are int32 ticks, one per lookup; long decoding with no prompt between would run them
    out, so before a step could, the ages are renumbered in their order, changing no choice."""
    from engine.kernels import slot_table

    folder = tiny_checkpoint("qwen3_5_moe", "nvfp4")
    plain, segmented = engine.load_model(folder, expert_cache_slots=8), engine.load_model(folder, expert_cache_slots=8)
    steps = GraphRunner(segmented, use_graphs=False)
    states = plain.new_state(40), segmented.new_state(40)
    prompt = torch.randint(2, 320, (7,), generator=torch.Generator().manual_seed(4))
    plain.forward(prompt, states[0])
    segmented.forward(prompt, states[1])
    cache = segmented.expert_executor.cache
    step_lookups = segmented.config.num_hidden_layers * segmented.config.num_experts_per_tok
    ticks = cache.slots + 3 * step_lookups  # room for three steps
    monkeypatch.setattr(slot_table, "TICKS", ticks)
    renumbered = []
    reserve = slot_table.SlotTable.reserve

    def recording_reserve(table, count):
        before = int(table.clock[0])
        reserve(table, count)
        if table is cache.table:  # not the plain model's, which renumbers on the host
            renumbered.append(int(table.clock[0]) != before)

    monkeypatch.setattr(slot_table.SlotTable, "reserve", recording_reserve)
    token = 7
    for _ in range(7):
        token = _step_alongside(plain, steps, states, token, 1)
        assert int(cache.device_table()["clock"][0]) <= ticks  # 7 steps' lookups would pass it unrenumbered
    assert sum(renumbered) >= 2
    a, b = plain.expert_executor.stats(), segmented.expert_executor.stats()
    assert (a["expert_cache_hits"], a["expert_cache_misses"]) == (b["expert_cache_hits"], b["expert_cache_misses"])


def test_a_failed_cpu_share_ends_the_step_in_a_plain_error_and_the_next_conversation_works(
    tiny_checkpoint, monkeypatch
):
    """The CPU threads fail mid-step: the GPU's waits are released (no hang), the step says what happened and what
    to do, and the mailbox is ready for the next step."""
    from engine.experts.calibration import Calibration
    from engine.kernels import cpu_share
    from engine.kernels.cpu_experts import CpuExpertKernel

    folder = tiny_checkpoint("qwen3_5_moe", "nvfp4")
    plain, split = engine.load_model(folder, expert_cache_slots=8), engine.load_model(folder, expert_cache_slots=8)
    executor = split.expert_executor
    executor.cpu_kernel = CpuExpertKernel(executor.cache.layout, "float32")
    executor.backend, executor.calibration = "cpu", Calibration(1e9, 1e9, 0.0, 1)
    steps = GraphRunner(split, use_graphs=False)
    prompt = torch.randint(2, 320, (9,), generator=torch.Generator().manual_seed(8))
    state = split.new_state(30)
    split.forward(prompt, state)
    steps.step(4, state)
    working = cpu_share._serve_step

    def broken(*args):
        raise RuntimeError("a thread died")

    monkeypatch.setattr(cpu_share, "_serve_step", broken)
    with pytest.raises(cpu_share.CpuShareError, match="a thread died.*offload expert backend"):
        steps.step(5, state)
    assert executor.decode.share.mailbox.flags[cpu_share.CANCEL] == 0  # cleared for the next step
    monkeypatch.setattr(cpu_share, "_serve_step", working)
    states = plain.new_state(30), split.new_state(30)
    plain.forward(prompt, states[0])
    split.forward(prompt, states[1])
    _step_alongside(plain, steps, states, 4, 3)


class _FakeCapture:
    """torch.cuda.graph for the CPU: the captured work runs once, as it is captured; its graph's replay is only
    logged. What it checks is the runner's order of graphs and host actions, not the logits."""

    def __init__(self, graph, log, fail_at=None, **kwargs):
        self.graph, self.log, self.fail_at = graph, log, fail_at

    def __enter__(self):
        self.log.append("begin")

    def __exit__(self, *error):
        self.log.append("end")
        if self.log.count("end") == self.fail_at:
            raise RuntimeError("operation not permitted when stream is capturing")


def _fake_graphs(monkeypatch, log, fail_at=None):
    class FakeGraph:
        def replay(self):
            log.append("replay")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, **kwargs: _FakeCapture(graph, log, fail_at))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)


def test_a_captured_step_is_graphs_cut_at_the_host_actions_and_replayed_in_order(tiny_checkpoint, monkeypatch):
    """Where the host copies every layer's misses, each MoE layer cuts the capture twice (the ids' mark before
    the shared expert, the fetch), and attention once where the device has no kernel that reads the length
    (the CPU): one graph more than cuts, replayed in the step's order with the host actions between them, and
    each layer's slots released right after the graph that reads them."""
    model = engine.load_model(tiny_checkpoint("qwen3_5_moe", "nvfp4"), expert_cache_slots=8)
    executor = model.expert_executor
    monkeypatch.setattr(executor, "copies_by_kernel", lambda layer: False)
    log = []
    _fake_graphs(monkeypatch, log)
    fetch, release = executor.fetch_for_step, executor.cache.release
    monkeypatch.setattr(executor, "fetch_for_step", lambda *args: log.append("fetch") or fetch(*args))
    monkeypatch.setattr(executor.cache, "release", lambda slots: log.append("release") or release(slots))
    runner = GraphRunner(model)
    runner._warm = True  # on CUDA the first step, run eagerly, makes it so
    state = model.new_state(30)
    model.forward([3, 4, 5], state)
    log.clear()  # the prompt's own releases
    runner.step(6, state)
    expected, released = [], []  # each graph's replay, then what ran after it; the release waits for its graph
    for kind in model.config.layer_types:
        cuts = ["attention"] * (kind == "full_attention") + ["ids", "fetch"]
        for cut in cuts:
            expected += ["replay", *released, *(["fetch"] if cut == "fetch" else [])]
            released = []
        released = ["release"]
    expected += ["replay", *released]
    assert len(runner.graphs) == expected.count("replay") and runner.state is state
    assert log == ["begin", "end"] * len(runner.graphs) + expected  # captured (no host action), then replayed
    log.clear()
    runner.step(7, state)
    assert log == expected
    assert state.position == 5
    assert all(s.length == 5 for s in state.layers if hasattr(s, "keys"))  # at_end moved the KV lengths on


def test_a_capture_that_fails_part_way_says_so_and_keeps_nothing(tiny_checkpoint, monkeypatch):
    model = engine.load_model(tiny_checkpoint("qwen3_5_moe", "nvfp4"), expert_cache_slots=8)
    monkeypatch.setattr(model.expert_executor, "copies_by_kernel", lambda layer: False)
    _fake_graphs(monkeypatch, [], fail_at=3)
    runner = GraphRunner(model)
    runner._warm = True
    state = model.new_state(30)
    with pytest.raises(GraphCaptureError, match="not permitted when stream is capturing"):
        runner.step(6, state)
    assert not runner.graphs and runner.state is None and state.position == 0
