"""What a run prints: one line per rollout, and how the run went at the end."""

from __future__ import annotations

from typing import Any


def rollout_line(metrics: dict[str, Any], total: int) -> str:
    line = f"rollout {metrics['rollout_id'] + 1}/{total}"
    if "rollout/reward/raw_mean" in metrics:
        line += f"  reward {metrics['rollout/reward/raw_mean']:+.4f}"
    if "train/loss" in metrics:
        line += f"  loss {metrics['train/loss']:+.4e}"
    if "train/clipfrac" in metrics:
        line += f"  clipfrac {metrics['train/clipfrac']:.3f}"
    for key, value in metrics.items():
        if key.endswith("/paired_gain"):
            line += f"  {key.removeprefix('eval/')} {value:+.4f}"
    return line + f"  {metrics['perf/step_time']:.2f}s"


def final_summary(first: dict[str, Any], last: dict[str, Any]) -> list[str]:
    """How the run went, in one line per evaluation set (or the rollout reward)."""
    lines = []
    for key, gain in last.items():
        if key.endswith("/paired_gain"):
            name = key.removeprefix("eval/").removesuffix("/paired_gain")
            after = last[f"eval/{name}/reward_mean"]
            before = after - gain  # the gain is the mean of per-sample differences
            lines.append(
                f"summary: eval {name}: reward {before:.4f} -> {after:.4f}, paired gain {gain:+.4f} "
                f"(std {last[f'eval/{name}/paired_gain_std']:.4f}) on the same prompts and seeds"
            )
    if not lines and "rollout/reward/raw_mean" in last and "rollout/reward/raw_mean" in first:
        lines.append(
            f"summary: rollout reward {first['rollout/reward/raw_mean']:.4f} (first rollout) -> "
            f"{last['rollout/reward/raw_mean']:.4f} (last rollout)"
        )
    return lines
