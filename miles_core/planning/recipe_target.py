"""What a recipe says it was planned for, read from its header, and the check that it holds.

Every recipe under ``recipes/`` names in its header the GPUs it was planned for and the
peak ``miles-core plan`` gives for the command the header shows::

    # Planned for 1 x H100 80GB (79.1 GiB) per training rank: with the command above,
    # miles-core plan peaks at 71.5 GiB (train); the rollout's samples take 7.96 GiB of host memory.

(``with the command above on NAME,``: planned on checkpoint folder NAME rather than the
one the command names.) :func:`plan_recipe` plans the recipe on a checkpoint's (weightless) configuration with that
command's rollout batch size and the named GPU's memory; the plugins' real-configuration
tests assert that it fits and that the header's figures are the plan's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_core.errors import ConfigError

_HEADER = re.compile(
    r"^# Planned for (?P<gpus>\d+) x (?P<gpu>.+?) \((?P<gib>\d+(?:\.\d+)?) GiB\) per training rank: with the command above(?: on (?P<on>\S+))?,\n"
    r"# miles-core plan peaks at (?P<peak>\d+(?:\.\d+)? [GM]iB) \((?P<phase>\w+)\); the rollout's samples take "
    r"(?P<host>\d+(?:\.\d+)? [GM]iB) of host memory\.$",
    re.MULTILINE,
)
_CHECKPOINT = re.compile(r"--hf-checkpoint (\S+)")
_ROLLOUT_BATCH = re.compile(r"--rollout-batch-size (\d+)")


@dataclass(frozen=True)
class PlannedFor:
    """A recipe header's planning line (see the module docstring)."""

    gpus: int
    gpu: str
    gpu_gib: float
    peak: str
    """The peak as :func:`~miles_core.planning.plan.gib` prints it."""
    phase: str
    host: str
    checkpoint: str
    """The checkpoint folder name the figures were planned on (the header's ``on NAME``, else
    the last part of the command's ``--hf-checkpoint``)."""
    rollout_batch_size: int

    @classmethod
    def read(cls, recipe: str | Path) -> PlannedFor:
        """The planning line of ``recipe``; a recipe without one (or without a command with
        ``--hf-checkpoint`` and ``--rollout-batch-size``) is a one-line ConfigError."""
        text = Path(recipe).read_text(encoding="utf-8")
        match = _HEADER.search(text)
        checkpoint = _CHECKPOINT.search(text)
        batch = _ROLLOUT_BATCH.search(text)
        if match is None or checkpoint is None or batch is None:
            raise ConfigError(
                f"{recipe}: the header names no planned GPUs (a '# Planned for N x GPU (G GiB) per training rank: ...' line "
                "after a command with --hf-checkpoint and --rollout-batch-size)"
            )
        return cls(
            gpus=int(match["gpus"]),
            gpu=match["gpu"],
            gpu_gib=float(match["gib"]),
            peak=match["peak"],
            phase=match["phase"],
            host=match["host"],
            checkpoint=match["on"] or Path(checkpoint[1]).name,
            rollout_batch_size=int(batch[1]),
        )

    def flags(self) -> list[str]:
        """The command-line flags that plan for these GPUs."""
        flags = ["--rollout-batch-size", str(self.rollout_batch_size), "--gpu-memory-gb", f"{self.gpu_gib:g}"]
        if self.gpus > 1:
            flags += ["--actor-num-gpus-per-node", str(self.gpus)]
        return flags


def plan_recipe(recipe: str | Path, checkpoint: str | Path, *extra: str) -> tuple[PlannedFor, Any]:
    """``recipe``'s header and the :class:`~miles_core.planning.plan.MemoryPlan` of the
    recipe on ``checkpoint`` for the GPUs it names (``extra``: more flags)."""
    from miles_core.config.resolve import resolve_config
    from miles_core.planning import plan_run

    target = PlannedFor.read(recipe)
    args = ["--hf-checkpoint", str(checkpoint), "--custom-config-path", str(recipe), *target.flags(), *extra]
    return target, plan_run(resolve_config(args), configured_first=True)


__all__ = ["PlannedFor", "plan_recipe"]
