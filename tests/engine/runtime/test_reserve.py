"""The runtime reserve measured on the GPU, with CUDA's and NVML's answers stood in for (no GPU here; gpu_tests/
measures it for real): the arithmetic, the cache file and its key, the fallback on a reading that cannot be right,
and the plan saying where its reserve came from."""

import json
from types import SimpleNamespace

import pytest
import torch

from engine.runtime import placement, reserve, vram
from engine.runtime.footprint import footprint_from_synthetic
from engine.runtime.planner import (
    DECODE_GRAPH_EXEC_BYTES,
    DEFAULT_RESERVE_SOURCE,
    DEFAULT_RUNTIME_RESERVE_BYTES,
    GIB,
    MIB,
    RESERVE_INSIDE_ALLOCATOR_BYTES,
    cublas_workspaces_bytes,
    plan_memory,
    runtime_reserve_bytes,
)

GPU = SimpleNamespace(
    name="NVIDIA Test 4GB",
    uuid="5a1e-0001",
    total_memory=4 * GIB,
    multi_processor_count=20,
    max_threads_per_multi_processor=1536,
    major=8,
)
FORMULA = runtime_reserve_bytes(20, 1536)
FORMULA_OUTSIDE = FORMULA - RESERVE_INSIDE_ALLOCATOR_BYTES - cublas_workspaces_bytes(8)
WORKSPACES = 16 * MIB  # what the fake run leaves allocated inside the allocator, as cuBLAS's workspaces


class FakeCard:
    """One GPU as torch.cuda and NVML see it: memory this process holds outside and inside the allocator, other
    programs' memory, and whether CUDA has started. The tiny model's run only moves the outside part."""

    def __init__(self, monkeypatch, others=300 * MIB, nvml=True):
        self.others, self.nvml, self.started = others, nvml, False
        self.outside, self.allocator, self.allocated = 0, 0, 0
        self.after_work = 500 * MIB  # what the process holds outside the allocator once the tiny model ran
        self.drift = []  # added to other programs' memory at each reading, to mimic one allocating meanwhile
        self.runs = 0
        self.driver = "570.10"
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_initialized", lambda: self.started)
        monkeypatch.setattr(cuda, "init", self._start)
        monkeypatch.setattr(cuda, "current_device", lambda: self._start() or 0)
        monkeypatch.setattr(cuda, "get_device_properties", lambda device=None: self._start() or GPU)
        monkeypatch.setattr(cuda, "get_device_name", lambda device=None: self._start() or GPU.name)
        monkeypatch.setattr(cuda, "mem_get_info", lambda device=None: self._read(cuda_view=True))
        monkeypatch.setattr(cuda, "memory_reserved", lambda device=None: self.allocator)
        monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: self.allocated)
        for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
            monkeypatch.setattr(cuda, name, lambda device=None: None)
        monkeypatch.setattr(reserve, "_nvml_used_by_uuid", lambda: self._read(cuda_view=False) if self.nvml else None)
        monkeypatch.setattr(reserve, "_driver_version", lambda: self.driver)

    def new_process(self):
        """This process ends and another starts: nothing on the card is its, and it has measured nothing."""
        self.started, self.outside, self.allocator, self.allocated = False, 0, 0, 0
        reserve.forget_in_process()

    def _start(self):
        if not self.started:
            self.started, self.outside = True, 300 * MIB  # a bare context and local memory
        return None

    def _read(self, cuda_view: bool):
        others = self.others + (self.drift.pop(0) if self.drift else 0)
        used = others + self.outside + self.allocator
        return (GPU.total_memory - used, GPU.total_memory) if cuda_view else {GPU.uuid: used}

    def work(self, device):
        self.runs += 1
        assert device == torch.device("cuda", 0)
        self.outside, self.allocator = self.after_work, 20 * MIB  # kernels loaded; the allocator keeps a cached block
        self.allocated = WORKSPACES  # in use inside that block for the process's life


@pytest.fixture
def card(monkeypatch, tmp_path):
    """The fake card, with the measurement running its stand-in for the tiny model and never waiting."""
    monkeypatch.setenv("MOEDESK_MODELS_DIR", str(tmp_path / "models"))
    reserve.forget_in_process()
    card = FakeCard(monkeypatch)
    measure = reserve.measure_runtime_reserve
    monkeypatch.setattr(
        reserve,
        "measure_runtime_reserve",
        lambda device, baseline: measure(device, baseline, card.work, sleep=lambda s: None),
    )
    yield card
    reserve.forget_in_process()


def test_the_measured_reserve_is_the_reading_plus_what_the_planner_adds(card):
    got = reserve.runtime_reserve()
    # NVML read the card before CUDA started (300 MiB of other programs), so only this process's 500 MiB count
    assert got.measured and got.measured_outside_bytes == 500 * MIB and not got.others_included
    outside = 500 * MIB + reserve.FULL_MODEL_KERNELS_BYTES + DECODE_GRAPH_EXEC_BYTES
    assert got.outside_allocator_bytes == outside
    assert got.lingering_bytes == WORKSPACES
    assert got.reserve_bytes == outside + RESERVE_INSIDE_ALLOCATOR_BYTES + WORKSPACES
    assert got.source == "measured on NVIDIA Test 4GB" and got.gpu == GPU.name


def test_what_was_allocated_before_the_measurement_is_not_counted_as_lingering(card):
    card._start()
    card.allocated = 100 * MIB  # a model already loaded in this process

    def tiny_model_run(device):
        card.outside, card.allocated = card.after_work, card.allocated + WORKSPACES

    card.work = tiny_model_run
    got = reserve.runtime_reserve()
    assert got.measured and got.lingering_bytes == WORKSPACES


def test_without_nvml_other_programs_count_in_and_the_reading_is_not_cached(card):
    card.nvml = False
    got = reserve.runtime_reserve()
    assert got.measured and got.others_included and got.measured_outside_bytes == 800 * MIB  # 500 + 300 others
    assert "other programs' GPU memory included" in got.source
    assert not reserve.reserve_file().exists()


def test_a_measurement_is_cached_by_gpu_driver_cuda_and_torch(card, monkeypatch):
    first = reserve.runtime_reserve()
    saved = json.loads(reserve.reserve_file().read_text(encoding="utf-8"))
    [key] = saved
    assert (
        key == f"v{reserve.RESERVE_VERSION}|{GPU.name}|driver 570.10|cuda {torch.version.cuda}|"
        f"torch {torch.__version__}"
    )
    assert saved[key] == {"measured_outside_bytes": 500 * MIB, "lingering_bytes": WORKSPACES}

    card.new_process()  # the file answers, nothing runs
    assert reserve.runtime_reserve() == first and card.runs == 1

    card.new_process()
    card.driver = "575.00"  # a driver update can change the context's size: measured again, both kept
    card.after_work = 520 * MIB
    assert reserve.runtime_reserve().measured_outside_bytes == 520 * MIB
    assert len(json.loads(reserve.reserve_file().read_text(encoding="utf-8"))) == 2


def test_the_reserve_file_lies_beside_the_calibration(card):
    from engine.paths import calibration_file

    assert reserve.reserve_file() == calibration_file().parent / "runtime_reserve.json"


def test_one_figure_per_process(card):
    first = reserve.runtime_reserve()
    card.after_work = 900 * MIB
    assert reserve.runtime_reserve() is first and card.runs == 1


@pytest.mark.parametrize(
    "after_work, drift, words",
    [
        (500 * MIB, [0, 40 * MIB, 0], "moved by 40 MiB"),  # another program allocated while the readings were taken
        (60 * MIB, [], "cannot be this process's alone"),  # less than any context
        (2 * FORMULA_OUTSIDE + 1 * MIB, [], "cannot be this process's alone"),  # far more than this GPU's formula
    ],
)
def test_a_reading_that_cannot_be_right_falls_back_to_the_formula_uncached(card, after_work, drift, words):
    card.after_work = after_work
    card.drift = [0] + drift  # the first NVML reading is the baseline, before CUDA
    got = reserve.runtime_reserve()
    assert not got.measured and got.reserve_bytes == FORMULA
    assert got.outside_allocator_bytes == FORMULA_OUTSIDE
    assert got.source.startswith(f"estimate for {GPU.name} from its 20 SMs, not measured: ") and words in got.source
    assert not reserve.reserve_file().exists()


def test_a_negative_reading_falls_back(card):
    card.after_work = -50 * MIB  # e.g. other programs freed memory between the baseline and the reading
    got = reserve.runtime_reserve()
    assert not got.measured and "-50 MiB" in got.source


def test_an_implausible_or_damaged_cache_entry_is_measured_again(card):
    key = f"v{reserve.RESERVE_VERSION}|{GPU.name}|driver 570.10|cuda {torch.version.cuda}|torch {torch.__version__}"
    reserve.reserve_file().parent.mkdir(parents=True, exist_ok=True)
    for entry in ({"measured_outside_bytes": 1}, {"measured_outside_bytes": "500"}, ["not", "a", "dict"]):
        card.new_process()
        reserve.reserve_file().write_text(json.dumps({key: entry}), encoding="utf-8")
        assert reserve.runtime_reserve().measured_outside_bytes == 500 * MIB
    card.new_process()
    reserve.reserve_file().write_text("not json", encoding="utf-8")
    assert reserve.runtime_reserve().measured
    assert card.runs == 4


def test_out_of_memory_while_measuring_falls_back(card, monkeypatch):
    def no_memory(device):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(card, "work", no_memory)
    got = reserve.runtime_reserve()
    assert not got.measured and "no memory free" in got.source


def test_the_vram_cap_leaves_out_the_measured_outside_part(card, monkeypatch):
    calls = {}
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device=None: calls.update(f=f))
    cap = vram.cap_process_memory(3 * GIB)
    measured = reserve.runtime_reserve()
    assert cap.outside_estimate_bytes == measured.outside_allocator_bytes == vram.outside_allocator_bytes()
    assert cap.allocator_limit_bytes == 3 * GIB - measured.outside_allocator_bytes
    assert calls["f"] == pytest.approx(cap.allocator_limit_bytes / GPU.total_memory)


# ---- plans ---------------------------------------------------------------------------------------------


def test_a_plan_says_where_its_reserve_came_from():
    footprint = footprint_from_synthetic("qwen3.6-35b-a3b-nvfp4")
    estimate = plan_memory(footprint, 4 * GIB, "4gb")
    assert estimate.reserve_source == DEFAULT_RESERVE_SOURCE and not estimate.reserve_measured
    assert "RTX 2050" in DEFAULT_RESERVE_SOURCE and "estimate" in DEFAULT_RESERVE_SOURCE
    measured = reserve.measured_reserve(500 * MIB, "NVIDIA H200", others_included=False)
    plan = plan_memory(footprint, 4 * GIB, "4gb", reserve_bytes=measured.reserve_bytes, reserve_source=measured.source)
    assert plan.reserve_measured and plan.breakdown["runtime_reserve"] == measured.reserve_bytes
    for text in (plan.summary(), plan.format_table()):
        assert "measured on NVIDIA H200" in text
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["reserve_source"] == "measured on NVIDIA H200" and data["reserve_measured"] is True
    given = plan_memory(footprint, 4 * GIB, "4gb", reserve_bytes=DEFAULT_RUNTIME_RESERVE_BYTES + MIB)
    assert given.reserve_source == "given by the caller" and not given.reserve_measured


def test_a_gpu_placement_plans_with_the_measured_reserve(card, tiny_checkpoint, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: card._start() or (8, 6))
    got = placement.plan_placement(tiny_checkpoint("qwen3_5_moe", "nvfp4"), "4gb")
    measured = reserve.runtime_reserve()
    assert measured.measured and not measured.others_included  # gpu_status read NVML's baseline before CUDA
    assert got.plan.breakdown["runtime_reserve"] == measured.reserve_bytes
    assert got.plan.reserve_source == "measured on NVIDIA Test 4GB" and "measured on NVIDIA Test 4GB" in got.note


def test_the_measurement_s_work_runs_a_prompt_and_decode_steps_of_the_tiny_model(monkeypatch):
    """The tiny model's run, on the CPU here (on a GPU it loads the kernels a chat uses): it loads, prefills and
    decodes through the loader's own API, and leaves no file behind."""
    from engine.runtime import placement as placement_module
    from engine.testing import tiny_checkpoints

    folders, write = [], tiny_checkpoints.write_tiny_checkpoint
    monkeypatch.setattr(placement_module, "gpu_dtype", lambda: torch.float32)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(
        tiny_checkpoints, "write_tiny_checkpoint", lambda folder, *a: folders.append(folder) or write(folder, *a)
    )
    reserve.run_tiny_model(torch.device("cpu"))
    assert len(folders) == 1 and not folders[0].exists()
