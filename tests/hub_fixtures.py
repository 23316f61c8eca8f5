"""Fixtures shared by the download tests: a private huggingface_hub home and a local fake Hub with tiny repos.

tests/conftest.py registers the fixtures for every test module; import the repo names from here.
"""

from __future__ import annotations

import json

import pytest

from engine.testing.hub_server import FakeHub

TINY = "Org/Tiny-MoE"  # Qwen3.5-MoE layout, NVFP4, two shards and an index, plus files the engine skips
QWEN3 = "Org/Tiny-Qwen3"  # Qwen3-MoE, bf16, one file
GATED = "Org/Gated-MoE"
NOT_MOE = "Org/Llama-Tiny"  # a config the engine does not run
NO_WEIGHTS = "Org/Bin-Only"
SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
TOKEN = "hf_test_token"


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    """huggingface_hub online (the suite runs with HF_HUB_OFFLINE=1), with its token file in a temp folder."""
    from huggingface_hub import constants

    home = tmp_path / "hf-home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(home / "stored_tokens"))
    return home


@pytest.fixture
def fake_hub(hf_home, tiny_checkpoint):
    """A started FakeHub serving the tiny repos; stopped after the test."""
    hub = FakeHub(valid_tokens=(TOKEN,))
    nvfp4 = tiny_checkpoint("qwen3_5_moe", "nvfp4", shards=2)
    extras = {
        "README.md": b"# Tiny MoE\n",
        ".gitattributes": b"*.safetensors filter=lfs\n",
        "original/consolidated.safetensors": b"\0" * 64,
        "preprocessor_config.json": b"{}",
    }
    hub.add_repo(TINY, nvfp4, files=extras)
    hub.add_repo(QWEN3, tiny_checkpoint("qwen3_moe", "bf16"))
    hub.add_repo(GATED, nvfp4, gated=True)
    hub.add_repo(
        NOT_MOE,
        files={
            "config.json": json.dumps({"model_type": "llama"}).encode(),
            "model.safetensors": (b"\x02\0\0\0\0\0\0\0{}"),
        },
    )
    hub.add_repo(NO_WEIGHTS, files={"config.json": b"{}", "pytorch_model.bin": b"\0" * 16})
    with hub:
        yield hub
