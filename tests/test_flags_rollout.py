"""Rollout flags end to end: from a resolved configuration to what the engine is asked
for, what it generates, and what the trainer and the logger do with the values.

The request-level test needs no pipeline (a recording engine answers); the others run
the tiny SD3 pipeline with two or three denoising steps at 32x32.
"""

from __future__ import annotations

import asyncio
import sys
from types import SimpleNamespace

import pytest
import torch

from miles_core.config.resolve import resolve_config
from miles_core.engine.base import RolloutEngine
from miles_core.errors import ConfigError, RequestError
from miles_core.request import RolloutOutput, RolloutRequest
from miles_core.rollout.data import PromptRecord
from miles_core.rollout.generate import RolloutSettings, generate_rollout, strategy_from_config
from miles_core.step_strategies import epoch_global_random_choice, select_steps

SD35 = ["--hf-checkpoint", "stabilityai/stable-diffusion-3.5-medium"]
WAN22 = ["--hf-checkpoint", "Wan-AI/Wan2.2-T2V-A14B-Diffusers"]  # reads the video and second-expert flags
QWEN = ["--hf-checkpoint", "Qwen/Qwen-Image"]  # reads --diffusion-true-cfg-scale
PROMPTS = [PromptRecord("a red cube", {}, 0), PromptRecord("a blue ball", {}, 1)]


class RecordingEngine(RolloutEngine):
    """Answers every request with blank outputs of the right seeds; records the requests
    and the most requests it saw in flight."""

    @classmethod
    def from_config(cls, config):  # a test double
        raise TypeError("build RecordingEngine directly")

    def __init__(self) -> None:
        self.requests: list[RolloutRequest] = []
        self.in_flight = 0
        self.max_in_flight = 0

    async def generate(self, request: RolloutRequest) -> list[RolloutOutput]:
        self.requests.append(request)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0.01)
            return [
                RolloutOutput(
                    request_id="r",
                    prompt=request.prompt,
                    seed=request.seed + i,
                    generated_output=torch.zeros(3, 8, 8),
                    rollout_log_probs=torch.zeros(request.num_inference_steps),
                )
                for i in range(request.num_outputs_per_prompt)
            ]
        finally:
            self.in_flight -= 1

    async def weights_checksum(self, module_names):
        return {}


def recorded_rollout(config, rollout_id: int = 0) -> RecordingEngine:
    engine = RecordingEngine()
    asyncio.run(generate_rollout(engine, RolloutSettings.from_config(config), rollout_id, PROMPTS, strategy_from_config(config)))
    return engine


ROLLOUT_FLAGS = [
    "--rollout-batch-size",
    "2",
    "--n-samples-per-prompt",
    "4",
    "--rollout-microgroup-size",
    "2",
    "--diffusion-num-steps",
    "6",
    "--diffusion-num-sde-steps",
    "2",
    "--diffusion-sde-window-range",
    "1,4",
    "--diffusion-guidance-scale",
    "3.5",
    "--diffusion-guidance-scale-2",
    "2.5",
    "--diffusion-negative-prompt",
    "blurry",
    "--diffusion-height",
    "48",
    "--diffusion-width",
    "80",
    "--diffusion-output-num-frames",
    "5",
    "--diffusion-fps",
    "12",
    "--diffusion-sde-type",
    "cps",
    "--diffusion-noise-level",
    "0.4",
    "--diffusion-log-prob-no-const",
    "--rollout-seed",
    "1000",
    "--sglang-server-concurrency",
    "1",
]


@pytest.mark.exercises(
    "--rollout-microgroup-size",
    "--diffusion-num-steps",
    "--diffusion-num-sde-steps",
    "--diffusion-sde-window-range",
    "--diffusion-guidance-scale",
    "--diffusion-guidance-scale-2",
    "--diffusion-true-cfg-scale",
    "--diffusion-negative-prompt",
    "--diffusion-height",
    "--diffusion-width",
    "--diffusion-output-num-frames",
    "--diffusion-fps",
    "--diffusion-sde-type",
    "--diffusion-noise-level",
    "--diffusion-log-prob-no-const",
    "--rollout-seed",
    "--sglang-server-concurrency",
)
def test_rollout_flags_reach_the_engine_request():
    engine = recorded_rollout(resolve_config([*WAN22, *ROLLOUT_FLAGS]))
    # Two prompts x (4 samples / microgroups of 2): four requests of two outputs, one at a time.
    assert len(engine.requests) == 4 and engine.max_in_flight == 1
    n = 4
    expected_seeds = sorted(1000 + g * n + offset for g in (0, 1) for offset in (0, 2))
    assert sorted(r.seed for r in engine.requests) == expected_seeds
    for request in engine.requests:
        assert request.num_outputs_per_prompt == 2
        assert request.num_inference_steps == 6
        assert (request.guidance_scale, request.true_cfg_scale) == (3.5, None)
        assert request.extra_sampling_params == {"guidance_scale_2": 2.5}
        assert request.negative_prompt == "blurry"
        assert (request.height, request.width) == (48, 80)
        assert (request.num_frames, request.fps) == (5, 12.0)
        assert (request.rollout_sde_type, request.rollout_noise_level, request.rollout_log_prob_no_const) == ("cps", 0.4, True)
        sde = request.rollout_sde_step_indices
        assert len(sde) == 2 and sde[1] == sde[0] + 1 and 1 <= sde[0] and sde[1] < 4  # inside the window [1, 4)

    # Control: the defaults ask for something else.
    defaults = recorded_rollout(resolve_config([*SD35, "--rollout-batch-size", "2", "--n-samples-per-prompt", "4"]))
    assert len(defaults.requests) == 2 and defaults.max_in_flight == 2  # the sd3 recipe: one request per group
    request = defaults.requests[0]
    assert (request.num_outputs_per_prompt, request.num_inference_steps, request.guidance_scale) == (4, 10, 4.0)
    assert (request.true_cfg_scale, request.negative_prompt, request.height, request.width) == (None, None, None, None)
    assert (request.num_frames, request.fps, request.extra_sampling_params) == (None, None, {})
    assert (request.rollout_sde_type, request.rollout_noise_level, request.rollout_log_prob_no_const) == ("sde", 0.7, False)
    assert request.rollout_sde_step_indices == ()  # --diffusion-num-sde-steps 0
    assert sorted(r.seed for r in defaults.requests) == [42, 46]
    # True CFG, for the family that reads it.
    qwen = recorded_rollout(resolve_config([*QWEN, "--rollout-batch-size", "1", "--diffusion-true-cfg-scale", "5.0"]))
    assert {r.true_cfg_scale for r in qwen.requests} == {5.0}
    # Wan 2.2 training only its high-noise expert, the second scale unset: diffusers' fallback
    # (the first scale) is sent, not left to an engine's own default.
    one = recorded_rollout(
        resolve_config(
            [*WAN22, "--rollout-batch-size", "1", "--update-weight-target-module", "transformer", "--diffusion-guidance-scale", "3.5"]
        )
    )
    assert {r.extra_sampling_params["guidance_scale_2"] for r in one.requests} == {3.5}


@pytest.mark.exercises("--diffusion-step-strategy-path", "--diffusion-sde-candidate-steps")
def test_step_strategy_path_picks_steps_from_the_candidates():
    flags = [
        *SD35,
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "2",
        "--diffusion-num-sde-steps",
        "2",
        "--diffusion-sde-candidate-steps",
        "1,5,7",
    ]
    config = resolve_config([*flags, "--diffusion-step-strategy-path", "miles_core.step_strategies.epoch_global_random_choice"])
    assert strategy_from_config(config) is epoch_global_random_choice
    chosen = {
        select_steps(config, seed=seed, epoch=epoch, strategy=strategy_from_config(config)).sde_steps
        for seed in range(5)
        for epoch in range(6)
    }
    assert all(len(steps) == 2 and set(steps) <= {1, 5, 7} for steps in chosen) and len(chosen) > 1
    # The rollout asks the engine for exactly those steps.
    engine = recorded_rollout(config)
    assert all(set(r.rollout_sde_step_indices) <= {1, 5, 7} for r in engine.requests)
    # Control: without the path the default sde_window ignores the candidates (contiguous windows).
    plain = resolve_config(flags)
    windows = {select_steps(plain, seed=seed, epoch=0, strategy=strategy_from_config(plain)).sde_steps for seed in range(20)}
    assert any(not set(steps) <= {1, 5, 7} for steps in windows)
    # The strategy's own rule: it needs candidates.
    no_candidates = resolve_config(
        [
            *SD35,
            "--rollout-batch-size",
            "2",
            "--diffusion-num-sde-steps",
            "2",
            "--diffusion-step-strategy-path",
            "miles_core.step_strategies.epoch_global_random_choice",
        ]
    )
    with pytest.raises(ValueError, match="epoch_global_random_choice requires --diffusion-sde-candidate-steps"):
        recorded_rollout(no_candidates)
    # ... reported by the training rules before anything loads.
    from miles_core.config.resolve import training_errors

    assert training_errors(no_candidates) == [
        "--diffusion-step-strategy-path miles_core.step_strategies.epoch_global_random_choice: "
        "epoch_global_random_choice requires --diffusion-sde-candidate-steps (e.g. 1,2,3)"
    ]
    assert training_errors(config) == []


# -- on the tiny SD3 pipeline ---------------------------------------------------------------


def tiny_config(tiny_sd3, *extra):
    return resolve_config(
        [
            "--hf-checkpoint",
            str(tiny_sd3),
            "--diffusion-model-family",
            "sd3",
            "--rollout-batch-size",
            "1",
            "--n-samples-per-prompt",
            "1",
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


@pytest.fixture(scope="module")
def engine(tiny_sd3):
    from miles_core.engine.factory import create_engine

    return create_engine(tiny_config(tiny_sd3))


def sample(engine, config):
    (group,) = asyncio.run(
        generate_rollout(engine, RolloutSettings.from_config(config), 0, [PromptRecord("a red cube")], strategy_from_config(config))
    )
    return group[0]


@pytest.mark.exercises("--diffusion-height", "--diffusion-width", "--diffusion-num-steps")
def test_size_and_steps_shape_the_samples(engine, tiny_sd3):
    wide = sample(engine, tiny_config(tiny_sd3, "--diffusion-width", "64"))
    assert wide.pixels.shape == (3, 32, 64)
    assert wide.output.denoising_env["image_kwargs"] == {"height": 32, "width": 64}
    square = sample(engine, tiny_config(tiny_sd3))
    assert square.pixels.shape == (3, 32, 32)
    assert square.log_probs.shape == (3,) and wide.output.dit_trajectory["timesteps"].shape == (3,)
    longer = sample(engine, tiny_config(tiny_sd3, "--diffusion-num-steps", "4"))
    assert longer.log_probs.shape == (4,) and longer.output.dit_trajectory["sigmas"].shape == (5,)


@pytest.mark.exercises("--diffusion-guidance-scale", "--diffusion-negative-prompt")
def test_guidance_scale_and_negative_prompt_change_the_conditioning(engine, tiny_sd3):
    cfg = sample(engine, tiny_config(tiny_sd3, "--diffusion-guidance-scale", "4.5"))
    assert cfg.output.denoising_env["guidance"]["guidance_scale"] == 4.5
    assert cfg.output.denoising_env["neg_cond_kwargs"] is not None
    off = sample(engine, tiny_config(tiny_sd3, "--diffusion-guidance-scale", "1.0"))
    assert off.output.denoising_env["neg_cond_kwargs"] is None  # diffusers' rule: CFG only above 1
    assert not torch.equal(cfg.pixels, off.pixels)
    negative = sample(
        engine, tiny_config(tiny_sd3, "--diffusion-guidance-scale", "4.5", "--diffusion-negative-prompt", "blurry, low quality")
    )
    neg_default = cfg.output.denoising_env["neg_cond_kwargs"]["encoder_hidden_states"]
    neg_given = negative.output.denoising_env["neg_cond_kwargs"]["encoder_hidden_states"]
    assert not torch.equal(neg_default, neg_given)
    assert torch.equal(
        cfg.output.denoising_env["pos_cond_kwargs"]["encoder_hidden_states"],
        negative.output.denoising_env["pos_cond_kwargs"]["encoder_hidden_states"],
    )
    assert not torch.equal(cfg.pixels, negative.pixels)


@pytest.mark.exercises("--diffusion-sde-type", "--diffusion-noise-level", "--diffusion-log-prob-no-const")
def test_sde_type_noise_level_and_no_const_reach_engine_and_trainer(engine, tiny_sd3):
    from miles_core.engine.factory import sde_backend
    from miles_core.plugin_manager import get_host
    from miles_core.sde import CpsBackend, FlowSdeBackend
    from miles_core.training.trainer import Trainer

    sde = sample(engine, tiny_config(tiny_sd3))
    cps = sample(engine, tiny_config(tiny_sd3, "--diffusion-sde-type", "cps"))
    assert not torch.equal(sde.pixels, cps.pixels)
    ode = sample(engine, tiny_config(tiny_sd3, "--diffusion-sde-type", "ode"))
    assert torch.equal(ode.log_probs, torch.zeros(3)) and (sde.log_probs[:2] != 0).all()
    quiet = sample(engine, tiny_config(tiny_sd3, "--diffusion-noise-level", "0.2"))
    assert not torch.equal(sde.pixels, quiet.pixels)
    no_const = sample(engine, tiny_config(tiny_sd3, "--diffusion-sde-type", "cps", "--diffusion-log-prob-no-const"))
    assert torch.equal(no_const.pixels, cps.pixels) and not torch.equal(no_const.log_probs, cps.log_probs)
    assert (no_const.log_probs[:2] < 0).all()

    # The trainer recomputes with the same dynamics.
    config = tiny_config(tiny_sd3, "--diffusion-sde-type", "cps", "--diffusion-noise-level", "0.2", "--diffusion-log-prob-no-const")
    assert sde_backend(config) is CpsBackend and sde_backend(tiny_config(tiny_sd3)) is FlowSdeBackend
    trainer = Trainer(engine.family, config, sde_backend(config), get_host().registries.loss.get("policy_loss").load())
    assert (type(trainer.backend), trainer.backend.noise_level, trainer.backend.log_prob_no_const) == (CpsBackend, 0.2, True)


@pytest.mark.exercises("--diffusion-true-cfg-scale", "--diffusion-output-num-frames", "--diffusion-guidance-scale-2", "--diffusion-fps")
def test_sd3_refuses_video_and_other_family_guidance_flags(engine, tiny_sd3):
    from dataclasses import replace

    from miles_core.errors import ConfigError

    # At configuration time, before anything loads: the family declares what it reads.
    with pytest.raises(ConfigError) as caught:
        tiny_config(
            tiny_sd3,
            "--diffusion-true-cfg-scale",
            "4.0",
            "--diffusion-output-num-frames",
            "3",
            "--diffusion-guidance-scale-2",
            "3.0",
            "--diffusion-fps",
            "8",
        )
    reads = "(it reads none of the family-specific generation flags)"
    assert caught.value.messages == [
        f"--diffusion-output-num-frames 3: the sd3 family does not read it {reads}",
        f"--diffusion-fps 8.0: the sd3 family does not read it {reads}",
        f"--diffusion-guidance-scale-2 3.0: the sd3 family does not read it {reads}",
        f"--diffusion-true-cfg-scale 4.0: the sd3 family does not read it {reads}",
    ]
    # A request that arrives another way (HTTP, a custom rollout) is refused by the family.
    settings = RolloutSettings.from_config(tiny_config(tiny_sd3))
    cases = [
        ({"diffusion_true_cfg_scale": 4.0}, "true_cfg_scale: SD3 has no true CFG"),
        ({"diffusion_output_num_frames": 3}, "num_frames: SD3 generates images (1 frame), got 3"),
    ]
    for change, message in cases:
        with pytest.raises(RequestError) as request_error:
            asyncio.run(
                generate_rollout(
                    engine, replace(settings, **change), 0, [PromptRecord("a red cube")], strategy_from_config(tiny_config(tiny_sd3))
                )
            )
        assert str(request_error.value).startswith(message), request_error.value
    # Control: the values that mean "an image, no other guidance" are accepted.
    sample(engine, tiny_config(tiny_sd3, "--diffusion-output-num-frames", "1"))


@pytest.mark.exercises("--update-weight-target-module")
def test_update_weight_target_module_selects_the_trained_components(engine, tiny_sd3):
    from miles_core.training.trainer import target_modules

    first, second = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    two_experts = SimpleNamespace(components=lambda: {"transformer": first, "transformer_2": second})
    wan = [*WAN22, "--rollout-batch-size", "1", "--diffusion-guidance-scale-2", "3"]
    both = resolve_config([*wan, "--update-weight-target-module", "transformer,transformer_2"])
    assert target_modules(both, two_experts) == {"transformer": first, "transformer_2": second}
    low = resolve_config([*wan, "--update-weight-target-module", "transformer_2"])
    assert target_modules(low, two_experts) == {"transformer_2": second}
    assert target_modules(resolve_config([*SD35, "--rollout-batch-size", "1"]), two_experts) == {"transformer": first}
    # A module the family's checkpoint does not have is a configuration error, one line
    # naming the flag, the value and the modules there are.
    with pytest.raises(ConfigError) as refused:
        resolve_config([*SD35, "--rollout-batch-size", "1", "--update-weight-target-module", "transformer,transformer_2"])
    assert refused.value.messages == [
        "--update-weight-target-module transformer,transformer_2: transformer_2 is not a trainable module of the sd3 "
        "family's checkpoint (its trainable modules: transformer)"
    ]
    with pytest.raises(ConfigError) as refused:
        resolve_config([*SD35, "--rollout-batch-size", "1", "--update-weight-target-module", ","])
    assert refused.value.messages == ["--update-weight-target-module ',': names no module to train (the sd3 family's: transformer)"]
    # The trainer refuses a component the family does not have too, naming what it trains
    # (a --train-pipeline-config-path class is checked only there).
    with pytest.raises(ValueError) as caught:
        target_modules(SimpleNamespace(update_weight_target_module="transformer,vae_decoder"), engine.family)
    assert str(caught.value) == (
        "--update-weight-target-module transformer,vae_decoder: unknown component(s) vae_decoder; this family trains transformer"
    )


@pytest.mark.exercises("--diffusion-generator-device")
def test_noise_is_drawn_on_the_cpu_and_the_model_goes_where_a_gpu_is(tiny_sd3, monkeypatch):
    from miles_core.engine.factory import create_engine
    from miles_core.errors import ConfigError
    from miles_sd3.family import SD3Family

    # auto and cpu both mean CPU generators, with or without GPUs; cuda (the model's GPU)
    # needs a visible GPU, but where an http engine's servers (elsewhere) draw the noise.
    assert tiny_config(tiny_sd3).diffusion_generator_device == "cpu"
    assert tiny_config(tiny_sd3, "--diffusion-generator-device", "cpu").diffusion_generator_device == "cpu"
    monkeypatch.setattr("miles_core.config.resolve.visible_gpu_count", lambda: 0)
    with pytest.raises(ConfigError) as caught:
        tiny_config(tiny_sd3, "--diffusion-generator-device", "cuda")
    assert caught.value.messages == [
        "--diffusion-generator-device cuda: no NVIDIA GPU is visible here (the noise is drawn on the model's GPU); use cpu (or auto)"
    ]
    remote = ["--rollout-engine", "http", "--rollout-engine-urls", "http://127.0.0.1:1"]
    assert tiny_config(tiny_sd3, *remote, "--diffusion-generator-device", "cuda").diffusion_generator_device == "cuda"
    monkeypatch.setattr("miles_core.config.resolve.visible_gpu_count", lambda: 1)
    assert tiny_config(tiny_sd3, "--diffusion-generator-device", "cuda").diffusion_generator_device == "cuda"
    assert tiny_config(tiny_sd3).diffusion_generator_device == "cpu"  # auto stays the CPU on a GPU machine
    # The flag reaches every rollout request (control: the default sends cpu).
    cuda = recorded_rollout(tiny_config(tiny_sd3, "--diffusion-generator-device", "cuda"))
    assert cuda.requests and {r.generator_device for r in cuda.requests} == {"cuda"}
    assert {r.generator_device for r in recorded_rollout(tiny_config(tiny_sd3)).requests} == {"cpu"}
    monkeypatch.undo()
    # The model's device comes from the machine, not from this flag.
    asked = []

    def record(cls, checkpoint, *, device="cpu", dtype=None):
        asked.append(str(device))
        raise RuntimeError("stop before loading")

    monkeypatch.setattr(SD3Family, "from_pretrained", classmethod(record))
    for gpus in (2, 0):
        monkeypatch.setattr("miles_core.model_loading.visible_gpu_count", lambda: gpus)
        with pytest.raises(RuntimeError, match="stop before loading"):
            create_engine(tiny_config(tiny_sd3))
    assert asked == ["cuda", "cpu"]
    monkeypatch.undo()


@pytest.mark.exercises("--diffusion-fps")
def test_fps_sets_the_frame_duration_of_logged_videos(tmp_path, monkeypatch):
    import imageio.v3 as iio
    from PIL import Image

    from miles_core.training.metrics_logging import WandbLogger

    frames = (torch.rand(4, 8, 8, 3) * 255).to(torch.uint8).numpy()

    def logged(fps):
        stub = SimpleNamespace(
            config=SimpleNamespace(diffusion_fps=fps),
            media_dir=SimpleNamespace(name=str(tmp_path)),
            wandb=SimpleNamespace(Video=lambda path, caption, format: path),
        )
        return WandbLogger._video(stub, frames, f"fps_{fps}", "a caption")

    # MP4 (the video extra): the stream's rate is --diffusion-fps; unset: 8.
    assert iio.immeta(logged(20.0), plugin="FFMPEG")["fps"] == 20.0
    assert iio.immeta(logged(None), plugin="FFMPEG")["fps"] == 8.0
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)  # no video extra: animated GIFs
    durations = {}
    for fps in (4.0, 20.0, None):
        with Image.open(logged(fps)) as gif:
            assert gif.n_frames == 4
            durations[fps] = gif.info["duration"]
    # 1000 / fps ms per frame (GIF stores centiseconds); unset: 8 fps, 125 ms.
    assert (durations[4.0], durations[20.0]) == (250, 50)
    assert abs(durations[None] - 125) <= 10
