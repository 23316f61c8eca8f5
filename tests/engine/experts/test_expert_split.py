"""The offload/cpu/hybrid split of a decode step's misses and of prompt chunks, and the per-machine calibration
file."""

import json

import pytest
import torch

from engine.experts import calibration as machine_calibration
from engine.experts.calibration import Calibration
from engine.experts.policy import BackendTrial, cpu_faster_for_chunk, cpu_share, resolve, trial_candidates

RECORD = 1_000_000  # bytes of one expert record


def test_backends_that_do_not_split():
    calibration = Calibration(50e9, 20e9, 0.0, 16)
    assert cpu_share(8, "offload", calibration, RECORD) == 0
    assert cpu_share(8, "gpu", calibration, RECORD) == 0
    assert cpu_share(8, "cpu", None, RECORD) == 8
    assert cpu_share(0, "hybrid", calibration, RECORD) == 0


@pytest.mark.parametrize(
    "pcie, cpu, call, misses, expected",
    [
        (50e9, 50e9, 0.0, 8, 4),  # equal paths: half each
        (50e9, 25e9, 0.0, 9, 3),  # the CPU at half the speed takes a third
        (10e9, 40e9, 0.0, 10, 8),  # a laptop's narrow link: the CPU takes most
        (50e9, 1e9, 0.0, 8, 0),  # a CPU far slower than one copy takes none
        (50e9, 50e9, 60e-6, 8, 2),  # a call's own cost: the CPU takes fewer (ties go to the copies)
        (50e9, 50e9, 200e-6, 8, 0),  # a call costing more than the copies it saves: none
    ],
)
def test_hybrid_balances_the_two_finishing_times(pcie, cpu, call, misses, expected):
    calibration = Calibration(pcie, cpu, call, 4)
    m = cpu_share(misses, "hybrid", calibration, RECORD)
    assert m == expected

    def finish(k):
        return max((misses - k) * RECORD / pcie, call + k * RECORD / cpu if k else 0.0)

    assert all(finish(m) <= finish(other) for other in range(misses + 1))


def test_auto_takes_hybrid_only_when_the_cpu_would_help():
    assert resolve("auto", Calibration(50e9, 30e9, 0.0, 16), RECORD) == "hybrid"
    assert resolve("auto", Calibration(50e9, 1e9, 0.0, 16), RECORD) == "offload"
    assert resolve("auto", Calibration(50e9, 30e9, 1e-3, 16), RECORD) == "offload"  # calls too dear
    assert resolve("auto", None, RECORD) == "offload"
    assert resolve("cpu", None, RECORD) == "cpu"


def test_auto_takes_gpu_where_the_cache_holds_every_layer():
    """Nothing misses once the cache is warm: gpu, untried (under cpu the cache would never warm)."""
    helps = Calibration(50e9, 30e9, 0.0, 16, 2e9)
    assert resolve("auto", helps, RECORD, all_pinned=False, all_resident=True) == "gpu"
    assert trial_candidates(helps, RECORD, all_pinned=False, all_resident=True) == ()
    assert resolve("offload", helps, RECORD, all_resident=True) == "offload"  # asked for: as asked


def test_an_executor_whose_cache_holds_every_layer_runs_auto_as_gpu_untried(tiny_checkpoint):
    import engine
    from engine.kernels.cpu_experts import CpuExpertKernel

    folder = tiny_checkpoint("qwen3_5_moe", "nvfp4")
    layers = engine.load_model(folder, expert_cache_slots=8).config.num_hidden_layers
    for slots, backend, trial in ((8 * layers, "gpu", False), (8 * (layers - 1), "hybrid", True)):
        executor = engine.load_model(folder, expert_cache_slots=slots).expert_executor
        executor.cpu_kernel = CpuExpertKernel(executor.cache.layout, "float32")  # on CUDA prepare() makes these
        executor.calibration = Calibration(1e9, 1e9, 0.0, 1)  # the CPU would help
        executor.choose_backend("auto")
        assert executor._calibrated_backend == backend and (executor.backend_trial is not None) == trial
        assert executor.backend == ("hybrid" if trial else "gpu")  # a trial starts on its first candidate


def test_the_trial_s_candidates_are_the_backends_that_can_win_here():
    helps, useless = Calibration(50e9, 30e9, 0.0, 16), Calibration(50e9, 1e9, 0.0, 16, 15e9)
    assert trial_candidates(helps, RECORD) == ("hybrid", "cpu", "offload")
    assert trial_candidates(useless, RECORD) == ()  # pinned copies win by the calibration: offload, untried
    assert resolve("auto", useless, RECORD) == "offload"
    assert trial_candidates(None, RECORD, all_pinned=False) == ()  # nothing measured: no CPU kernel either


def test_pageable_records_put_cpu_on_trial_even_where_the_calibration_gives_it_nothing():
    """Records that could not be pinned (WSL2; pin budget 0): decode's pageable copies can run far below the
    calibration's rate, so cpu is timed against offload even where the calibration gives the CPU no miss (hybrid
    would split as offload does), and with all three where a slow pageable copy makes the CPU help."""
    useless = Calibration(50e9, 1e9, 0.0, 16, 15e9)
    assert not cpu_share(8, "hybrid", useless, RECORD, pinned=False)
    assert resolve("auto", useless, RECORD, all_pinned=False) == "offload"  # what stands if nothing is timed
    assert trial_candidates(useless, RECORD, all_pinned=False) == ("cpu", "offload")
    slow_pageable = Calibration(50e9, 10e9, 1e-4, 8, 2e9)
    assert resolve("auto", slow_pageable, RECORD) == "offload"  # pinned, the copies would win
    assert resolve("auto", slow_pageable, RECORD, all_pinned=False) == "hybrid"
    assert trial_candidates(slow_pageable, RECORD, all_pinned=False) == ("hybrid", "cpu", "offload")


@pytest.mark.parametrize("fastest", ["hybrid", "cpu", "offload"])
def test_auto_s_trial_takes_turns_and_keeps_the_shortest_median_step(fastest):
    candidates = ("hybrid", "cpu", "offload")
    trial = BackendTrial(candidates)
    ran = []
    for step in range(trial.steps):
        ran.append(trial.backend)
        slow = step == BackendTrial.SETTLE + 1  # an outlier (a collection, another program) in the first window
        trial.record(0.5 if slow else 0.010 if trial.backend == fastest else 0.012 + 0.001 * (len(ran) % 3))
    window = BackendTrial.WINDOW
    assert trial.steps == BackendTrial.STEPS  # three candidates: the longest trial, which bench.py leaves untimed
    assert ran == [backend for backend in candidates for _ in range(window)] * BackendTrial.ROUNDS
    counted = BackendTrial.ROUNDS * (window - BackendTrial.SETTLE)  # a window's first steps capture graphs again
    assert [len(trial.seconds[b]) for b in candidates] == [counted] * 3
    assert trial.chosen == trial.backend == fastest  # the median, not the mean, which the outlier would sway
    assert list(trial.to_dict()["step_seconds"]) == list(candidates)
    assert trial.to_dict()["chosen"] == fastest and trial.to_dict()["step_seconds"][fastest] == 0.010
    trial.record(0.001)  # chosen: later steps change nothing
    assert trial.backend == fastest and len(trial.seconds[fastest]) == counted


def test_a_trial_of_two_is_shorter_and_a_trial_of_one_is_refused():
    trial = BackendTrial(("cpu", "offload"))
    assert trial.steps == 2 * BackendTrial.WINDOW * BackendTrial.ROUNDS < BackendTrial.STEPS
    assert trial.to_dict() == {"chosen": None, "step_seconds": {"cpu": None, "offload": None}}
    for _ in range(trial.steps):
        trial.record(0.02 if trial.backend == "offload" else 0.01)
    assert trial.chosen == "cpu"
    with pytest.raises(ValueError, match="two or three"):
        BackendTrial(("offload",))


def test_calibration_is_measured_once_per_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEDESK_MODELS_DIR", str(tmp_path / "models"))
    measured = []

    def measure():
        measured.append(1)
        return Calibration(40e9, 20e9, 1e-5, 8)

    first = machine_calibration.cached_calibration("machine a", measure)
    again = machine_calibration.cached_calibration("machine a", measure)
    other = machine_calibration.cached_calibration("machine b", measure)
    assert first == again == other == Calibration(40e9, 20e9, 1e-5, 8)
    assert len(measured) == 2  # machine a once, machine b once
    assert machine_calibration.calibration_file() == tmp_path / "calibration.json"
    machine_calibration.calibration_file().write_text("not json", encoding="utf-8")
    assert machine_calibration.cached_calibration("machine a", measure) == first  # a damaged file is measured again
    assert len(measured) == 3


def test_an_implausible_calibration_is_neither_kept_nor_trusted_from_the_file(tmp_path, monkeypatch):
    """A measurement on a busy machine (the H200 machine once gave 1.8e15 B/s and 6.5 ms a call) is used for the
    run it was made in but not saved, and one found in the file is measured again."""
    monkeypatch.setenv("MOEDESK_MODELS_DIR", str(tmp_path / "models"))
    busy, sane = Calibration(47e9, 1.8e15, 0.0065, 16), Calibration(47e9, 28e9, 5e-4, 16)
    assert not busy.plausible() and sane.plausible()
    results = [busy, sane]
    assert machine_calibration.cached_calibration("machine", lambda: results.pop(0)) == busy
    assert (
        machine_calibration.cached_calibration("machine", lambda: results.pop(0)) == sane
    )  # nothing saved: measured again
    assert machine_calibration.cached_calibration("machine", lambda: pytest.fail("measured a third time")) == sane
    machine_calibration.calibration_file().write_text(json.dumps({"machine": busy.to_dict()}), encoding="utf-8")
    assert machine_calibration.cached_calibration("machine", lambda: sane) == sane


def test_calibration_measures_the_cpu_again_when_the_figures_cannot_be_real():
    """The CPU's time per call and per expert come from calls of 1 and of 8 experts, the time of a further token
    from the 8 experts chosen by 8 tokens each; a run where 8 cost no more than 1 (a busy machine) is measured
    again."""
    measured = []

    def cpu_seconds(calls, per_call, tokens):
        measured.append((per_call, tokens))
        if len(measured) <= 10:  # the two warm-ups, then a first attempt on a busy machine: 10 ms whatever the work
            return calls * 0.010
        # then 0.2 ms a call, 0.8 ms an expert, 0.1 ms each further token of an expert
        return calls * (0.0002 + per_call * (0.0008 + (tokens - 1) * 0.0001))

    calibration = machine_calibration.calibrate_cpu(47e9, 1_769_472, cpu_seconds, 15e9)  # one NVFP4 expert of Qwen3.6
    assert calibration.plausible() and len(measured) == 18
    assert calibration.cpu_bytes_per_s == pytest.approx(1_769_472 / 0.0008)
    assert calibration.cpu_call_seconds == pytest.approx(0.0002) and calibration.pageable_bytes_per_s == 15e9
    assert calibration.cpu_token_seconds == pytest.approx(0.0001)


def test_misses_of_a_layer_beyond_the_pin_budget_go_more_to_the_cpu():
    """Unpinned records cross PCIe 3-4x slower (15 against 54 GB/s on the H200 machine), so the split gives the
    CPU more of such a layer's misses, and auto takes hybrid when some layers are unpinned even where pinned
    copies alone would not make the CPU worth a call."""
    calibration = Calibration(50e9, 10e9, 1e-4, 8, 15e9)
    pinned, pageable = (cpu_share(8, "hybrid", calibration, RECORD, pinned=p) for p in (True, False))
    assert pageable > pinned

    def finish(k):  # the later of the CPU's call and the unpinned copies of the rest
        return max((8 - k) * RECORD / 15e9, 1e-4 + k * RECORD / 10e9 if k else 0.0)

    assert finish(pageable) == pytest.approx(min(finish(k) for k in range(9)))
    dear_calls = Calibration(50e9, 10e9, 3e-4, 8, 15e9)
    assert resolve("auto", dear_calls, RECORD) == "offload"
    assert resolve("auto", dear_calls, RECORD, all_pinned=False) == "hybrid"
    assert cpu_share(8, "hybrid", Calibration(50e9, 10e9, 1e-4, 8), RECORD, pinned=False) == pinned  # not measured


def test_a_short_chunk_goes_to_the_cpu_when_it_beats_the_copies():
    calibration = Calibration(10e9, 20e9, 1e-4, 8)  # a narrow link (a laptop's): the CPU is the faster path
    few = [2, 1, 0, 3]  # tokens per expert of a short chunk
    assert cpu_faster_for_chunk(calibration, few, RECORD, 3 * RECORD, pinned=True)
    assert not cpu_faster_for_chunk(calibration, few, RECORD, 0, pinned=True)  # already on the GPU
    assert not cpu_faster_for_chunk(Calibration(50e9, 5e9, 1e-4, 8), few, RECORD, 3 * RECORD, pinned=True)
    many = [64] * 4  # a long chunk: the multiply-adds of its tokens outweigh one copy of each expert
    assert not cpu_faster_for_chunk(calibration, many, RECORD, 4 * RECORD, pinned=True)


def test_the_measured_cost_of_a_further_token_decides_a_chunk():
    """A chunk's experts on the CPU cost one token's time plus the calibrated time of each further token: where
    the kernel's further tokens are dear (the H200 machine's: prefill fell from 372 to 85 tok/s when a quarter
    of the one-token time was assumed), the copies win."""
    tokens = [4] * 8  # a 128-token chunk spread over a layer's experts: a few tokens each
    cheap = Calibration(20e9, 70e9, 1e-4, 16, None, 0.25 * RECORD / 70e9)
    dear = Calibration(20e9, 70e9, 1e-4, 16, None, 2.0 * RECORD / 70e9)
    assert cpu_faster_for_chunk(cheap, tokens, RECORD, 8 * RECORD, pinned=True)
    assert not cpu_faster_for_chunk(dear, tokens, RECORD, 8 * RECORD, pinned=True)


@pytest.mark.parametrize("cpu_bytes_per_s, on_cpu", [(1e12, True), (1e7, False)])
def test_prompt_chunks_computed_on_the_cpu_give_the_same_logits(tiny_checkpoint, cpu_bytes_per_s, on_cpu):
    """cpu and hybrid backends: a chunk whose experts the CPU computes sooner than they would be copied is computed
    by the CPU expert kernel from the host records, with nothing copied; the logits are the GPU path's."""
    import engine
    from engine.kernels.cpu_experts import CpuExpertKernel

    folder = tiny_checkpoint("qwen3_5_moe", "nvfp4")
    plain, split_model = (
        engine.load_model(folder, expert_cache_slots=8),
        engine.load_model(folder, expert_cache_slots=8),
    )
    executor = split_model.expert_executor
    executor.cpu_kernel = CpuExpertKernel(executor.cache.layout, "float32")  # on CUDA prepare() makes these
    executor.backend, executor.calibration = "hybrid", Calibration(1e9, cpu_bytes_per_s, 0.0, 1)
    prompt = torch.randint(2, 320, (6,), generator=torch.Generator().manual_seed(8))
    expected = plain.forward(prompt, plain.new_state(16))
    got = split_model.forward(prompt, split_model.new_state(16))
    assert torch.allclose(got, expected, rtol=0, atol=1e-5 * float(expected.abs().max()))
    stats = executor.stats()
    assert (stats["cpu_expert_calls"] > 0) == on_cpu and (stats["expert_bytes_copied"] == 0) == on_cpu


def test_the_calibrations_cpu_calls_never_read_a_record_twice(tiny_checkpoint):
    """A record read twice can come from the CPU's cache (the H200 machine's 300 MB L3 made 35 GB/s look like 70):
    the calibration's calls walk every layer's records, each (layer, expert) once until all were read."""
    import engine
    from engine.kernels.cpu_experts import CpuExpertKernel

    model = engine.load_model(tiny_checkpoint("qwen3_5_moe", "nvfp4"), expert_cache_slots=8)
    executor = model.expert_executor
    executor.cpu_kernel = CpuExpertKernel(executor.cache.layout, "float32")
    layer_of = {packed.records.data_ptr(): layer for layer, packed in executor.packed.items()}
    read = []

    def run(records, x, ids, weights, on_cpu):
        assert x.shape[0] == ids.shape[0] and bool(on_cpu.all())
        read.extend((layer_of[records.data_ptr()], int(e)) for e in ids[0])
        return torch.zeros(x.shape[0], executor.cpu_kernel.hidden)

    executor.cpu_kernel.run = run
    experts = next(iter(executor.packed.values())).records.shape[0]
    total = len(executor.packed) * experts
    calls = total // 2
    assert executor._cpu_seconds(calls, 2, 3) >= 0
    assert len(read) == total and len(set(read)) == total


def test_hybrid_balance_gives_the_cpu_less_when_the_gpu_waits_and_more_when_it_does_not():
    from engine.experts.policy import HybridBalance

    notch = HybridBalance.NOTCH
    balance = HybridBalance(0.5)
    assert balance.counts(8) == [0, 1, 1, 2, 2, 3, 3, 4, 4]  # halves rounded up: a lone miss goes to the CPU
    balance.update(waited=30, layers=40)  # the GPU waited in most layers: the CPU is the slower path
    assert balance.fraction == pytest.approx(0.5 - notch)
    balance.update(waited=2, layers=40)  # it hardly waited: the copies are; a move back starts small
    assert balance.fraction == pytest.approx(0.5)
    balance.update(waited=2, layers=40)  # the same way again: twice the move
    assert balance.fraction == pytest.approx(0.5 + 2 * notch)
    balance.update(waited=12, layers=40)  # between: held, and the next move starts small
    assert balance.fraction == pytest.approx(0.5 + 2 * notch)
    balance.update(waited=2, layers=40)
    assert balance.fraction == pytest.approx(0.5 + 3 * notch)
    balance.update(waited=0, layers=0)  # all hits: nothing learnt
    assert balance.fraction == pytest.approx(0.5 + 3 * notch)


def test_hybrid_balance_leaves_a_far_start_in_a_few_steps_and_stays_within_bounds():
    from engine.experts.policy import HybridBalance

    balance = HybridBalance(0.25)
    steps = 0
    while balance.fraction < 1.0:  # the CPU never kept the GPU waiting: all its misses go to the CPU
        balance.update(waited=0, layers=40)
        steps += 1
    assert steps <= 9 and balance.notch == HybridBalance.LARGEST_NOTCH  # 24 at the smallest notch
    assert balance.counts(8) == list(range(9)) == [cpu_share(m, "cpu", None, RECORD) for m in range(9)]  # = cpu
    for _ in range(100):
        balance.update(waited=40, layers=40)
    assert balance.fraction == 0.0 and balance.counts(8) == [0] * 9
    balance.update(waited=0, layers=0)  # from nothing it tries again, a small step
    assert balance.fraction == HybridBalance.NOTCH


def test_hybrid_s_policy_balances_from_the_calibration_once_a_step_made_its_split():
    from engine.experts.policy import HybridBalance, policy_for

    calibration = Calibration(1e9, 1e9, 0.0, 1)  # half of a token's misses to the CPU
    policy = policy_for("hybrid")
    policy.hear(8, 8)  # no device-split step yet: nothing to move
    assert policy.balance is None
    assert policy.cpu_counts(8, calibration, RECORD) == HybridBalance(0.5).counts(8)
    policy.hear(8, 8)  # the GPU waited in every layer: the CPU gets less
    assert policy.balance.fraction < 0.5
    assert policy_for("cpu").cpu_counts(4, None, RECORD) == [0, 1, 2, 3, 4]
    assert policy_for("offload").cpu_counts(4, calibration, RECORD) == [0] * 5
    with pytest.raises(ValueError, match="resolve it first"):
        policy_for("auto")
