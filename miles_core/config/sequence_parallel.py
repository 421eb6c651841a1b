"""Configuration rules of sequence parallelism (``--sequence-parallel-size``,
``--ulysses-degree``): which combinations can run, checked before anything loads.

Sequence parallelism splits each sample's tokens over ``--sequence-parallel-size`` (SP)
training ranks: a Ulysses degree U (all-to-all of heads) times a ring degree SP / U
(key/value chunks passed around a ring). The training ranks of one run are
``data-parallel size x SP`` (:mod:`miles_core.training.sequence_parallel` builds the mesh).
"""

from __future__ import annotations

from typing import Any

RING_BACKENDS: tuple[str, ...] = (
    "_native_cudnn",
    "_native_flash",
    "flash",
    "flash_hub",
    "flash_varlen_hub",
    "_flash_3_hub",
    "_flash_3_varlen_hub",
)
"""diffusers attention backends whose forward returns the log-sum-exp and whose backward
takes it back: what ring attention merges its partial results with. All need CUDA;
torch's CPU attention (``native``) returns no log-sum-exp."""


def ulysses_degree(sequence_parallel_size: int, ulysses: int) -> int:
    """The Ulysses degree in effect: ``--ulysses-degree``, or SP itself when it is 0 (auto)."""
    return int(sequence_parallel_size) if not ulysses else int(ulysses)


def sequence_parallel_errors(config: Any, family: Any, gpus: int) -> list[str]:
    """One-line errors about the sequence-parallel flags of a resolved ``config`` (its
    world size already checked to be divisible by SP; several ranks without ``--use-ray``
    are reported with the world size); ``family`` is the model family's spec (or None)
    and ``gpus`` the GPUs this machine shows."""
    sp = int(config.get("sequence_parallel_size"))
    given = int(config.get("ulysses_degree"))
    if sp == 1:
        if given > 1:
            return [f"--ulysses-degree {given} needs --sequence-parallel-size > 1 (it is the Ulysses share of sequence parallelism)"]
        return []
    errors = []
    ulysses = ulysses_degree(sp, given)
    if sp % ulysses:
        return [f"--ulysses-degree {ulysses} must divide --sequence-parallel-size {sp} (the ring degree is SP / Ulysses degree)"]
    ring = sp // ulysses
    if family is not None and getattr(family, "sequence_parallel_refusal", None):
        errors.append(
            f"--sequence-parallel-size {sp}: the {family.name} family cannot split a sample's tokens: {family.sequence_parallel_refusal}"
        )
    if ring > 1:
        backend = config.get("fsdp_attention_backend")
        if not gpus:
            errors.append(
                f"--sequence-parallel-size {sp} --ulysses-degree {ulysses}: a ring degree of {ring} needs an attention backend "
                "that returns the log-sum-exp (flash or cuDNN attention, CUDA only); this machine has no GPU and CPU "
                f"attention returns none: use --ulysses-degree {sp} (Ulysses only)"
            )
        elif backend is None or str(backend).lower() not in RING_BACKENDS:
            errors.append(
                f"--sequence-parallel-size {sp} --ulysses-degree {ulysses}: a ring degree of {ring} needs an attention backend "
                f"that returns the log-sum-exp; --fsdp-attention-backend {backend or 'unset (native)'} does not; use one "
                f"of {', '.join(RING_BACKENDS)}"
            )
    return errors


__all__ = ["RING_BACKENDS", "sequence_parallel_errors", "ulysses_degree"]
