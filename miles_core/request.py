"""The ``/rollout/generate`` request and its per-output result (docs/design.md, "The wire contract").

Field names are sglang-diffusion's. :meth:`RolloutRequest.from_json` validates a JSON
body field by field; a bad field raises :class:`RequestError` naming it, which the
HTTP server turns into a 4xx.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from miles_core.errors import RequestError

if TYPE_CHECKING:
    from torch import Tensor

SDE_TYPES = ("sde", "cps", "ode")
FLOW_SHIFT = "flow_shift"
"""The ``extra_sampling_params`` key of the schedule shift (``--diffusion-flow-shift``), as
the reference sends it to sglang-diffusion."""
GENERATOR_DEVICES = ("cpu", "cuda")
"""Values of ``generator_device`` (sglang-diffusion's field, ``--diffusion-generator-device``):
where each output's noise generator lives."""


@dataclass(frozen=True)
class RolloutRequest:
    """One prompt, ``num_outputs_per_prompt`` outputs; output *i* uses ``seed + i``."""

    prompt: str
    negative_prompt: str | None = None
    seed: int = 0
    width: int | None = None
    """None: the pipeline's native size."""
    height: int | None = None
    num_inference_steps: int = 10
    num_outputs_per_prompt: int = 1
    guidance_scale: float = 4.0
    true_cfg_scale: float | None = None
    num_frames: int | None = None
    fps: float | None = None
    rollout: bool = True
    """False: evaluation, pixels only."""
    rollout_sde_type: str = "sde"
    rollout_noise_level: float = 0.7
    rollout_log_prob_no_const: bool = False
    rollout_debug_mode: bool = False
    rollout_return_denoising_env: bool = False
    rollout_return_dit_trajectory: bool = False
    rollout_sde_step_indices: tuple[int, ...] | None = None
    """0-based loop steps that run the SDE; None: every step but the last."""
    rollout_return_step_indices: tuple[int, ...] | None = None
    """Latents to return (index T is the final latent); None: all of 0..T."""
    extra_sampling_params: Mapping[str, Any] = field(default_factory=dict)
    request_id: str = ""
    image_path: tuple[str, ...] | None = None
    """The conditioning image of an image-to-video request (sglang-diffusion's field: a
    path, or a list holding one path, readable where the engine runs); None: text only.
    See :mod:`miles_core.conditioning_image`."""
    generator_device: str = "cpu"
    """Where output *i*'s generator (seeded ``seed + i``) draws its initial and SDE noise
    (sglang-diffusion's field): ``cpu``, the same latents on any machine; ``cuda``, on
    the device the model runs on (the CPU for a model on the CPU), whose stream differs
    from the CPU's, so reproducible on the same GPU type only."""

    @classmethod
    def from_json(cls, data: Any) -> RolloutRequest:
        """Validate a decoded JSON body; raise :class:`RequestError` naming the field."""
        if not isinstance(data, Mapping):
            raise RequestError("body", f"must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise RequestError(unknown[0], "unknown field")
        if "prompt" not in data:
            raise RequestError("prompt", "is required")
        values = {name: _check(name, data[name]) for name in data}
        request = cls(**values)
        request.validate()
        return request

    def validate(self) -> None:
        """Range checks that do not depend on the model."""
        if self.num_inference_steps < 1:
            raise RequestError("num_inference_steps", f"must be at least 1, got {self.num_inference_steps}")
        if self.num_outputs_per_prompt < 1:
            raise RequestError("num_outputs_per_prompt", f"must be at least 1, got {self.num_outputs_per_prompt}")
        if not 0 <= self.seed < 2**63:
            raise RequestError("seed", f"must be in [0, 2**63), got {self.seed}")
        for name in ("width", "height", "num_frames"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise RequestError(name, f"must be positive, got {value}")
        if self.rollout_sde_type not in SDE_TYPES:
            raise RequestError("rollout_sde_type", f"must be one of {', '.join(SDE_TYPES)}, got {self.rollout_sde_type!r}")
        if not math.isfinite(self.rollout_noise_level) or self.rollout_noise_level < 0:
            raise RequestError("rollout_noise_level", f"must be a finite number >= 0, got {self.rollout_noise_level}")
        if not math.isfinite(self.guidance_scale) or self.guidance_scale < 0:
            raise RequestError("guidance_scale", f"must be a finite number >= 0, got {self.guidance_scale}")
        if self.generator_device not in GENERATOR_DEVICES:
            raise RequestError("generator_device", f"must be one of {', '.join(GENERATOR_DEVICES)}, got {self.generator_device!r}")
        if self.image_path is not None and len(self.image_path) != 1:
            raise RequestError("image_path", f"takes one conditioning image per request, got {len(self.image_path)}")
        self.flow_shift  # noqa: B018 - reading the property checks the value
        steps = self.num_inference_steps
        for name, upper in (("rollout_sde_step_indices", steps - 1), ("rollout_return_step_indices", steps + 1)):
            indices = getattr(self, name)
            if indices is None:
                continue
            if list(indices) != sorted(set(indices)):
                raise RequestError(name, "must be sorted and unique")
            bad = [i for i in indices if not 0 <= i < upper]
            if bad:
                rule = (
                    f"SDE steps must be in [0, {steps - 1}): the last step (sigma' = 0) is never stochastic"
                    if name == "rollout_sde_step_indices"
                    else f"latent indices must be in [0, {steps}]"
                )
                raise RequestError(name, f"{bad[0]} is out of range; {rule}")

    @property
    def flow_shift(self) -> float | None:
        """``extra_sampling_params.flow_shift`` (where sglang-diffusion reads it): the
        sampling schedule's shift; None: the checkpoint scheduler's own. A value that is
        not a finite number > 0 raises :class:`RequestError`."""
        shift = self.extra_sampling_params.get(FLOW_SHIFT)
        if shift is None:
            return None
        # The shift divides by 1 + (s - 1)·σ: s <= 0 would reach 0 or flip the schedule.
        if isinstance(shift, bool) or not isinstance(shift, (int, float)) or not math.isfinite(shift) or shift <= 0:
            raise RequestError("extra_sampling_params", f"{FLOW_SHIFT} must be a finite number > 0, got {shift!r}")
        return float(shift)

    def sde_steps(self) -> tuple[int, ...]:
        """The loop steps that run the SDE (none for ``rollout: false`` or ``ode``)."""
        if not self.rollout or self.rollout_sde_type == "ode" or self.rollout_noise_level == 0:
            return ()
        if self.rollout_sde_step_indices is None:
            return tuple(range(self.num_inference_steps - 1))
        return tuple(self.rollout_sde_step_indices)

    def return_steps(self) -> tuple[int, ...]:
        if self.rollout_return_step_indices is None:
            return tuple(range(self.num_inference_steps + 1))
        return tuple(self.rollout_return_step_indices)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for name in ("rollout_sde_step_indices", "rollout_return_step_indices", "image_path"):
            if data[name] is not None:
                data[name] = list(data[name])
        data["extra_sampling_params"] = dict(self.extra_sampling_params)
        return data

    def with_request_id(self) -> RolloutRequest:
        from dataclasses import replace

        return self if self.request_id else replace(self, request_id=uuid.uuid4().hex)


_INT_FIELDS = {"seed", "width", "height", "num_inference_steps", "num_outputs_per_prompt", "num_frames"}
_FLOAT_FIELDS = {"guidance_scale", "true_cfg_scale", "fps", "rollout_noise_level"}
_BOOL_FIELDS = {
    "rollout",
    "rollout_log_prob_no_const",
    "rollout_debug_mode",
    "rollout_return_denoising_env",
    "rollout_return_dit_trajectory",
}
_STR_FIELDS = {"prompt", "negative_prompt", "rollout_sde_type", "request_id", "generator_device"}
_NULLABLE = {
    "negative_prompt",
    "width",
    "height",
    "true_cfg_scale",
    "num_frames",
    "fps",
    "rollout_sde_step_indices",
    "rollout_return_step_indices",
    "image_path",
}


def _check(name: str, value: Any) -> Any:
    if value is None:
        if name in _NULLABLE:
            return None
        raise RequestError(name, "must not be null")
    if name in _INT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, int):
            raise RequestError(name, f"must be an integer, got {value!r}")
        return value
    if name in _FLOAT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RequestError(name, f"must be a number, got {value!r}")
        return float(value)
    if name in _BOOL_FIELDS:
        if not isinstance(value, bool):
            raise RequestError(name, f"must be true or false, got {value!r}")
        return value
    if name in _STR_FIELDS:
        if not isinstance(value, str):
            raise RequestError(name, f"must be a string, got {value!r}")
        return value
    if name in ("rollout_sde_step_indices", "rollout_return_step_indices"):
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise RequestError(name, f"must be a list of integers, got {value!r}")
        return tuple(value)
    if name == "image_path":
        paths = [value] if isinstance(value, str) else value
        if not isinstance(paths, list) or not all(isinstance(p, str) and p for p in paths):
            raise RequestError(name, f"must be a path or a list of paths (non-empty strings), got {value!r}")
        return tuple(paths)
    if name == "extra_sampling_params":
        if not isinstance(value, dict):
            raise RequestError(name, f"must be an object, got {value!r}")
        return dict(value)
    raise RequestError(name, "unknown field")


@dataclass
class RolloutOutput:
    """One output of a request: the record the contract returns (one per output)."""

    request_id: str
    prompt: str
    seed: int
    """This output's own seed (request seed + i)."""
    generated_output: Tensor
    """Pixels in [0, 1]: image [C, H, W] or video [C, F, H, W]."""
    rollout_log_probs: Tensor | None = None
    """[T]: per-step log-probs, 0 on ODE steps."""
    rollout_debug_tensors: dict[str, Tensor] | None = None
    denoising_env: dict[str, Any] | None = None
    dit_trajectory: dict[str, Any] | None = None
    inference_time_s: float = 0.0
    peak_memory_mb: float = 0.0
    log_prob_fallbacks: int = 0
    """Rows x steps of this output's request whose fp32 log-prob was non-finite and was
    recomputed in float64: a per-request count, repeated on each of its outputs (ours;
    sglang-diffusion does not send it)."""
    extra_outputs: dict[str, Tensor] = field(default_factory=dict)
    """Further outputs of the family (LTX-2: ``audio``)."""

    def to_wire(self) -> dict[str, Any]:
        """A plain dict (tensors still tensors) in the contract's field order."""
        record = {
            "request_id": self.request_id,
            "prompt": self.prompt,
            "seed": self.seed,
            "generated_output": self.generated_output,
            "rollout_log_probs": self.rollout_log_probs,
            "rollout_debug_tensors": self.rollout_debug_tensors,
            "denoising_env": self.denoising_env,
            "dit_trajectory": self.dit_trajectory,
            "inference_time_s": self.inference_time_s,
            "peak_memory_mb": self.peak_memory_mb,
            "log_prob_fallbacks": self.log_prob_fallbacks,
        }
        if self.extra_outputs:
            record["extra_outputs"] = self.extra_outputs
        return record

    @classmethod
    def from_wire(cls, record: Mapping[str, Any]) -> RolloutOutput:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in record.items() if k in names})
