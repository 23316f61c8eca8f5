"""Routed experts stay in their checkpoint format in host RAM: a model costs about its file size."""

import subprocess
import sys
from pathlib import Path

import pytest

import engine
from engine.checkpoint.formats import NVFP4
from engine.testing.tiny_checkpoints import write_tiny_checkpoint

# big enough that experts decoded to float32 at load (7x the NVFP4 bytes) could not hide in the slack
LARGER = dict(
    hidden_size=512,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    num_experts=64,
    linear_num_value_heads=8,
    linear_value_head_dim=64,
    linear_key_head_dim=64,
    head_dim=64,
)

MEASURE = """
import resource, sys, torch, engine
def rss_mib():
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20
before = rss_mib()
model = engine.load_model(sys.argv[1])
model.score(torch.arange(2, 66))
print(rss_mib() - before)
"""


def test_nvfp4_experts_are_kept_packed(tiny_checkpoint):
    model = engine.load_model(tiny_checkpoint("qwen3_5_moe", "nvfp4"))
    bank = model.layers[0].mlp.experts
    gate, up, down = bank.stored(0)
    assert {w.format for w in (gate, up, down)} == {NVFP4}
    assert gate.tensors["weight"].dtype.itemsize == 1 and gate.tensors["weight"].shape == (32, 32)
    # 4.5 bits a weight: packed codes plus one fp8 scale per 16 weights, plus the scalar scales
    weights = 8 * 3 * 32 * 64
    assert weights // 2 + weights // 16 <= bank.nbytes <= weights // 2 + weights // 16 + 8 * 3 * 8


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="RSS is read from /proc (Linux)")
def test_resident_memory_is_about_the_file_size(tmp_path):
    folder = write_tiny_checkpoint(tmp_path, "qwen3_5_moe", "nvfp4", text_overrides=LARGER)
    file_mib = sum(p.stat().st_size for p in folder.glob("*.safetensors")) / 2**20
    assert file_mib > 100
    grown = float(
        subprocess.run(
            [sys.executable, "-c", MEASURE, str(folder)], capture_output=True, text=True, check=True
        ).stdout.split()[-1]
    )
    assert grown < 1.3 * file_mib + 64, f"RSS grew {grown:.0f} MiB for a {file_mib:.0f} MiB checkpoint"
