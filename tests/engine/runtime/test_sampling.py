"""Each sampling control changes which tokens can be drawn, in the order and with the semantics documented."""

import math
from collections import Counter

import pytest
import torch

from engine.runtime.sampling import Sampler, SamplingParams

# Every control off, so a test switches on only the one it checks.
PLAIN = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0)


def sampler(seed=0, **settings) -> Sampler:
    return Sampler(SamplingParams(**{**PLAIN, "seed": seed, **settings}))


def log_probs(*probs: float) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs], dtype=torch.float32)


def draws(sample: Sampler, logits: torch.Tensor, n: int = 1000, context=(), generated=()) -> Counter:
    return Counter(sample(logits, context, generated) for _ in range(n))


def test_greedy_picks_the_argmax_whatever_the_seed():
    logits = torch.tensor([1.0, 3.0, 2.0, -1.0])
    assert {sampler(seed, temperature=0.0)(logits, [], []) for seed in range(20)} == {1}


@pytest.mark.parametrize("temperature", [0.5, 1.0, 5.0, 100.0])
def test_top_k_1_is_greedy_at_any_temperature(temperature):
    logits = torch.tensor([1.0, 1.1, 0.9, 1.05])
    assert set(draws(sampler(temperature=temperature, top_k=1), logits, 200)) == {1}


def test_top_k_2_draws_only_the_two_best():
    logits = torch.tensor([1.7, 2.0, 1.8, 1.9, 1.6])
    assert set(draws(sampler(top_k=2), logits)) == {1, 3}


@pytest.mark.parametrize(
    "top_p, nucleus", [(0.05, {0}), (0.4, {0}), (0.75, {0, 1}), (0.9, {0, 1, 2}), (0.99, {0, 1, 2, 3})]
)
def test_top_p_keeps_the_smallest_set_reaching_top_p(top_p, nucleus):
    logits = log_probs(0.5, 0.3, 0.15, 0.05)
    assert set(draws(sampler(top_p=top_p), logits, 2000)) == nucleus


def test_top_p_applies_to_what_top_k_left():
    # After top_k=2 the two best hold 0.625 and 0.375, so top_p=0.6 needs only the best.
    logits = log_probs(0.5, 0.3, 0.15, 0.05)
    assert set(draws(sampler(top_k=2, top_p=0.6), logits)) == {0}
    assert set(draws(sampler(top_k=0, top_p=0.6), logits)) == {0, 1}


@pytest.mark.parametrize("min_p, kept", [(0.1, {0, 1, 2}), (0.2, {0, 1}), (0.9, {0})])
def test_min_p_drops_tokens_below_min_p_times_the_best(min_p, kept):
    logits = log_probs(0.6, 0.3, 0.08, 0.02)
    assert set(draws(sampler(min_p=min_p), logits, 3000)) == kept


def test_repetition_penalty_turns_away_from_a_token_in_the_context():
    logits = torch.tensor([2.0, 1.8, 0.5])
    assert sampler(temperature=0.0)(logits, [0], []) == 0
    assert sampler(temperature=0.0, repetition_penalty=1.3)(logits, [0], []) == 1  # 2.0 / 1.3 < 1.8


def test_repetition_penalty_multiplies_negative_logits():
    logits = torch.tensor([-1.0, -1.2, -5.0])
    # -1.0 * 1.3 = -1.3 falls below -1.2; dividing would have raised it to -0.77.
    assert sampler(temperature=0.0, repetition_penalty=1.3)(logits, [0], []) == 1


def test_repetition_penalty_covers_the_prompt_and_counts_each_token_once():
    logits = torch.tensor([2.0, 1.2, 1.0])
    greedy_penalised = sampler(temperature=0.0, repetition_penalty=1.3)
    assert greedy_penalised(logits, [0, 0, 0], []) == 0  # 2.0 / 1.3 = 1.54; three times would be 0.91
    assert greedy_penalised(torch.tensor([2.0, 1.8, 1.0]), [0, 2], []) == 1  # a prompt token, never generated


def test_presence_penalty_lowers_only_generated_tokens():
    greedy = sampler(temperature=0.0, presence_penalty=0.5)
    assert greedy(torch.tensor([1.8, 2.0, 0.0]), [0, 1], [1]) == 0  # generated 2.0 - 0.5 < 1.8
    assert greedy(torch.tensor([2.0, 1.8, 0.0]), [0, 1], [1]) == 0  # prompt-only token 0 keeps its 2.0


def test_presence_penalty_is_subtracted_once_per_token():
    greedy = sampler(temperature=0.0, presence_penalty=0.2)
    assert greedy(torch.tensor([1.7, 2.0]), [1, 1, 1], [1, 1, 1]) == 1  # 1.8; three times would be 1.4


def test_frequency_penalty_grows_with_each_repeat_of_a_generated_token():
    greedy = sampler(temperature=0.0, frequency_penalty=0.2)
    assert greedy(torch.tensor([1.7, 2.0]), [1], [1]) == 1  # once: 2.0 - 0.2 = 1.8 > 1.7
    assert greedy(torch.tensor([1.7, 2.0]), [1, 1], [1, 1]) == 0  # twice: 1.6 < 1.7
    assert greedy(torch.tensor([1.7, 2.0]), [1, 1], []) == 1  # prompt tokens are not counted
    with pytest.raises(ValueError, match="frequency_penalty"):
        SamplingParams(frequency_penalty=3.0).validate()


def test_a_very_low_temperature_behaves_like_greedy():
    logits = torch.tensor([1.0, 1.1, 0.9, 1.05])
    assert set(draws(sampler(temperature=1e-4), logits, 200)) == {1}


def test_a_very_high_temperature_spreads_draws_evenly():
    logits = torch.tensor([4.0, 2.0, 0.0, -2.0])
    counts = draws(sampler(temperature=1e4), logits, 2000)
    assert set(counts) == {0, 1, 2, 3}
    assert all(400 < n < 600 for n in counts.values()), counts


def random_logits(steps: int, vocab: int = 100) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    return [torch.randn(vocab, generator=generator) * 3 for _ in range(steps)]


def generate(sample: Sampler, steps: list[torch.Tensor]) -> list[int]:
    tokens = []
    for logits in steps:
        tokens.append(sample(logits, tokens, tokens))
    return tokens


def test_the_same_seed_draws_the_same_tokens_and_another_seed_does_not():
    steps = random_logits(50)
    first = generate(sampler(seed=7), steps)
    assert generate(sampler(seed=7), steps) == first
    assert generate(sampler(seed=8), steps) != first


def test_a_sampler_without_a_seed_reports_one_that_replays_it():
    steps = random_logits(50)
    unseeded = Sampler(SamplingParams(**PLAIN))
    tokens = generate(unseeded, steps)
    assert isinstance(unseeded.seed, int)
    assert generate(Sampler(SamplingParams(**PLAIN, seed=unseeded.seed)), steps) == tokens


def test_sampling_leaves_the_callers_logits_alone():
    logits = torch.tensor([2.0, -1.0, 0.5])
    before = logits.clone()
    sampler(temperature=0.5, top_k=2, top_p=0.9, min_p=0.1, repetition_penalty=1.5, presence_penalty=1.0)(
        logits, [0, 1], [1]
    )
    assert torch.equal(logits, before)


@pytest.mark.parametrize(
    "setting, value, allowed",
    [
        ("temperature", -0.1, ">= 0"),
        ("temperature", float("nan"), ">= 0"),
        ("top_k", -1, ">= 0"),
        ("top_p", 0.0, "in (0, 1]"),
        ("top_p", 1.5, "in (0, 1]"),
        ("min_p", 1.0, "in [0, 1)"),
        ("min_p", -0.1, "in [0, 1)"),
        ("repetition_penalty", 0.0, "> 0"),
        ("presence_penalty", 2.5, "in [-2, 2]"),
        ("presence_penalty", -3.0, "in [-2, 2]"),
        ("max_new_tokens", 0, ">= 1"),
        ("stop", ("</s>", ""), "a sequence of non-empty strings"),
        ("stop", "</s>", "a sequence of non-empty strings"),
    ],
)
def test_validation_names_the_setting_its_range_and_the_value(setting, value, allowed):
    params = SamplingParams(**{setting: value})
    with pytest.raises(ValueError) as raised:
        params.validate()
    assert str(raised.value) == f"{setting} must be {allowed}, got {value!r}"
    with pytest.raises(ValueError):
        Sampler(params)


def test_the_defaults_and_the_edges_of_each_range_are_valid():
    SamplingParams().validate()
    SamplingParams(
        temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, presence_penalty=-2.0, max_new_tokens=1, stop=("</s>",)
    ).validate()
    SamplingParams(presence_penalty=2.0, repetition_penalty=0.01).validate()


QWEN_GENERATION_CONFIG = {
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
    "transformers_version": "4.57.0",
}


def test_from_generation_config_reads_the_known_keys_and_keeps_defaults_for_the_rest():
    params = SamplingParams.from_generation_config(QWEN_GENERATION_CONFIG)
    assert params == SamplingParams(temperature=0.6, top_k=20, top_p=0.95)


def test_from_generation_config_maps_every_sampling_key():
    config = {
        "temperature": 1,
        "top_k": 40,
        "top_p": 0.9,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "presence_penalty": 1.5,
        "max_new_tokens": 256,
    }
    params = SamplingParams.from_generation_config(config)
    assert params == SamplingParams(
        temperature=1.0,
        top_k=40,
        top_p=0.9,
        min_p=0.05,
        repetition_penalty=1.1,
        presence_penalty=1.5,
        max_new_tokens=256,
    )
    assert isinstance(params.temperature, float)


def test_do_sample_false_means_greedy():
    params = SamplingParams.from_generation_config({**QWEN_GENERATION_CONFIG, "do_sample": False})
    assert params.temperature == 0.0


def test_overrides_win_and_none_overrides_are_ignored():
    params = SamplingParams.from_generation_config(
        {**QWEN_GENERATION_CONFIG, "do_sample": False}, temperature=0.9, top_p=None, seed=3, stop=("</s>",)
    )
    assert (params.temperature, params.top_p, params.seed, params.stop) == (0.9, 0.95, 3, ("</s>",))
