"""How much work one ``/rollout/generate`` request may ask of a server.

A request's cost grows with ``num_outputs_per_prompt x num_frames x height x width x
num_inference_steps`` (its *work*: denoised pixels times steps; memory grows with all but
the last factor). A server refuses, before any tensor is allocated, a request whose work
or one of whose fields is over its limit, so one request cannot exhaust the machine.

The defaults come from the served model's default output: the size, and frame count,
``family.resolve_params`` gives a request that sets none (see :meth:`RequestLimits.derive`
and ``docs/engine.md``, "Limits"); every limit has a ``miles-core serve-engine`` flag.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from miles_core.errors import ConfigError, RequestError, RequestLimitError

if TYPE_CHECKING:
    from miles_core.family import GenerationParams, ModelFamily
    from miles_core.request import RolloutRequest

log = logging.getLogger(__name__)

DEFAULT_MAX_OUTPUTS = 64
"""Outputs per request: four times the largest recipe group (16 samples per prompt)."""
FALLBACK_MAX_STEPS = 1000
"""Steps when the scheduler does not say how many timesteps it was trained with."""
VIDEO_REFERENCE_FRAMES = 121
"""The clip a video family's limits are sized for when its default is shorter (Cosmos 3
defaults to one frame): LTX-2's default clip, about 5 s at 24 fps."""
WORK_OUTPUTS, WORK_STEPS = 16, 50
"""The default work limit is that of 16 outputs (a recipe group) of 50 steps (diffusers'
usual default) at the model's default size."""
DEFAULT_MAX_BODY_BYTES = 1024**2
"""A ``/rollout/generate`` body is a prompt and a few numbers: 1 MiB is ample."""

FLAGS = {
    "max_outputs_per_request": "--max-outputs-per-request",
    "max_inference_steps": "--max-inference-steps",
    "max_resolution": "--max-resolution",
    "max_num_frames": "--max-num-frames",
    "max_request_work": "--max-request-work",
}
"""Each limit's ``miles-core serve-engine`` flag."""
BODY_FLAG = "--max-generate-body-bytes"


@dataclass(frozen=True)
class DefaultOutput:
    """What a request that sets no size gets from the family."""

    height: int
    width: int
    frames: int
    video: bool
    """Whether the family resolves ``num_frames`` (it makes videos)."""

    @classmethod
    def of(cls, family: ModelFamily) -> DefaultOutput:
        """The family's default output; :data:`FALLBACK_OUTPUT` (with a warning) when it
        refuses a request without sizes (a tiny test model whose positional table is
        smaller than the real model's default size)."""
        from miles_core.request import RolloutRequest

        # No CFG: families that need more settings with CFG on (Wan 2.2's second scale) resolve too.
        request = RolloutRequest(prompt="", guidance_scale=1.0, num_inference_steps=1, rollout=False)
        try:
            params = family.resolve_params(request)
        except RequestError as exc:
            log.warning(
                "%s refuses a request without sizes (%s): request limits assume a %dx%d, %d-frame default output; "
                "set %s, %s and %s to fit the model",
                type(family).__name__,
                exc,
                FALLBACK_OUTPUT.height,
                FALLBACK_OUTPUT.width,
                VIDEO_REFERENCE_FRAMES,
                FLAGS["max_resolution"],
                FLAGS["max_num_frames"],
                FLAGS["max_request_work"],
            )
            return FALLBACK_OUTPUT
        return cls(int(params.height), int(params.width), int(params.num_frames or 1), params.num_frames is not None)


FALLBACK_OUTPUT = DefaultOutput(1024, 1024, 1, video=True)
"""The default output assumed for a family that cannot tell its own: generous (a 1024 x
1024 video), so that the limits never refuse a request the model can serve."""


@dataclass(frozen=True)
class RequestLimits:
    """The largest request a server takes (field by field, and in total work)."""

    max_outputs_per_request: int
    max_inference_steps: int
    max_resolution: int
    """Largest ``width`` or ``height``, in pixels."""
    max_num_frames: int
    max_request_work: int
    """Largest ``outputs x frames x height x width x steps``."""

    @classmethod
    def derive(cls, family: ModelFamily, overrides: Mapping[str, int | None] | None = None) -> RequestLimits:
        """The limits for ``family`` (see :meth:`for_output`), each from ``overrides``
        when given there (not None)."""
        given = cls.check_overrides(overrides or {})
        default = None if {"max_resolution", "max_num_frames", "max_request_work"} <= set(given) else (DefaultOutput.of(family))
        return cls.for_output(default, _train_timesteps(family), given)

    @classmethod
    def for_output(
        cls, default: DefaultOutput | None, train_timesteps: int, overrides: Mapping[str, int | None] | None = None
    ) -> RequestLimits:
        """The limits for a model whose default output is ``default`` and whose scheduler
        was trained with ``train_timesteps`` timesteps, each from ``overrides`` when given:

        - outputs per request: :data:`DEFAULT_MAX_OUTPUTS`;
        - steps: ``train_timesteps`` (sampling with more steps than the model was trained
          with timesteps adds nothing);
        - width and height: twice the larger side of the default output;
        - frames: 1 for an image model; for a video model twice its reference clip: its
          default clip, counted as at least :data:`VIDEO_REFERENCE_FRAMES` frames;
        - work: ``16 outputs x 50 steps x reference frames x default height x default
          width`` (one frame for an image model).

        ``default`` may be None only when the last three are all overridden."""
        given = cls.check_overrides(overrides or {})
        values: dict[str, int] = {"max_outputs_per_request": DEFAULT_MAX_OUTPUTS, "max_inference_steps": train_timesteps}
        if default is not None:
            frames = max(default.frames, VIDEO_REFERENCE_FRAMES) if default.video else 1
            values.update(
                max_resolution=2 * max(default.height, default.width),
                max_num_frames=2 * frames if default.video else 1,
                max_request_work=WORK_OUTPUTS * WORK_STEPS * frames * default.height * default.width,
            )
        values.update(given)
        return cls(**values)

    @staticmethod
    def check_overrides(overrides: Mapping[str, int | None]) -> dict[str, int]:
        """The overrides that are set; :class:`ConfigError` for an unknown name or a value
        that is not a positive integer."""
        given = {name: value for name, value in overrides.items() if value is not None}
        unknown = sorted(set(given) - set(FLAGS))
        if unknown:
            raise ConfigError(f"unknown request limit {unknown[0]!r} (known: {', '.join(FLAGS)})")
        for name, value in given.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{FLAGS[name]} {value!r}: must be a positive integer")
        return given

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def check(self, request: RolloutRequest, params: GenerationParams) -> None:
        """Raise :class:`RequestLimitError` for the first limit ``request`` (resolved by
        the family as ``params``) is over: a field (400), then the total work (413)."""
        frames = params.num_frames or 1
        for name, value, limit, what in (
            ("num_outputs_per_prompt", request.num_outputs_per_prompt, "max_outputs_per_request", "outputs"),
            ("num_inference_steps", request.num_inference_steps, "max_inference_steps", "steps"),
            ("height", params.height, "max_resolution", "pixels"),
            ("width", params.width, "max_resolution", "pixels"),
            ("num_frames", frames, "max_num_frames", "frames"),
        ):
            maximum = getattr(self, limit)
            if value > maximum:
                raise RequestLimitError(
                    name,
                    f"{value} is over this server's limit of {maximum} {what} ({FLAGS[limit]} raises it)",
                    value=value,
                    limit=maximum,
                    flag=FLAGS[limit],
                )
        work = request.num_outputs_per_prompt * frames * params.height * params.width * request.num_inference_steps
        if work > self.max_request_work:
            raise RequestLimitError(
                "request",
                f"work {request.num_outputs_per_prompt} outputs x {frames} frames x {params.height} x {params.width} "
                f"pixels x {request.num_inference_steps} steps = {work} is over this server's limit of "
                f"{self.max_request_work} ({FLAGS['max_request_work']} raises it)",
                value=work,
                limit=self.max_request_work,
                flag=FLAGS["max_request_work"],
                status=413,
            )


def body_too_large(size: int | None, limit: int, flag: str, how: str = "raises it") -> RequestLimitError:
    """The 413 for a request body over ``limit`` bytes (``size`` None: not read to its end)."""
    got = f"{size} bytes is over" if size is not None else "over"
    return RequestLimitError(
        "body",
        f"{got} this server's limit of {limit} bytes ({flag} {how})",
        value=size,
        limit=limit,
        flag=flag,
        status=413,
    )


def _train_timesteps(family: Any) -> int:
    scheduler = getattr(getattr(family, "pipeline", None), "scheduler", None)
    config = getattr(scheduler, "config", None) or {}
    value = config.get("num_train_timesteps") if hasattr(config, "get") else None
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else FALLBACK_MAX_STEPS


__all__ = [
    "BODY_FLAG",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_OUTPUTS",
    "FALLBACK_MAX_STEPS",
    "FALLBACK_OUTPUT",
    "FLAGS",
    "VIDEO_REFERENCE_FRAMES",
    "WORK_OUTPUTS",
    "WORK_STEPS",
    "DefaultOutput",
    "RequestLimits",
    "body_too_large",
]
