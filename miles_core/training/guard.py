"""The reward-hacking guard (docs/guide.md, "Reward-hacking guard"): at every evaluation,
on each eval set's samples (fixed prompts, fixed seeds), collateral statistics of the
images, the gap between training and held-out reward, an optional judge reward and the
KL to the reference, each compared with the first evaluation that measured it.

For a statistic with per-sample (diversity: per-pair) values ``x``, the first evaluation
that measures it sets the baseline ``b = mean(x)`` and the spread
``s = max(std(x), SPREAD_FLOOR_RELATIVE * |b|, SPREAD_FLOOR_ABSOLUTE)`` (the sample
standard deviation, floored so that a constant statistic divides by no zero); later
evaluations report the drift ``(mean(x) - b) / s``. An alarm is raised at an evaluation
where

- an image statistic (brightness, saturation, contrast, high_frequency, jpeg_size,
  color_entropy) drifted beyond the threshold in either direction;
- diversity (pairwise distance between samples of the same prompt) fell below minus the
  threshold;
- the reward gap (training reward mean over the rollouts since the previous evaluation
  minus each held-out sample's reward; its baseline is the first evaluation that has
  training rollouts before it) rose above the threshold;
- the judge reward (``--guard-rm-type``) fell below minus the threshold while the held-out
  trained reward's mean rose above its first evaluation;
- the KL to the reference (run-wide, :meth:`Trainer.reference_kl
  <miles_core.training.trainer.Trainer.reference_kl>`) exceeds ``--guard-kl-max``: it is 0
  before training by construction, so it has an absolute bound instead of a spread (its
  drift is the KL itself: baseline 0, spread 1).

A checkpoint keeps the baselines (:meth:`RunGuard.state_dict`): a resumed run compares
with the original run's first evaluation.

:class:`Guard` is the arithmetic (numbers in, metrics and alarms out); :class:`RunGuard`
wires it into a run: it measures the images, scores the judge, measures the KL, writes
``guard.jsonl`` and logs one line per alarm.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from miles_core.config.guard_flags import IMAGE_STATISTICS, STATISTICS, parse_thresholds
from miles_core.errors import GuardStopError, RewardError

SPREAD_FLOOR_RELATIVE = 0.01
"""A baseline's spread is at least this fraction of the baseline's magnitude ..."""
SPREAD_FLOOR_ABSOLUTE = 1e-6
"""... and at least this, so that a constant statistic (every sample alike) divides by no zero."""
KL_PAIRS = 32
"""Transitions of the latest rollout the KL is averaged over (evenly spaced)."""
ALARMS_FILE = "guard.jsonl"
"""One JSON line per alarm, in the run directory."""
GUARD_CHECKPOINT_DIR = "guard_checkpoint"
"""Where ``--guard-stop-on-alarm`` saves its checkpoint when ``--save`` is unset (in the run directory)."""


@dataclass(frozen=True)
class GuardSettings:
    """The guard's flags."""

    threshold: float
    """``--guard-threshold``: the default alarm threshold, in spreads."""
    thresholds: Mapping[str, float] = field(default_factory=dict)
    """``--guard-thresholds``: per-statistic overrides."""
    kl_max: float = 0.05
    """``--guard-kl-max``: the KL's absolute bound."""
    judge: str | None = None
    """``--guard-rm-type``: the judge reward's registered name."""
    stop_on_alarm: bool = False

    @classmethod
    def from_config(cls, config: Any) -> GuardSettings:
        return cls(
            threshold=float(config.guard_threshold),
            thresholds=parse_thresholds(config.guard_thresholds),
            kl_max=float(config.guard_kl_max),
            judge=config.guard_rm_type,
            stop_on_alarm=bool(config.guard_stop_on_alarm),
        )

    def threshold_of(self, statistic: str) -> float:
        return self.thresholds.get(statistic, self.threshold)


@dataclass(frozen=True)
class EvalSetObservation:
    """One eval set at one evaluation: per-sample values of each statistic measured
    (diversity per pair), the held-out trained reward per sample (NaN: failed) and the
    judge's (None without ``--guard-rm-type``)."""

    statistics: Mapping[str, torch.Tensor]
    rewards: torch.Tensor
    judge_rewards: torch.Tensor | None = None


@dataclass(frozen=True)
class Alarm:
    """One line of ``guard.jsonl``."""

    rollout_id: int
    trained_rollouts: int
    eval_set: str | None
    statistic: str
    value: float
    baseline: float
    spread: float
    drift: float
    threshold: float
    message: str

    def record(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class GuardReport:
    """What one evaluation's check produced: ``guard/*`` metrics and the alarms raised."""

    metrics: dict[str, float]
    alarms: list[Alarm]


@dataclass(frozen=True)
class _Baseline:
    mean: float
    spread: float
    where: str
    """How a message names it ("the first evaluation")."""


def _finite(values: torch.Tensor) -> torch.Tensor:
    values = values.detach().to("cpu", torch.float64).flatten()
    return values[torch.isfinite(values)]


def _baseline(values: torch.Tensor, where: str) -> _Baseline:
    mean = float(values.mean())
    std = float(values.std()) if values.numel() > 1 else 0.0
    return _Baseline(mean, max(std, SPREAD_FLOOR_RELATIVE * abs(mean), SPREAD_FLOOR_ABSOLUTE), where)


def _label(statistic: str) -> str:
    return {"high_frequency": "high-frequency energy", "jpeg_size": "JPEG size", "color_entropy": "colour entropy"}.get(
        statistic, statistic.replace("_", " ")
    )


class Guard:
    """The guard's arithmetic: :meth:`check` takes one evaluation's observations and
    returns its ``guard/*`` metrics and alarms; the first evaluation measuring a statistic
    is its baseline."""

    def __init__(self, settings: GuardSettings) -> None:
        self.settings = settings
        self.baselines: dict[tuple[str | None, str], _Baseline] = {}
        self._reward_baselines: dict[str, float] = {}

    def check(
        self,
        *,
        rollout_id: int,
        trained_rollouts: int,
        eval_sets: Mapping[str, EvalSetObservation],
        training_reward: float | None = None,
        kl: float | None = None,
    ) -> GuardReport:
        """``training_reward``: the mean training reward of the rollouts since the previous
        evaluation (None: none ran); ``kl``: the KL to the reference now (None: not measured)."""
        metrics: dict[str, float] = {}
        alarms: list[Alarm] = []

        def judge(name: str | None, statistic: str, values: torch.Tensor, where: str, raise_if: Callable[[float], bool]) -> None:
            values = _finite(values)
            if not values.numel():
                return
            prefix = f"guard/{name}/{statistic}" if name is not None else f"guard/{statistic}"
            key = (name, statistic)
            if key not in self.baselines:
                self.baselines[key] = _baseline(values, where)
            base = self.baselines[key]
            value = float(values.mean())
            drift = (value - base.mean) / base.spread
            threshold = self.settings.threshold_of(statistic)
            raised = raise_if(drift) if drift == drift else False
            metrics[prefix] = value
            metrics[f"{prefix}/drift"] = drift
            metrics[f"{prefix}/alarm"] = 1.0 if raised else 0.0
            if raised:
                way = "rose" if drift > 0 else "fell"
                side = "above" if drift > 0 else "below"
                extra = " while the trained reward rose" if statistic == "judge_reward" else ""
                judge_name = f" ({self.settings.judge})" if statistic == "judge_reward" and self.settings.judge else ""
                message = (
                    f"guard: alarm: {name} {_label(statistic)}{judge_name} {way} {abs(drift):.1f} spreads {side} "
                    f"{base.where}{extra} ({base.mean:.3g} -> {value:.3g}; threshold {threshold:g})"
                )
                alarms.append(
                    Alarm(rollout_id, trained_rollouts, name, statistic, value, base.mean, base.spread, drift, threshold, message)
                )

        for name, observed in eval_sets.items():
            for statistic in (*IMAGE_STATISTICS, "diversity"):
                if statistic not in observed.statistics:
                    continue
                threshold = self.settings.threshold_of(statistic)
                if statistic == "diversity":
                    rule = lambda d, t=threshold: d < -t  # noqa: E731
                else:
                    rule = lambda d, t=threshold: abs(d) > t  # noqa: E731
                judge(name, statistic, observed.statistics[statistic], "the first evaluation", rule)
            rewards = _finite(observed.rewards)
            reward_rose = False
            if rewards.numel():
                self._reward_baselines.setdefault(name, float(rewards.mean()))
                reward_rose = float(rewards.mean()) > self._reward_baselines[name]
            if training_reward is not None and math.isfinite(training_reward) and rewards.numel():
                t = self.settings.threshold_of("reward_gap")
                judge(
                    name,
                    "reward_gap",
                    training_reward - rewards,
                    "the first evaluation after training rollouts",
                    lambda d, t=t: d > t,
                )
            if observed.judge_rewards is not None:
                t = self.settings.threshold_of("judge_reward")
                judge(
                    name,
                    "judge_reward",
                    observed.judge_rewards,
                    "the first evaluation",
                    lambda d, t=t, rose=reward_rose: d < -t and rose,
                )
        if kl is not None:
            bound = self.settings.kl_max
            raised = kl > bound
            metrics.update({"guard/kl": kl, "guard/kl/drift": kl, "guard/kl/alarm": 1.0 if raised else 0.0})
            if raised:
                message = f"guard: alarm: KL to the reference {kl:.3g} exceeds its bound (--guard-kl-max {bound:g})"
                alarms.append(Alarm(rollout_id, trained_rollouts, None, "kl", kl, 0.0, 1.0, kl, bound, message))
        metrics["guard/alarms"] = float(len(alarms))
        return GuardReport(metrics, alarms)

    def state_dict(self) -> dict[str, Any]:
        """The baselines, JSON-like (floats round-trip exactly), for a checkpoint."""
        return {
            "baselines": [
                {"eval_set": name, "statistic": statistic, "mean": base.mean, "spread": base.spread, "where": base.where}
                for (name, statistic), base in self.baselines.items()
            ],
            "reward_baselines": dict(self._reward_baselines),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.baselines = {
            (item["eval_set"], item["statistic"]): _Baseline(float(item["mean"]), float(item["spread"]), str(item["where"]))
            for item in state["baselines"]
        }
        self._reward_baselines = {str(name): float(value) for name, value in state["reward_baselines"].items()}


def observe_eval_set(
    images: Sequence[torch.Tensor], rewards: torch.Tensor, samples_per_prompt: int, judge_rewards: torch.Tensor | None = None
) -> EvalSetObservation:
    """An eval set's statistics from its samples' pixels (``[C, H, W]`` images or
    ``[C, F, H, W]`` videos, in prompt order)."""
    from miles_core.image_statistics import STATISTICS as FUNCTIONS
    from miles_core.image_statistics import pairwise_distances

    batch = torch.stack([image.detach().float().cpu() for image in images])
    statistics = {name: FUNCTIONS[name](batch) for name in IMAGE_STATISTICS}
    if samples_per_prompt > 1:
        statistics["diversity"] = pairwise_distances(batch, samples_per_prompt)
    return EvalSetObservation(statistics, rewards, judge_rewards)


class _JudgeConfig:
    """The run's configuration with the judge as the evaluation reward (no mixture), for a
    :class:`~miles_core.training.rewards.RewardScorer`: a judge that returns a dict per
    sample is read at the evaluation's key (``--eval-reward-key``, default ``--reward-key``)."""

    def __init__(self, config: Any, judge: str) -> None:
        self._config = config
        self._override = {"eval_rm_type": judge, "eval_reward_weights": None}

    def __getattr__(self, name: str) -> Any:
        if name in self._override:
            return self._override[name]
        return getattr(self._config, name)


class RunGuard:
    """The guard of one run (built by the RL loop when evaluations run, unless
    ``--no-guard``). :meth:`training_reward` notes each rollout's training reward;
    :meth:`after_evaluation` checks an evaluation and returns its ``guard/*`` metrics."""

    def __init__(
        self,
        config: Any,
        out: Path,
        log: Callable[[str], None],
        *,
        training_scorer: Any = None,
        measure_kl: Callable[[], Awaitable[float | None]] | None = None,
    ) -> None:
        """Builds the judge reward now (``--guard-rm-type``): one that cannot be built
        stops the run before its first rollout. ``measure_kl``: returns the KL to the
        reference (None where the caller knows none can be measured)."""
        from miles_core.training.rewards import RewardScorer

        self.settings = GuardSettings.from_config(config)
        self.guard = Guard(self.settings)
        from miles_core.config.eval_config import eval_datasets

        datasets = eval_datasets(config)
        self.samples_per_prompt: dict[str, int] = {d.name: d.n_samples_per_eval_prompt for d in datasets}
        """Each eval set's samples per prompt (diversity needs 2 or more)."""
        self.path = out / ALARMS_FILE
        self.log = log
        self.measure_kl = measure_kl
        self.judge = None
        if self.settings.judge:
            share = training_scorer if isinstance(training_scorer, RewardScorer) else None
            self.judge = RewardScorer(_JudgeConfig(config, self.settings.judge), evaluation=True, share=share)
        self._rewards: list[float] = []
        self._resumed = False
        """Restored from a checkpoint and no rollout noted since: an evaluation now re-measures the checkpoint's weights."""
        single = [d for d in datasets if d.n_samples_per_eval_prompt < 2]
        if single and not getattr(config, "eval_config", None):
            log("guard: diversity is not measured: it needs --n-samples-per-eval-prompt 2 or more")
        elif single:  # --eval-config: each set has its own samples per prompt
            names = ", ".join(d.name for d in single)
            log(f"guard: diversity is not measured on eval set(s) {names}: it needs 2 or more samples per prompt")

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (:func:`~miles_core.training.run_state.save_run_state`):
        the baselines and the training rewards noted since the last evaluation, so that a
        resumed run compares with the original run's first evaluation."""
        return {**self.guard.state_dict(), "training_rewards": list(self._rewards)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.guard.load_state_dict(state)
        self._rewards = [float(value) for value in state["training_rewards"]]
        self._resumed = True

    def training_reward(self, metrics: Mapping[str, Any]) -> None:
        """A rollout's reward metrics are in: its ``rollout/reward/raw_mean`` counts in
        the training reward of the next evaluation's reward gap."""
        self._resumed = False
        value = metrics.get("rollout/reward/raw_mean")
        if value is not None and math.isfinite(float(value)):
            self._rewards.append(float(value))

    async def _judge_rewards(self, samples: Sequence[Any]) -> torch.Tensor:
        """The judge's rewards of ``samples``, scored on copies (the samples keep the
        evaluation reward's values)."""
        import copy

        copies = [copy.copy(sample) for sample in samples]
        for sample in copies:
            sample.metadata = dict(getattr(sample, "metadata", None) or {})
        try:
            rewards = await self.judge.score(copies)
        except RewardError as exc:  # a dict without a usable key, a wrong shape: name the flag it came from
            raise RewardError(f"--guard-rm-type {self.settings.judge}: {exc}") from None
        for sample in copies:
            self.judge.take_outcome(sample)
        return rewards

    async def after_evaluation(self, result: Any, rollout_id: int, trained_rollouts: int) -> dict[str, float]:
        """Check one evaluation (an :class:`~miles_core.training.evaluation.EvalResult`
        going into rollout ``rollout_id``'s record, taken after ``trained_rollouts``
        rollouts): return its ``guard/*`` metrics, append its alarms to ``guard.jsonl``
        and log one line each."""
        eval_sets = {}
        for name, images in result.images.items():
            samples = result.samples.get(name, [])
            judged = await self._judge_rewards(samples) if self.judge is not None and samples else None
            per_prompt = getattr(result, "samples_per_prompt", {}).get(name) or self.samples_per_prompt[name]  # the set's own
            eval_sets[name] = observe_eval_set(images, result.rewards[name], per_prompt, judged)
        training = sum(self._rewards) / len(self._rewards) if self._rewards else None
        if self._resumed:
            # A resumed run's evaluation before its first rollout re-measures the checkpoint's
            # weights: no reward gap there; the rollouts noted since the original run's last
            # evaluation count in the next one, as they would have without the interruption.
            training = None
        else:
            self._rewards = []
        kl = await self.measure_kl() if self.measure_kl is not None else None
        report = self.guard.check(
            rollout_id=rollout_id, trained_rollouts=trained_rollouts, eval_sets=eval_sets, training_reward=training, kl=kl
        )
        if report.alarms:
            with self.path.open("a", encoding="utf-8") as handle:
                for alarm in report.alarms:
                    handle.write(json.dumps(alarm.record()) + "\n")
            for alarm in report.alarms:
                self.log(alarm.message)
        return report.metrics


def guard_for_run(
    config: Any,
    trainer: Any,
    engine: Any,
    out: Path,
    log: Callable[[str], None],
    *,
    on_engine_thread: bool,
    training_scorer: Any = None,
    turns: Any = None,
    state: Mapping[str, Any] | None = None,
) -> RunGuard | None:
    """The run's guard (None under ``--no-guard``), with the KL measured on the trainer
    (on the embedded engine's compute thread when they share it; the trainer made
    resident first under ``--offload-train``'s ``turns``); says once why the KL is not
    measured where it cannot be. ``state``: the guard's state in the checkpoint a resumed
    run restored (None: a fresh run, or a checkpoint saved without one, whose first
    evaluation is then the baseline)."""
    if config.no_guard:
        return None
    from miles_core.plugin_manager import loss_spec

    reference_kl = getattr(trainer, "reference_kl", None)
    measure_kl = None
    if loss_spec(config).trains_on in ("nft_pairs", "preference_pairs"):
        log(
            f"guard: the KL to the reference is not measured: --loss-type {config.loss_type} trains on final latents, "
            "not on the SDE transitions the KL is measured on"
        )
    elif reference_kl is None:
        log("guard: the KL to the reference is not measured: the trainer runs on remote ranks")
    elif getattr(trainer, "mesh", None) is not None:
        log("guard: the KL to the reference is not measured: the trainer is sharded over several ranks")
    elif trainer.kl_reference() is None:
        log("guard: the KL to the reference is not measured: full fine-tuning without --use-ema has no reference policy")
    else:

        async def measure_kl() -> float | None:
            async with turns.trainer_resident() if turns is not None else _nothing():
                if on_engine_thread:
                    return await engine.run_compute(reference_kl, KL_PAIRS)
                return reference_kl(KL_PAIRS)

    guard = RunGuard(config, out, log, training_scorer=training_scorer, measure_kl=measure_kl)
    if state is not None:
        guard.load_state_dict(state)
    return guard


@asynccontextmanager
async def _nothing() -> AsyncIterator[None]:
    yield


def checkpoint_directory(config: Any, out: Path) -> Path:
    """Where ``--guard-stop-on-alarm`` saves: ``--save``, else ``RUN_DIR/guard_checkpoint``."""
    return Path(config.save) if config.save else out / GUARD_CHECKPOINT_DIR


class _SaveTo:
    """The run's configuration with ``save`` pointing elsewhere."""

    def __init__(self, config: Any, directory: Path) -> None:
        self._config, self.save = config, str(directory)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


async def stop_for_alarm(run: Any, rollout_id: int, metrics: Mapping[str, Any], *, saved: bool) -> GuardStopError:
    """``--guard-stop-on-alarm``, once rollout ``rollout_id``'s record (with an alarm) is
    written: checkpoint that rollout (unless ``saved`` already: an interval save to
    ``--save``) to :func:`checkpoint_directory`, and return the one-line error to stop
    with (exit status 3), naming the statistics."""
    from miles_core.training.run_state import save_run_state

    config = run.config
    where = checkpoint_directory(config, run.out)
    if not saved:
        if run.turns is not None:  # --offload-train: the trainer's state comes back for the save
            await run.turns.enter("checkpoint")
        target = config if config.save else _SaveTo(config, where)
        save_run_state(target, run.trainer, rollout_id, run.data_source, run.schedule, resumed_from=run.resumed_from, guard=run.guard)
    names = ", ".join(alarmed_statistics(metrics)) or "unknown"
    return GuardStopError(
        f"guard: alarm at rollout {rollout_id} ({names}; see {run.out / ALARMS_FILE}): stopped by --guard-stop-on-alarm, "
        f"checkpoint at {where}"
    )


def alarmed_statistics(metrics: Mapping[str, Any]) -> list[str]:
    """The statistics (``held-out/diversity``, ``kl``) whose alarm a record raised."""
    return [
        key[len("guard/") : -len("/alarm")]
        for key, value in metrics.items()
        if key.startswith("guard/") and key.endswith("/alarm") and value
    ]


__all__ = [
    "ALARMS_FILE",
    "GUARD_CHECKPOINT_DIR",
    "KL_PAIRS",
    "SPREAD_FLOOR_ABSOLUTE",
    "SPREAD_FLOOR_RELATIVE",
    "STATISTICS",
    "Alarm",
    "EvalSetObservation",
    "Guard",
    "GuardReport",
    "GuardSettings",
    "RunGuard",
    "alarmed_statistics",
    "checkpoint_directory",
    "guard_for_run",
    "observe_eval_set",
    "stop_for_alarm",
]
