"""miles-core: reinforcement-learning post-training for flow-matching diffusion models.

The public API for plugin authors: :data:`hookimpl` and the spec records.
Importing this package stays light (no torch, no diffusers).
"""

from __future__ import annotations

from importlib import metadata as _metadata

from miles_core.config.flag import Flag
from miles_core.hookspecs import hookimpl
from miles_core.specs import (
    LossSpec,
    ModelFamilySpec,
    RewardSpec,
    RolloutEngineSpec,
    RolloutFilterSpec,
    SdeBackendSpec,
    Spec,
    StepStrategySpec,
)

try:
    __version__ = _metadata.version("miles-core")
except _metadata.PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0"

__all__ = [
    "Flag",
    "LossSpec",
    "ModelFamilySpec",
    "RewardSpec",
    "RolloutEngineSpec",
    "RolloutFilterSpec",
    "SdeBackendSpec",
    "Spec",
    "StepStrategySpec",
    "__version__",
    "hookimpl",
]
