"""What the machine has: the GPU's memory, system RAM, and a diagnostics text for bug reports.

Every reader degrades to "unknown" instead of raising: a missing NVML, torch or psutil must never
take the window down, since the footer polls these every few seconds.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import shutil
import sys
from pathlib import Path

GIB, MIB, KIB = 2**30, 2**20, 2**10
NO_GPU_TEXT = "no NVIDIA GPU: CPU mode"


def format_bytes(n: int | float) -> str:
    """A size the way the app shows sizes: GiB from 1 GiB up, then MiB, then KiB."""
    if abs(n) >= GIB:
        return f"{n / GIB:.2f} GiB"
    if abs(n) >= MIB:
        return f"{n / MIB:.1f} MiB"
    if abs(n) >= KIB:
        return f"{n / KIB:.1f} KiB"
    return f"{int(n)} B"


def gpu_memory() -> dict | None:
    """Memory of GPU 0 (name, total_bytes, used_bytes, free_bytes), or None when there is no NVIDIA GPU.

    NVML is asked first: it reads the whole card (every process) without creating a CUDA context,
    which would itself cost a few hundred MiB of the VRAM being measured.
    """
    return _gpu_from_nvml() or _gpu_from_torch()


@functools.cache
def _nvml_device():
    """(pynvml, handle of GPU 0), initialised once because the footer polls; None without NVML or a GPU."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
    except Exception:  # not installed, no driver, no device: all mean "ask torch instead"
        return None


def _gpu_from_nvml() -> dict | None:
    device = _nvml_device()
    if device is None:
        return None
    pynvml, handle = device
    try:
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        name = pynvml.nvmlDeviceGetName(handle)
    except Exception:  # the driver went away (GPU reset): report no GPU until it is back
        return None
    name = name.decode() if isinstance(name, bytes) else str(name)
    return {
        "name": name,
        "total_bytes": int(memory.total),
        "used_bytes": int(memory.used),
        "free_bytes": int(memory.free),
    }


def _gpu_from_torch() -> dict | None:
    try:
        import torch

        from engine.api import load_model  # noqa: F401  (its module sets CUDA's allocator, fixed once CUDA starts)

        if not torch.cuda.is_available():
            return None
        free, total = torch.cuda.mem_get_info(0)
        name = torch.cuda.get_device_name(0)
    except Exception:  # a broken CUDA install reads as no GPU rather than a crash
        return None
    return {"name": name, "total_bytes": int(total), "used_bytes": int(total - free), "free_bytes": int(free)}


def ram() -> dict:
    """System RAM: total_bytes, used_bytes (what is not available to new programs), available_bytes; 0 when unknown."""
    try:
        import psutil

        memory = psutil.virtual_memory()
        total, available = int(memory.total), int(memory.available)
    except Exception:  # psutil missing: POSIX sysconf still knows the totals on Linux
        try:
            page = os.sysconf("SC_PAGE_SIZE")
            total, available = os.sysconf("SC_PHYS_PAGES") * page, os.sysconf("SC_AVPHYS_PAGES") * page
        except (AttributeError, ValueError, OSError):
            total = available = 0
    return {"total_bytes": total, "used_bytes": total - available, "available_bytes": available}


def disk_free(folder: Path) -> int | None:
    """Free bytes on the disk holding `folder` (its nearest existing parent), None when it cannot be read."""
    for candidate in (folder, *folder.parents):
        if candidate.exists():
            try:
                return shutil.disk_usage(candidate).free
            except OSError:
                return None
    return None


def gpu_summary_text(gpu: dict | None = None) -> str:
    """One line about the GPU for the footer and diagnostics; reads it when not given."""
    gpu = gpu if gpu is not None else gpu_memory()
    if gpu is None:
        return NO_GPU_TEXT
    return f"{gpu['name']}: {format_bytes(gpu['used_bytes'])} / {format_bytes(gpu['total_bytes'])} used"


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _torch_text() -> str:
    try:
        import torch
    except Exception as exc:  # diagnostics are most needed when the install is broken
        return f"not importable ({exc})"
    return f"{torch.__version__} (CUDA {torch.version.cuda or 'none'})"


def _pyside_text() -> str:
    try:
        import PySide6
    except Exception as exc:  # diagnostics can also be asked for from a shell without the GUI installed
        return f"not importable ({exc})"
    return PySide6.__version__


def diagnostics() -> str:
    """Versions, OS, GPU and RAM as plain text, to paste into a bug report."""
    memory = ram()
    lines = [
        f"MoE Desk (engine and app) {_version('moedesk')}",
        f"Python {sys.version.split()[0]} ({platform.python_implementation()})",
        f"torch {_torch_text()}",
        f"PySide6 {_pyside_text()}",
        f"OS {platform.platform()}",
        f"CPU {platform.machine()}, {os.cpu_count() or '?'} logical cores",
        f"GPU {gpu_summary_text()}",
        f"RAM {format_bytes(memory['used_bytes'])} / {format_bytes(memory['total_bytes'])} used",
    ]
    return "\n".join(lines)
