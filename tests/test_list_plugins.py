import json
import os
import subprocess
import sys

from tests.fake_dists import make_dist

REPO_PLUGINS = {
    "core": (
        "miles-core",
        {
            "sde_backend": ["sde", "cps", "ode"],
            "step_strategy": ["sde_window", "epoch_global_random_choice", "ode_and_return_last"],
            "loss": ["policy_loss", "nft", "sft_loss", "custom_loss"],
            "rollout_filter": ["check_reward_nonzero_std", "pop_first"],
            "rollout_engine": ["embedded", "http", "sglang"],
            "reward": ["remote"],
        },
    ),
    "sd3": ("miles-sd3", {"model_family": ["sd3"]}),
    "wan22": ("miles-wan22", {"model_family": ["wan2_2", "wan2_2_ti2v", "wan2_2_i2v"]}),
    "ltx": ("miles-ltx", {"model_family": ["ltx"]}),
    "qwen_image": ("miles-qwen-image", {"model_family": ["qwen_image"]}),
    "cosmos3": ("miles-cosmos3", {"model_family": ["cosmos3"]}),
    "flux": ("miles-flux", {"model_family": ["flux"]}),
    "rewards": (
        "miles-rewards",
        {
            "reward": [
                "jpeg_compressibility",
                "jpeg_incompressibility",
                "brightness",
                "redness",
                "colorfulness",
                "pickscore",
                "aesthetic",
                "clipscore",
                "temporal_consistency",
                "motion_magnitude",
                "hpsv2",
                "imagereward",
                "ocr",
                "vlm_judge",
            ]
        },
    ),
    "algorithms": (
        "miles-algorithms",
        {"sde_backend": ["dance_sde"], "step_strategy": ["mixgrpo"], "loss": ["grpo_guard", "flow_dpo"]},
    ),
}

# Runs list-plugins in-process and reports which heavy libraries it imported.
PROBE = """
import contextlib, io, json, sys
from miles_core.cli.main import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    code = main(sys.argv[1:])
heavy = sorted(m for m in ("torch", "diffusers", "transformers", "numpy", "PIL") if m in sys.modules)
print(json.dumps({"code": code, "heavy": heavy, "stdout": out.getvalue()}))
"""


def probe(*args, env=None):
    result = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, env=env, check=True)
    return json.loads(result.stdout)


def test_json_lists_every_repo_plugin_without_heavy_imports():
    result = probe("list-plugins", "--json")
    assert result["code"] == 0
    assert result["heavy"] == []
    records = {r["name"]: r for r in json.loads(result["stdout"])}
    for name, (distribution, registers) in REPO_PLUGINS.items():
        record = records[name]
        assert record["distribution"] == distribution
        assert record["status"] == "ok" and record["error"] is None
        assert record["version"]
        assert {k: v for k, v in record["registers"].items() if k != "flag"} == registers
    assert "--pickscore-model-path" in records["rewards"]["registers"]["flag"]


def test_table_without_heavy_imports():
    result = probe("list-plugins")
    assert result["heavy"] == []
    lines = result["stdout"].splitlines()
    assert lines[0].split() == ["NAME", "DISTRIBUTION", "VERSION", "STATUS", "REGISTERS"]
    sd3 = next(line for line in lines if line.startswith("sd3 "))
    assert "miles-sd3" in sd3 and " ok " in sd3 and "model_family: sd3" in sd3


def test_failed_and_disabled_plugins_are_listed(tmp_path):
    make_dist(tmp_path, "broken-plugin", "0.9", {"broken": "raise ImportError('needs libfoo')\n"})
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "MILES_STRICT_PLUGINS": "1", "MILES_DISABLED_PLUGINS": "ltx"}
    result = probe("list-plugins", "--json", env=env)
    records = {r["name"]: r for r in json.loads(result["stdout"])}
    broken = records["broken"]
    assert broken["status"] == "failed"
    assert (broken["distribution"], broken["version"], broken["entry_point"]) == ("broken-plugin", "0.9", "broken_plugin_broken")
    assert broken["error"] == "cannot import broken_plugin_broken: ImportError: needs libfoo"
    assert records["ltx"]["status"] == "disabled"
    assert records["sd3"]["status"] == "ok"
    table = probe("list-plugins", env=env)["stdout"]
    assert "    error: cannot import broken_plugin_broken: ImportError: needs libfoo (entry point broken_plugin_broken)" in table


def test_main_usage_and_unknown_command():
    result = subprocess.run([sys.executable, "-m", "miles_core.cli.main", "frobnicate"], capture_output=True, text=True)
    assert result.returncode == 2
    assert (
        result.stderr
        == "miles-core: error: unknown command 'frobnicate'; commands: train, list-plugins, config, plan, make-tiny, score, generate, serve-engine, serve-reward, router, report\n"
    )
    result = subprocess.run([sys.executable, "-m", "miles_core.cli.main", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "make-tiny" in result.stdout
