"""Compiles every Triton kernel to PTX for the GPU generations named on the command line, without a GPU, assembles
it with Triton's ptxas for its stack frame, and prints one JSON line per (kernel, capability): run by tests/engine/kernels/test_triton_compile.py in a process of its own,
since the rest of the suite runs Triton's interpreter, where kernels are Python functions."""

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from engine.kernels import (
    triton_attention,
    triton_combine,
    triton_cpu_share,
    triton_gather,
    triton_gdn,
    triton_linear_kernel,
    triton_linear_launch,
    triton_link,
    triton_norm,
    triton_prefill_attention,
    triton_rope,
    triton_router,
    triton_slots,
)


def _signature(kernel, pointers: dict, constexprs: dict, floats=()) -> dict:
    return {
        name: "constexpr" if name in constexprs else pointers.get(name) or ("fp32" if name in floats else "i32")
        for name in kernel.arg_names
    }


def _linear_case(fmt, gemv, table, swiglu=False):
    pointers = {
        "x_ptr": "*bf16",
        "w_ptr": "*u8",
        "s_ptr": "*u8",
        "r_ptr": "*fp32",
        "out_ptr": "*fp32",
        "table_ptr": "*i32",
    }
    constexprs = dict(
        FORMAT=fmt,
        TABLE=table,
        SWIGLU=swiglu,
        BM=1 if gemv else 16,
        BN=32,
        BK=128,
        ATOMIC=True,
        DOT_DTYPE=triton.language.float16,
        PRECISION="tf32",
        ROW_SCALE=True,
        DIVIDE=False,
        SCALE_COLS=0,
        SCALE_GROUPS=1,
        EVEN_K=True,
    )
    assert tuple(constexprs) == triton_linear_launch._CONSTEXPR_NAMES
    return triton_linear_kernel.linear_kernel, pointers, constexprs, ()


def _prefill_attention_case():
    """The FP8 prefill attention kernel at Qwen3.6's head sizes, with the tiles it launches on that card."""
    pointers = {"q_ptr": "*bf16", "k_ptr": "*u8", "v_ptr": "*u8", "scales_ptr": "*fp32", "out_ptr": "*bf16"}

    def launched(capability):
        precision = triton_attention.precision_for(capability // 10)
        block_m, block_n, warps = triton_prefill_attention.TILES[precision]
        constexprs = {"GROUP": 8, "D": 256, "DV": 256, "BLOCK_M": block_m, "BLOCK_N": block_n, "PRECISION": precision}
        return constexprs, {"num_warps": warps, "num_stages": triton_prefill_attention.STAGES}

    return triton_prefill_attention._prefill_kernel, pointers, launched, ("scale",)


def _decode_attention_case(fp8: bool):
    """The decode attention kernel over a bf16 cache, or an FP8 one (uint8 rows, float32 scales)."""
    rows = "*u8" if fp8 else "*bf16"
    pointers = {
        "q_ptr": "*bf16",
        "k_ptr": rows,
        "v_ptr": rows,
        "scales_ptr": "*fp32" if fp8 else "*bf16",  # without FP8 unread: the caller passes q
        "position_ptr": "*i64",
        "acc_ptr": "*fp32",
        "m_ptr": "*fp32",
        "l_ptr": "*fp32",
    }
    sizes = {"GROUP": 8, "GROUP_PAD": 16, "D": 256, "DV": 256, "SPLITS": 32, "FP8": fp8}

    def launched(capability):  # what decode_attention launches on that card: TF32 from Ampere on, else IEEE
        precision = triton_attention.precision_for(capability // 10)
        block_n, warps = triton_attention.TILES[precision]
        return {**sizes, "PRECISION": precision, "BLOCK_N": block_n}, {"num_warps": warps}

    return triton_attention._split_kernel, pointers, launched, ("scale",)


CASES = {
    "rms_norm": (
        triton_norm._rms_norm_kernel,
        {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "y_ptr": "*bf16", "sum_ptr": "*bf16"},
        {"BLOCK": 2048, "ADD": True},
        ("eps", "offset"),
    ),
    "gdn delta": (
        triton_gdn._delta_kernel,
        {
            name: "*bf16"
            for name in (
                "qkv_ptr",
                "b_ptr",
                "a_ptr",
                "conv_state_ptr",
                "conv_weight_ptr",
                "a_log_ptr",
                "dt_bias_ptr",
                "o_ptr",
            )
        }
        | {"state_ptr": "*fp32"},
        {"BLOCK_DK": 128, "BLOCK_DV": 32, "BLOCK_K": 4},
        ("q_scale",),
    ),
    "gdn gate norm": (
        triton_gdn._gate_norm_kernel,
        {name: "*bf16" for name in ("o_ptr", "z_ptr", "norm_weight_ptr", "out_ptr", "qkv_ptr", "conv_state_ptr")},
        {"BLOCK_DV": 128, "BLOCK_C": 256, "BLOCK_K": 4},
        ("eps",),
    ),
    "gdn recurrence": (
        triton_gdn._recurrence_kernel,
        {name: "*fp32" for name in ("u_ptr", "w_ptr", "k_ptr", "decay_ptr", "states_ptr")},
        lambda capability: (
            {"BLOCK_L": 64, "BLOCK_DV": triton_gdn.RECURRENCE_COLS, "BLOCK_R": triton_gdn.RECURRENCE_ROWS},
            {"num_warps": triton_gdn.RECURRENCE_WARPS, "num_stages": triton_gdn.RECURRENCE_STAGES},
        ),
        (),
    ),
    "prefill attention fp8": _prefill_attention_case(),
    "decode attention": _decode_attention_case(fp8=False),
    "decode attention fp8": _decode_attention_case(fp8=True),
    "decode attention merge": (
        triton_attention._merge_kernel,
        {"acc_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "out_ptr": "*bf16"},
        {"DV": 256, "SPLITS": 32, "MERGE": 16},
        (),
    ),
    "gather records": (
        triton_gather._gather_kernel,
        {"records_ptr": "*i32", "pool_ptr": "*i32", "table_ptr": "*i32"},
        {"BLOCK": triton_gather.BLOCK, "ROWS": 8},
        (),
    ),
    "link mark": (triton_link._mark_kernel, {"mark_ptr": "*i64"}, {}, ()),
    "link hold": (
        triton_link._hold_kernel,
        {"mark_ptr": "*i64", "table_ptr": "*i64"},
        {"COUNT": False, "BLOCK": triton_link.TABLE_BLOCK},
        (),
    ),
    "link hold records": (
        triton_link._hold_kernel,
        {"mark_ptr": "*i64", "table_ptr": "*i32"},
        {"COUNT": True, "BLOCK": triton_link.TABLE_BLOCK},
        (),
    ),
    "assign slots": (
        triton_slots._assign_kernel,
        {
            "ids_ptr": "*i64",
            "keys_ptr": "*i32",
            "ages_ptr": "*i32",
            "clock_ptr": "*i32",
            "where_ptr": "*i32",
            "slots_ptr": "*i32",
            "table_ptr": "*i32",
            "counts_ptr": "*i64",
            "cpu_counts_ptr": "*i32",
            "gpu_rows_ptr": "*fp32",
        },
        {"K": 8, "K_PAD": 8, "BLOCK": 256, "SPLIT": True},
        (),
    ),
    "router top-k": (
        triton_router._router_kernel,
        {"logits_ptr": "*bf16", "ids_ptr": "*i64", "weights_ptr": "*fp32"},
        {"K": 8, "K_PAD": 8, "BLOCK": 256, "NORMALISE": True},
        (),
    ),
    "post cpu share": (
        triton_cpu_share._post_kernel,
        {
            "ids_ptr": "*i64",
            "weights_ptr": "*fp32",
            "gpu_rows_ptr": "*fp32",
            "y_ptr": "*bf16",
            "base_ptr": "*i32",
            "box_ids_ptr": "*i32",
            "box_weights_ptr": "*fp32",
            "box_x_ptr": "*fp32",
            "flags_ptr": "*i32",
        },
        {"K": 8, "K_BLOCK": 8, "BLOCK": triton_cpu_share.BLOCK},
        (),
    ),
    "wait cpu share": (
        triton_cpu_share._wait_kernel,
        {
            "gpu_rows_ptr": "*fp32",
            "base_ptr": "*i32",
            "flags_ptr": "*i32",
            "box_out_ptr": "*fp32",
            "routed_ptr": "*fp32",
            "waits_ptr": "*i32",
        },
        {"K": 8, "K_BLOCK": 8, "BLOCK": triton_cpu_share.BLOCK},
        (),
    ),
    "combine experts": (
        triton_combine._combine_kernel,
        {
            "h_ptr": "*bf16",
            "routed_ptr": "*bf16",
            "weights_ptr": "*fp32",
            "rows_ptr": "*fp32",
            "shared_ptr": "*bf16",
            "gate_ptr": "*bf16",
            "cpu_ptr": "*fp32",
            "out_ptr": "*bf16",
        },
        {
            "K": 8,
            "K_BLOCK": 8,
            "BLOCK": triton_combine.BLOCK,
            "ROWS": True,
            "SHARED": True,
            "GATE": True,
            "CPU": True,
        },
        (),
    ),
    "norm rope": (
        triton_rope._norm_rope_kernel,
        {
            "x_ptr": "*bf16",
            "w_ptr": "*fp32",
            "positions_ptr": "*i64",
            "inv_freq_ptr": "*fp32",
            "out_ptr": "*bf16",
        },
        {"ROTARY": 64, "BLOCK": 256},
        ("eps", "offset"),
    ),
    "nvfp4 gemv grouped": _linear_case(triton_linear_kernel.F_NVFP4, True, 1),
    "nvfp4 gemv slots swiglu": _linear_case(triton_linear_kernel.F_NVFP4, True, 2, swiglu=True),
    "nvfp4 tiles": _linear_case(triton_linear_kernel.F_NVFP4, False, 0),
    "fp8 gemv": _linear_case(triton_linear_kernel.F_FP8, True, 0),
    "fp8 block tiles": _linear_case(triton_linear_kernel.F_FP8_BLOCK, False, 0),
}


# Triton's own assemblers; the newer one reads the PTX version Triton writes
ASSEMBLERS = [
    Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name for name in ("ptxas-blackwell", "ptxas")
]


def stack_bytes(ptx: str, capability: int) -> int | None:
    """The per-thread stack frame (local memory) ptxas gives the kernel, or None without an assembler that reads it."""
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "kernel.ptx"
        source.write_text(ptx)
        for assembler in ASSEMBLERS:
            if not assembler.exists():
                continue
            done = subprocess.run(
                [str(assembler), f"-arch=sm_{capability}", "-v", str(source), "-o", str(Path(folder) / "kernel.cubin")],
                capture_output=True,
                text=True,
            )
            found = re.search(r"(\d+) bytes stack frame", done.stdout + done.stderr)
            if done.returncode == 0 and found:
                return int(found.group(1))
    return None


def main(capabilities):
    for case, (kernel, pointers, sizes, floats) in CASES.items():
        for capability in capabilities:
            # a case's sizes are its constexprs, or a function of the card giving them and the launch's options
            constexprs, options = sizes(capability) if callable(sizes) else (sizes, {})
            source = ASTSource(
                fn=kernel, signature=_signature(kernel, pointers, constexprs, floats), constexprs=constexprs
            )
            try:
                compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)
                ptx = compiled.asm["ptx"]
                result = {
                    "ptx_target": f".target sm_{capability}" in ptx,
                    "hopper_only": "wgmma" in ptx or "cp.async.bulk" in ptx,
                    "shared_bytes": compiled.metadata.shared,
                    "stack_bytes": stack_bytes(ptx, capability),
                }
            except Exception as error:  # reported, so the test names the kernel that failed
                result = {"error": f"{type(error).__name__}: {error}"[:2000]}
            print(json.dumps({"case": case, "capability": capability, **result}), flush=True)


if __name__ == "__main__":
    main([int(c) for c in sys.argv[1:]])
