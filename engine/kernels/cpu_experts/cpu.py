"""numba, where it is installed, and what its compiled code may use of this CPU."""

from __future__ import annotations

import platform

try:
    import numba
except ImportError:  # the engine still works: CpuExpertKernel falls back to PyTorch
    numba = None


def _prefer_512_bit_vectors() -> None:
    """LLVM tunes Intel server CPUs to 256-bit vectors even where they have AVX-512; these kernels ran 2.25x
    faster per core with 512-bit ones on the H200 machine's Xeon (Emerald Rapids). Before the first compile;
    NUMBA_CPU_FEATURES, when set, wins."""
    if numba is None or numba.config.CPU_FEATURES is not None:
        return
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return
    from llvmlite import binding

    numba.config.CPU_FEATURES = binding.get_host_cpu_features().flatten() + ",-prefer-256-bit"


_prefer_512_bit_vectors()


def bf16_dot_supported() -> bool:
    """Whether the kernels were compiled for a CPU with AVX512-BF16's dot (Intel Cooper Lake, Sapphire Rapids and
    later Xeons; AMD Zen 4 and later) and AVX512-BW's word permute, which the bf16-activation path uses, by an
    LLVM that declares the dot on bfloat vectors (17 and later: the only declaration tested)."""
    if numba is None or platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    from llvmlite import binding

    if binding.llvm_version_info[0] < 17:
        return False
    features = numba.config.CPU_FEATURES
    if features is None:
        features = binding.get_host_cpu_features().flatten()
    enabled = set(features.split(","))
    return {"+avx512bf16", "+avx512bw"} <= enabled
