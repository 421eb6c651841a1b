"""The reward-hacking guard's statistic names and ``--guard-thresholds`` parsing: shared by
the configuration checks (a bad value stops the run before anything loads) and the guard
itself (:mod:`miles_core.training.guard`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from miles_core.errors import ConfigError

IMAGE_STATISTICS = ("brightness", "saturation", "contrast", "high_frequency", "jpeg_size", "color_entropy")
"""Per-sample image statistics (:data:`miles_core.image_statistics.STATISTICS`): an alarm in either direction."""
STATISTICS = (*IMAGE_STATISTICS, "diversity", "reward_gap", "judge_reward")
"""Every statistic measured per eval set, in metric order; ``--guard-thresholds`` names these."""


def parse_thresholds(items: Sequence[str] | None) -> dict[str, float]:
    """``--guard-thresholds STAT=X ...`` as ``{stat: X}``; :class:`ConfigError` (one line)
    for an item that is not ``STAT=X``, an unknown statistic or a threshold that is not a
    finite number above 0."""
    thresholds: dict[str, float] = {}
    for item in items or ():
        name, sep, text = str(item).partition("=")
        name = name.strip()
        if not sep:
            raise ConfigError(f"--guard-thresholds {item}: expected STAT=X (for example diversity=2.5)")
        if name not in STATISTICS:
            raise ConfigError(f"--guard-thresholds {item}: unknown statistic {name!r}; known: {', '.join(STATISTICS)}")
        try:
            value = float(text)
        except ValueError:
            raise ConfigError(f"--guard-thresholds {item}: {text!r} is not a number") from None
        if not math.isfinite(value) or value <= 0:
            raise ConfigError(f"--guard-thresholds {item}: the threshold must be a finite number above 0 (in spreads)")
        thresholds[name] = value
    return thresholds


__all__ = ["IMAGE_STATISTICS", "STATISTICS", "parse_thresholds"]
