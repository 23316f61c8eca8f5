"""Every Triton kernel compiles to PTX for Turing (sm_75) and Ampere (sm_86), the oldest cards we ship for, on a
machine without a GPU. The interpreter (the other kernel tests) runs Python and accepts what the compiler
refuses, such as a global that is not a constexpr; this catches that, and any instruction those cards lack."""

import json
import os
import subprocess
import sys

import pytest
from locations import ROOT

pytest.importorskip("triton", reason="Triton ships for Linux; the Windows app runs the reference kernels")


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "triton_compile_check.py"), "75", "86"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert rows, done.stderr[-3000:]
    return {(row["case"], row["capability"]): row for row in rows}


KERNELS = [
    "rms_norm",
    "gdn delta",
    "gdn gate norm",
    "gdn recurrence",
    "prefill attention fp8",
    "decode attention",
    "decode attention fp8",
    "decode attention merge",
    "gather records",
    "link mark",
    "link hold",
    "link hold records",
    "assign slots",
    "router top-k",
    "post cpu share",
    "wait cpu share",
    "combine experts",
    "norm rope",
    "nvfp4 gemv grouped",
    "nvfp4 gemv slots swiglu",
    "nvfp4 tiles",
    "fp8 gemv",
    "fp8 block tiles",
]


# The most shared memory a block may take: Turing's 64 KiB, Ampere consumer cards' (sm_86) 99 KiB
SHARED_BYTES = {75: 64 * 1024, 86: 99 * 1024}
# The most local memory (spilled registers) a thread may take: the card reserves it for every thread it can hold
# (an RTX 3060: 28 SMs x 1,536 threads x 512 B = 21 MiB), outside the allocator and the plan's reserve
STACK_BYTES = 512


def test_every_kernel_is_checked(compiled):
    assert {case for case, _ in compiled} == set(KERNELS)


@pytest.mark.parametrize("capability", [75, 86])
@pytest.mark.parametrize("case", KERNELS)
def test_kernel_compiles_for_consumer_cards(compiled, case, capability):
    row = compiled[case, capability]
    assert "error" not in row, row.get("error")
    assert row["ptx_target"] and not row["hopper_only"]
    assert row["shared_bytes"] <= SHARED_BYTES[capability], f"{row['shared_bytes']} bytes of shared memory a block"
    assert row["stack_bytes"] is not None, "ptxas did not assemble the kernel"
    assert row["stack_bytes"] <= STACK_BYTES, f"{row['stack_bytes']} bytes of local memory a thread"
