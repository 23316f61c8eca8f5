"""How many of numba's threads the expert kernels use, and the lock their parallel launches take."""

from __future__ import annotations

import functools
import os
import threading

from engine.kernels.cpu_experts.cpu import numba

_threads: int | None = None
_launch = threading.Lock()  # numba's default thread pool takes one parallel launch at a time
_launching = threading.local()  # the thread count numba was last given on this calling thread


@functools.cache
def default_threads() -> int:
    """Physical cores (hyper-threads share one core's vector units), within numba's pool. Asked once: psutil
    reads the CPU topology from the system each time (150 us, once per expert call before it was cached)."""
    try:
        import psutil

        cores = psutil.cpu_count(logical=False)
    except ImportError:
        cores = None
    cores = cores or os.cpu_count() or 1
    return min(cores, numba.config.NUMBA_NUM_THREADS) if numba is not None else cores


def set_threads(n: int | None) -> None:
    """Threads the expert kernels use (None: default_threads())."""
    global _threads
    if n is not None:
        limit = numba.config.NUMBA_NUM_THREADS if numba is not None else os.cpu_count() or 1
        if not 1 <= n <= limit:
            raise ValueError(f"threads must be between 1 and {limit}, got {n}")
    _threads = n


def threads() -> int:
    return _threads or default_threads()


def numba_threads(n: int) -> None:
    """Give numba's pool `n` threads for launches from this thread (numba keeps it per calling thread); a call
    costs 19 us, so only when it changes. Code that launches numba kernels sets threads through here."""
    if getattr(_launching, "threads", None) != n:
        numba.set_num_threads(n)
        _launching.threads = n
