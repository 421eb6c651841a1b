"""The opt-in sglang lane (scripts/sglang_lane.sh): the real sglang-diffusion server on CPU.

Skipped unless ``MILES_SGLANG_PYTHON`` names the Python of a separate sglang environment
(``MILES_SGLANG_TINY``: a tiny SD3 pipeline directory; default: one written here).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
import torch

from miles_core.config.resolve import resolve_config
from miles_core.engine.factory import create_engine
from miles_core.engine.sglang import SglangEngine
from miles_core.engine.wire import unpack_outputs
from miles_core.request import RolloutRequest

PYTHON = os.environ.get("MILES_SGLANG_PYTHON")
pytestmark = pytest.mark.skipif(not PYTHON, reason="MILES_SGLANG_PYTHON is not set (run scripts/sglang_lane.sh)")

# The server arguments a CPU needs (docs/engine.md, "Setting up the sglang environment"), as --sglang-* pass-through flags.
CPU_ARGS = [
    "--sglang-model-id",
    "stable-diffusion-3-medium",
    "--sglang-backend",
    "sglang",
    "--sglang-num-gpus",
    "1",
    "--sglang-dit-cpu-offload",
    "false",
    "--sglang-text-encoder-cpu-offload",
    "false",
    "--sglang-vae-cpu-offload",
    "false",
    "--sglang-pin-cpu-memory",
    "false",
    "--sglang-dit-precision",
    "fp32",
    "--sglang-text-encoder-precisions",
    "fp32",
    "fp32",
    "fp32",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    given = os.environ.get("MILES_SGLANG_TINY")
    if given:
        return Path(given)
    path = tmp_path_factory.mktemp("lane") / "tiny-sd3"
    subprocess.run([sys.executable, "-m", "miles_core.cli.main", "make-tiny", "sd3", str(path)], check=True, capture_output=True)
    return path


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    engine = SglangEngine.launch(PYTHON, str(tiny), CPU_ARGS, 1, tmp_path_factory.mktemp("sglang"), timeout=300)
    yield engine
    engine.stop_servers()


REQUEST = dict(
    prompt="a red cube", seed=11, width=32, height=32, num_inference_steps=4, num_outputs_per_prompt=2, rollout_return_dit_trajectory=True
)


async def _post_raw(url: str, body: dict) -> list:
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/rollout/generate", json=body) as response:
            raw = await response.read()
            assert response.status == 200, raw[:500]
    return unpack_outputs(raw)


@pytest.mark.exercises("--rollout-engine", "--sglang-python")
def test_first_latent_matches_the_embedded_engine(server, tiny):
    body = {**RolloutRequest(**REQUEST).to_json(), "generator_device": "cpu"}
    theirs = asyncio.run(_post_raw(server.urls[0], body))
    config = resolve_config(["--hf-checkpoint", str(tiny), "--diffusion-model-family", "sd3", "--rollout-batch-size", "1"])
    embedded = create_engine(config)
    ours = asyncio.run(embedded.generate(RolloutRequest(**REQUEST)))
    for mine, real in zip(ours, theirs):
        a, b = mine.dit_trajectory["latents"][0], real.dit_trajectory["latents"][0]
        assert a.shape == b.shape
        print(f"seed {mine.seed}: first latent max |diff| {float((a.float() - b.float()).abs().max()):.3g}")
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=0)


def test_server_checksum_matches_the_checkpoint(server, tiny):
    from miles_core.model_loading import load_family
    from miles_core.weights import module_checksum

    config = resolve_config(["--hf-checkpoint", str(tiny), "--diffusion-model-family", "sd3", "--rollout-batch-size", "1"])
    module = load_family(config).components()["transformer"]
    reported = asyncio.run(server.weights_checksums(["transformer"]))
    # sglang hashes pos_embed.pos_embed too (a parameter there, a buffer in diffusers).
    from miles_core.weights import named_tensors_checksum

    full = dict(module.named_parameters()) | {"pos_embed.pos_embed": module.pos_embed.pos_embed}
    assert reported[server.urls[0]]["transformer"] == named_tensors_checksum(full.items())
    assert module_checksum(module) != named_tensors_checksum(full.items())


@pytest.mark.exercises("--rollout-engine", "--sglang-python", "--rollout-num-engines")
def test_short_training_against_the_real_server(tiny, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input": p}) + "\n" for p in ["a red cube", "a blue ball"]))
    out = tmp_path / "run"
    args = [
        "--hf-checkpoint",
        str(tiny),
        "--diffusion-model-family",
        "sd3",
        "--prompt-data",
        str(prompts),
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "2",
        "--rollout-microgroup-size",
        "2",
        "--diffusion-num-steps",
        "4",
        "--diffusion-num-sde-steps",
        "2",
        "--diffusion-height",
        "32",
        "--diffusion-width",
        "32",
        "--rm-type",
        "jpeg_incompressibility",
        "--output-dir",
        str(out),
        "--num-rollout",
        "2",
        "--rollout-engine",
        "sglang",
        "--sglang-python",
        PYTHON,
        "--rollout-num-engines",
        "1",
        "--debug-skip-optimizer-step",
        "--diffusion-debug-mode",
        *CPU_ARGS,
    ]
    from miles_core.training.run import train

    path = asyncio.run(train(resolve_config(args), log=lambda line: None))
    records = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    drift = [
        (r.get("train/log_prob_mean_abs_diff"), r.get("train/log_prob_max_abs_diff"))
        for r in records
        if "train/log_prob_mean_abs_diff" in r
    ]
    velocity = [
        (r.get("train/model_output_mean_abs_diff"), r.get("train/model_output_max_abs_diff"))
        for r in records
        if "train/log_prob_mean_abs_diff" in r
    ]
    print("log-prob drift (mean, max) per rollout:", drift)
    print("velocity drift (mean, max) per rollout:", velocity)
    assert len(drift) == 2
    # Measured on CPU, fp32: mean ~5e-8, max ~2.4e-7; velocity mean |diff| ~3e-7 (fp32
    # rounding: the server's DiT is diffusers' modules; our batched [neg; pos] forward sums
    # in another order). Before the trajectory timesteps were rebuilt as the [T] grid
    # (sglang sends one per returned latent) this was ~2e-3 / 2e-2; see docs/engine.md.
    assert all(mean is not None and mean < 1e-6 and max_ < 1e-5 for mean, max_ in drift), drift
    assert all(mean < 1e-5 and max_ < 1e-4 for mean, max_ in velocity), velocity
    syncs = sorted((out / "sglang" / "weight-sync").iterdir())
    assert syncs, "the run synced no weights"
