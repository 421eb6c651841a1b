"""Schedule and SFT-source flags: ``--diffusion-flow-shift`` (the engine's sampling
schedule, sent as ``extra_sampling_params.flow_shift``), ``--fsdp-flow-shift`` (the SFT
sigma grid) and ``--sft-encoder-checkpoint`` (SFT's tokenizers, text encoders and VAE).

The shift is diffusers' ``FlowMatchEulerDiscreteScheduler`` ``shift``:
``σ' = s·σ / (1 + (s − 1)·σ)`` on the grid ``linspace(1, σ_min, T)`` with ``σ_min =
shift_s(1 / num_train_timesteps)``, timesteps ``1000·σ'``, and a terminal 0.
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

from miles_core.config.resolve import resolve_config
from miles_core.engine.embedded import EmbeddedEngine
from miles_core.errors import ConfigError, RequestError
from miles_core.request import RolloutRequest

SIZE, STEPS, SHIFT = 32, 4, 5.0
PROMPT = "a red cube on a blue table"


def shift(s: float, sigma: np.ndarray | float) -> np.ndarray | float:
    return s * sigma / (1 + (s - 1) * sigma)


def expected_sigmas(s: float, steps: int, num_train_timesteps: int = 1000) -> np.ndarray:
    """The formula in float64: diffusers' raw grid runs between the shifted endpoints of
    its training sigmas (1 and shift_s(1/N)), then the shift is applied to it."""
    raw = np.linspace(1.0, shift(s, 1.0 / num_train_timesteps), steps)
    return np.append(shift(s, raw), 0.0)


def copy_with_scheduler_shift(src: Path, dst: Path, value: float) -> Path:
    shutil.copytree(src, dst)
    path = dst / "scheduler" / "scheduler_config.json"
    config = json.loads(path.read_text())
    config["shift"] = value
    path.write_text(json.dumps(config))
    return dst


def request(**overrides) -> RolloutRequest:
    fields = dict(
        prompt=PROMPT,
        seed=11,
        height=SIZE,
        width=SIZE,
        num_inference_steps=STEPS,
        guidance_scale=4.5,
        num_outputs_per_prompt=2,
        rollout_return_dit_trajectory=True,
    )
    return RolloutRequest(**{**fields, **overrides})


def with_shift(req: RolloutRequest, value: float) -> RolloutRequest:
    from dataclasses import replace

    return replace(req, extra_sampling_params={**req.extra_sampling_params, "flow_shift": value})


@pytest.fixture(scope="module")
def engine(tiny_sd3) -> EmbeddedEngine:
    return EmbeddedEngine.from_checkpoint(tiny_sd3, "sd3")


@pytest.fixture(scope="module")
def shifted_dir(tiny_sd3, tmp_path_factory) -> Path:
    """The tiny pipeline whose scheduler config says shift 5 (the tiny's own says 3)."""
    return copy_with_scheduler_shift(tiny_sd3, tmp_path_factory.mktemp("shifted") / "stable-diffusion-3-tiny", SHIFT)


# -- --diffusion-flow-shift: the schedule -------------------------------------------------


@pytest.mark.exercises("--diffusion-flow-shift")
@pytest.mark.parametrize("s", [0.5, 1.0, SHIFT, 12.0])
def test_shifted_schedule_is_the_formula_and_diffusers_scheduler_with_that_shift(engine, s):
    family = engine.family
    params = family.resolve_params(with_shift(request(), s))
    assert params.flow_shift == s
    schedule = family.schedule(params)
    reference = FlowMatchEulerDiscreteScheduler(shift=s)
    reference.set_timesteps(STEPS)
    assert torch.equal(schedule.sigmas, reference.sigmas)
    assert torch.equal(schedule.timesteps, reference.timesteps)
    expected = expected_sigmas(s, STEPS)
    assert np.abs(schedule.sigmas.double().numpy() - expected).max() < 1e-6  # fp32 rounding of the float64 formula
    assert np.abs(schedule.timesteps.double().numpy() - 1000 * expected[:-1]).max() < 1e-3


@pytest.mark.exercises("--diffusion-flow-shift")
def test_unset_shift_is_the_checkpoint_schedulers_own(engine):
    family = engine.family
    assert family.pipeline.scheduler.config.shift == 3.0  # the tiny pipeline's config
    unset = family.schedule(family.resolve_params(request()))
    assert family.resolve_params(request()).flow_shift is None
    assert torch.equal(unset.sigmas, family.schedule(family.resolve_params(with_shift(request(), 3.0))).sigmas)
    shifted = family.schedule(family.resolve_params(with_shift(request(), SHIFT))).sigmas
    assert (shifted[1:-1] - unset.sigmas[1:-1]).abs().min() > 1e-2  # control: the shift moves every inner sigma


@pytest.mark.exercises("--diffusion-flow-shift")
def test_explicit_shift_replaces_dynamic_shifting(engine):
    family = engine.family
    original = family.pipeline.scheduler
    family.pipeline.scheduler = FlowMatchEulerDiscreteScheduler.from_config(original.config, use_dynamic_shifting=True)
    try:
        dynamic = family.schedule(family.resolve_params(request())).sigmas
        explicit = family.schedule(family.resolve_params(with_shift(request(), SHIFT))).sigmas
    finally:
        family.pipeline.scheduler = original
    reference = FlowMatchEulerDiscreteScheduler(shift=SHIFT)
    reference.set_timesteps(STEPS)
    assert torch.equal(explicit, reference.sigmas)
    assert not torch.equal(dynamic, explicit)


# -- --diffusion-flow-shift: the request ----------------------------------------------------


@pytest.mark.exercises("--diffusion-flow-shift")
def test_flow_shift_travels_in_extra_sampling_params_and_round_trips(engine):
    req = with_shift(request(request_id="r"), SHIFT)
    body = json.loads(json.dumps(req.to_json()))
    assert body["extra_sampling_params"] == {"flow_shift": SHIFT}  # where sglang-diffusion reads it
    back = RolloutRequest.from_json(body)
    assert back == req and back.flow_shift == SHIFT
    assert RolloutRequest.from_json({"prompt": "x", "extra_sampling_params": {"flow_shift": 2}}).flow_shift == 2.0
    assert RolloutRequest.from_json({"prompt": "x"}).flow_shift is None
    for bad in (0, -1.5, "5", True, float("nan"), float("inf")):
        with pytest.raises(RequestError, match=r"^extra_sampling_params: flow_shift must be a finite number > 0"):
            RolloutRequest.from_json({"prompt": "x", "extra_sampling_params": {"flow_shift": bad}})
    # A request built in-process (no from_json) is checked when the family resolves it.
    with pytest.raises(RequestError, match=r"^extra_sampling_params: flow_shift must be"):
        engine.generate_sync(with_shift(request(), -1.0))


@pytest.mark.exercises("--diffusion-flow-shift")
def test_config_puts_the_shift_on_every_rollout_request(tiny_sd3, prompts):
    from miles_core.rollout.generate import RolloutSettings
    from miles_core.rollout.seeds import microgroups

    base = [
        "--hf-checkpoint",
        str(tiny_sd3),
        "--prompt-data",
        str(prompts),
        "--rollout-batch-size",
        "1",
        "--n-samples-per-prompt",
        "2",
        "--diffusion-num-steps",
        str(STEPS),
    ]
    group = microgroups(0, 0, 2, 2)[0]
    shifted = RolloutSettings.from_config(resolve_config([*base, "--diffusion-flow-shift", "5"]))
    assert shifted.request("p", group, (0,), (0, STEPS)).flow_shift == SHIFT
    plain = RolloutSettings.from_config(resolve_config(base))
    assert plain.request("p", group, (0,), (0, STEPS)).flow_shift is None


# -- --diffusion-flow-shift: what the engine generates -----------------------------------


def assert_same(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x.generated_output, y.generated_output)
        assert torch.equal(x.rollout_log_probs, y.rollout_log_probs)
        for key in ("latents", "timesteps", "sigmas"):
            assert torch.equal(x.dit_trajectory[key], y.dit_trajectory[key]), key


@pytest.mark.exercises("--diffusion-flow-shift")
def test_engine_with_a_shift_equals_a_checkpoint_whose_scheduler_has_it(engine, shifted_dir):
    req = request()
    with_flag = engine.generate_sync(with_shift(req, SHIFT))
    plain = engine.generate_sync(req)
    # Control: the shift changes what is generated.
    assert (with_flag[0].generated_output - plain[0].generated_output).abs().max() > 1e-4
    assert not torch.equal(with_flag[0].rollout_log_probs, plain[0].rollout_log_probs)
    # Parity: the same as the checkpoint whose scheduler config has shift 5, bit for bit.
    assert_same(with_flag, EmbeddedEngine.from_checkpoint(shifted_dir, "sd3").generate_sync(req))
    # The trajectory records the shifted sigmas: what the trainer recomputes log-probs on.
    reference = FlowMatchEulerDiscreteScheduler(shift=SHIFT)
    reference.set_timesteps(STEPS)
    assert torch.equal(with_flag[0].dit_trajectory["sigmas"], reference.sigmas)
    assert np.abs(plain[0].dit_trajectory["sigmas"].double().numpy() - expected_sigmas(3.0, STEPS)).max() < 1e-6


@pytest.mark.exercises("--diffusion-flow-shift")
def test_evaluation_with_a_shift_matches_diffusers_with_that_scheduler_shift(engine, tiny_sd3, shifted_dir):
    req = request(rollout=False, rollout_return_dit_trajectory=False, num_outputs_per_prompt=1)
    ours = engine.generate_sync(with_shift(req, SHIFT))[0].generated_output
    noise = torch.randn((1, 4, SIZE // 8, SIZE // 8), generator=torch.Generator().manual_seed(req.seed))

    def diffusers_image(checkpoint: Path) -> torch.Tensor:
        pipe = StableDiffusion3Pipeline.from_pretrained(str(checkpoint))
        pipe.set_progress_bar_config(disable=True)
        return pipe(
            PROMPT,
            negative_prompt=" ",
            latents=noise,
            height=SIZE,
            width=SIZE,
            num_inference_steps=STEPS,
            guidance_scale=4.5,
            output_type="pt",
        ).images[0]

    assert (ours - diffusers_image(shifted_dir)).abs().max() <= 1e-5  # the family's tolerance against diffusers
    assert (ours - diffusers_image(tiny_sd3)).abs().max() > 1e-4  # control: the unshifted pipeline differs


@pytest.mark.exercises("--diffusion-flow-shift")
def test_served_engine_applies_the_shift_and_refuses_a_bad_one(engine):
    from miles_core.engine.http import HttpEngine
    from miles_core.engine.server import create_app, start_server
    from miles_core.errors import EngineRequestError

    req = with_shift(request(request_id="served"), SHIFT)

    async def main():
        server = await start_server(create_app(engine))
        try:
            async with HttpEngine(server.url) as client:
                await client.wait_until_healthy(timeout=30, interval=0.05)
                got = await client.generate(req)
                with pytest.raises(EngineRequestError, match=r"HTTP 400: extra_sampling_params: flow_shift must be"):
                    await client.generate(with_shift(req, 0.0))
                return got
        finally:
            await server.close()

    assert_same(asyncio.run(asyncio.wait_for(main(), 120)), engine.generate_sync(req))


# -- --fsdp-flow-shift: the SFT sigma grid ------------------------------------------------


def write_sft_rows(root: Path) -> Path:
    from PIL import Image

    (root / "images").mkdir(parents=True)
    rows = []
    for i, colour in enumerate([(220, 30, 30), (30, 30, 220), (30, 200, 30)]):
        Image.new("RGB", (40, 40), colour).save(root / "images" / f"{i}.png")
        rows.append(json.dumps({"input": f"square {i}", "image": f"images/{i}.png"}))
    (root / "sft.jsonl").write_text("\n".join(rows) + "\n")
    return root / "sft.jsonl"


def sft_config(checkpoint: Path, data: Path, *extra: str):
    return resolve_config(
        [
            "--hf-checkpoint",
            str(checkpoint),
            "--diffusion-model-family",
            "sd3",
            "--prompt-data",
            str(data),
            "--loss-type",
            "sft_loss",
            "--rollout-batch-size",
            "3",
            "--diffusion-num-steps",
            "10",
            "--diffusion-height",
            str(SIZE),
            "--diffusion-width",
            str(SIZE),
            *extra,
        ]
    )


@pytest.mark.exercises("--fsdp-flow-shift")
@pytest.mark.parametrize("s", [None, 0.5, SHIFT])
def test_sft_draws_its_sigmas_from_the_shifted_grid(engine, tiny_sd3, tmp_path, s):
    from miles_core.training.sft import load_sft_rows, sft_batch, sft_params

    data = write_sft_rows(tmp_path)
    config = sft_config(tiny_sd3, data, *([] if s is None else ["--fsdp-flow-shift", str(s)]))
    family = engine.family
    params = sft_params(family, config)
    assert params.flow_shift == s
    rows = load_sft_rows(data, input_key="input", image_key="image")
    batch = sft_batch(family, rows, params, torch.Generator().manual_seed(7))
    steps = torch.randint(0, 10, (3,), generator=torch.Generator().manual_seed(7))  # sft_batch's first draw
    # Unset: the checkpoint scheduler's own shift (3.0 in the tiny pipeline's config).
    grid = expected_sigmas(3.0 if s is None else s, 10)
    assert np.abs(batch["sigma"].double().numpy() - grid[steps.numpy()]).max() < 1e-6
    assert np.abs(batch["timestep"].double().numpy() - 1000 * grid[steps.numpy()]).max() < 1e-3
    sigma = batch["sigma"].view(-1, 1, 1, 1)
    x_t = (1 - sigma) * batch["x0"]["latents"] + sigma * batch["noise"]["latents"]
    assert torch.allclose(batch["x_t"]["latents"], x_t, atol=1e-6, rtol=0)
    if s is not None:  # control: another shift, another grid
        assert np.abs(grid[1:-1] - expected_sigmas(3.0, 10)[1:-1]).min() > 1e-3


# -- --sft-encoder-checkpoint ----------------------------------------------------------


@pytest.fixture(scope="module")
def encoder_dirs(tiny_sd3, tmp_path_factory):
    """``train``: the tiny pipeline with its transformer nudged; ``encoders``: the tiny
    pipeline with its VAE and first text encoder nudged (the ones SFT must use);
    ``transformer_only``: ``train`` without any tokenizer, text encoder or VAE folder."""
    root = tmp_path_factory.mktemp("encoders")
    pipe = StableDiffusion3Pipeline.from_pretrained(str(tiny_sd3))
    with torch.no_grad():
        for module in (pipe.vae, pipe.text_encoder):
            for p in module.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    pipe.save_pretrained(root / "encoders")
    train = shutil.copytree(tiny_sd3, root / "stable-diffusion-3-train")
    transformer = StableDiffusion3Pipeline.from_pretrained(str(tiny_sd3)).transformer
    with torch.no_grad():
        for p in transformer.parameters():
            p.mul_(1.01)
    transformer.save_pretrained(train / "transformer")
    bare = shutil.copytree(train, root / "stable-diffusion-3-transformer-only")
    for folder in ("vae", "text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer", "tokenizer_2", "tokenizer_3"):
        shutil.rmtree(bare / folder)
    return {"train": train, "encoders": root / "encoders", "transformer_only": bare, "tiny": Path(tiny_sd3)}


def state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def same_weights(module: torch.nn.Module, reference: dict[str, torch.Tensor]) -> bool:
    current = module.state_dict()
    return current.keys() == reference.keys() and all(torch.equal(current[k], reference[k]) for k in reference)


@pytest.mark.exercises("--sft-encoder-checkpoint")
def test_sft_takes_tokenizers_text_encoders_and_vae_from_the_encoder_checkpoint(encoder_dirs, tmp_path):
    from miles_core.model_loading import load_sft_family
    from miles_core.training.sft import load_sft_rows, sft_batch, sft_params

    data = write_sft_rows(tmp_path)
    encoders = StableDiffusion3Pipeline.from_pretrained(str(encoder_dirs["encoders"]))
    trained = StableDiffusion3Pipeline.from_pretrained(str(encoder_dirs["train"]))
    plain_family = load_sft_family(sft_config(encoder_dirs["train"], data))
    assert not same_weights(plain_family.pipeline.vae, state(encoders.vae))  # the fixture really differs
    for checkpoint in ("train", "transformer_only"):
        family = load_sft_family(sft_config(encoder_dirs[checkpoint], data, "--sft-encoder-checkpoint", str(encoder_dirs["encoders"])))
        pipe = family.pipeline
        for name in ("vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
            assert same_weights(getattr(pipe, name), state(getattr(encoders, name))), name
        assert same_weights(pipe.transformer, state(trained.transformer))
        assert pipe.tokenizer_3 is not None and pipe.scheduler is not None
    # What SFT computes: latents from the encoder checkpoint's VAE, prompts from its text
    # encoders; the transformer's checkpoint alone (control) gives other ones.
    rows = load_sft_rows(data, input_key="input", image_key="image")
    params = sft_params(family, sft_config(encoder_dirs["train"], data))
    ours = sft_batch(family, rows, params, torch.Generator().manual_seed(0))
    reference = load_sft_family(sft_config(encoder_dirs["encoders"], data))
    expected = sft_batch(reference, rows, params, torch.Generator().manual_seed(0))
    plain = sft_batch(plain_family, rows, params, torch.Generator().manual_seed(0))
    assert torch.equal(ours["x0"]["latents"], expected["x0"]["latents"])
    assert torch.equal(ours["cond"].positive["pooled_projections"], expected["cond"].positive["pooled_projections"])
    assert (ours["x0"]["latents"] - plain["x0"]["latents"]).abs().max() > 1e-4
    assert (ours["cond"].positive["pooled_projections"] - plain["cond"].positive["pooled_projections"]).abs().max() > 1e-4


@pytest.mark.exercises("--sft-encoder-checkpoint")
def test_sft_encoder_checkpoint_without_the_components_is_a_one_line_error(encoder_dirs, tmp_path):
    from miles_core.errors import RunError
    from miles_core.model_loading import load_sft_family

    data = write_sft_rows(tmp_path / "data")
    lacking = shutil.copytree(encoder_dirs["encoders"], tmp_path / "lacking")
    shutil.rmtree(lacking / "vae")
    index = json.loads((lacking / "model_index.json").read_text())
    del index["tokenizer_2"]
    (lacking / "model_index.json").write_text(json.dumps(index))
    for directory, message in [
        (
            lacking,
            r"^--sft-encoder-checkpoint \S+lacking: lacks vae, tokenizer_2 \(each of .* needs a model_index.json "
            r"entry and a folder\)$",
        ),
        (tmp_path / "nowhere", r"^--sft-encoder-checkpoint \S+nowhere: not a local diffusers pipeline directory"),
    ]:
        config = sft_config(encoder_dirs["train"], data, "--sft-encoder-checkpoint", str(directory))
        with pytest.raises(RunError, match=message) as excinfo:
            load_sft_family(config)
        assert "\n" not in str(excinfo.value)


# -- configuration rules ------------------------------------------------------------------


@pytest.mark.exercises("--diffusion-flow-shift", "--fsdp-flow-shift", "--sft-encoder-checkpoint")
def test_bad_shift_and_sft_source_flags_are_one_line_config_errors(tiny_sd3, prompts, tmp_path):
    data = write_sft_rows(tmp_path)
    rl = ["--hf-checkpoint", str(tiny_sd3), "--prompt-data", str(prompts), "--rollout-batch-size", "1"]
    sft = ["--hf-checkpoint", str(tiny_sd3), "--prompt-data", str(data), "--rollout-batch-size", "1", "--loss-type", "sft_loss"]
    cases = [
        (rl + ["--diffusion-flow-shift", "0"], "--diffusion-flow-shift 0.0: must be positive"),
        (rl + ["--diffusion-flow-shift", "nan"], "--diffusion-flow-shift nan: must be a finite number > 0"),
        (sft + ["--fsdp-flow-shift", "-2"], "--fsdp-flow-shift -2.0: must be positive"),
        (rl + ["--fsdp-flow-shift", "2"], "--fsdp-flow-shift applies to --loss-type sft_loss only"),
        (sft + ["--diffusion-flow-shift", "2"], "--diffusion-flow-shift shapes the rollout engine's schedule"),
        (rl + ["--sft-encoder-checkpoint", str(tiny_sd3)], "--sft-encoder-checkpoint requires --loss-type sft_loss"),
    ]
    for argv, message in cases:
        with pytest.raises(ConfigError) as excinfo:
            resolve_config(argv)
        assert any(line.startswith(message) for line in str(excinfo.value).splitlines()), (argv, str(excinfo.value))
    resolve_config(rl + ["--diffusion-flow-shift", "3"])  # controls: the same flags where they apply
    resolve_config(sft + ["--fsdp-flow-shift", "3", "--sft-encoder-checkpoint", str(tiny_sd3)])
    assert math.isclose(resolve_config(sft + ["--fsdp-flow-shift", "3"]).fsdp_flow_shift, 3.0)


@pytest.mark.exercises("--diffusion-flow-shift")
def test_a_run_with_a_shift_trains_on_the_shifted_sigmas_with_zero_drift(tiny_sd3, prompts, tmp_path):
    from miles_core.training.debug_data import load_rollout_data
    from miles_core.training.run import train

    config = resolve_config(
        [
            "--hf-checkpoint",
            str(tiny_sd3),
            "--diffusion-model-family",
            "sd3",
            "--prompt-data",
            str(prompts),
            "--rollout-batch-size",
            "1",
            "--n-samples-per-prompt",
            "2",
            "--rollout-microgroup-size",
            "2",
            "--diffusion-num-steps",
            str(STEPS),
            "--diffusion-num-sde-steps",
            "2",
            "--diffusion-height",
            str(SIZE),
            "--diffusion-width",
            str(SIZE),
            "--rm-type",
            "jpeg_incompressibility",
            "--num-rollout",
            "1",
            "--debug-skip-optimizer-step",
            "--diffusion-debug-mode",
            "--micro-batch-size-sample",
            "2",
            "--micro-batch-size-tstep",
            "1",
            "--diffusion-flow-shift",
            str(SHIFT),
            "--save-debug-rollout-data",
            str(tmp_path / "rollouts" / "{}.msgpack"),
            "--output-dir",
            str(tmp_path / "run"),
        ]
    )
    path = asyncio.run(train(config, log=lambda line: None))
    (record,) = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    # The trainer recomputes the engine's log-probs on the recorded (shifted) sigmas exactly.
    assert record["train/log_prob_max_abs_diff"] == 0.0 and record["train/model_output_max_abs_diff"] == 0.0
    samples, _ = load_rollout_data(str(tmp_path / "rollouts" / "{}.msgpack"), 0)
    reference = FlowMatchEulerDiscreteScheduler(shift=SHIFT)
    reference.set_timesteps(STEPS)
    for sample in samples:
        assert torch.equal(sample.output.dit_trajectory["sigmas"], reference.sigmas)
