"""Rewards for the reward plumbing tests: custom rewards (``--custom-rm-path``) that record
their calls, return dicts, raise or return NaN for chosen samples, and a dict-valued
reward class registered by the tests; log functions that keep a run's scored samples."""

from __future__ import annotations

import asyncio
import math
import os
from typing import Any

import numpy as np

CALLS: list[list[str]] = []
"""Each custom reward call: the prompts it got, in order."""

LOGGED: dict[str, list[Any]] = {"rollout": [], "eval": []}
"""Samples the log functions below received, per kind."""


def _record(samples: list[Any]) -> None:
    CALLS.append([s.prompt for s in samples])


async def prompt_length(args: Any, samples: list[Any]) -> list[float]:
    """Reward = the prompt's length (batched)."""
    _record(samples)
    return [float(len(s.prompt)) for s in samples]


async def rank_in_group(args: Any, samples: list[Any]) -> list[float]:
    """A group reward: each sample's rank by mean pixel value within the call (0 = darkest)."""
    _record(samples)
    means = [float(np.asarray(s.pixels, dtype=np.float64).mean()) for s in samples]
    order = sorted(range(len(means)), key=means.__getitem__)
    return [float(order.index(i)) for i in range(len(means))]


async def flaky(args: Any, samples: list[Any]) -> list[Any]:
    """Raises when any prompt says "boom"; NaN for "nan", inf for "inf", a string for
    "text"; otherwise the prompt's length."""
    _record(samples)
    if any("boom" in s.prompt for s in samples):
        raise ValueError("cannot read the boom prompt")
    values: list[Any] = []
    for s in samples:
        if "nan" in s.prompt:
            values.append(math.nan)
        elif "inf" in s.prompt:
            values.append(math.inf)
        elif "text" in s.prompt:
            values.append("high")
        else:
            values.append(float(len(s.prompt)))
    return values


async def always_fails(args: Any, samples: list[Any]) -> list[float]:
    _record(samples)
    raise RuntimeError("the reward server is offline")


async def wrong_length(args: Any, samples: list[Any]) -> list[float]:
    return [1.0]


async def fails_first_sample(args: Any, samples: list[Any]) -> list[float]:
    """Mean pixel value, NaN for the first sample of each prompt group."""
    return [math.nan if s.index_in_group == 0 else float(np.asarray(s.pixels, dtype=np.float64).mean()) for s in samples]


async def length_parts(args: Any, samples: list[Any]) -> list[dict[str, Any]]:
    """A dict per sample: ``length`` (the prompt's), ``words``, and a non-numeric ``note``."""
    _record(samples)
    return [{"length": float(len(s.prompt)), "words": len(s.prompt.split()), "note": "text"} for s in samples]


class Tones:
    """A registered dict-valued reward (registered by the tests as ``tones``): the mean
    pixel value (``brightness``) and their standard deviation (``contrast``)."""

    built = 0

    def __init__(self, config: Any = None) -> None:
        type(self).built += 1

    def __call__(self, outputs, prompts=None, metadata=None) -> list[dict[str, float]]:
        arrays = [np.asarray(o, dtype=np.float64) for o in outputs]
        return [{"brightness": float(a.mean()), "contrast": float(a.std())} for a in arrays]


async def slow_mean(args: Any, samples: list[Any]) -> list[float]:
    """Mean pixel value, after a line per call in the file ``$MILES_TEST_REWARD_MARK`` (when
    set) and ``$MILES_TEST_REWARD_SECONDS`` (default 0.3) of sleep: a reward server slow
    enough to be killed while it scores."""
    mark = os.environ.get("MILES_TEST_REWARD_MARK")
    if mark:
        with open(mark, "a") as file:
            file.write(f"{len(samples)}\n")
    await asyncio.sleep(float(os.environ.get("MILES_TEST_REWARD_SECONDS", "0.3")))
    return [float(np.asarray(s.pixels, dtype=np.float64).mean()) for s in samples]


async def hangs(args: Any, samples: list[Any]) -> list[float]:
    """Never answers in a test's time (a hung reward server)."""
    await asyncio.sleep(3600)
    return [0.0 for _ in samples]


async def log_rollout(rollout_id: int, args: Any, samples: Any, metrics: dict[str, Any]) -> None:
    LOGGED["rollout"].append(list(samples))


async def log_eval(rollout_id: int, args: Any, samples: Any, metrics: dict[str, Any]) -> None:
    LOGGED["eval"].append({name: list(group) for name, group in samples.items()})


class Counting:
    """A registered reward (registered by the tests as ``counting``): the mean pixel value;
    counts its calls and outputs and reports them through ``pop_metrics``."""

    def __init__(self, config: Any = None) -> None:
        self.calls = self.outputs = 0

    def __call__(self, outputs, prompts=None, metadata=None) -> list[float]:
        self.calls += 1
        self.outputs += len(outputs)
        return [float(np.asarray(o, dtype=np.float64).mean()) for o in outputs]

    def pop_metrics(self) -> dict[str, float]:
        metrics = {"calls": self.calls, "outputs": self.outputs}
        self.calls = self.outputs = 0
        return metrics


class Unbuildable:
    """A registered reward (registered by the tests as ``unbuildable``) whose weights are missing."""

    def __init__(self, config: Any = None) -> None:
        raise OSError("no weights at /nowhere/model.safetensors")

    def __call__(self, outputs, prompts=None, metadata=None) -> list[float]:
        raise AssertionError("never built")
