"""The runtime reserve of the GPU in use, measured there once and cached beside the calibration.

A plan sets aside a runtime reserve for what the process needs outside the tensors it budgets
(engine/runtime/planner.py). Most of it lies outside PyTorch's allocator: the CUDA context, the kernel
images a forward loads, and per-thread local memory, whose size depends on the card. Here that part is
read on the card itself: the tiny NVFP4 model runs a prefill chunk and graphed decode steps on it (so the
kernels a chat uses are loaded), is dropped, and what the process then holds outside the allocator is
its memory in use less `torch.cuda.memory_reserved()`. "In use" is the card's used memory less what it
held before this process started CUDA, read through NVML; without NVML, or with CUDA already started,
it is the card's whole used memory, other programs' included (a larger reserve, never a smaller).
What stays allocated inside the allocator once the model is dropped (cuBLAS's workspaces, one per stream that ran
a GEMM) is read as well, since it lives under the VRAM cap for the process's life. The parts the tiny model cannot
show are added from the planner: a full-size model's extra kernel
images, its decode graphs, and the allocator's slack and graph pool.

A reading that cannot be right (it moved while being taken, or lies outside plausible bounds) is not
used: the plan takes the planner's formula for this GPU and says so. Measurements are cached by GPU,
driver, CUDA and torch version in runtime_reserve.json beside calibration.json.
"""

from __future__ import annotations

import gc
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine.runtime.planner import (
    DECODE_GRAPH_EXEC_BYTES,
    DEFAULT_RESERVE_SOURCE,
    DEFAULT_RUNTIME_RESERVE_BYTES,
    MIB,
    RESERVE_INSIDE_ALLOCATOR_BYTES,
    reserve_inside_allocator_bytes,
)

RESERVE_VERSION = 2  # bump when what is measured changes: older entries are then measured again
RESERVE_FILE_NAME = "runtime_reserve.json"
# Kernel images a full-size forward loads beyond the tiny model's (other tile shapes, cuBLAS's kernels for wide
# GEMMs); docs/PLANNER.md gives the measurement this rounds up.
FULL_MODEL_KERNELS_BYTES = 128 * MIB
READINGS = 3  # readings of the outside part, READING_INTERVAL_S apart, that must agree
READING_INTERVAL_S = 0.05
READING_TOLERANCE_BYTES = 4 * MIB  # more movement than this is another program allocating or freeing
MIN_PLAUSIBLE_OUTSIDE_BYTES = 128 * MIB  # below any CUDA context with cuBLAS and kernels loaded
MAX_PLAUSIBLE_OUTSIDE_FACTOR = 2  # times the formula's outside part: beyond it the reading holds more than this process
PROMPT_TOKENS = 150  # over two GDN scan blocks and a partial one, as a real prompt's chunk has
DECODE_STEPS = 4  # the first runs the plain forward, the next capture and replay the step's graphs


class ReserveMeasurementError(RuntimeError):
    """A reading of the reserve that cannot be right, with why."""


@dataclass(frozen=True)
class RuntimeReserve:
    """The runtime reserve a plan sets aside on one GPU, and where the figure came from."""

    reserve_bytes: int  # what the plan's breakdown["runtime_reserve"] holds
    outside_allocator_bytes: int  # the part outside PyTorch's allocator, which a VRAM cap must leave out
    source: str  # "measured on <GPU>..." or which estimate it is, for the plan to say
    measured: bool
    gpu: str | None  # the GPU's name; None without one
    measured_outside_bytes: int | None = None  # the reading itself: context, kernel images, local memory
    lingering_bytes: int | None = None  # the reading of what stays allocated inside the allocator (cuBLAS workspaces)
    others_included: bool = False  # the reading had no baseline, so other programs' GPU memory is in it

    def to_dict(self) -> dict:
        return asdict(self)


def measured_reserve(outside_bytes: int, gpu: str, others_included: bool, lingering_bytes: int = 0) -> RuntimeReserve:
    """The reserve from the readings: what lies outside the allocator and what stays inside it without a model,
    plus what the planner budgets beyond what a tiny model shows (a full-size model's extra kernels and its decode
    graphs, the allocator's slack and graph pool)."""
    outside = outside_bytes + FULL_MODEL_KERNELS_BYTES + DECODE_GRAPH_EXEC_BYTES
    source = f"measured on {gpu}" + (", other programs' GPU memory included" if others_included else "")
    return RuntimeReserve(
        outside + RESERVE_INSIDE_ALLOCATOR_BYTES + lingering_bytes,
        outside,
        source,
        measured=True,
        gpu=gpu,
        measured_outside_bytes=outside_bytes,
        lingering_bytes=lingering_bytes,
        others_included=others_included,
    )


def reference_estimate() -> RuntimeReserve:
    """The planner's default reserve, for the reference card: what a plan made without a GPU uses."""
    return RuntimeReserve(
        DEFAULT_RUNTIME_RESERVE_BYTES,
        DEFAULT_RUNTIME_RESERVE_BYTES - reserve_inside_allocator_bytes(),
        DEFAULT_RESERVE_SOURCE,
        measured=False,
        gpu=None,
    )


def formula_estimate(device: torch.device, why: str) -> RuntimeReserve:
    """The planner's formula for this GPU (its SMs set the local memory), saying why nothing was measured."""
    from engine.runtime.vram import gpu_runtime_reserve_bytes

    reserve, props = gpu_runtime_reserve_bytes(device), torch.cuda.get_device_properties(device)
    return RuntimeReserve(
        reserve,
        reserve - reserve_inside_allocator_bytes(props.major),
        f"estimate for {props.name} from its {props.multi_processor_count} SMs, not measured: {why}",
        measured=False,
        gpu=props.name,
    )


def reserve_file() -> Path:
    """runtime_reserve.json, beside calibration.json in the user's data folder."""
    from engine.paths import calibration_file

    return calibration_file().parent / RESERVE_FILE_NAME


def _driver_version() -> str:
    """The NVIDIA driver's version from NVML, else the CUDA version the driver supports."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # no NVML (not installed, or no library in the driver): the CUDA runtime still knows
        getter = getattr(torch._C, "_cuda_getDriverVersion", None)
        return f"cuda {getter()}" if getter is not None else "unknown"


def reserve_key(device: torch.device) -> str:
    """What a cached measurement holds for: the GPU, the driver, CUDA and torch (each can move the context's size)."""
    return (
        f"v{RESERVE_VERSION}|{torch.cuda.get_device_name(device)}|driver {_driver_version()}|"
        f"cuda {torch.version.cuda}|torch {torch.__version__}"
    )


def _nvml_used_by_uuid() -> dict[str, int] | None:
    """Memory in use on each GPU by its UUID, from NVML (which needs no CUDA context); None without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # not installed, or the driver has no NVML library
        return None
    try:
        used = {}
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            used[_plain_uuid(uuid.decode() if isinstance(uuid, bytes) else uuid)] = int(
                pynvml.nvmlDeviceGetMemoryInfo(handle).used
            )
        return used
    except Exception:  # a device NVML cannot read (e.g. a MIG slice): no baseline
        return None
    finally:
        pynvml.nvmlShutdown()


def _plain_uuid(uuid: object) -> str:
    return str(uuid).lower().removeprefix("gpu-")


_BASELINE: dict = {}  # "used": what each GPU held before this process started CUDA, once read


def note_card_baseline() -> dict[str, int] | None:
    """What every GPU holds before this process starts CUDA (NVML, by UUID), read once while CUDA has not
    started: afterwards this process's own memory would count as other programs'. None when unknown."""
    if "used" not in _BASELINE and not torch.cuda.is_initialized():
        _BASELINE["used"] = _nvml_used_by_uuid()
    return _BASELINE.get("used")


def _outside_reading(device: torch.device, baseline_used: int | None) -> int:
    """This process's GPU memory outside PyTorch's allocator now."""
    if baseline_used is not None:
        used = _nvml_used_by_uuid()
        uuid = _plain_uuid(torch.cuda.get_device_properties(device).uuid)
        if used is None or uuid not in used:
            raise ReserveMeasurementError("NVML stopped answering while the reserve was measured")
        in_use = used[uuid] - baseline_used
    else:
        free, total = torch.cuda.mem_get_info(device)
        in_use = total - free
    return in_use - torch.cuda.memory_reserved(device)


def run_tiny_model(device: torch.device) -> None:
    """Load the tiny NVFP4 model onto `device` with an expert cache, prefill a prompt and decode a few tokens."""
    from engine.loader import load_model
    from engine.runtime.placement import gpu_dtype
    from engine.testing.tiny_checkpoints import write_tiny_checkpoint

    with tempfile.TemporaryDirectory(prefix="moedesk-reserve-") as folder:
        path = write_tiny_checkpoint(Path(folder) / "tiny", "qwen3_5_moe", "nvfp4")
        # offload: the one backend that needs no calibration; the expert kernels are the same
        model = load_model(path, device, gpu_dtype(), expert_cache_slots=model_slots(path), expert_backend="offload")
    state = model.new_state(PROMPT_TOKENS + DECODE_STEPS)
    prompt = torch.randint(2, model.config.vocab_size, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(0))
    token = int(model.forward(prompt, state).argmax())
    for _ in range(DECODE_STEPS):
        token = int(model.forward([token], state).argmax())
    torch.cuda.synchronize(device)


def model_slots(folder: Path) -> int:
    """One layer of expert-cache slots, as the 4gb plan gives a model."""
    from engine.config import read_config

    return read_config(folder).num_experts


def measure_runtime_reserve(
    device: torch.device,
    baseline: dict[str, int] | None,
    work: Callable[[torch.device], None] = run_tiny_model,
    sleep: Callable[[float], None] = time.sleep,
) -> RuntimeReserve:
    """Run `work` on `device`, drop it, and read what the process holds outside the allocator; add the parts the
    planner budgets beyond it. `baseline`: card_baseline(), taken before CUDA started. ReserveMeasurementError
    when the reading cannot be right."""
    props = torch.cuda.get_device_properties(device)
    baseline_used = baseline.get(_plain_uuid(props.uuid)) if baseline else None
    allocated_before = torch.cuda.memory_allocated(device) if torch.cuda.is_initialized() else 0
    work(device)
    gc.collect()  # the model, its state and its decode graphs go; the kernel images stay loaded
    torch.cuda.synchronize(device)
    # what the run left allocated (before empty_cache, which may hand the workspaces back), not what was already
    lingering = max(0, torch.cuda.memory_allocated(device) - allocated_before)
    torch.cuda.empty_cache()
    readings = []
    for index in range(READINGS):
        if index:
            sleep(READING_INTERVAL_S)
        readings.append(_outside_reading(device, baseline_used))
    torch.cuda.reset_peak_memory_stats(device)  # the measurement's own tensors are no part of a later peak
    if max(readings) - min(readings) > READING_TOLERANCE_BYTES:
        raise ReserveMeasurementError(
            f"the GPU's memory in use moved by {_mib(max(readings) - min(readings))} "
            f"while it was read: another program is using {props.name}"
        )
    outside = max(readings)
    highest = _highest_plausible(device)
    if not MIN_PLAUSIBLE_OUTSIDE_BYTES <= outside <= highest:
        raise ReserveMeasurementError(
            f"the reading, {_mib(outside)} outside PyTorch's allocator, cannot be this process's alone (plausible: "
            f"{_mib(MIN_PLAUSIBLE_OUTSIDE_BYTES)} to {_mib(highest)})"
            + (
                ""
                if baseline_used is not None
                else "; other programs' GPU memory was counted in, since NVML could "
                "not read the card before CUDA started"
            )
        )
    return measured_reserve(outside, props.name, others_included=baseline_used is None, lingering_bytes=lingering)


def _highest_plausible(device: torch.device) -> int:
    return MAX_PLAUSIBLE_OUTSIDE_FACTOR * formula_estimate(device, "").outside_allocator_bytes


def _mib(n: int) -> str:
    return f"{n / MIB:,.0f} MiB"


_IN_PROCESS: dict[int, RuntimeReserve] = {}  # one figure per GPU for the process's life: every plan agrees


def runtime_reserve(device: torch.device | str = "cuda") -> RuntimeReserve:
    """The reserve for plans on `device`: cached from an earlier run, else measured now (and cached when the
    reading is this process's alone), else the planner's formula for the GPU with the reason."""
    baseline = note_card_baseline()  # before anything below starts CUDA
    device = torch.device("cuda", torch.device(device).index or torch.cuda.current_device())
    if device.index in _IN_PROCESS:
        return _IN_PROCESS[device.index]
    key, path = reserve_key(device), reserve_file()
    saved = _read_saved(path)
    reserve = _from_saved(saved.get(key), device)
    if reserve is None:
        try:
            reserve = measure_runtime_reserve(device, baseline)
        except ReserveMeasurementError as exc:
            reserve = formula_estimate(device, str(exc))
        except torch.cuda.OutOfMemoryError:
            reserve = formula_estimate(device, "the GPU had no memory free for the measurement")
        if reserve.measured and not reserve.others_included:
            saved[key] = {
                "measured_outside_bytes": reserve.measured_outside_bytes,
                "lingering_bytes": reserve.lingering_bytes,
            }
            _write_saved(path, saved)
    _IN_PROCESS[device.index] = reserve
    return reserve


def _read_saved(path: Path) -> dict:
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return saved if isinstance(saved, dict) else {}


def _from_saved(entry: object, device: torch.device) -> RuntimeReserve | None:
    """A cached reading made into the reserve, or None when it is missing, malformed or not plausible here."""
    if not isinstance(entry, dict):
        return None
    outside, lingering = entry.get("measured_outside_bytes"), entry.get("lingering_bytes")
    if any(isinstance(n, bool) or not isinstance(n, int) for n in (outside, lingering)):
        return None
    if not MIN_PLAUSIBLE_OUTSIDE_BYTES <= outside <= _highest_plausible(device) or lingering < 0:
        return None
    return measured_reserve(
        outside, torch.cuda.get_device_name(device), others_included=False, lingering_bytes=lingering
    )


def _write_saved(path: Path, saved: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(saved, indent=1), encoding="utf-8")
    except OSError:
        pass  # a read-only data folder only costs the measurement next time


def forget_in_process() -> None:
    """Drop this process's figures and baseline, so the next plan reads the cache or measures again (tests)."""
    _IN_PROCESS.clear()
    _BASELINE.clear()
