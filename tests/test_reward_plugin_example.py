"""The reward-plugin example of docs/rewards.md ("Writing a reward plugin"), installed and
used for real: a dict-valued reward with its own flag, scored through the run's scorer."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from miles_core.testing import install_into

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "miles-example-reward"

USE = r"""
import asyncio, json, sys
from types import SimpleNamespace
import numpy as np, torch
from miles_core.errors import ConfigError
from miles_core.config.resolve import resolve_config
from miles_core.plugin_manager import get_host
from miles_core.training.rewards import RewardScorer

base = ["--hf-checkpoint", "stabilityai/stable-diffusion-3.5-medium", "--rollout-batch-size", "1",
        "--n-samples-per-prompt", "2"]
config = resolve_config([*base, "--rm-type", "photo", "--reward-key", "sharpness", "--photo-exposure-target", "0.25"])
flat = torch.full((3, 8, 8), 0.25)
checker = torch.from_numpy(np.indices((8, 8)).sum(axis=0) % 2 * np.ones((3, 1, 1))).float()
samples = [SimpleNamespace(pixels=p, prompt="a photo", metadata={}, seed=i, group_index=0) for i, p in enumerate([flat, checker])]
scorer = RewardScorer(config)
rewards = asyncio.run(scorer.score(samples))
try:
    resolve_config([*base, "--rm-type", "photo", "--photo-exposure-target", "1.5"])
    invalid = None
except ConfigError as exc:
    invalid = str(exc)
print(json.dumps({
    "record": get_host().record("example_reward").registers,
    "provider": config.components["reward"].provider,
    "rewards": rewards.tolist(),
    "components": [s.reward_components for s in samples],
    "metrics": scorer.finish(samples),
    "invalid": invalid,
}))
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    return install_into(EXAMPLE, tmp_path_factory.mktemp("site"))


@pytest.mark.exercises("--reward-key", "--rm-type")
def test_reward_example_is_discovered_and_scores_through_the_run_scorer(installed):
    env = {**os.environ, "PYTHONPATH": str(installed), "MILES_STRICT_PLUGINS": "1"}
    result = subprocess.run([sys.executable, "-c", USE], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["record"] == {"reward": ["photo"], "flag": ["--photo-exposure-target"]}
    assert data["provider"] == "miles-example-reward 0.1.0"
    # flat grey at the target: sharpness 0, exposure 1; a 0/1 checkerboard: every
    # neighbour differs by 1 (sharpness 1 + 1), mean 0.5 is 0.25 off a 0.75 range.
    assert data["rewards"] == pytest.approx([0.0, 2.0])
    assert data["components"] == [{"exposure": pytest.approx(1.0)}, {"exposure": pytest.approx(2 / 3)}]
    assert data["metrics"]["rollout/reward/exposure_mean"] == pytest.approx(5 / 6)
    assert data["invalid"] == "--photo-exposure-target 1.5: must be strictly between 0 and 1"


def test_rewards_guide_shows_the_example_code():
    guide = (ROOT / "docs" / "rewards.md").read_text(encoding="utf-8")
    section = guide[guide.index("## Writing a reward plugin") :]
    blocks = dict(re.findall(r'```\w+ title="([^"]+)"\n(.*?)```', section, flags=re.S))
    assert set(blocks) == {"pyproject.toml", "src/miles_example_reward/plugin.py", "src/miles_example_reward/photo.py"}
    for rel, code in blocks.items():
        assert code == (EXAMPLE / rel).read_text(encoding="utf-8"), f"docs/rewards.md is out of date for {rel}"
