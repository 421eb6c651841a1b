"""Denoising-step backends: one implementation of the step math, used by the rollout
engine to take a step and by the trainer to recompute that step's log-probability.

Notation (docs/design.md, "The SDE step and its log-probability"): flow-matching sigmas run from ``σ_0 = 1`` down to
``σ_T = 0``; at step *k*, ``σ = σ_k``, ``σ' = σ_{k+1}``, ``dt = σ' − σ < 0``, ``v`` is the
predicted velocity, ``x`` the current latent, ``η`` the noise level and ``ε ~ N(0, I)``.

``sde`` (Flow-GRPO)::

    s   = η · sqrt(σ / (1 − σ̃)),   σ̃ = σ, except σ̃ = σ_1 (``sigma_max``) when σ = 1
    μ   = x · (1 + s²/(2σ) · dt) + v · (1 + s²(1 − σ)/(2σ)) · dt
    std = s · sqrt(−dt)
    x'  = μ + std · ε

``cps`` (coefficient-preserving sampling)::

    s   = σ' · sin(η·π/2)
    x̂0 = x − σ·v,   x̂1 = x + (1 − σ)·v
    μ   = (1 − σ')·x̂0 + sqrt(σ'² − s²)·x̂1
    std = s
    x'  = μ + s · ε

``ode``::

    x'  = x + dt · v,   std = 0,   log-prob = 0

A stochastic backend with ``η = 0`` is exactly ``ode``. The last step (``σ' = 0``) is
never a stochastic step: its Gaussian is degenerate, so asking for one is an error.

Log-probability of a transition: the mean over every non-batch element of
``−(x' − μ)²/(2·std²) − log std − log sqrt(2π)``; with ``log_prob_no_const`` (pairs with
``cps``) it is ``−mean((x' − μ)²)``. All math runs in fp32. A row whose fp32 log-prob is
not finite is recomputed in float64 and counted in ``StepOutput.fallback_count``; if it
is still not finite, :class:`NonFiniteLogProbError` is raised, never passed on.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from miles_core.errors import NonFiniteLogProbError

__all__ = [
    "BACKENDS",
    "CpsBackend",
    "FlowSdeBackend",
    "NonFiniteLogProbError",
    "OdeBackend",
    "SdeBackend",
    "StepOutput",
    "StreamStep",
    "broadcast_sigma",
    "score_streams",
    "step_streams",
    "working_precision",
]

Sigma = float | Tensor
"""A sigma: a Python float, a 0-d tensor, or a per-sample tensor of shape [B]."""

_LOG_SQRT_2PI = math.log(math.sqrt(2.0 * math.pi))


@dataclass
class StepOutput:
    """What a step (or the rescoring of a transition) produced; all fp32."""

    prev_sample: Tensor
    """x', the latent after the step, shaped like x."""
    mean: Tensor
    """μ, shaped like x."""
    std: Tensor
    """The transition's standard deviation (``s·sqrt(−dt)`` for sde, ``s`` for cps, 0 for
    ode), shaped [B, 1, ..., 1]."""
    log_prob: Tensor
    """Per-sample log-probability of x' given x, shape [B]."""
    noise: Tensor | None = None
    """ε drawn (or given) for the step; None for deterministic steps and rescoring."""
    fallback_count: int = 0
    """Rows whose fp32 log-prob was non-finite and were recomputed in float64."""
    noise_scale: Tensor | None = None
    """``s``, the noise scale Flow-GRPO calls ``std_dev_t``, shaped [B, 1, ..., 1]. The
    Flow-GRPO KL term divides by ``2·s²`` (for cps ``s`` equals ``std``)."""


class SdeBackend(abc.ABC):
    """A denoising-step backend. Subclasses supply :meth:`mean_std`; stepping,
    scoring and the float64 fallback are shared so the engine and the trainer agree."""

    name: ClassVar[str] = ""
    stochastic: ClassVar[bool] = True
    """False for a backend that never injects noise (ode)."""

    def __init__(self, *, noise_level: float = 0.7, log_prob_no_const: bool = False) -> None:
        if not math.isfinite(noise_level) or noise_level < 0:
            raise ValueError(f"noise_level must be a finite number >= 0, got {noise_level!r}")
        self.noise_level = float(noise_level)
        self.log_prob_no_const = bool(log_prob_no_const)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(noise_level={self.noise_level}, log_prob_no_const={self.log_prob_no_const})"

    @property
    def deterministic(self) -> bool:
        """True when steps are plain Euler (ODE) steps: ode, or noise level 0."""
        return not self.stochastic or self.noise_level == 0.0

    # ----------------------------------------------------------------- the math
    @abc.abstractmethod
    def mean_std(self, x: Tensor, v: Tensor, sigma: Sigma, sigma_next: Sigma, *, sigma_max: float) -> tuple[Tensor, Tensor]:
        """Return (μ, std) of the transition; std is shaped [B or 1, 1, ..., 1].

        Computes in fp32, or in float64 when ``x`` is float64 (the fallback path)."""

    def noise_scale(self, x: Tensor, sigma: Sigma, sigma_next: Sigma, *, sigma_max: float) -> Tensor:
        """``s`` (Flow-GRPO's ``std_dev_t``), broadcast against ``x``; zeros when
        deterministic."""
        x = working_precision(x)
        sig, sig_next = broadcast_sigma(sigma, x), broadcast_sigma(sigma_next, x)
        if self.deterministic:
            return torch.zeros_like(sig * sig_next)
        return self.scale(sig, sig_next, sigma_max)

    def scale(self, sigma: Tensor, sigma_next: Tensor, sigma_max: float) -> Tensor:
        """``s``, the diffusion coefficient of a stochastic step, for sigmas already
        broadcast against the latent (see :func:`broadcast_sigma`). Stochastic
        backends override it; it is only called when the backend is not deterministic."""
        raise NotImplementedError(f"{type(self).__name__} does not define its noise scale s")

    # ------------------------------------------------------------ public entry points
    def step(
        self,
        x: Tensor,
        v: Tensor,
        sigma: Sigma,
        sigma_next: Sigma,
        *,
        sigma_max: float,
        noise: Tensor | None = None,
        generator: torch.Generator | None = None,
        step_index: int | None = None,
    ) -> StepOutput:
        """Take one step from x with velocity v; draws ε from ``generator`` unless
        ``noise`` is given."""
        x, v = working_precision(x), working_precision(v)
        self._check_step(x, sigma_next, step_index)
        mean, std = self.mean_std(x, v, sigma, sigma_next, sigma_max=sigma_max)
        batch = x.shape[0]
        std = _per_row(std, x)
        scale = _per_row(self.noise_scale(x, sigma, sigma_next, sigma_max=sigma_max), x)
        if self.deterministic:
            zeros = torch.zeros(batch, dtype=x.dtype, device=x.device)
            return StepOutput(mean, mean, std, zeros, None, 0, scale)
        if noise is None:
            noise = torch.randn(x.shape, generator=generator, device=x.device, dtype=torch.float32)
        else:
            if noise.shape != x.shape:
                raise ValueError(f"noise shape {tuple(noise.shape)} != latent shape {tuple(x.shape)}")
            noise = noise.to(device=x.device, dtype=torch.float32)
        prev_sample = mean + std * noise
        # Score x' from (x', μ) exactly as log_prob() will, so that the engine's value and
        # the trainer's recomputation go through the same operations.
        log_prob, fallbacks = self._score(prev_sample.detach(), x, v, sigma, sigma_next, sigma_max, step_index, mean, std)
        return StepOutput(prev_sample, mean, std, log_prob, noise, fallbacks, scale)

    def log_prob(
        self,
        x_next: Tensor,
        x: Tensor,
        v: Tensor,
        sigma: Sigma,
        sigma_next: Sigma,
        *,
        sigma_max: float,
        step_index: int | None = None,
    ) -> StepOutput:
        """Recompute the log-probability of the transition x → x_next under velocity v.

        ``x_next`` is treated as data (detached); gradients flow through v (and x)."""
        x, v, x_next = working_precision(x), working_precision(v), working_precision(x_next).detach()
        if x_next.shape != x.shape:
            raise ValueError(f"x_next shape {tuple(x_next.shape)} != x shape {tuple(x.shape)}")
        self._check_step(x, sigma_next, step_index)
        mean, std = self.mean_std(x, v, sigma, sigma_next, sigma_max=sigma_max)
        std = _per_row(std, x)
        scale = _per_row(self.noise_scale(x, sigma, sigma_next, sigma_max=sigma_max), x)
        if self.deterministic:
            zeros = torch.zeros(x.shape[0], dtype=x.dtype, device=x.device)
            return StepOutput(x_next, mean, std, zeros, None, 0, scale)
        log_prob, fallbacks = self._score(x_next, x, v, sigma, sigma_next, sigma_max, step_index, mean, std)
        return StepOutput(x_next, mean, std, log_prob, None, fallbacks, scale)

    # -------------------------------------------------------------------- internals
    def _check_step(self, x: Tensor, sigma_next: Sigma, step_index: int | None) -> None:
        if self.deterministic:
            return
        sig_next = torch.as_tensor(sigma_next)
        if bool((sig_next <= 0).any()):
            where = f" (step {step_index})" if step_index is not None else ""
            raise ValueError(
                f"{self.name or type(self).__name__} backend with noise_level={self.noise_level} "
                f"asked for a stochastic step to sigma'=0{where}: the last denoising step is "
                "never an SDE step (its Gaussian is degenerate); take it with the ode backend"
            )

    def _elementwise_log_prob(self, x_next: Tensor, mean: Tensor, std: Tensor) -> Tensor:
        diff = x_next - mean
        if self.log_prob_no_const:
            per_elem = -(diff**2)
        else:
            per_elem = -(diff**2) / (2 * std**2) - torch.log(std) - _LOG_SQRT_2PI
        return per_elem.mean(dim=tuple(range(1, per_elem.ndim)))

    def _score(
        self,
        x_next: Tensor,
        x: Tensor,
        v: Tensor,
        sigma: Sigma,
        sigma_next: Sigma,
        sigma_max: float,
        step_index: int | None,
        mean: Tensor,
        std: Tensor,
    ) -> tuple[Tensor, int]:
        """Per-sample log-prob in fp32, with bad rows recomputed in float64."""
        log_prob = self._elementwise_log_prob(x_next, mean, std)
        bad = ~torch.isfinite(log_prob)
        # On the meta device (the memory planner's count, miles_core.planning) there are no
        # values to check; the same operations ran, so the same bytes were held.
        if log_prob.is_meta or not bool(bad.any()):
            return log_prob, 0
        bad_idx = bad.nonzero().flatten()
        good_idx = (~bad).nonzero().flatten()
        rows = bad_idx.tolist()

        x64, v64, xn64 = x[bad_idx].double(), v[bad_idx].double(), x_next[bad_idx].double()
        mean64, std64 = self.mean_std(x64, v64, _take(sigma, bad_idx, x), _take(sigma_next, bad_idx, x), sigma_max=sigma_max)
        lp64 = self._elementwise_log_prob(xn64, mean64, _per_row(std64, x64))
        lp_bad = lp64.to(log_prob.dtype)
        still_bad = ~torch.isfinite(lp_bad)
        if bool(still_bad.any()):
            failed = [rows[i] for i in still_bad.nonzero().flatten().tolist()]
            in_f64 = bool(torch.isfinite(lp64[still_bad]).all())
            detail = "finite in float64 but out of float32 range" if in_f64 else "not finite in float64"
            raise NonFiniteLogProbError(step_index, failed, detail)

        # Rebuild the output from row slices rather than patching the fp32 result in
        # place: a patched row would still back-propagate 0·inf = NaN into v's gradient.
        out = log_prob.new_zeros(log_prob.shape)
        if good_idx.numel():
            good_lp = self._elementwise_log_prob(x_next[good_idx], mean[good_idx], _take_rows(std, good_idx))
            out = out.index_put((good_idx,), good_lp)
        out = out.index_put((bad_idx,), lp_bad)
        return out, len(rows)


class FlowSdeBackend(SdeBackend):
    """Flow-GRPO's SDE step (``sde``)."""

    name = "sde"

    def scale(self, sigma: Tensor, sigma_next: Tensor, sigma_max: float) -> Tensor:
        # At σ = 1 the ratio σ/(1−σ) is infinite; Flow-GRPO substitutes σ_1 in the
        # denominator so the first step stays finite.
        sigma_tilde = torch.where(sigma == 1, torch.full_like(sigma, sigma_max), sigma)
        return self.noise_level * torch.sqrt(sigma / (1 - sigma_tilde))

    def mean_std(self, x: Tensor, v: Tensor, sigma: Sigma, sigma_next: Sigma, *, sigma_max: float) -> tuple[Tensor, Tensor]:
        x, v = working_precision(x), working_precision(v)
        sig, sig_next = broadcast_sigma(sigma, x), broadcast_sigma(sigma_next, x)
        dt = sig_next - sig
        if self.deterministic:
            return x + dt * v, torch.zeros_like(dt)
        s = self.scale(sig, sig_next, sigma_max)
        mean = x * (1 + s**2 / (2 * sig) * dt) + v * (1 + s**2 * (1 - sig) / (2 * sig)) * dt
        std = s * torch.sqrt(-dt)
        return mean, std


class CpsBackend(SdeBackend):
    """Coefficient-preserving sampling (``cps``); usually paired with
    ``log_prob_no_const``."""

    name = "cps"

    def scale(self, sigma: Tensor, sigma_next: Tensor, sigma_max: float) -> Tensor:
        return sigma_next * math.sin(self.noise_level * math.pi / 2)

    def mean_std(self, x: Tensor, v: Tensor, sigma: Sigma, sigma_next: Sigma, *, sigma_max: float) -> tuple[Tensor, Tensor]:
        x, v = working_precision(x), working_precision(v)
        sig, sig_next = broadcast_sigma(sigma, x), broadcast_sigma(sigma_next, x)
        if self.deterministic:
            return x + (sig_next - sig) * v, torch.zeros_like(sig_next * sig)
        s = self.scale(sig, sig_next, sigma_max)
        x0_hat = x - sig * v
        x1_hat = x + (1 - sig) * v
        mean = (1 - sig_next) * x0_hat + torch.sqrt(sig_next**2 - s**2) * x1_hat
        return mean, s


class OdeBackend(SdeBackend):
    """Deterministic Euler step (``ode``); its log-prob is 0."""

    name = "ode"
    stochastic = False

    def mean_std(self, x: Tensor, v: Tensor, sigma: Sigma, sigma_next: Sigma, *, sigma_max: float) -> tuple[Tensor, Tensor]:
        x, v = working_precision(x), working_precision(v)
        sig, sig_next = broadcast_sigma(sigma, x), broadcast_sigma(sigma_next, x)
        dt = sig_next - sig
        return x + dt * v, torch.zeros_like(dt)


BACKENDS: dict[str, type[SdeBackend]] = {cls.name: cls for cls in (FlowSdeBackend, CpsBackend, OdeBackend)}
"""The built-in backends by ``--diffusion-sde-type`` name."""


# ------------------------------------------------------------------------- helpers
def working_precision(t: Tensor) -> Tensor:
    """fp32, unless already float64 (the fallback recompute keeps its precision)."""
    return t if t.dtype == torch.float64 else t.float()


def broadcast_sigma(sigma: Sigma, x: Tensor) -> Tensor:
    """A float, 0-d or [B] sigma as a [B or 1, 1, ..., 1] tensor in x's dtype/device."""
    t = torch.as_tensor(sigma, dtype=x.dtype, device=x.device)
    tail = (1,) * (x.ndim - 1)
    if t.ndim == 0:
        return t.reshape((1,) + tail)
    if t.ndim == 1 and t.shape[0] in (1, x.shape[0]):
        return t.reshape((t.shape[0],) + tail)
    if t.ndim == x.ndim and t.shape[0] in (1, x.shape[0]) and all(d == 1 for d in t.shape[1:]):
        return t
    raise ValueError(f"sigma must be a float or a tensor of shape [B] (B={x.shape[0]}), got shape {tuple(t.shape)}")


def _take(sigma: Sigma, idx: Tensor, x: Tensor) -> Sigma:
    """The rows ``idx`` of a per-sample sigma; a shared sigma is returned as is."""
    per_sample = isinstance(sigma, Tensor) and sigma.ndim >= 1 and sigma.shape[0] == x.shape[0]
    if per_sample and x.shape[0] > 1:
        return sigma[idx.to(sigma.device)]
    return sigma


def _take_rows(t: Tensor, idx: Tensor) -> Tensor:
    return t[idx] if t.shape[0] > 1 else t


def _per_row(std: Tensor, x: Tensor) -> Tensor:
    """Expand a [1, 1, ..., 1] std to [B, 1, ..., 1] so callers can index it per sample."""
    return std.expand((x.shape[0],) + (1,) * (x.ndim - 1)).contiguous()


# ------------------------------------------------------------------- latent streams
@dataclass
class StreamStep:
    """A step over a family's named latent streams (LTX-2 has video and audio)."""

    prev_sample: dict[str, Tensor]
    mean: dict[str, Tensor]
    std: dict[str, Tensor]
    noise: dict[str, Tensor] | None
    log_prob: Tensor
    """[B]: the mean over every non-batch element of every stream, i.e. the per-stream
    log-probs weighted by their element counts."""
    fallback_count: int = 0
    noise_scale: Tensor | None = None


def _joint(outputs: dict[str, StepOutput], x: dict[str, Tensor]) -> Tensor:
    counts = {name: x[name][0].numel() for name in outputs}
    total = sum(counts.values())
    return sum(out.log_prob * (counts[name] / total) for name, out in outputs.items())  # type: ignore[return-value]


def step_streams(
    backend: SdeBackend,
    x: dict[str, Tensor],
    v: dict[str, Tensor],
    sigma: Sigma,
    sigma_next: Sigma,
    *,
    sigma_max: float,
    noise: dict[str, Tensor] | None = None,
    step_index: int | None = None,
) -> StreamStep:
    """One step of every stream with the same sigmas; the engine's sampling step."""
    outputs = {
        name: backend.step(
            x[name],
            v[name],
            sigma,
            sigma_next,
            sigma_max=sigma_max,
            noise=None if noise is None else noise[name],
            step_index=step_index,
        )
        for name in x
    }
    return _stream_step(outputs, x)


def score_streams(
    backend: SdeBackend,
    x_next: dict[str, Tensor],
    x: dict[str, Tensor],
    v: dict[str, Tensor],
    sigma: Sigma,
    sigma_next: Sigma,
    *,
    sigma_max: float,
    step_index: int | None = None,
) -> StreamStep:
    """The log-probability of a recorded transition of every stream; the trainer's
    recomputation, through the same operations as :func:`step_streams`."""
    outputs = {
        name: backend.log_prob(x_next[name], x[name], v[name], sigma, sigma_next, sigma_max=sigma_max, step_index=step_index) for name in x
    }
    return _stream_step(outputs, x)


def _stream_step(outputs: dict[str, StepOutput], x: dict[str, Tensor]) -> StreamStep:
    first = next(iter(outputs.values()))
    noises = {name: out.noise for name, out in outputs.items() if out.noise is not None}
    return StreamStep(
        prev_sample={name: out.prev_sample for name, out in outputs.items()},
        mean={name: out.mean for name, out in outputs.items()},
        std={name: out.std for name, out in outputs.items()},
        noise=noises or None,
        log_prob=_joint(outputs, x) if len(outputs) > 1 else first.log_prob,
        fallback_count=sum(out.fallback_count for out in outputs.values()),
        noise_scale=first.noise_scale,
    )
