"""``--ci-test``: the run must reach a metric.

At the end of a run with ``--ci-test``, the value of ``--ci-metric-checker-key`` in the
last ``metrics.jsonl`` record that has it must be at least
``--ci-metric-checker-threshold``; otherwise the run fails with one line naming the key,
the value and the threshold. The configuration requires the key and the threshold
together with ``--ci-test`` (:mod:`miles_core.config.resolve`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def check_ci_metric(config: Any, metrics_path: str | Path) -> float | None:
    """Check the run's metric; return its value (None without ``--ci-test``). A miss
    raises :class:`~miles_core.training.run.RunError`."""
    from miles_core.errors import RunFailedError

    if not config.ci_test:
        return None
    key, threshold = config.ci_metric_checker_key, config.ci_metric_checker_threshold
    path = Path(metrics_path)
    value: Any = None
    found = False
    # The last record wins: a resumed run appends, and a metric may be logged only on
    # some rollouts (evaluation).
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RunFailedError(f"--ci-test: {path}:{number} is not JSON ({exc.msg})") from None
        if isinstance(record, dict) and key in record:
            value, found = record[key], True
    if not found:
        raise RunFailedError(f"--ci-test: no record of {path} has --ci-metric-checker-key {key!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise RunFailedError(f"--ci-test: metric {key!r} is {value!r}, not a number (threshold {threshold})")
    if value < threshold:
        raise RunFailedError(
            f"--ci-test: metric {key!r} is {value}, below --ci-metric-checker-threshold {threshold} (last record of {path})"
        )
    return float(value)
