"""Run-loop flags checked by their observable effects: which checkpoints a run writes and
what they hold (``--save-interval``, ``--no-save-optim``), what a resume restores
(``--load``, ``--ckpt-step``, ``--no-load-optim``, ``--no-load-rng``), weights that never
move (``--debug-skip-optimizer-step``, ``--debug-rollout-only``) and the W&B run's
identity (``--wandb-team``, ``--wandb-host``, ``--wandb-run-id``, ``--wandb-key``,
``--wandb-dir``)."""

from __future__ import annotations

import random

import pytest
import torch

from miles_core.config.resolve import resolve_config
from miles_core.training.checkpoint import available_iterations, load_checkpoint
from miles_core.training.run_state import restore_run_state, save_run_state
from tests.tiny_runs import run_metrics, tiny_run_args

SD35 = ["--hf-checkpoint", "stabilityai/stable-diffusion-3.5-medium", "--rollout-batch-size", "1"]
TRAIN = ("--use-lora", "--lora-rank", "4", "--lr", "1e-2", "--deterministic-mode")


def run(tiny_sd3, prompts, out, *extra):
    return run_metrics([*tiny_run_args(tiny_sd3, prompts, out, n=2, steps=3, sde_steps=1), *extra])


# -- checkpoints ---------------------------------------------------------------------------------


@pytest.mark.exercises("--save", "--save-interval", "--no-save-optim")
def test_save_interval_and_no_save_optim_shape_the_checkpoints(tiny_sd3, prompts, tmp_path):
    run(
        tiny_sd3,
        prompts,
        tmp_path / "light",
        "--num-rollout",
        "3",
        *TRAIN,
        "--save",
        str(tmp_path / "light-ckpt"),
        "--save-interval",
        "2",
        "--no-save-optim",
    )
    # Every second rollout (id 1) and the last one (id 2), without optimizer state.
    assert available_iterations(tmp_path / "light-ckpt") == [1, 2]
    light = load_checkpoint(tmp_path / "light-ckpt", 2)
    assert light.optimizer_state is None
    assert not (tmp_path / "light-ckpt" / "iter_0000002" / "optimizer.safetensors").exists()
    # Control: no interval saves only the last rollout, with AdamW's moments.
    run(tiny_sd3, prompts, tmp_path / "full", "--num-rollout", "3", *TRAIN, "--save", str(tmp_path / "full-ckpt"))
    assert available_iterations(tmp_path / "full-ckpt") == [2]
    full = load_checkpoint(tmp_path / "full-ckpt", 2)
    moments = full.optimizer_state["state"]
    assert moments and all(float(entry["step"]) == 3 for entry in moments.values())
    assert any(entry["exp_avg"].abs().sum() > 0 for entry in moments.values())
    # The same deterministic run: the saved weights agree, only the optimizer is missing.
    for component, tensors in full.model_state.items():
        assert all(torch.equal(tensors[name], light.model_state[component][name]) for name in tensors)


class TinyTrainer:
    """What ``save_run_state``/``restore_run_state`` use of a Trainer, around one linear layer."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.module = torch.nn.Linear(3, 2)
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=0.1)
        self.optimizer_steps = 0
        self.ema = None

    def step(self) -> None:
        self.optimizer.zero_grad()
        self.module(torch.ones(1, 3)).square().sum().backward()
        self.optimizer.step()
        self.optimizer_steps += 1

    def trainable_state(self):
        return {"transformer": {k: p.detach().clone() for k, p in self.module.named_parameters()}}

    def load_trainable_state(self, state):
        self.module.load_state_dict(state["transformer"])


@pytest.mark.exercises("--load", "--ckpt-step", "--no-load-optim", "--no-load-rng")
def test_resume_flags_choose_what_is_restored(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    saver = TinyTrainer(seed=0)
    python_state, torch_state = random.getstate(), torch.get_rng_state()
    try:
        saver.step()
        save_run_state(resolve_config([*SD35, "--save", ckpt]), saver, 0)
        first = saver.trainable_state()["transformer"]["weight"]
        saver.step()
        random.seed(1)
        torch.manual_seed(1)
        save_run_state(resolve_config([*SD35, "--save", ckpt]), saver, 1)  # RNG captured here
        after_save = (random.random(), torch.rand(3))

        def restore(*flags):
            trainer = TinyTrainer(seed=5)
            random.seed(2)
            torch.manual_seed(2)
            start = restore_run_state(resolve_config([*SD35, "--load", ckpt, *flags]), trainer)
            return start, trainer, (random.random(), torch.rand(3))

        random.seed(2)
        torch.manual_seed(2)
        unrestored = (random.random(), torch.rand(3))

        # --load: the latest checkpoint (id 1), weights, AdamW moments and step count, and the RNGs.
        start, trainer, draws = restore()
        assert start == 2 and trainer.optimizer_steps == 2
        assert torch.equal(trainer.module.weight, saver.module.weight)
        saved_moments = saver.optimizer.state_dict()["state"]
        loaded_moments = trainer.optimizer.state_dict()["state"]
        assert all(torch.equal(loaded_moments[i]["exp_avg"], saved_moments[i]["exp_avg"]) for i in saved_moments)
        assert draws[0] == after_save[0] and torch.equal(draws[1], after_save[1])

        # --ckpt-step 0: the first checkpoint's weights and the rollout after it.
        start, trainer, _ = restore("--ckpt-step", "0")
        assert start == 1 and trainer.optimizer_steps == 1 and torch.equal(trainer.module.weight, first)

        # --no-load-optim: the weights, but a fresh optimizer (no moments).
        start, trainer, _ = restore("--no-load-optim")
        assert start == 2 and torch.equal(trainer.module.weight, saver.module.weight)
        assert trainer.optimizer.state_dict()["state"] == {}

        # --no-load-rng: the process keeps its own generator states.
        _, _, draws = restore("--no-load-rng")
        assert draws[0] == unrestored[0] and torch.equal(draws[1], unrestored[1])
        assert draws[0] != after_save[0]
    finally:
        random.setstate(python_state)
        torch.set_rng_state(torch_state)


# -- debugging -------------------------------------------------------------------------------------


def rollout_outputs(template: str, rollout_id: int) -> list[torch.Tensor]:
    from miles_core.training.debug_data import load_rollout_data

    samples, _ = load_rollout_data(template, rollout_id)
    return [s.output.generated_output for s in samples]


@pytest.mark.exercises("--debug-skip-optimizer-step", "--debug-rollout-only")
def test_skipped_optimizer_steps_and_rollout_only_runs_leave_the_weights_alone(tiny_sd3, prompts, tmp_path):
    def go(name, *extra):
        template = str(tmp_path / f"{name}-rollouts" / "{}.msgpack")
        records = run(tiny_sd3, prompts, tmp_path / name, "--num-rollout", "2", *TRAIN, "--save-debug-rollout-data", template, *extra)
        return records, rollout_outputs(template, 1)

    rollout_only, frozen = go("rollout-only", "--debug-rollout-only")
    skipped, probe = go("skipped", "--debug-skip-optimizer-step")
    trained, live = go("trained")
    # --debug-rollout-only: rollouts and rewards, no training and no saved weights.
    assert not any(key.startswith("train/") for r in rollout_only for key in r)
    assert all("rollout/reward/raw_mean" in r for r in rollout_only)
    assert not (tmp_path / "rollout-only" / "lora").exists()
    # --debug-skip-optimizer-step: the forward and its loss, no gradient step, so the second
    # rollout samples the initial weights exactly as a rollout-only run does.
    assert all("train/loss" in r and "train/grad_norm" not in r for r in skipped)
    assert all(torch.equal(a, b) for a, b in zip(probe, frozen))
    assert not (tmp_path / "skipped" / "lora").exists()
    # Control: a training run steps, saves its LoRA and samples other images afterwards.
    assert all(r["train/grad_norm"] > 0 for r in trained)
    assert (tmp_path / "trained" / "lora" / "pytorch_lora_weights.safetensors").is_file()
    assert not any(torch.equal(a, b) for a, b in zip(live, frozen))


# -- W&B -----------------------------------------------------------------------------------------


@pytest.fixture
def wandb_home(tmp_path, monkeypatch):
    """W&B's own files under tmp_path; WANDB_DIR is not where the runs below go."""
    for name, sub in (
        ("WANDB_DIR", "wb-env"),
        ("WANDB_CACHE_DIR", "wb-cache"),
        ("WANDB_CONFIG_DIR", "wb-config"),
        ("WANDB_DATA_DIR", "wb-data"),
    ):
        (tmp_path / sub).mkdir()
        monkeypatch.setenv(name, str(tmp_path / sub))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_ENTITY", raising=False)
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    return tmp_path


@pytest.mark.exercises("--wandb-team", "--wandb-host", "--wandb-run-id", "--wandb-key", "--wandb-dir")
def test_wandb_identity_flags_reach_the_wandb_run(wandb_home):
    pytest.importorskip("wandb")
    from miles_core.config.document import config_document
    from miles_core.training.metrics_logging import WandbLogger
    from tests.test_run_features import items, settled_wandb_records

    key = "k" * 40

    def logged(directory, *flags):
        config = resolve_config(
            [*SD35, "--use-wandb", "--wandb-mode", "offline", "--wandb-project", "flags", "--wandb-dir", str(directory), *flags]
        )
        logger = WandbLogger(config, config_document(config), wandb_home / "run")
        settings = logger.run.settings
        seen = (logger.run.id, logger.run.entity, settings.base_url, settings.api_key, settings.resume)
        logger.log({"rollout_id": 0, "rollout/reward/raw_mean": 0.5})
        logger.finish()
        (run_dir,) = (directory / "wandb").glob("offline-run-*")
        (log_file,) = run_dir.glob("run-*.wandb")
        records = [r.run for r in settled_wandb_records(log_file, "run") if r.WhichOneof("record_type") == "run"]
        (record,) = records
        return seen, run_dir, record

    seen, run_dir, record = logged(
        wandb_home / "chosen",
        "--wandb-team",
        "my-team",
        "--wandb-host",
        "http://wandb.example.invalid:8080",
        "--wandb-run-id",
        "flagrun01",
        "--wandb-key",
        key,
    )
    assert seen == ("flagrun01", "my-team", "http://wandb.example.invalid:8080", key, "allow")
    assert run_dir.name.endswith("-flagrun01")  # --wandb-dir, not WANDB_DIR
    assert not (wandb_home / "wb-env" / "wandb").exists()
    assert (record.run_id, record.entity, record.project) == ("flagrun01", "my-team", "flags")
    assert items(record.config.update)["logging"]["wandb_key"] == "<redacted>"
    assert key not in "".join(p.read_text(errors="ignore") for p in run_dir.rglob("*") if p.is_file())

    # Control: without them, W&B picks its own id, no team, its default host and no key.
    seen, run_dir, record = logged(wandb_home / "other")
    run_id, entity, host, api_key, resume = seen
    assert run_id != "flagrun01" and run_dir.name.endswith(f"-{run_id}") and record.entity != "my-team"
    assert host != "http://wandb.example.invalid:8080" and api_key is None and resume is None


@pytest.mark.exercises("--load")
def test_load_from_a_directory_without_checkpoints_is_an_error_unless_it_is_the_save_directory(tmp_path):
    from miles_core.config.resolve import resolve_config
    from miles_core.errors import RunError
    from miles_core.training.run_state import restore_run_state

    base = ["--hf-checkpoint", "stabilityai/stable-diffusion-3.5-medium", "--rollout-batch-size", "1"]
    typo = resolve_config([*base, "--load", str(tmp_path / "chekpoints"), "--save", str(tmp_path / "checkpoints")])
    with pytest.raises(RunError) as caught:
        restore_run_state(typo, trainer=None)
    assert str(caught.value) == (
        f"--load {tmp_path / 'chekpoints'}: no checkpoint there (no latest_checkpointed_iteration.txt); to start "
        "fresh and resume later, give the same directory to --save and --load"
    )
    # Control: a first run whose --load is its own (still empty) --save directory starts fresh.
    same = resolve_config([*base, "--load", str(tmp_path / "checkpoints"), "--save", str(tmp_path / "checkpoints")])
    assert restore_run_state(same, trainer=None) is None
