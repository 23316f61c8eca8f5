"""The emulated narrow host->GPU link (engine/experts/link.py, `bench --link-gbps`): its arithmetic on a fake
clock, the copies it holds still happening byte for byte, the split's calibration seeing the held rate, and
the bench's checks of the flag. The CUDA kernels that hold the streams are compiled by test_triton_compile.py
and timed by gpu_tests/engine/experts/test_link_limit.py."""

import pytest
import torch

import engine
from engine.experts.calibration import Calibration
from engine.experts.link import LinkLimit, LinkLimitError, LinkThrottle, copied_records
from engine.experts.policy import resolve
from engine.runtime.graph_runner import GraphRunner


class FakeClock:
    """Nanoseconds that move only when a copy is said to take time or the throttle sleeps."""

    def __init__(self):
        self.now, self.slept = 0, []

    def clock_ns(self):
        return self.now

    def sleep(self, seconds):
        self.slept.append(seconds)
        self.now += round(seconds * 1e9)


def throttle(bytes_per_s, clock):
    return LinkThrottle(LinkLimit(bytes_per_s), "cpu", clock.clock_ns, clock.sleep)


def test_a_run_of_copies_is_held_for_its_bytes_over_the_link_less_the_time_it_took():
    clock = FakeClock()
    link = throttle(1e9, clock)
    link.start()
    clock.now += 200_000  # 1 MB copied at 5 GB/s
    link.hold(1_000_000)  # 1 ms at 1 GB/s: the stream waits the other 0.8
    assert clock.slept == [pytest.approx(0.0008)] and clock.now == 1_000_000
    link.start()
    clock.now += 3_000_000  # a copy slower than the link: held no further
    link.hold(1_000_000)
    assert len(clock.slept) == 1


def test_a_gather_is_held_for_the_records_its_table_copies():
    clock = FakeClock()
    link = throttle(2e9, clock)
    table = torch.tensor([[4, 0], [-1, 1], [7, 2], [-1, -1]], dtype=torch.int32)
    assert copied_records(table) == 2
    link.start()
    link.hold_records(table, 1_000_000)  # two 1 MB records at 2 GB/s
    assert clock.slept == [pytest.approx(0.001)]


@pytest.mark.parametrize("bytes_per_s", [0.0, -1.0, float("nan"), float("inf")])
def test_a_limit_that_is_no_rate_is_refused(bytes_per_s):
    with pytest.raises(LinkLimitError, match="positive number of bytes per second"):
        LinkLimit(bytes_per_s)


def test_a_limit_must_be_below_the_measured_link():
    LinkLimit(6.5e9).check_below(7e9, "pinned")
    with pytest.raises(LinkLimitError, match="not below this machine's measured pageable host->GPU rate of 5.0 GB/s"):
        LinkLimit(6.5e9).check_below(5e9, "pageable")
    assert LinkLimit(6.5e9).through(50e9) == 6.5e9 and LinkLimit(6.5e9).through(3e9) == 3e9


def test_held_copies_still_happen_and_the_held_time_is_their_bytes_over_the_link(tiny_checkpoint):
    """Prefill (whole layers streamed, misses fetched) and graph-cut decode steps (misses gathered from a table)
    under a 1 GB/s link: the same logits and bytes copied as without it, and with copies that take no time on
    the fake clock, the time held is every copied byte over the link."""
    folder = tiny_checkpoint("qwen3_5_moe", "nvfp4")
    plain, held = (engine.load_model(folder, expert_cache_slots=8) for _ in range(2))
    clock = FakeClock()
    executor = held.expert_executor
    executor.cache._link, executor._gather_link = throttle(1e9, clock), throttle(1e9, clock)  # as prepare() makes them
    prompt = torch.randint(2, 320, (6,), generator=torch.Generator().manual_seed(3))
    for model in (plain, held):
        state = model.new_state(16)
        model.forward(prompt, state)
        steps = GraphRunner(model, use_graphs=False)
        for token in (5, 9, 14):
            model.last_logits = steps.step(token, state)
    assert torch.allclose(held.last_logits, plain.last_logits, rtol=0, atol=1e-5 * float(plain.last_logits.abs().max()))
    copied = executor.stats()["expert_bytes_copied"]
    assert copied == plain.expert_executor.stats()["expert_bytes_copied"] > 0
    assert sum(clock.slept) == pytest.approx(copied / 1e9, rel=1e-3)


def test_the_splits_calibration_sees_the_held_link(monkeypatch, tiny_checkpoint):
    """Measured on a fast link the CPU would not help, so auto would offload; held to a laptop's link the
    copies are slower than the CPU, and auto splits."""
    import engine.experts.cached_executor as executor_module

    measured = Calibration(50e9, 2e9, 1e-5, 8, 20e9)
    record = 2_000_000
    assert resolve("auto", measured, record) == "offload"
    held = measured.through_link(6.5e9)
    assert (held.pcie_bytes_per_s, held.pageable_bytes_per_s) == (6.5e9, 6.5e9)
    assert (held.cpu_bytes_per_s, held.cpu_call_seconds) == (2e9, 1e-5)
    assert measured.through_link(None) == measured
    assert resolve("auto", held, record) == "hybrid"
    executor = engine.load_model(tiny_checkpoint("qwen3_5_moe", "nvfp4"), expert_cache_slots=8).expert_executor
    monkeypatch.setattr(executor_module, "cached_calibration", lambda key, measure: measured)
    executor.link = LinkLimit(6.5e9)
    executor._prepare_cpu(executor.cache.layout, torch.float32)  # on CUDA prepare() runs it
    assert executor.calibration == held
