"""Scoring samples with the run's reward: dispatch, mixtures, dict rewards, group rewards,
and per-sample failures.

What scores a sample (first match):

1. ``--custom-rm-path``: ``async def rm(args, samples) -> list`` gets the samples in one
   batched call (with ``--group-rm``: one call per prompt group).
2. ``metadata["rm_type"]`` of the sample (its data row): that registered reward alone.
3. ``--reward-weights '{"a": wa, "b": wb}'``: every named registered reward; the trained
   reward is ``wa * a + wb * b`` and each one is kept as a component.
4. ``--rm-type NAME``: that registered reward.

In evaluation (``RewardScorer(config, evaluation=True)``) ``--eval-rm-type`` or
``--eval-reward-weights``, when set, score every sample (they replace 2, 3 and 4: rows'
``rm_type`` is ignored, so the held-out reward is the one reported), and
``--eval-reward-key`` (default ``--reward-key``) picks the scalar of a dict reward.

A registered reward is built once per run as ``cls(config)`` (instances are cached, and
shared between the training and the evaluation scorer) and called as
``reward(outputs, prompts, metadata) -> list`` in a worker thread
(``asyncio.to_thread``), so the event loop, and the generation on it, keeps going; calls
to one reward instance are serialised by a lock, so a reward need not be thread-safe.
Without ``--group-rm`` the samples are grouped by their reward and each reward gets one
call for all of its samples; and calls coalesce: samples that :meth:`RewardScorer.score`
calls submit for a reward while a call of it runs (streaming: the microgroups returning
meanwhile) wait, and its next call takes all of them, so a reward's own batch size
(``--pickscore-batch-size``...) is reached. With ``--group-rm``, one call per prompt group
(``group_index``). A ``--custom-rm-path`` function is called once per ``score`` call;
its calls may overlap.

Values, per sample: a number; or a dict, from which the reward key (``--reward-key``)
picks the trained scalar and whose other numeric keys become the sample's
``reward_components``. A dict without a reward key, or a key that no dict of a call
holds, is a :class:`RewardError` listing the keys; so is a return value that is not a
sequence of one value per sample.

Failures are per sample. A value that is NaN, infinite or not a number fails that sample;
so does an exception instance, which a reward returns in a sample's place to say why it
could not score that sample (a server that did not answer for it) while scoring the others.
A call that raises fails its samples with one warning line naming the reward and the
exception; when that call held several samples (a batched call without ``--group-rm``)
they are then scored one at a time, so one bad sample does not take the others with it
(a group reward is not retried: it scores the group as a whole). A failed sample gets
``reward = nan``, ``reward_failed = True`` and ``remove_sample = True``: it is left out of
its group's advantage statistics, gets advantage 0 and is masked in the loss
(:func:`miles_core.training.advantages.advantages_from_config`). :meth:`RewardScorer.finish`
counts them (``rollout/reward/failed``, and ``rollout/reward/<reward>_failed`` for each
reward that scored samples: a mixture's components, rows' ``rm_type`` rewards,
``custom_rm``) and raises :class:`RewardError` naming the reward that failed for every
sample it scored in the rollout, with its last error (and naming the reward set when every
sample failed without one reward failing them all).

A reward instance with a ``pop_metrics() -> dict[str, float]`` method reports its own
counters: :meth:`RewardScorer.finish` calls it (after the rollout's calls) and logs each key
as ``rollout/reward/<reward>/<key>`` (an evaluation: ``eval/<set>/reward/<reward>/<key>``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import numbers
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from miles_core.errors import RewardError, RewardsFailedError
from miles_core.rollout.sample import Sample

log = logging.getLogger("miles_core.rewards")

CUSTOM = "--custom-rm-path"
"""Key of the custom reward in a scorer's call plan."""


def _brief(sample: Any) -> str:
    prompt = str(getattr(sample, "prompt", ""))
    if len(prompt) > 40:
        prompt = prompt[:37] + "..."
    seed = getattr(sample, "seed", None)
    return repr(prompt) + (f" (seed {seed})" if seed is not None else "")


def _listed(items: Sequence[str], limit: int = 3) -> str:
    shown = "; ".join(items[:limit])
    return shown + (f"; and {len(items) - limit} more" if len(items) > limit else "")


def _number(value: Any) -> float | None:
    """``value`` as a float, or None when it is not a real number (NaN and inf are)."""
    if torch.is_tensor(value) and value.numel() == 1:
        value = value.item()
    elif hasattr(value, "shape") and hasattr(value, "item") and getattr(value, "shape", None) == ():
        value = value.item()  # a numpy scalar array
    if isinstance(value, numbers.Real):
        return float(value)
    return None


class _Failure:
    """One sample's failed value: why (for the warning)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


class _Queue:
    """The samples waiting for the next call of one registered reward, on one event loop,
    and the task making those calls (None when idle)."""

    __slots__ = ("loop", "task", "waiting")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.task: asyncio.Task | None = None
        self.waiting: list[tuple[list[Any], asyncio.Future]] = []


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class RewardScorer:
    """Scores samples with the configuration's reward (see the module docstring).

    Attributes:
        evaluation: this scorer scores evaluations (``--eval-*`` reward flags apply).
        needs_whole_groups: ``--group-rm``: :meth:`score` must get whole prompt groups.
        name: the default reward, for messages (``brightness``, ``0.5*ocr + 0.5*pickscore``,
            ``--custom-rm-path my.rm``).
        weights: the mixture's ``{reward: weight}``; None without one.
        key: the dict-reward key this scorer trains (or evaluates) on; None when unset.
    """

    def __init__(
        self,
        config: Any,
        *,
        evaluation: bool = False,
        share: RewardScorer | None = None,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        """Build the default reward(s) now, so a missing model fails before the run starts.

        ``share``: another scorer of the same run whose built reward instances this one
        reuses (the evaluation scorer shares the training scorer's models). ``warn``:
        where per-sample failure warnings go (default: the ``miles_core.rewards`` logger).
        """
        from miles_core.plugin_manager import get_host

        self.config = config
        self.evaluation = evaluation
        self.needs_whole_groups = bool(getattr(config, "group_rm", False))
        self.warn = warn or log.warning
        self.registry = get_host().registries.reward
        if share is not None:
            self._rewards, self._build_lock, self._call_locks = share._rewards, share._build_lock, share._call_locks
        else:
            self._rewards: dict[str, Any] = {}
            self._build_lock = threading.Lock()
            self._call_locks: dict[str, threading.Lock] = {}
        self._queues: dict[str, _Queue] = {}  # per registered reward: the samples waiting for its next call
        self._outcomes: dict[int, dict[str, str | None]] = {}
        """Per scored sample (by id) until :meth:`finish`: each reward that scored it and
        why it failed (None: it did not)."""
        get = lambda dest: getattr(config, dest, None)  # noqa: E731
        self.key: str | None = (get("eval_reward_key") or get("reward_key")) if evaluation else get("reward_key")
        self.key_flag = "--eval-reward-key" if evaluation and get("eval_reward_key") else "--reward-key"
        self.custom = None
        self.weights: dict[str, float] | None = None
        self.default: str | None = None  # the single registered reward, when that is the default
        eval_rm, eval_weights = (get("eval_rm_type"), get("eval_reward_weights")) if evaluation else (None, None)
        self.fixed = bool(eval_rm or eval_weights)
        """An evaluation reward set (``--eval-rm-type`` / ``--eval-reward-weights``) scores
        every sample: rows' ``metadata.rm_type`` are ignored."""
        if eval_rm or eval_weights:
            self.default, self.weights = eval_rm, self._weights(eval_weights, "--eval-reward-weights")
        elif get("custom_rm_path"):
            from miles_core.refs import resolve_path_flag

            self.custom = resolve_path_flag(CUSTOM, config.custom_rm_path, "async_callable")
        elif get("reward_weights"):
            self.weights = self._weights(get("reward_weights"), "--reward-weights")
        elif get("rm_type"):
            self.default = config.rm_type
        else:
            raise RewardError(
                "no reward: set --rm-type (a registered reward), --reward-weights (a mixture) or --custom-rm-path (your own function)"
            )
        if self.custom is not None:
            self.name = f"{CUSTOM} {config.custom_rm_path}"
        elif self.weights is not None:
            self.name = " + ".join(f"{w:g}*{n}" for n, w in self.weights.items())
        else:
            self.name = self.default
        flag = ("--eval-" if eval_rm or eval_weights else "--") + ("reward-weights" if self.weights else "rm-type")
        for reward in self.weights or ([self.default] if self.default else []):
            self._reward(reward, flag=flag)

    @staticmethod
    def _weights(weights: Any, flag: str) -> dict[str, float] | None:
        if weights is None:
            return None
        if not isinstance(weights, Mapping) or not weights:
            raise RewardError(f"{flag}: expected a non-empty JSON object of reward weights, got {weights!r}")
        return {str(name): float(w) for name, w in weights.items()}

    # -- building and calling rewards ----------------------------------------------------

    def _reward(self, name: str, *, flag: str | None = None, sample: Any = None) -> Any:
        """The built instance of registered reward ``name`` (built on first use)."""
        instance = self._rewards.get(name)
        if instance is not None:  # no lock: a call never waits for another reward's build
            return instance
        with self._build_lock:
            if name in self._rewards:
                return self._rewards[name]
            if name not in self.registry:
                where = f"metadata rm_type of sample {_brief(sample)}" if sample is not None else None
                message = self.registry.unknown_message(name, flag=flag)
                raise RewardError(f"{where}: {message}" if where else message)
            try:
                instance = self.registry.get(name).load()(self.config)
            except RewardError:
                raise
            except Exception as exc:
                raise RewardError(f"reward {name}: cannot be built: {type(exc).__name__}: {exc}") from exc
            self._call_locks[name] = threading.Lock()  # before the instance: a lock-free reader finds both
            self._rewards[name] = instance
            return instance

    def _call_registered(self, name: str, samples: Sequence[Any]) -> Any:
        reward = self._reward(name)
        with self._call_locks[name]:
            return reward([s.pixels for s in samples], [s.prompt for s in samples], [getattr(s, "metadata", {}) for s in samples])

    async def _call(self, name: str, samples: list[Any]) -> list[Any]:
        """The raw values of reward ``name`` (or :data:`CUSTOM`) for ``samples``: one
        value per sample, else :class:`RewardError`; raises whatever the reward raises."""
        if name == CUSTOM:
            values = await self.custom(self.config, samples)
        else:
            values = await asyncio.to_thread(self._call_registered, name, samples)
        label = self.name if name == CUSTOM else f"reward {name}"
        if torch.is_tensor(values) or hasattr(values, "tolist"):
            values = values.tolist()
        if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Sequence):
            raise RewardError(f"{label} returned {type(values).__name__}, expected a list of one value per sample")
        if len(values) != len(samples):
            raise RewardError(f"{label} returned {len(values)} values for {len(samples)} samples")
        return list(values)

    async def _coalesced(self, name: str, samples: list[Any]) -> list[tuple[float, dict] | _Failure]:
        """Registered reward ``name``'s parsed values for ``samples``, through its queue:
        while a call of the reward runs, samples submitted meanwhile wait, and the next call
        takes all of them (each submitter gets its own samples' results)."""
        loop = asyncio.get_running_loop()
        queue = self._queues.get(name)
        if queue is None or queue.loop is not loop:
            queue = self._queues[name] = _Queue(loop)
        future = loop.create_future()
        queue.waiting.append((samples, future))
        if queue.task is None:
            queue.task = loop.create_task(self._drain(name, queue))
        return await future

    async def _drain(self, name: str, queue: _Queue) -> None:
        """Call reward ``name`` on everything waiting in ``queue`` until nothing is."""
        batch: list[tuple[list[Any], asyncio.Future]] = []
        try:
            while queue.waiting:
                batch, queue.waiting = [(s, f) for s, f in queue.waiting if not f.done()], []
                if not batch:
                    continue
                try:
                    results = await self._values(name, [x for part, _ in batch for x in part], retry=True)
                except Exception as exc:  # not per sample (RewardError): every submitter gets it
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                start = 0
                for part, future in batch:
                    if not future.done():
                        future.set_result(results[start : start + len(part)])
                    start += len(part)
                batch = []
        finally:
            queue.task = None
            for _, future in batch + queue.waiting:  # cancelled (the loop is closing)
                future.cancel()
            queue.waiting = []

    def _parse(self, name: str, values: list[Any]) -> list[tuple[float, dict[str, float]] | _Failure]:
        """Per sample ``(scalar, other numeric keys)`` or a :class:`_Failure`."""
        label = self.name if name == CUSTOM else f"reward {name}"
        dicts = [v for v in values if isinstance(v, Mapping)]
        if dicts:
            keys = sorted({str(k) for d in dicts for k in d})
            if self.key is None:
                raise RewardError(
                    f"{label} returns a dict per sample (keys: {', '.join(keys)}); choose the trained one with "
                    f"{'--eval-reward-key or ' if self.evaluation else ''}--reward-key"
                )
            if not any(self.key in d for d in dicts):
                raise RewardError(f"{self.key_flag} {self.key}: {label} returns no such key (keys: {', '.join(keys)})")
        parsed: list[tuple[float, dict[str, float]] | _Failure] = []
        for value in values:
            extras: dict[str, float] = {}
            if isinstance(value, BaseException):  # the reward could not score this sample, and says why
                parsed.append(_Failure(_one_line(str(value) or type(value).__name__)))
                continue
            if isinstance(value, Mapping):
                if self.key not in value:
                    parsed.append(_Failure(f"no key {self.key!r} (keys: {', '.join(map(str, value))})"))
                    continue
                for k, v in value.items():
                    number = _number(v)
                    if k != self.key and number is not None and math.isfinite(number):
                        extras[str(k)] = number
                value = value[self.key]
            number = _number(value)
            if number is None:
                parsed.append(_Failure(f"returned {value!r} ({type(value).__name__}), not a number"))
            elif not math.isfinite(number):
                parsed.append(_Failure(f"returned {number}"))
            else:
                parsed.append((number, extras))
        return parsed

    async def _values(self, name: str, samples: list[Any], *, retry: bool) -> list[tuple[float, dict] | _Failure]:
        """Reward ``name``'s parsed values for ``samples``, failures warned about."""
        label = self.name if name == CUSTOM else f"reward {name}"
        try:
            parsed = self._parse(name, await self._call(name, samples))
        except RewardError:
            raise
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}".strip()
            if len(samples) == 1 or not retry:
                what = f"sample {_brief(samples[0])}" if len(samples) == 1 else f"the group of {_brief(samples[0])}"
                self.warn(f"{label} raised {error} on {what}; {len(samples)} sample(s) masked")
                return [_Failure(error)] * len(samples)
            self.warn(f"{label} raised {error} on a call of {len(samples)} samples; scoring them one at a time")
            parsed = []
            failed: list[str] = []
            for sample in samples:
                try:
                    (one,) = self._parse(name, await self._call(name, [sample]))
                except RewardError:
                    raise
                except Exception as exc_one:
                    one = _Failure(f"{type(exc_one).__name__}: {exc_one}".strip())
                if isinstance(one, _Failure):
                    failed.append(f"{_brief(sample)}: {one.reason}")
                parsed.append(one)
            if failed:
                self.warn(f"{label}: {len(failed)} of {len(samples)} sample(s) failed on their own and are masked: {_listed(failed)}")
            return parsed
        bad = [f"{_brief(s)} {p.reason}" for s, p in zip(samples, parsed) if isinstance(p, _Failure)]
        if bad:
            self.warn(f"{label}: {len(bad)} of {len(samples)} sample(s) got no finite reward and are masked: {_listed(bad)}")
        return parsed

    # -- scoring -------------------------------------------------------------------------

    def reward_set(self, sample: Any) -> str | None:
        """The reward that scores ``sample``: :data:`CUSTOM`, its ``metadata["rm_type"]``,
        or None for the default (the mixture or ``--rm-type`` reward)."""
        if self.custom is not None:
            return CUSTOM
        if self.fixed:
            return None
        metadata = getattr(sample, "metadata", None)
        override = metadata.get("rm_type") if isinstance(metadata, Mapping) else None
        return override.strip() if isinstance(override, str) and override.strip() else None

    def label(self, reward_set: str | None) -> str:
        return self.name if reward_set in (None, CUSTOM) else reward_set

    async def _score_part(self, reward_set: str | None, samples: list[Any]) -> None:
        """Score samples that share a reward set (and, with --group-rm, a prompt group)."""
        retry = not self.needs_whole_groups
        if reward_set is None and self.weights is not None:
            names = list(self.weights)
        else:
            name = reward_set or self.default
            if reward_set not in (None, CUSTOM) and reward_set not in self._rewards:
                await asyncio.to_thread(self._reward, name, sample=samples[0])  # unknown name: RewardError
            names = [name]
        if self.needs_whole_groups or names == [CUSTOM]:
            # A group reward sees one group per call; a custom reward's calls run concurrently.
            results = await asyncio.gather(*(self._values(name, samples, retry=retry) for name in names))
        else:
            results = await asyncio.gather(*(self._coalesced(name, samples) for name in names))
        for i, sample in enumerate(samples):
            values = [result[i] for result in results]
            self._outcomes[id(sample)] = {
                name: (value.reason if isinstance(value, _Failure) else None) for name, value in zip(names, values)
            }
            sample.reward_failures = {self.metric_name(name): isinstance(value, _Failure) for name, value in zip(names, values)}
            components: dict[str, float] = {}
            if self.weights is not None and reward_set is None:
                for name, value in zip(names, values):
                    if not isinstance(value, _Failure):
                        components[name] = value[0]
                ok = len(components) == len(names)
                reward = sum(self.weights[n] * components[n] for n in names) if ok else math.nan
            else:
                (value,) = values
                ok = not isinstance(value, _Failure)
                reward, components = (value[0], dict(value[1])) if ok else (math.nan, {})
            sample.reward = float(reward)
            sample.reward_components = components
            sample.reward_failed = not ok
            if not ok:
                sample.remove_sample = True

    async def score(self, samples: Sequence[Sample]) -> torch.Tensor:
        """Score ``samples`` (any subset of a rollout; whole prompt groups under
        ``--group-rm``); set each one's ``reward``, ``reward_components`` and
        ``reward_failed`` (``remove_sample`` too when it failed) and return the
        ``[len(samples)]`` float32 tensor of rewards (NaN where a sample failed)."""
        samples = list(samples)
        parts: dict[Any, list[Any]] = {}
        for sample in samples:
            reward_set = self.reward_set(sample)
            key = (reward_set, getattr(sample, "group_index", None)) if self.needs_whole_groups else (reward_set,)
            parts.setdefault(key, []).append(sample)
        await asyncio.gather(*(self._score_part(key[0], part) for key, part in parts.items()))
        return torch.tensor([float(s.reward) for s in samples], dtype=torch.float32)

    def metric_name(self, reward: str) -> str:
        """The name of reward ``reward`` (a registered name, or :data:`CUSTOM`) in metric keys."""
        return "custom_rm" if reward == CUSTOM else reward

    def take_outcome(self, sample: Any) -> dict[str, str | None]:
        """What :meth:`score` recorded for ``sample`` for :meth:`finish`, and forgets it:
        each reward that scored it and why it failed (None: it did not). A reward worker
        hands it to the driver with the sample's reward."""
        return self._outcomes.pop(id(sample), None) or {}

    def pop_counters(self, rewards: Sequence[str], prefix: str) -> dict[str, float]:
        """``<prefix><reward>/<key>`` for what each reward's ``pop_metrics()`` (if it has
        one) counted since it was last asked."""
        metrics: dict[str, float] = {}
        for name in rewards:
            pop = getattr(self._rewards.get(name), "pop_metrics", None)
            if not callable(pop):
                continue
            with self._call_locks[name]:
                values = pop()
            if not isinstance(values, Mapping):
                self.warn(f"reward {name}: pop_metrics() returned {type(values).__name__}, expected a dict of numbers")
                continue
            for key, value in values.items():
                number = _number(value)
                if number is None:
                    self.warn(f"reward {name}: pop_metrics() value {key!r} is {value!r}, not a number; not logged")
                    continue
                metrics[f"{prefix}{name}/{key}"] = number
        return metrics

    def finish(self, samples: Sequence[Sample], *, prefix: str = "rollout/reward/") -> dict[str, float]:
        """After all of a rollout's samples are scored: the reward metrics
        (:func:`summarize_rewards`), which may raise :class:`RewardError`."""
        outcomes = [self.take_outcome(sample) for sample in samples]
        return summarize_rewards(
            samples,
            outcomes,
            lambda rewards: self.pop_counters(rewards, prefix),
            name=self.name,
            evaluation=self.evaluation,
            prefix=prefix,
        )


def summarize_rewards(
    samples: Sequence[Any],
    outcomes: Sequence[Mapping[str, str | None]],
    counters: Callable[[list[str]], dict[str, float]],
    *,
    name: str,
    evaluation: bool,
    prefix: str = "rollout/reward/",
) -> dict[str, float]:
    """A rollout's reward metrics from its scored ``samples`` and their ``outcomes``
    (:meth:`RewardScorer.take_outcome`, one per sample): :func:`reward_metrics`, plus
    ``<reward>_failed`` for each reward that scored any of them and what ``counters``
    returns for those rewards (their ``pop_metrics()`` as ``<reward>/<key>``; summed over
    the workers of a Ray run). :class:`RewardError` naming the reward(s) that failed for
    every sample they scored (or, failing that, when every sample failed); ``name``: the
    scorer's reward set, for that message."""
    tally: dict[str, list[Any]] = {}  # reward -> [samples scored, failed, last error]
    for outcome in outcomes:
        for reward, error in outcome.items():
            counts = tally.setdefault(reward, [0, 0, None])
            counts[0] += 1
            if error is not None:
                counts[1] += 1
                counts[2] = error
    own = counters([n for n in tally if n != CUSTOM])
    what = "evaluation" if evaluation else "rollout"
    dead = [(reward, scored, error) for reward, (scored, failed, error) in tally.items() if scored and failed == scored]
    if dead:
        raise RewardsFailedError(
            "; ".join(
                f"reward {name if reward == CUSTOM else reward} failed for every sample it scored in this "
                f"{what} ({scored} sample{'s' if scored != 1 else ''}); last error: {_one_line(error)}"
                for reward, scored, error in dead
            )
        )
    failed = [s for s in samples if getattr(s, "reward_failed", False)]
    if samples and len(failed) == len(samples):
        counts = ", ".join(f"{name if n == CUSTOM else n} {c[1]} of {c[0]}" for n, c in tally.items() if c[1])
        raise RewardsFailedError(
            f"reward {name} failed for every sample of the {what} ({len(samples)} samples"
            + (f"; failures per reward: {counts}" if counts else "")
            + "); see the warnings above for why"
        )
    metrics = reward_metrics(samples, prefix=prefix)
    metrics.update(own)
    return metrics


def reward_metrics(samples: Sequence[Any], *, prefix: str = "rollout/reward/") -> dict[str, float]:
    """A rollout's reward metrics over its samples whose reward did not fail:
    ``raw_mean``, ``raw_std`` (population), ``raw_min``, ``raw_max``, ``failed`` (count)
    and ``<component>_mean`` for each reward component; keys start with ``prefix``.
    Also what a replay (``--load-debug-rollout-data``) reports, from the saved samples."""
    valid = [s for s in samples if not getattr(s, "reward_failed", False)]
    metrics: dict[str, float] = {}
    if valid:
        # float32, the dtype of the rewards tensor score() returns (the numbers run.py logged before)
        rewards = torch.tensor([float(s.reward) for s in valid], dtype=torch.float32)
        metrics.update(
            {
                f"{prefix}raw_mean": float(rewards.mean()),
                f"{prefix}raw_std": float(rewards.std(unbiased=False)),
                f"{prefix}raw_min": float(rewards.min()),
                f"{prefix}raw_max": float(rewards.max()),
            }
        )
    metrics[f"{prefix}failed"] = len(samples) - len(valid)
    per_reward: dict[str, int] = {}
    for sample in samples:
        for name, failed in (getattr(sample, "reward_failures", None) or {}).items():
            per_reward[name] = per_reward.get(name, 0) + int(failed)
    metrics.update({f"{prefix}{name}_failed": count for name, count in per_reward.items()})
    names = list(dict.fromkeys(k for s in valid for k in (getattr(s, "reward_components", None) or {})))
    for name in names:
        values = [s.reward_components[name] for s in valid if name in s.reward_components]
        metrics[f"{prefix}{name}_mean"] = float(sum(values) / len(values))
    return metrics


__all__ = ["CUSTOM", "RewardError", "RewardScorer", "reward_metrics", "summarize_rewards"]
