"""How the rollout side calls an engine: the default call for one request, and the
``extra_sampling_params`` every request of a run carries (rollouts and evaluation)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from miles_core.engine.base import RolloutEngine
from miles_core.request import RolloutOutput, RolloutRequest

Generate = Callable[[RolloutEngine, RolloutRequest], Awaitable[Sequence[RolloutOutput]]]


async def engine_generate(engine: RolloutEngine, request: RolloutRequest) -> Sequence[RolloutOutput]:
    return await engine.generate(request)


def extra_sampling_params(config: Any) -> dict[str, Any]:
    """The request's ``extra_sampling_params`` from the flags, for rollouts and
    evaluation alike: Wan 2.2's second guidance scale and the schedule shift, under the
    names sglang-diffusion reads."""
    extra: dict[str, Any] = {}
    if getattr(config, "diffusion_guidance_scale_2", None) is not None:
        extra["guidance_scale_2"] = config.diffusion_guidance_scale_2
    elif "guidance_scale_2" in _generation_options(config):
        # Unset: diffusers' fallback (the first scale), sent explicitly, since an engine
        # with defaults of its own (sglang-diffusion's Wan 2.2 A14B: 3.0) would not apply it.
        extra["guidance_scale_2"] = config.diffusion_guidance_scale
    if getattr(config, "diffusion_flow_shift", None) is not None:
        extra["flow_shift"] = config.diffusion_flow_shift
    return extra


def _generation_options(config: Any) -> tuple[str, ...]:
    """The family-specific generation settings the run's model family reads."""
    from miles_core.plugin_manager import get_host

    registry = get_host().registries.model_family
    name = getattr(config, "model_family", None)
    return registry.get(name).spec.generation_options if name in registry else ()
