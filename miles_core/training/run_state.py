"""Saving and restoring what a run needs to go on exactly where it stopped: the
trainable weights, the optimizer, the EMA, the RNG streams, the learning-rate schedule,
a custom data source's state and the reward-hacking guard's baselines, in one atomic
checkpoint (:mod:`~miles_core.training.checkpoint`).

Full fine-tuning on several ranks saves sharded (:mod:`~miles_core.training.sharded_checkpoint`):
the trainer's ``save_sharded(directory, optimizer=...)`` has every rank write its shards
(under Ray, :class:`~miles_core.cluster.train_ranks.RayTrainer` asks its ranks), and this
process writes the rest and publishes the checkpoint; ``load_sharded`` reads them back at
any world size (a one-process trainer reads them itself)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles_core.config.model import Config
from miles_core.errors import RunError

GUARD_KEY = "guard"
"""The reward-hacking guard's state in a checkpoint's extra state (:meth:`RunGuard.state_dict
<miles_core.training.guard.RunGuard.state_dict>`)."""


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
    if checkpoint.sharded is not None:
        _load_sharded(config, trainer, checkpoint)
    else:
        try:
            trainer.load_trainable_state(checkpoint.model_state)
        except ValueError as exc:
            raise RunError(f"--load {checkpoint.path}: {exc}") from None
        if checkpoint.optimizer_state is not None and not config.no_load_optim:
            load_trainer_optimizer_state(trainer, checkpoint.optimizer_state)
    trainer.optimizer_steps = int(checkpoint.extra.get("optimizer_steps", 0))
    if trainer.ema is not None and checkpoint.sharded is None:
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


def restored_guard_state(config: Config) -> dict[str, Any] | None:
    """The reward-hacking guard's state in the checkpoint ``--load`` resumed from (read
    from its meta.json only), or None: saved without a guard (``--no-guard``, no
    evaluations, an older version), so the resumed run's first evaluation is the baseline."""
    from miles_core.training.checkpoint import read_extra

    extra = read_extra(Path(config.load), config.ckpt_step)
    state = (extra or {}).get(GUARD_KEY)
    return state if isinstance(state, dict) else None


def _load_sharded(config: Config, trainer: Any, checkpoint: Any) -> None:
    """Read a sharded checkpoint's weights, optimizer state and EMA into ``trainer``."""
    from miles_core.errors import CheckpointError
    from miles_core.training.sharded_checkpoint import SHARD_DIR, ShardedPart, read_shards

    directory = checkpoint.path / SHARD_DIR
    try:
        part = ShardedPart.from_record(checkpoint.sharded, checkpoint.path / "meta.json")
        load = getattr(trainer, "load_sharded", None)
        if callable(load):
            load(directory, part, optimizer=not config.no_load_optim)
        else:
            read_shards(trainer, directory, part, optimizer=not config.no_load_optim)
    except (CheckpointError, ValueError) as exc:
        raise RunError(f"--load {checkpoint.path}: {exc}") from None


def _save_sharded(config: Config, trainer: Any, rollout_id: int, extra: dict[str, Any], rng_state: dict[str, Any]) -> None:
    from miles_core.training.sharded_checkpoint import save_sharded_checkpoint, write_shards

    optimizer = not config.no_save_optim
    save = getattr(trainer, "save_sharded", None)

    def write(directory: Path) -> Any:
        return save(directory, optimizer=optimizer) if callable(save) else write_shards(trainer, directory, optimizer=optimizer)

    save_sharded_checkpoint(Path(config.save), rollout_id, write, rng_state=rng_state, extra=extra)


def save_run_state(
    config: Config,
    trainer: Any,
    rollout_id: int,
    data_source: Any = None,
    schedule: Any = None,
    *,
    resumed_from: int | None = None,
    rng_state: dict[str, Any] | None = None,
    guard: Any = None,
) -> None:
    """Save checkpoint ``rollout_id`` under ``--save`` (sharded for full fine-tuning on
    several ranks), then apply ``--save-keep-last``, never deleting ``resumed_from`` (the
    checkpoint this run was restored from, when ``--load`` is the same directory).
    ``rng_state``: this process's RNG streams as :func:`~.checkpoint.capture_rng` took
    them earlier (default: captured now). ``guard``: the run's
    :class:`~miles_core.training.guard.RunGuard`, whose baselines are kept."""
    from miles_core.training.checkpoint import capture_rng, rotate_checkpoints, save_checkpoint, trainer_optimizer_state
    from miles_core.training.lr_schedule import SCHEDULE_KEY, schedule_state
    from miles_core.training.sharded_checkpoint import uses_sharded_checkpoints

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
    if guard is not None:
        extra[GUARD_KEY] = guard.state_dict()
    rank_rng = getattr(trainer, "rank_rng_states", None)
    if rank_rng is not None:  # training ranks on Ray: each one's RNG, restored at the same world size
        extra["rank_rng"] = rank_rng()
    extra = {"optimizer_steps": trainer.optimizer_steps, "use_lora": bool(config.use_lora), "loss_type": config.loss_type, **extra}
    rng_state = capture_rng() if rng_state is None else rng_state
    if uses_sharded_checkpoints(config):
        _save_sharded(config, trainer, rollout_id, extra, rng_state)  # the EMA is sharded with the weights
    else:
        save_checkpoint(
            Path(config.save),
            rollout_id,
            model_state=trainer.trainable_state(),
            optimizer_state=None if config.no_save_optim else trainer_optimizer_state(trainer),
            rng_state=rng_state,
            extra={**extra, **({"ema": trainer.ema.state_dict()} if trainer.ema is not None else {})},
        )
    keep = getattr(config, "save_keep_last", None)
    if keep:
        same = resumed_from is not None and config.load and Path(config.load).resolve() == Path(config.save).resolve()
        rotate_checkpoints(Path(config.save), int(keep), newest=rollout_id, protect=[resumed_from] if same else [])
