"""The FP8 KV cache: e4m3 rows with a scale per KV head, the checkpoint's where it ships them, else measured from
the first rows; the attention kernels read it directly (the Triton decode kernel in its CPU interpreter here), the
model's logits stay near the bf16 cache's, and the planner's guaranteed prompt grows with the smaller rows."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import engine
from engine.checkpoint.quant_config import declares_fp8_kv_cache, kv_cache_choice, read_quant_settings
from engine.cli import main
from engine.kernels import reference
from engine.layers.attention import E4M3_MAX, MEASURED_SCALE_MARGIN, KVCache
from engine.runtime.footprint import footprint_from_synthetic
from engine.runtime.planner import GIB, plan_memory

triton = pytest.importorskip("triton", reason="Triton ships for Linux; the Windows app runs the reference kernels")
tl = triton.language

from engine.kernels import triton_attention, triton_prefill_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3_STEP = 2.0**-3  # a normal e4m3 value's spacing relative to its binade: rounding is within half of it
# Model logits, fp8 cache against bf16 cache, as max |diff| / max |bf16 logits|, on the tiny NVFP4 checkpoint over a
# 150-token prompt: the rows' e4m3 rounding (2^-4 relative) averaged through the softmax; measured 0.25 % there
MODEL_LOGITS_TOLERANCE = 0.01


def _cache_with(rows_k, rows_v, fixed=None, capacity=96):
    cache = KVCache(rows_k.shape[1], rows_k.shape[2], capacity, DEVICE, torch.float8_e4m3fn, fixed)
    cache.append(rows_k.to(DEVICE), rows_v.to(DEVICE))
    return cache


def _dequantised(cache):
    n = cache.length
    return (
        reference.dequantize_e4m3(cache.keys[:n], cache.scales[0]),
        reference.dequantize_e4m3(cache.values[:n], cache.scales[1]),
    )


def _fp8_rows(k, v, capacity):
    """(key bytes [capacity, Hkv, D], value bytes [capacity, Hkv, Dv], scales [2, Hkv]) as caches store them, for
    keys and values of different head sizes (one cache holds one size)."""
    keys, values = _cache_with(k, k, capacity=capacity), _cache_with(v, v, capacity=capacity)
    return keys.keys, values.values, torch.stack([keys.scales[0], values.scales[1]])


# ---- e4m3 in Triton, without fp8 instructions -------------------------------------------------------------


@triton.jit
def _decode_bytes(raw_ptr, out_ptr, N: tl.constexpr):
    at = tl.arange(0, N)
    tl.store(out_ptr + at, triton_attention.e4m3_to_float32(tl.load(raw_ptr + at)))


def test_e4m3_bit_decoding_is_torchs_conversion_for_every_byte():
    raw = torch.arange(256, dtype=torch.uint8, device=DEVICE)
    got = torch.empty(256, device=DEVICE)
    _decode_bytes[(1,)](raw, got, N=256)
    expected = raw.view(torch.float8_e4m3fn).float()
    nan = expected.isnan()
    assert nan.sum() == 2 and torch.equal(got.isnan(), nan)  # 0x7F and 0xFF
    assert torch.equal(got[~nan], expected[~nan])  # bit for bit, subnormals included
    assert torch.equal(got[~nan].signbit(), expected[~nan].signbit())  # and -0.0 (0x80)


# ---- the cache --------------------------------------------------------------------------------------------


def test_measured_scales_and_rounding():
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(20, 2, 32, generator=gen) * torch.tensor([1.0, 30.0])[None, :, None]  # heads of unlike size
    v = torch.randn(20, 2, 32, generator=gen)
    cache = _cache_with(k, v)
    assert cache.keys.dtype == torch.uint8 and cache.keys.element_size() == 1
    expected = torch.stack([k.abs().amax(dim=(0, 2)), v.abs().amax(dim=(0, 2))]) * MEASURED_SCALE_MARGIN / E4M3_MAX
    assert torch.allclose(cache.scales.cpu(), expected, rtol=1e-6)
    keys, values = _dequantised(cache)
    for got, want, scales in ((keys, k, cache.scales[0]), (values, v, cache.scales[1])):
        normal = want.abs() >= 2.0**-6 * scales.cpu()[None, :, None]  # e4m3's smallest normal, scaled
        error = (got.cpu() - want).abs()
        assert (error[normal] <= E4M3_STEP / 2 * want.abs()[normal] * (1 + 1e-6)).all()
        assert (error[~normal] <= 2.0**-10 * scales.cpu().max()).all()  # half a subnormal step


def test_later_rows_keep_the_first_scales_and_saturate_beyond_them():
    k, v = torch.ones(4, 1, 16), torch.ones(4, 1, 16)
    cache = _cache_with(k, v)
    first = cache.scales.clone()
    big = torch.full((1, 1, 16), 10 * MEASURED_SCALE_MARGIN)
    cache.write_at(torch.tensor([4], device=DEVICE), big.to(DEVICE), -big.to(DEVICE))  # as a decode step writes
    cache.advance()
    assert torch.equal(cache.scales, first)
    keys, values = _dequantised(cache)
    assert torch.equal(keys[4].cpu(), torch.full((1, 16), MEASURED_SCALE_MARGIN))  # clamped to 448 x scale
    assert torch.equal(values[4].cpu(), torch.full((1, 16), -MEASURED_SCALE_MARGIN))


def test_a_decode_step_may_measure_the_scales():
    cache = KVCache(2, 16, 8, DEVICE, torch.float8_e4m3fn)
    row = torch.randn(1, 2, 16, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    cache.write_at(torch.tensor([0], device=DEVICE), row, 2 * row)
    measured = row.abs().amax(dim=(0, 2)).cpu() * MEASURED_SCALE_MARGIN / E4M3_MAX
    assert torch.allclose(cache.scales.cpu(), torch.stack([measured, 2 * measured]), rtol=1e-6)


def test_fixed_scales_are_used_as_given():
    fixed = torch.tensor([[0.5], [0.25]])
    cache = _cache_with(torch.ones(3, 2, 16), torch.ones(3, 2, 16), fixed=fixed)
    assert torch.equal(cache.scales.cpu(), fixed.expand(2, 2))
    assert torch.equal(cache.keys[:3].cpu(), torch.full((3, 2, 16), 0x40, dtype=torch.uint8))  # 2.0 = 1 / 0.5
    assert torch.equal(cache.values[:3].cpu(), torch.full((3, 2, 16), 0x48, dtype=torch.uint8))  # 4.0 = 1 / 0.25


def test_host_copies_keep_their_scales():
    gen = torch.Generator().manual_seed(3)
    source = _cache_with(torch.randn(10, 2, 16, generator=gen), torch.randn(10, 2, 16, generator=gen))
    saved = source.host_copy()
    assert saved.scales is not None and saved.tensors[-1] is saved.scales
    other = _cache_with(100 * torch.randn(5, 2, 16, generator=gen), torch.randn(5, 2, 16, generator=gen))
    other.load(saved)
    assert torch.equal(other.scales, source.scales) and other.length == 10
    assert torch.equal(other.keys[:10], source.keys[:10]) and torch.equal(other.values[:10], source.values[:10])
    clone = source.clone()
    assert torch.equal(clone.scales, source.scales) and clone.scales.data_ptr() != source.scales.data_ptr()
    plain = KVCache(2, 16, 16, DEVICE, torch.float32)
    with pytest.raises(ValueError, match="own dtype"):
        plain.load(saved)


# ---- attention over the cache ------------------------------------------------------------------------------


@pytest.mark.parametrize("new, total", [(37, 37), (1, 1), (16, 53), (9, 100), (1, 77)])
def test_fp8_causal_attention_is_attention_over_the_dequantised_rows(monkeypatch, new, total):
    """Several query and key blocks (shrunk) with the causal mask crossing them."""
    monkeypatch.setattr(reference, "ATTENTION_QUERY_BLOCK", 8)
    monkeypatch.setattr(reference, "ATTENTION_KEY_BLOCK", 16)
    gen = torch.Generator().manual_seed(new * 100 + total)
    k, v = torch.randn(total, 2, 32, generator=gen), torch.randn(total, 2, 16, generator=gen)
    raw_k, raw_v, scales = _fp8_rows(k, v, total)
    q = torch.randn(new, 8, 32, generator=gen).to(DEVICE)
    keys, values = reference.dequantize_e4m3(raw_k, scales[0]), reference.dequantize_e4m3(raw_v, scales[1])
    expected = reference.causal_attention(q, keys, values, 0.2)
    got = engine.kernels.causal_attention(q, raw_k, raw_v, 0.2, scales)
    assert got.shape == (new, 8, 16) and got.dtype == q.dtype
    # the same float32 math, blocked; on CUDA the Triton kernel, whose dots run in TF32 from Ampere on
    tolerance = 5e-3 if triton_attention.dot_precision(raw_k) == "tf32" else 1e-5
    assert torch.allclose(got, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("new, total", [(37, 37), (1, 1), (16, 53), (9, 100), (40, 41)])
@pytest.mark.parametrize("heads, kv_heads, dim, value_dim", [(8, 2, 32, 16), (4, 4, 16, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_prefill_attention_reads_the_fp8_cache(new, total, heads, kv_heads, dim, value_dim, dtype):
    """A prompt chunk over the FP8 cache in one kernel (triton_prefill_attention): blocks of queries and keys with
    the causal mask crossing them, the earlier chunks' keys before them; NaN bytes beyond the keys never read."""
    gen = torch.Generator().manual_seed(new * 100 + total + heads)
    k, v = torch.randn(total, kv_heads, dim, generator=gen), torch.randn(total, kv_heads, value_dim, generator=gen)
    raw_k, raw_v, scales = _fp8_rows(k, v, total + 20)
    raw_k[total:] = 0x7F
    raw_v[total:] = 0x7F
    q = torch.randn(new, heads, dim, generator=gen).to(DEVICE, dtype)
    got = triton_prefill_attention.fp8_causal_attention(q, raw_k[:total], raw_v[:total], dim**-0.5, scales)
    expected = reference.fp8_causal_attention(q.float(), raw_k[:total], raw_v[:total], dim**-0.5, scales)
    assert got.shape == (new, heads, value_dim) and got.dtype == dtype
    tolerance = 1e-2  # bf16: the output's rounding
    if dtype == torch.float32:  # TF32 dots on Ampere and up, as in the decode kernel
        tolerance = 5e-3 if triton_attention.dot_precision(raw_k) == "tf32" else 1e-5
    assert torch.allclose(got.float(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("heads, kv_heads, dim, value_dim", [(16, 2, 64, 64), (4, 4, 32, 16), (8, 1, 16, 32)])
@pytest.mark.parametrize("position", [0, 15, 77])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_decode_attention_reads_the_fp8_cache(heads, kv_heads, dim, value_dim, position, dtype):
    gen = torch.Generator().manual_seed(position + heads)
    rows = position + 1
    k, v = torch.randn(rows, kv_heads, dim, generator=gen), torch.randn(rows, kv_heads, value_dim, generator=gen)
    raw_k, raw_v, scales = _fp8_rows(k, v, 96)
    raw_k[rows:] = 0x7F  # NaN bytes beyond the token: never read
    raw_v[rows:] = 0x7F
    q = torch.randn(1, heads, dim, generator=gen).to(DEVICE, dtype)
    at = torch.tensor([position], device=DEVICE)
    assert triton_attention.decode_attention_capturable(q, raw_k, raw_v)
    got = triton_attention.decode_attention(q, raw_k, raw_v, at, dim**-0.5, scales)
    keys = reference.dequantize_e4m3(raw_k[:rows], scales[0])
    values = reference.dequantize_e4m3(raw_v[:rows], scales[1])
    expected = reference.causal_attention(q.float(), keys, values, dim**-0.5)
    assert got.shape == (1, heads, value_dim) and got.dtype == dtype
    tolerance = 1e-2  # bf16: the output's rounding
    if dtype == torch.float32:  # on Ampere and up the kernel's dots run in TF32: q and the weights keep 10 bits
        tolerance = 5e-3 if triton_attention.dot_precision(raw_k) == "tf32" else 1e-5
    assert torch.allclose(got.float(), expected, rtol=tolerance, atol=tolerance)
    on_reference = reference.decode_attention(q, raw_k, raw_v, at, dim**-0.5, scales)
    assert torch.allclose(on_reference.float(), expected, rtol=tolerance, atol=tolerance)


# ---- the option, the model ---------------------------------------------------------------------------------


def test_which_checkpoints_declare_an_fp8_kv_cache(tiny_checkpoint):
    nvfp4, bf16 = tiny_checkpoint("qwen3_5_moe", "nvfp4"), tiny_checkpoint("qwen3_5_moe", "bf16")
    config = json.loads((nvfp4 / "config.json").read_text())["quantization_config"]
    assert declares_fp8_kv_cache(config)
    assert declares_fp8_kv_cache({"kv_cache_quant_algo": "FP8"})  # hf_quant_config.json's spelling
    assert not declares_fp8_kv_cache({"kv_cache_scheme": None, "kv_cache_quant_algo": None})
    assert read_quant_settings(nvfp4, None).kv_cache_fp8  # from hf_quant_config.json alone
    assert not read_quant_settings(bf16, None).kv_cache_fp8
    quant = read_quant_settings(nvfp4, config)
    assert [kv_cache_choice(c, quant) for c in ("auto", "bf16", "fp8")] == ["bf16", "bf16", "fp8"]  # auto: not yet
    with pytest.raises(ValueError, match="auto, bf16, fp8"):
        kv_cache_choice("int8", quant)


@pytest.fixture(scope="module")
def nvfp4_models(tiny_checkpoint):
    folder = tiny_checkpoint("qwen3_5_moe", "nvfp4")
    return engine.load_model(folder, kv_cache_dtype="fp8"), engine.load_model(folder, kv_cache_dtype="bf16")


def _prompt(n=150):
    return torch.randint(2, 320, (n,), generator=torch.Generator().manual_seed(5))


def test_model_logits_on_the_fp8_cache_stay_near_the_bf16_caches(nvfp4_models):
    fp8, plain = nvfp4_models
    states = fp8.new_state(200), plain.new_state(200)
    attention = [s for s in states[0].layers if isinstance(s, KVCache)]
    assert attention and all(s.keys.dtype == torch.uint8 for s in attention)
    assert all(s.keys.dtype == torch.float32 for s in states[1].layers if isinstance(s, KVCache))
    ids = _prompt()
    for model, state in zip(nvfp4_models, states):
        model.forward(ids[:100], state)  # a prefill chunk measures the scales
    for start in range(100, 150, 10):  # then chunks and single decode tokens
        chunk = ids[start : start + (1 if start % 20 else 10)]
        got, expected = (model.forward(chunk, state) for model, state in zip(nvfp4_models, states))
        assert float((got - expected).abs().max() / expected.abs().max()) <= MODEL_LOGITS_TOLERANCE


def test_the_checkpoints_kv_scales_are_the_caches(tiny_checkpoint, tmp_path):
    folder = shutil.copytree(tiny_checkpoint("qwen3_5_moe", "nvfp4"), tmp_path / "with-kv-scales")
    tensors = load_file(folder / "model.safetensors")
    attention = "model.language_model.layers.3.self_attn"
    tensors[f"{attention}.k_proj.k_scale"] = torch.tensor(0.03125)  # ModelOpt's names, per tensor
    tensors[f"{attention}.v_proj.v_scale"] = torch.tensor(0.0078125)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    model = engine.load_model(folder, kv_cache_dtype="fp8")
    state = model.new_state(64)
    cache = state.layers[3]
    assert torch.equal(cache.scales, torch.tensor([[0.03125] * 2, [0.0078125] * 2]))
    model.forward(_prompt(20), state)
    assert torch.equal(cache.scales, torch.tensor([[0.03125] * 2, [0.0078125] * 2]))  # not measured over


# ---- the plans ---------------------------------------------------------------------------------------------


def test_fp8_kv_cache_plans():
    """An FP8 KV cache plans at half the bytes a token; auto stays bf16 until the FP8 path is measured on a GPU."""
    auto, bf16, fp8_kv = (
        footprint_from_synthetic("qwen3.6-35b-a3b-nvfp4"),
        footprint_from_synthetic("qwen3.6-35b-a3b-nvfp4", "bf16"),
        footprint_from_synthetic("qwen3.6-35b-a3b-nvfp4", "fp8"),
    )
    assert (auto.kv_cache, fp8_kv.kv_cache) == ("bf16", "fp8") and auto == bf16
    assert fp8_kv.kv_bytes_per_token == 10 * 2 * 2 * 256 == bf16.kv_bytes_per_token // 2
    plans = {kv: plan_memory(fp, 4 * GIB, "4gb") for kv, fp in (("fp8", fp8_kv), ("bf16", bf16))}
    assert plans["fp8"].kv_cache == "fp8" and "(fp8)" in plans["fp8"].format_table()
    assert plans["fp8"].max_prompt_tokens >= 1.8 * plans["bf16"].max_prompt_tokens, plans["fp8"].format_table()
    assert plans["fp8"].breakdown["total"] <= 4 * GIB
    for preset, budget in (("8gb", 8 * GIB), ("12gb", 12 * GIB)):  # never less prompt or cache than bf16's
        fp8, plain = plan_memory(fp8_kv, budget, preset), plan_memory(bf16, budget, preset)
        assert fp8.max_prompt_tokens >= plain.max_prompt_tokens
        assert fp8.expert_cache_layers >= plain.expert_cache_layers


def test_plan_cli_takes_the_kv_cache_option(capsys):
    figures = {}
    for kv in ("auto", "bf16", "fp8"):
        assert (
            main(["plan", "--synthetic", "qwen3.6-35b-a3b-nvfp4", "--preset", "4gb", "--kv-cache", kv, "--json"]) == 0
        )
        figures[kv] = json.loads(capsys.readouterr().out)
    assert figures["auto"] == figures["bf16"] != figures["fp8"]
    assert (figures["fp8"]["kv_cache"], figures["bf16"]["kv_cache"]) == ("fp8", "bf16")
