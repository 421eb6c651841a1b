"""--rollout-engine builds engines from a resolved configuration."""

import asyncio

import pytest
import torch

from miles_core.config.resolve import resolve_config
from miles_core.engine.embedded import EmbeddedEngine
from miles_core.engine.factory import create_engine
from miles_core.engine.http import HttpEngine
from miles_core.rollout.data import PromptRecord
from miles_core.rollout.generate import RolloutSettings, generate_rollout, strategy_from_config
from miles_core.sde import CpsBackend


class HalfNoiseCps(CpsBackend):
    """A one-off backend for --sde-step-backend-path: CPS at half the noise level."""

    name = "half_noise_cps"

    def scale(self, sigma, sigma_next, sigma_max):
        return super().scale(sigma, sigma_next, sigma_max) / 2


def config_for(tiny_sd3, *extra):
    return resolve_config(
        [
            "--hf-checkpoint",
            str(tiny_sd3),
            "--diffusion-model-family",
            "sd3",
            "--rollout-batch-size",
            "1",
            "--n-samples-per-prompt",
            "2",
            "--diffusion-num-steps",
            "3",
            "--diffusion-num-sde-steps",
            "2",
            "--diffusion-height",
            "32",
            "--diffusion-width",
            "32",
            *extra,
        ]
    )


def test_embedded_engine_from_config_runs_a_rollout(tiny_sd3):
    config = config_for(tiny_sd3)
    engine = create_engine(config)
    assert isinstance(engine, EmbeddedEngine)
    assert engine.family.device.type == "cpu" and engine.family.dtype == torch.float32
    settings = RolloutSettings.from_config(config)
    groups = asyncio.run(generate_rollout(engine, settings, 0, [PromptRecord("a red cube")], strategy_from_config(config)))
    (group,) = groups
    assert [s.seed for s in group] == [config.rollout_seed, config.rollout_seed + 1]
    assert [tuple(s.sde_step_indices) for s in group] == [(0, 1), (0, 1)]
    assert all(s.log_probs[:2].ne(0).all() and s.log_probs[2] == 0 for s in group)


@pytest.mark.exercises("--sde-step-backend-path")
def test_custom_sde_backend_path_is_served_under_its_path(tiny_sd3):
    path = "tests.test_engine_factory.HalfNoiseCps"
    config = config_for(tiny_sd3, "--sde-step-backend-path", path, "--diffusion-log-prob-no-const")
    engine = create_engine(config)
    assert engine.backends[path] is HalfNoiseCps
    settings = RolloutSettings.from_config(config)
    assert settings.diffusion_sde_type == path
    strategy = strategy_from_config(config)
    (group,) = asyncio.run(generate_rollout(engine, settings, 0, [PromptRecord("a red cube")], strategy))
    std = group[0].output.rollout_debug_tensors  # debug mode is off: none
    assert std is None
    # Control: the built-in cps gives other samples from the same seeds.
    plain = config_for(tiny_sd3, "--diffusion-sde-type", "cps", "--diffusion-log-prob-no-const")
    (other,) = asyncio.run(
        generate_rollout(create_engine(plain), RolloutSettings.from_config(plain), 0, [PromptRecord("a red cube")], strategy)
    )
    assert not torch.equal(group[0].pixels, other[0].pixels)


@pytest.mark.exercises("--rollout-engine", "--rollout-engine-urls", "--sglang-server-concurrency")
def test_http_engine_from_config():
    config = resolve_config(
        [
            "--hf-checkpoint",
            "stabilityai/stable-diffusion-3.5-medium",
            "--rollout-batch-size",
            "1",
            "--rollout-engine",
            "http",
            "--rollout-engine-urls",
            "http://127.0.0.1:1,http://127.0.0.1:2",
            "--sglang-server-concurrency",
            "3",
        ]
    )
    engine = create_engine(config)
    assert isinstance(engine, HttpEngine)
    assert engine.urls == ["http://127.0.0.1:1", "http://127.0.0.1:2"] and engine.max_concurrency == 3


def test_a_host_cache_keeps_its_byte_bound_least_recently_used_first(tiny_sd3):
    """The trainer's SFT prompt cache (on_host, max_bytes): entries on the host, the
    encodings handed back equal to a fresh encode, the oldest evicted past the bound."""
    from miles_core.engine.sampler import ConditioningCache
    from miles_core.request import RolloutRequest

    engine = create_engine(config_for(tiny_sd3))
    family = engine.family
    params = family.resolve_params(RolloutRequest(prompt="p", num_inference_steps=2, height=32, width=32))
    one = ConditioningCache(max_entries=100, on_host=True)
    one.encode(family, "a red cube", None, params)
    size = one.nbytes
    assert size > 0
    cache = ConditioningCache(max_entries=100, on_host=True, max_bytes=2 * size)
    for prompt in ("a red cube", "a blue ball", "a red cube", "a green tree"):
        cond = cache.encode(family, prompt, None, params)
        fresh = family.encode(prompt, None, params)
        assert all(torch.equal(cond.positive[k], fresh.positive[k]) for k in fresh.positive)
        assert all(t.device == family.device for t in cond.positive.values())
    # "a blue ball" was the least recently used when "a green tree" came: it went.
    assert (cache.misses, cache.hits, cache.nbytes) == (3, 1, 2 * size)
    cache.encode(family, "a red cube", None, params)
    cache.encode(family, "a blue ball", None, params)
    assert (cache.misses, cache.hits) == (4, 2)
    # Control: without the bound nothing is evicted.
    unbounded = ConditioningCache(max_entries=100, on_host=True)
    for prompt in ("a red cube", "a blue ball", "a green tree", "a blue ball"):
        unbounded.encode(family, prompt, None, params)
    assert (unbounded.misses, unbounded.hits, unbounded.nbytes) == (3, 1, 3 * size)
    # An entry larger than the bound is used, not kept.
    tiny = ConditioningCache(max_entries=100, on_host=True, max_bytes=size - 1)
    tiny.encode(family, "a red cube", None, params)
    assert tiny.nbytes == 0


def test_microgroups_of_one_prompt_encode_it_once(tiny_sd3):
    from miles_core.request import RolloutRequest

    config = config_for(tiny_sd3)
    engine = create_engine(config)
    cache = engine.conditioning_cache
    request = RolloutRequest(
        prompt="a blue ball",
        seed=3,
        num_inference_steps=2,
        height=32,
        width=32,
        num_outputs_per_prompt=2,
        rollout_return_dit_trajectory=True,
    )
    first = engine.generate_sync(request)
    second = engine.generate_sync(request)
    assert (cache.misses, cache.hits) == (1, 1)
    assert all(torch.equal(a.generated_output, b.generated_output) for a, b in zip(first, second))
    # Without the cache the samples are the same bit for bit.
    from miles_core.engine.sampler import sample

    uncached = sample(engine.family, request.with_request_id(), engine.backends)
    assert all(torch.equal(a.generated_output, b.generated_output) for a, b in zip(first, uncached))
    # Control: a weight update clears it, and another prompt is another entry.
    transformer = engine.family.components()["transformer"]
    name, parameter = next(iter(transformer.named_parameters()))
    engine.update_weights_from_tensors("transformer", {name: parameter.detach().clone()})
    engine.generate_sync(request)
    assert cache.misses == 2
