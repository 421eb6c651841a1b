"""The report's charts, built from the runs' metrics: which keys go on which chart, how
several runs are told apart (one colour per run, one dash pattern per curve of a chart)
and the derived curves (bands, confidence intervals, throughput)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from html import escape
from pathlib import Path

from miles_core.report.run_files import Run
from miles_core.report.svg_chart import DASHES, PALETTE, RefLine, Series, line_chart

Z95 = 1.96
"""The two-sided 95% normal quantile: a paired gain's band is gain +- Z95 * std / sqrt(n)."""


@dataclass
class Figure:
    title: str
    svg: str
    caption: str = ""

    def html(self) -> str:
        caption = f"<figcaption>{escape(self.caption)}</figcaption>" if self.caption else ""
        return f'<figure class="chart-box"><h4>{escape(self.title)}</h4>{self.svg}{caption}</figure>'


@dataclass
class Curve:
    """One curve of a chart, before it is given a colour: (x, y) points, an optional band."""

    label: str
    xs: list[float]
    ys: list[float]
    band: list[tuple[float, float]] | None = None


def styled(runs: Sequence[Run], curves_of: Callable[[Run], list[Curve]]) -> list[Series]:
    """Every run's curves as series: one run, a colour per curve; several runs, a colour
    per run and a dash pattern per curve, legends naming the run."""
    series = []
    for r, run in enumerate(runs):
        for c, curve in enumerate(curves_of(run)):
            if len(runs) == 1:
                color, dash, name = PALETTE[c % len(PALETTE)], "", curve.label
            else:
                color, dash, name = PALETTE[r % len(PALETTE)], DASHES[c % len(DASHES)], f"{run.name}: {curve.label}"
            series.append(Series(name, curve.xs, curve.ys, color=color, dash=dash, band=curve.band))
    return series


def figure(
    runs: Sequence[Run],
    title: str,
    curves_of: Callable[[Run], list[Curve]],
    *,
    x_label: str,
    caption: str = "",
    refs: Sequence[RefLine] = (),
) -> Figure | None:
    series = styled(runs, curves_of)
    if not series:
        return None
    return Figure(title, line_chart(series, x_label=x_label, refs=refs), caption)


def key_curve(run: Run, key: str, label: str | None = None) -> list[Curve]:
    xs, ys = run.series(key)
    return [Curve(label or key, xs, ys)] if xs else []


def keys_curves(*keys: str) -> Callable[[Run], list[Curve]]:
    return lambda run: [c for key in keys for c in key_curve(run, key)]


def per_step_curve(run: Run, key: str, label: str | None = None) -> list[Curve]:
    """A ``train/*_per_step`` list against the optimizer step (counted over the run)."""
    xs, ys, step = [], [], 0
    for record in run.records:
        values = record.get(key)
        if not isinstance(values, list):
            continue
        for value in values:
            if isinstance(value, (int, float)):
                xs.append(float(step))
                ys.append(float(value))
            step += 1
    return [Curve(label or key, xs, ys)] if xs else []


def all_keys(runs: Sequence[Run]) -> set[str]:
    return set().union(*(run.keys() for run in runs)) if runs else set()


def eval_sets(runs: Sequence[Run]) -> list[str]:
    """The eval sets of ``runs``: in their sample manifests or in their metrics."""
    names = {m.group(1) for key in all_keys(runs) if (m := re.fullmatch(r"eval/(.+)/reward_mean", key))}
    names |= {str(entry["eval_set"]) for run in runs for entry in run.manifest if "eval_set" in entry}
    return sorted(names)


@dataclass
class Evaluation:
    """One evaluation of one eval set as the sample manifest records it."""

    number: int
    """The manifest's ``evaluation`` index (0 for the run's first)."""
    trained: int
    """Rollouts trained when it was evaluated (the x of every evaluation curve)."""
    entries: list[dict]


def finite_number(value: object) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def manifest_evaluations(run: Run, eval_set: str) -> list[Evaluation]:
    """The evaluations of ``eval_set`` in the run's sample manifest, by rollouts trained.
    Two with the same rollouts trained (a resumed run evaluating again where it restarted):
    the later one wins."""
    numbered: dict[int, Evaluation] = {}
    for entry in run.manifest:
        if entry.get("eval_set") != eval_set:
            continue
        try:
            number, trained = int(entry["evaluation"]), int(entry["trained_rollouts"])
        except (KeyError, TypeError, ValueError):
            continue
        numbered.setdefault(number, Evaluation(number, trained, [])).entries.append(entry)
    latest: dict[int, Evaluation] = {}
    for evaluation in sorted(numbered.values(), key=lambda e: e.number):
        latest[evaluation.trained] = evaluation
    return sorted(latest.values(), key=lambda e: e.trained)


def mean_std(values: Sequence[float], ddof: int = 0) -> tuple[float, float]:
    """Mean and standard deviation (``ddof`` 0: population, as the run logs its rewards);
    NaN where there are too few values."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan
    mean = math.fsum(values) / n
    if n - ddof <= 0:
        return mean, math.nan
    return mean, math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - ddof))


@dataclass
class PairedGain:
    gain: float
    low: float
    high: float
    n: int


def paired_gain(baseline: Evaluation, evaluation: Evaluation) -> PairedGain:
    """The mean per-sample reward change from ``baseline`` to ``evaluation`` over the samples
    (matched by prompt and sample index, so by prompt and seed) valid in both, with its 95%
    band gain +- Z95 * s / sqrt(n), s the differences' sample standard deviation (ddof 1)."""
    before = {
        (e.get("prompt_index"), e.get("sample_index")): r for e in baseline.entries if (r := finite_number(e.get("reward"))) is not None
    }
    differences = []
    for entry in evaluation.entries:
        reward = finite_number(entry.get("reward"))
        key = (entry.get("prompt_index"), entry.get("sample_index"))
        if reward is not None and key in before:
            differences.append(reward - before[key])
    gain, std = mean_std(differences, ddof=1)
    half = Z95 * std / math.sqrt(len(differences)) if differences else math.nan
    return PairedGain(gain, gain - half, gain + half, len(differences))


def manifest_reward_curves(run: Run, eval_set: str) -> list[Curve]:
    """The evaluation reward of ``eval_set`` per evaluation from the sample manifest: the mean
    (band +- population std) over the samples whose reward did not fail, and each component's mean."""
    evaluations = manifest_evaluations(run, eval_set)
    xs, means, band = [], [], []
    components: dict[str, tuple[list[float], list[float]]] = {}
    for evaluation in evaluations:
        rewards = [r for e in evaluation.entries if (r := finite_number(e.get("reward"))) is not None]
        mean, std = mean_std(rewards)
        xs.append(float(evaluation.trained))
        means.append(mean)
        band.append((mean - std, mean + std))
        values: dict[str, list[float]] = {}
        for entry in evaluation.entries:
            parts = entry.get("reward_components")
            for name, value in parts.items() if isinstance(parts, dict) else ():
                if (v := finite_number(value)) is not None:
                    values.setdefault(str(name), []).append(v)
        for name, vs in values.items():
            cx, cy = components.setdefault(name, ([], []))
            cx.append(float(evaluation.trained))
            cy.append(mean_std(vs)[0])
    if not xs:
        return []
    curves = [Curve(f"{eval_set} reward mean", xs, means, band)]
    curves += [Curve(f"{eval_set} {name}", cx, cy) for name, (cx, cy) in sorted(components.items())]
    return curves


def manifest_gain_curve(run: Run, eval_set: str) -> list[Curve]:
    """The paired gain of ``eval_set`` at every evaluation against its first in the manifest
    (0 there, drawn), with its 95% band."""
    evaluations = manifest_evaluations(run, eval_set)
    if not evaluations:
        return []
    gains = [paired_gain(evaluations[0], evaluation) for evaluation in evaluations]
    return [
        Curve(
            f"{eval_set} paired gain",
            [float(e.trained) for e in evaluations],
            [g.gain for g in gains],
            [(g.low, g.high) for g in gains],
        )
    ]


def eval_trained_rollouts(run: Run, key: str) -> tuple[list[float], list[float], list[dict]]:
    """(rollouts trained when evaluated, values, records) of the records holding ``key``
    (an ``eval/*`` key): a record holds the evaluation after its rollout trained, except
    the run's first evaluation when it ran before training (it has no paired gain yet)."""
    before = not run.flag("skip_eval_before_train", False)
    xs, ys, records, first = [], [], [], True
    for record in run.records:
        value = record.get(key)
        if not isinstance(value, (int, float)) or "rollout_id" not in record:
            continue
        rollout = int(record["rollout_id"])
        has_gain = any(k.endswith("/paired_gain") for k in record)
        xs.append(float(rollout if (first and before and not has_gain) else rollout + 1))
        ys.append(float(value))
        records.append(record)
        first = False
    return xs, ys, records


def eval_curve(run: Run, key: str, label: str) -> list[Curve]:
    xs, ys, _ = eval_trained_rollouts(run, key)
    return [Curve(label, xs, ys)] if xs else []


def reward_components(run: Run, prefix: str) -> list[str]:
    """The mixture components logged under ``prefix`` as ``<name>_mean``."""
    names = set()
    for key in run.keys():
        if key.startswith(prefix) and key.endswith("_mean") and "/" not in key[len(prefix) :]:
            name = key[len(prefix) : -len("_mean")]
            if name != "raw":
                names.add(name)
    return sorted(names)


def samples_per_evaluation(run: Run, eval_set: str) -> dict[int, int]:
    """trained rollouts -> samples with a reward, from the sample manifest."""
    counts: dict[int, int] = {}
    for entry in run.manifest:
        if entry.get("eval_set") == eval_set and entry.get("reward") is not None:
            trained = int(entry.get("trained_rollouts", -1))
            counts[trained] = counts.get(trained, 0) + 1
    return counts


def configured_samples(run: Run, eval_set: str) -> int | None:
    """n_samples_per_eval_prompt x the eval set's prompts, when its prompt file is readable."""
    if run.flag("eval_config"):  # each set has its own count there: the manifest tells
        return None
    n = run.flag("n_samples_per_eval_prompt")
    data = run.flag("eval_prompt_data") or []
    if not isinstance(n, int) or not isinstance(data, list):
        return None
    pairs = dict(zip(data[::2], data[1::2]))
    path = pairs.get(eval_set)
    if not isinstance(path, str):
        return None
    for candidate in (Path(path), run.path / path):
        if candidate.is_file():
            try:
                lines = [line for line in candidate.read_text(encoding="utf-8").splitlines() if line.strip()]
            except OSError:
                return None
            return n * len(lines)
    return None


def paired_gain_curve(run: Run, eval_set: str) -> tuple[list[Curve], str]:
    """The paired gain of ``eval_set`` with its 95% band, gain +- Z95 * std / sqrt(n), n the
    samples of that evaluation (from the sample manifest, else n_samples_per_eval_prompt x
    the eval set's prompts); and where n came from."""
    xs, ys, records = eval_trained_rollouts(run, f"eval/{eval_set}/paired_gain")
    if not xs:
        return [], ""
    manifest = samples_per_evaluation(run, eval_set)
    configured = configured_samples(run, eval_set)
    band, sources = [], set()
    for x, g, record in zip(xs, ys, records):
        std = record.get(f"eval/{eval_set}/paired_gain_std", math.nan)
        n, source = manifest.get(int(x)), "the sample manifest"
        if n is None:
            n, source = configured, "n_samples_per_eval_prompt x prompts"
        if n:
            half = Z95 * std / math.sqrt(n)
            band.append((g - half, g + half))
        else:
            band.append((math.nan, math.nan))
            source = "nowhere (no band)"
        sources.add(source)
    return [Curve(f"{eval_set} paired gain", xs, ys, band)], ", ".join(sorted(sources))


def reward_figures(runs: Sequence[Run]) -> list[Figure]:
    figures = []

    def training(run: Run) -> list[Curve]:
        xs, means = run.series("rollout/reward/raw_mean")
        if not xs:
            return []
        stds = dict(zip(*run.series("rollout/reward/raw_std")))
        band = [(m - stds.get(x, math.nan), m + stds.get(x, math.nan)) for x, m in zip(xs, means)]
        return [Curve("reward mean", xs, means, band)]

    fig = figure(
        runs,
        "Training reward",
        training,
        x_label="rollout",
        caption="Mean reward of each rollout's samples; the band is mean +- standard deviation.",
    )
    if fig:
        figures.append(fig)
    components = sorted({c for run in runs for c in reward_components(run, "rollout/reward/")})
    if components:
        fig = figure(
            runs,
            "Reward components",
            lambda run: [c for name in components for c in key_curve(run, f"rollout/reward/{name}_mean", name)],
            x_label="rollout",
            caption="Mean of each component of the reward mixture per rollout (before weighting).",
        )
        if fig:
            figures.append(fig)
    for eval_set in eval_sets(runs):

        def evaluation(run: Run, eval_set: str = eval_set) -> list[Curve]:
            if manifest_evaluations(run, eval_set):
                return manifest_reward_curves(run, eval_set)
            curves = []  # a run without a sample manifest: its eval/* metrics
            xs, ys, records = eval_trained_rollouts(run, f"eval/{eval_set}/reward_mean")
            if xs:
                band = [
                    (m - r.get(f"eval/{eval_set}/reward_std", math.nan), m + r.get(f"eval/{eval_set}/reward_std", math.nan))
                    for m, r in zip(ys, records)
                ]
                curves.append(Curve(f"{eval_set} reward mean", xs, ys, band))
            for name in reward_components(run, f"eval/{eval_set}/reward/"):
                curves += eval_curve(run, f"eval/{eval_set}/reward/{name}_mean", f"{eval_set} {name}")
            return curves

        fig = figure(
            runs,
            f"Evaluation reward: {eval_set}",
            evaluation,
            x_label="rollouts trained",
            caption="Mean reward over the eval set's prompts and fixed seeds (samples whose reward did not fail), "
            "per evaluation; the band is mean +- standard deviation.",
        )
        if fig:
            figures.append(fig)
        notes: list[str] = []

        def gain(run: Run, eval_set: str = eval_set, notes: list[str] = notes) -> list[Curve]:
            curves = manifest_gain_curve(run, eval_set)
            if curves:
                notes.append(f"{run.name}: from the sample manifest, n the samples valid in both evaluations, std with ddof 1")
                return curves
            curves, source = paired_gain_curve(run, eval_set)
            if curves:
                notes.append(f"{run.name}: from the metrics, n from {source}")
            return curves

        series = styled(runs, gain)
        if series:
            caption = (
                "Mean per-sample reward change against the first evaluation (same prompts and seeds; 0 there); band: 95% "
                "confidence interval, gain +- 1.96 * std / sqrt(n) (" + "; ".join(notes) + ")."
            )
            figures.append(
                Figure(
                    f"Paired gain: {eval_set}",
                    line_chart(series, x_label="rollouts trained", refs=[RefLine(0.0, "no change", "#999")]),
                    caption,
                )
            )
    return figures


OPTIMISATION = (
    ("Loss", ("train/loss", "train/policy_loss", "train/kl_loss", "train/entropy_loss")),
    ("Clip fraction", ("train/clipfrac",)),
    ("Approximate KL", ("train/approx_kl",)),
    # Two charts: the ratio itself (about 1) and its deviation (about 0) would flatten each other on one axis.
    ("Importance ratio", ("train/ratio_mean", "train/ratio_min", "train/ratio_max")),
    ("Importance ratio deviation", ("train/ratio_abs_dev",)),
    ("Gradient norm", ("train/grad_norm",)),
    ("Learning rate", ("train/lr",)),
)


def optimisation_figures(runs: Sequence[Run]) -> list[Figure]:
    figures = []
    keys = all_keys(runs)
    for title, chart_keys in OPTIMISATION:
        present = [k for k in chart_keys if k in keys]
        if not present:
            continue
        per_step = [f"{k}_per_step" for k in present if f"{k}_per_step" in keys]
        if per_step:
            fig = figure(
                runs,
                title,
                lambda run, ks=per_step: [c for k in ks for c in per_step_curve(run, k, k.removesuffix("_per_step"))],
                x_label="optimizer step",
                caption="Per optimizer step.",
            )
        else:
            fig = figure(runs, title, keys_curves(*present), x_label="rollout", caption="Per rollout.")
        if fig:
            figures.append(fig)
    drift = [k for k in ("train/log_prob_mean_abs_diff", "train/log_prob_max_abs_diff") if k in keys]
    if drift:
        per_step = [f"{k}_per_step" for k in drift if f"{k}_per_step" in keys]
        if per_step:
            fig = figure(
                runs,
                "Rollout vs trainer log-prob drift",
                lambda run: [c for k in per_step for c in per_step_curve(run, k, k.removesuffix("_per_step"))],
                x_label="optimizer step",
            )
        else:
            fig = figure(runs, "Rollout vs trainer log-prob drift", keys_curves(*drift), x_label="rollout")
        if fig:
            fig.caption = "|log-prob the trainer recomputes - log-prob the rollout recorded| (mean and max over samples): near zero when rollout and training agree."
            figures.append(fig)
    return figures


PHASES = (
    ("perf/rollout_time", "rollout"),
    ("perf/reward_time", "reward (waiting)"),
    ("perf/train_time", "train"),
    ("perf/weight_sync_time", "weight sync"),
    ("perf/step_time", "whole step"),
)


def time_figures(runs: Sequence[Run]) -> list[Figure]:
    figures = []
    keys = all_keys(runs)
    phases = [(k, label) for k, label in PHASES if k in keys]
    if phases:
        fig = figure(
            runs,
            "Time per phase",
            lambda run: [c for k, label in phases for c in key_curve(run, k, label)],
            x_label="rollout",
            caption="Seconds per rollout spent in each phase.",
        )
        if fig:
            figures.append(fig)

    def throughput(run: Run) -> list[Curve]:
        curves = []
        counts = dict(zip(*run.series("rollout/num_samples")))
        for key, label in (("perf/step_time", "samples/s (whole step)"), ("perf/rollout_time", "samples/s (rollout)")):
            xs, ys = [], []
            for x, seconds in zip(*run.series(key)):
                if x in counts and seconds > 0:
                    xs.append(x)
                    ys.append(counts[x] / seconds)
            if xs:
                curves.append(Curve(label, xs, ys))
        return curves

    fig = figure(runs, "Throughput", throughput, x_label="rollout", caption="rollout/num_samples divided by the phase's seconds.")
    if fig:
        figures.append(fig)
    faults = [k for k in ("rollout/engine_retries", "rollout/engine_restarts") if k in keys]
    if faults:
        fig = figure(
            runs,
            "Engine faults",
            keys_curves(*faults),
            x_label="rollout",
            caption="Requests retried and engines restarted (remote engines).",
        )
        if fig:
            figures.append(fig)
    return figures


DIRECTIONS = {"diversity": (-1,), "reward_gap": (1,), "judge_reward": (-1,)}
"""The side(s) of zero on which a guard statistic's drift raises an alarm; others: both."""


def guard_threshold(run: Run, statistic: str) -> float | None:
    """The alarm threshold (in spreads) of ``statistic`` in ``run``: its --guard-thresholds
    item, else --guard-threshold."""
    for item in run.flag("guard_thresholds") or ():
        name, _, value = str(item).partition("=")
        if name.strip() == statistic:
            try:
                return float(value)
            except ValueError:
                return None
    value = run.flag("guard_threshold")
    return float(value) if isinstance(value, (int, float)) else None


def guard_figures(runs: Sequence[Run]) -> list[Figure]:
    """A drift chart per guard statistic and eval set with its alarm threshold(s), and the
    KL to the reference against its absolute bound."""
    figures = []
    drift_keys = sorted(k for k in all_keys(runs) if k.startswith("guard/") and k.endswith("/drift") and k != "guard/kl/drift")
    for key in drift_keys:
        name = key.removeprefix("guard/").removesuffix("/drift")
        statistic = name.rsplit("/", 1)[-1]
        thresholds = {t for run in runs if (t := guard_threshold(run, statistic)) is not None}
        refs = [
            RefLine(sign * t, f"alarm threshold {sign * t:g}") for t in sorted(thresholds) for sign in DIRECTIONS.get(statistic, (1, -1))
        ]
        fig = figure(
            runs,
            f"Guard: {name}",
            lambda run, key=key: eval_curve(run, key, "drift"),
            x_label="rollouts trained",
            refs=refs,
            caption="Signed change since the first evaluation, in units of its spread then; an alarm is raised beyond the threshold.",
        )
        if fig:
            figures.append(fig)
    if "guard/kl" in all_keys(runs):
        bounds = {float(b) for run in runs if isinstance(b := run.flag("guard_kl_max"), (int, float))}
        fig = figure(
            runs,
            "Guard: KL to the reference",
            lambda run: eval_curve(run, "guard/kl", "KL"),
            x_label="rollouts trained",
            refs=[RefLine(b, f"bound {b:g}") for b in sorted(bounds)],
            caption="KL of the policy to the reference model on the latest rollout's transitions; an alarm above the bound.",
        )
        if fig:
            figures.append(fig)
    return figures
