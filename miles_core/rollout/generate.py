"""Generating one rollout: prompt groups, microgroups, seeds, concurrent requests.

Each prompt group of ``n_samples_per_prompt`` samples is split into microgroups of at
most ``rollout_microgroup_size`` outputs, one ``/rollout/generate`` request each, with
the seed layout of :mod:`miles_core.rollout.seeds`. All microgroups of a rollout run as
concurrent tasks: an engine that caps each of its servers (``caps_per_server``, the
``http`` engines) keeps at most ``--sglang-server-concurrency`` in flight per server;
for any other engine the rollout keeps at most that many in flight in all. Which server
serves a microgroup changes nothing in it (its seed is fixed before it is sent); results
come back in (group, sample) order whatever order the requests finish in. ``on_microgroup`` is
called as each microgroup returns, so scoring can overlap generation.

:func:`diffusion_rollout` is the whole built-in rollout behind ``miles-core train``,
with the signature a ``--rollout-function-path`` function has, so one can wrap it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from miles_core.engine.base import RolloutEngine
from miles_core.request import RolloutRequest
from miles_core.rollout.data import PromptRecord
from miles_core.rollout.requests import Generate, engine_generate, extra_sampling_params
from miles_core.rollout.sample import Sample
from miles_core.rollout.seeds import Microgroup, group_index, microgroups
from miles_core.step_strategies import StepStrategy, select_steps

MicrogroupCallback = Callable[[list[Sample]], Awaitable[None]]


@dataclass(frozen=True)
class RolloutSettings:
    """What a rollout needs from the configuration (flag names as in the CLI)."""

    n_samples_per_prompt: int
    rollout_microgroup_size: int
    rollout_batch_size: int
    rollout_seed: int
    diffusion_num_steps: int
    diffusion_num_sde_steps: int
    diffusion_sde_window_range: tuple[int, int] | None
    diffusion_sde_candidate_steps: tuple[int, ...] | None
    diffusion_guidance_scale: float
    diffusion_true_cfg_scale: float | None
    diffusion_negative_prompt: str | None
    diffusion_height: int | None
    diffusion_width: int | None
    diffusion_output_num_frames: int
    diffusion_fps: float | None
    diffusion_sde_type: str
    diffusion_noise_level: float
    diffusion_log_prob_no_const: bool
    diffusion_debug_mode: bool
    sglang_server_concurrency: int
    diffusion_generator_device: str = "cpu"
    """Where the engine's per-output generators draw the noise (the requests' ``generator_device``)."""
    extra_sampling_params: Mapping[str, Any] = field(default_factory=dict)
    config: Any = field(default=None, compare=False, repr=False)
    """The run's whole configuration, for step strategies that read their own flags
    (:attr:`miles_core.step_strategies.StepContext.config`)."""

    @classmethod
    def from_config(cls, config: Any) -> RolloutSettings:
        from dataclasses import fields

        values = {f.name: getattr(config, f.name) for f in fields(cls) if f.name not in ("extra_sampling_params", "config")}
        if getattr(config, "sde_step_backend_path", None):
            # A one-off backend travels under its path (EmbeddedEngine.from_config registers it so).
            values["diffusion_sde_type"] = config.sde_step_backend_path
        return cls(**values, extra_sampling_params=extra_sampling_params(config), config=config)

    def request(
        self, prompt: str, microgroup: Microgroup, sde_steps: Sequence[int], return_steps: Sequence[int], *, image: str | None = None
    ) -> RolloutRequest:
        """One microgroup's request; ``image``: the prompt row's conditioning image."""
        frames = self.diffusion_output_num_frames
        return RolloutRequest(
            prompt=prompt,
            negative_prompt=self.diffusion_negative_prompt,
            seed=microgroup.seed,
            width=self.diffusion_width,
            height=self.diffusion_height,
            num_inference_steps=self.diffusion_num_steps,
            num_outputs_per_prompt=microgroup.size,
            guidance_scale=self.diffusion_guidance_scale,
            true_cfg_scale=self.diffusion_true_cfg_scale,
            num_frames=frames if frames and frames > 1 else None,
            fps=self.diffusion_fps,
            rollout=True,
            rollout_sde_type=self.diffusion_sde_type,
            rollout_noise_level=self.diffusion_noise_level,
            rollout_log_prob_no_const=self.diffusion_log_prob_no_const,
            rollout_debug_mode=self.diffusion_debug_mode,
            rollout_return_denoising_env=True,
            rollout_return_dit_trajectory=True,
            rollout_sde_step_indices=tuple(sde_steps),
            rollout_return_step_indices=tuple(return_steps),
            extra_sampling_params=dict(self.extra_sampling_params),
            image_path=None if image is None else (image,),
            generator_device=self.diffusion_generator_device,
        )


async def generate_rollout(
    engine: RolloutEngine,
    settings: RolloutSettings,
    rollout_id: int,
    prompts: Sequence[PromptRecord],
    strategy: StepStrategy,
    *,
    epoch: int = 0,
    on_microgroup: MicrogroupCallback | None = None,
    generate: Generate = engine_generate,
) -> list[list[Sample]]:
    """Generate every group of one rollout; returns the groups in prompt order, each
    with its samples in seed order. ``generate`` sends one microgroup's request
    (``--custom-generate-function-path`` replaces it)."""
    # An engine that caps each server itself must not be capped here too: E servers carry
    # up to E x --sglang-server-concurrency requests.
    limit = contextlib.nullcontext() if engine.caps_per_server else asyncio.Semaphore(settings.sglang_server_concurrency)
    groups: list[list[Sample | None]] = [[None] * settings.n_samples_per_prompt for _ in prompts]

    async def run(position: int, record: PromptRecord, microgroup: Microgroup) -> None:
        selection = select_steps(settings, seed=microgroup.seed, epoch=epoch, strategy=strategy, rollout_id=rollout_id)
        request = settings.request(record.prompt, microgroup, selection.sde_steps, selection.return_steps, image=record.image)
        async with limit:
            outputs = await generate(engine, request)
        if len(outputs) != microgroup.size:
            raise RuntimeError(f"engine returned {len(outputs)} outputs for a microgroup of {microgroup.size}")
        samples = []
        for i, output in enumerate(outputs):
            if output.seed != microgroup.seed + i:
                raise RuntimeError(f"engine returned seed {output.seed} for output {i} of seed {microgroup.seed}")
            sample = Sample(
                prompt=record.prompt,
                metadata=dict(record.metadata),
                rollout_id=rollout_id,
                group_index=microgroup.group_index,
                index_in_group=microgroup.offset + i,
                seed=output.seed,
                sde_step_indices=selection.sde_steps,
                output=output,
                image=record.image,
            )
            groups[position][microgroup.offset + i] = sample
            samples.append(sample)
        if on_microgroup is not None:
            await on_microgroup(samples)

    tasks = [
        run(position, record, microgroup)
        for position, record in enumerate(prompts)
        for microgroup in microgroups(
            settings.rollout_seed,
            group_index(rollout_id, position, settings.rollout_batch_size),
            settings.n_samples_per_prompt,
            settings.rollout_microgroup_size,
        )
    ]
    await asyncio.gather(*tasks)
    return [[sample for sample in group if sample is not None] for group in groups]


async def diffusion_rollout(
    config: Any,
    rollout_id: int,
    engine: RolloutEngine,
    data_source: Any,
    *,
    evaluation: bool = False,
    on_microgroup: MicrogroupCallback | None = None,
) -> list[Sample]:
    """The built-in rollout: ``data_source.batch(rollout_id)``'s prompt groups through
    :func:`generate_rollout`, flattened (group after group). With ``evaluation`` it is
    the built-in evaluation of one eval set instead (``data_source.batch`` gives its
    prompts; fixed seeds, deterministic sampling, pixels only). Every request goes through
    ``--custom-generate-function-path`` when it is set."""
    from miles_core.errors import HookError
    from miles_core.rollout.hooks import DATA_SOURCE_FLAG, generate_function, prompt_batch

    if data_source is None:
        raise HookError(f"the built-in rollout needs prompts: give --prompt-data or {DATA_SOURCE_FLAG}")
    generate = generate_function(config)
    if evaluation:
        from miles_core.rollout.evaluation import eval_samples

        # An eval set's own settings (--eval-config: samples per prompt, steps) ride on its source.
        return await eval_samples(config, engine, data_source.batch(rollout_id), generate, getattr(data_source, "dataset", None))
    prompts = prompt_batch(config, data_source, rollout_id)
    epoch_of = getattr(data_source, "epoch_of", None)
    groups = await generate_rollout(
        engine,
        RolloutSettings.from_config(config),
        rollout_id,
        prompts,
        strategy_from_config(config),
        epoch=epoch_of(rollout_id) if epoch_of is not None else 0,
        on_microgroup=on_microgroup,
        generate=generate,
    )
    return [sample for group in groups for sample in group]


def strategy_from_config(config: Any) -> StepStrategy:
    """The run's step strategy (:func:`miles_core.plugin_manager.step_strategy`)."""
    from miles_core.plugin_manager import step_strategy

    return step_strategy(config)
