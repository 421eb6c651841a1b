"""The plugin-authoring guide's example, installed and used for real."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from miles_core.testing import install_into

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "miles-example-plugin"

USE = r"""
import json, sys
import numpy as np, torch
from miles_core.config.resolve import resolve_config
from miles_core.plugin_manager import get_host

host = get_host()
record = host.record("example")
config = resolve_config(["--hf-checkpoint", "stabilityai/stable-diffusion-3.5-medium", "--rollout-batch-size", "2",
                         "--rm-type", "contrast", "--diffusion-sde-type", "const_sde"])
reward = host.registries.reward.get("contrast").load()(config)
flat = np.full((3, 8, 8), 0.5)
checker = np.indices((8, 8)).sum(axis=0) % 2 * np.ones((3, 1, 1))
backend = host.registries.sde_backend.get("const_sde").load()(noise_level=0.5)
x, v = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0)), torch.randn(2, 4, 8, 8)
out = backend.step(x, v, 0.6, 0.4, sigma_max=0.9, generator=torch.Generator().manual_seed(1))
again = backend.log_prob(out.prev_sample, x, v, 0.6, 0.4, sigma_max=0.9)
print(json.dumps({
    "status": record.status, "distribution": record.distribution, "registers": record.registers,
    "components": {k: [c.name, c.provider] for k, c in config.components.items()},
    "rewards": reward([flat, checker]),
    "std": out.std.flatten().tolist(),
    "logp_match": torch.equal(out.log_prob, again.log_prob),
}))
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    return install_into(EXAMPLE, tmp_path_factory.mktemp("site"))


def test_example_is_discovered_and_used(installed):
    env = {**os.environ, "PYTHONPATH": str(installed), "MILES_STRICT_PLUGINS": "1"}
    result = subprocess.run([sys.executable, "-c", USE], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["status"] == "ok" and data["distribution"] == "miles-example-plugin"
    assert data["registers"] == {"sde_backend": ["const_sde"], "reward": ["contrast"]}
    assert data["components"]["reward"] == ["contrast", "miles-example-plugin 0.1.0"]
    assert data["components"]["sde_backend"] == ["const_sde", "miles-example-plugin 0.1.0"]
    assert data["rewards"] == [0.0, 0.5]
    # std = s * sqrt(-dt) with s = noise level 0.5 and dt = -0.2
    assert data["std"] == pytest.approx([0.5 * 0.2**0.5] * 2, rel=1e-6)
    assert data["logp_match"] is True


def test_without_the_example_its_names_are_unknown():
    # Control: the names above come from the installed example, not from the core.
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "miles_core.cli.main",
            "config",
            "--hf-checkpoint",
            "sd3",
            "--rollout-batch-size",
            "1",
            "--rm-type",
            "contrast",
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert "--rm-type contrast: unknown reward" in result.stderr


def test_guide_shows_the_example_code():
    guide = (ROOT / "docs" / "plugins.md").read_text(encoding="utf-8")
    blocks = dict(re.findall(r'```\w+ title="([^"]+)"\n(.*?)```', guide, flags=re.S))
    assert set(blocks) == {
        "pyproject.toml",
        "src/miles_example/plugin.py",
        "src/miles_example/contrast.py",
        "src/miles_example/const_sde.py",
    }
    for rel, code in blocks.items():
        assert code == (EXAMPLE / rel).read_text(encoding="utf-8"), f"docs/plugins.md is out of date for {rel}"
