"""Saving and restoring what a run needs to go on exactly where it stopped: the
trainable weights, the optimizer, the EMA, the RNG streams, the learning-rate schedule
and a custom data source's state, in one atomic checkpoint (:mod:`~miles_core.training.checkpoint`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles_core.config.model import Config
from miles_core.errors import RunError


def restore_run_state(config: Config, trainer: Any, data_source: Any = None) -> int | None:
    """Load ``--load`` (``--ckpt-step`` or the latest); return the first rollout to run,
    or None when there is nothing to resume from. A ``--data-source-path`` source gets
    back the state it had when the checkpoint was saved."""
    from miles_core.errors import CheckpointError
    from miles_core.training.checkpoint import (
        latest_iteration,
        load_checkpoint,
        load_trainer_optimizer_state,
        restore_rng,
    )

    if not config.load:
        return None
    root = Path(config.load)
    try:
        if config.ckpt_step is None and latest_iteration(root) is None:
            if config.save and Path(config.save).resolve() == root.resolve():
                return None  # a first run pointed at its own --save directory
            raise CheckpointError(
                "no checkpoint there (no latest_checkpointed_iteration.txt); to start fresh and resume later, "
                "give the same directory to --save and --load"
            )
        checkpoint = load_checkpoint(root, config.ckpt_step)
    except CheckpointError as exc:
        raise RunError(f"--load {root}: {exc}") from None
    try:
        trainer.load_trainable_state(checkpoint.model_state)
    except ValueError as exc:
        raise RunError(f"--load {checkpoint.path}: {exc}") from None
    if checkpoint.optimizer_state is not None and not config.no_load_optim:
        load_trainer_optimizer_state(trainer, checkpoint.optimizer_state)
    trainer.optimizer_steps = int(checkpoint.extra.get("optimizer_steps", 0))
    if trainer.ema is not None:
        if "ema" not in checkpoint.extra:
            raise RunError(f"--load {checkpoint.path}: this run keeps an EMA but the checkpoint has none")
        trainer.ema.load_state_dict(checkpoint.extra["ema"])
    if not config.no_load_rng:
        restore_rng(checkpoint.rng_state)
        if hasattr(trainer, "restore_rank_rng"):  # another world size (or none saved): ranks reseed from (seed, rank)
            trainer.restore_rank_rng(checkpoint.extra.get("rank_rng"))
    if config.data_source_path and data_source is not None:
        if "data_source" not in checkpoint.extra:
            raise RunError(
                f"--data-source-path {config.data_source_path}: the checkpoint {checkpoint.path} holds no data-source "
                "state (saved without --data-source-path), so the prompts cannot resume where they stood"
            )
        data_source.load_state_dict(checkpoint.extra["data_source"])
    return checkpoint.rollout_id + 1


def save_run_state(config: Config, trainer: Any, rollout_id: int, data_source: Any = None, schedule: Any = None) -> None:
    from miles_core.training.checkpoint import capture_rng, save_checkpoint, trainer_optimizer_state
    from miles_core.training.lr_schedule import SCHEDULE_KEY, schedule_state

    extra: dict[str, Any] = {} if schedule is None else {SCHEDULE_KEY: schedule_state(schedule)}
    if config.data_source_path and data_source is not None:
        # The built-in source is a pure function of the rollout id; a custom one may not be.
        state = data_source.state_dict()
        if not isinstance(state, dict):
            raise RunError(
                f"--data-source-path {config.data_source_path}: state_dict() must return a dict of JSON-like "
                f"values and tensors, got {type(state).__name__}"
            )
        extra["data_source"] = state
    rank_rng = getattr(trainer, "rank_rng_states", None)
    if rank_rng is not None:  # training ranks on Ray: each one's RNG, restored at the same world size
        extra["rank_rng"] = rank_rng()
    save_checkpoint(
        Path(config.save),
        rollout_id,
        model_state=trainer.trainable_state(),
        optimizer_state=None if config.no_save_optim else trainer_optimizer_state(trainer),
        rng_state=capture_rng(),
        extra={
            "optimizer_steps": trainer.optimizer_steps,
            "use_lora": bool(config.use_lora),
            "loss_type": config.loss_type,
            **extra,
            **({"ema": trainer.ema.state_dict()} if trainer.ema is not None else {}),
        },
    )
