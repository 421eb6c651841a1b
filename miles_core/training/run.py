"""The run loop behind ``miles-core train``: rollout, reward, advantages, optimizer
steps, weight sync, metrics; one record per rollout in ``metrics.jsonl``."""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import time
from contextlib import nullcontext
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

import torch

from miles_core.config.model import Config
from miles_core.engine.embedded import EmbeddedEngine
from miles_core.model_loading import load_family


class RunError(RuntimeError):
    """A run that cannot start or go on; the message names the cause."""


def output_directory(config: Config, resume_from: int | None) -> Path:
    """The run directory. A fresh run never reuses one that holds a run; a resumed run
    (``--load``) continues its own: records of rollouts it will redo move to
    ``metrics.superseded.jsonl`` (nothing written is lost)."""
    path = Path(config.output_dir) if config.output_dir else Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")
    metrics = path / "metrics.jsonl"
    if metrics.exists():
        if resume_from is None:
            raise RunError(f"--output-dir {path}: already holds a run (metrics.jsonl); choose another directory")
        keep, superseded = [], []
        for line in metrics.read_text(encoding="utf-8").splitlines():
            if line.strip():
                (keep if json.loads(line)["rollout_id"] < resume_from else superseded).append(line)
        if superseded:
            with (path / "metrics.superseded.jsonl").open("a", encoding="utf-8") as handle:
                handle.write("\n".join(superseded) + "\n")
        metrics.write_text("".join(line + "\n" for line in keep), encoding="utf-8")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _restore(config: Config, trainer: Any, data_source: Any = None) -> int | None:
    """Load ``--load`` (``--ckpt-step`` or the latest); return the first rollout to run,
    or None when there is nothing to resume from. A ``--data-source-path`` source gets
    back the state it had when the checkpoint was saved."""
    from miles_core.training.checkpoint import (
        CheckpointError, latest_iteration, load_checkpoint, load_trainer_optimizer_state, restore_rng,
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


def _save(config: Config, trainer: Any, rollout_id: int, data_source: Any = None, schedule: Any = None) -> None:
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
        Path(config.save), rollout_id,
        model_state=trainer.trainable_state(),
        optimizer_state=None if config.no_save_optim else trainer_optimizer_state(trainer),
        rng_state=capture_rng(),
        extra={"optimizer_steps": trainer.optimizer_steps, "use_lora": bool(config.use_lora),
               "loss_type": config.loss_type, **extra,
               **({"ema": trainer.ema.state_dict()} if trainer.ema is not None else {})},
    )


def number_of_rollouts(config: Config, num_prompts: int) -> int:
    if config.num_rollout is not None:
        return config.num_rollout
    if config.num_epoch is not None:
        # An SFT rollout consumes rollout_batch_size x n_samples_per_prompt rows; an RL one
        # rollout_batch_size prompts (each sampled n times).
        per_rollout = config.rollout_batch_size * (config.n_samples_per_prompt if config.loss_type == "sft_loss" else 1)
        return math.ceil(config.num_epoch * num_prompts / per_rollout)
    raise RunError("set --num-rollout (rollouts to run) or --num-epoch (passes over --prompt-data)")


def _rollout_source(config: Config, records: list) -> Any:
    """The prompt source of an RL run: ``--data-source-path`` or the built-in one over
    ``--prompt-data`` (None under ``--disable-rollout-global-dataset`` without a data
    source: the ``--rollout-function-path`` function finds its own prompts). Loads the
    rollout function too, so a bad one fails before any model loads."""
    from miles_core.rollout.hooks import build_data_source, rollout_hook

    rollout_hook(config)
    return build_data_source(config, None if config.disable_rollout_global_dataset else records)


async def train(config: Config, *, log: Callable[[str], None] = lambda line: print(line, file=sys.stderr)) -> Path:
    """Run the training loop; return the run directory. With ``--use-ray`` the training
    ranks, the reward and the engine servers the run starts are Ray actors
    (:mod:`miles_core.cluster`), released when the run ends."""
    cluster = None
    if config.get("use_ray"):
        from miles_core.cluster.placement import PlacementError
        from miles_core.cluster.runtime import ClusterError
        from miles_core.cluster.session import RaySession

        sft = config.loss_type == "sft_loss"
        rolls_out = not (sft or config.train_only or config.load_debug_rollout_data)
        try:
            cluster = RaySession.start(
                config, engines=(config.rollout_num_engines or 0) if rolls_out and _starts_fleet(config) else 0,
                reward_worker=rolls_out, log=log,
            )
        except (ClusterError, PlacementError) as exc:
            raise RunError(str(exc)) from None
    try:
        return await _train(config, log=log, cluster=cluster)
    finally:
        if cluster is not None:
            cluster.close()


def _starts_fleet(config: Config) -> bool:
    """``--rollout-engine http --rollout-num-engines N`` without URLs: the run starts its servers."""
    return config.rollout_engine == "http" and not config.rollout_engine_urls and bool(config.get("rollout_num_engines"))


async def _train(config: Config, *, log: Callable[[str], None], cluster: Any = None) -> Path:
    import yaml

    from miles_core.cli.config_command import config_document
    from miles_core.plugin_manager import get_host
    from miles_core.training.lr_schedule import from_config as lr_schedule_from_config
    from miles_core.training.metrics_logging import Progress, metrics_logger, require_wandb
    from miles_core.training.trainer import Trainer

    from miles_core.training.environment import apply_train_env_vars

    try:
        apply_train_env_vars(config, log)
    except ValueError as exc:
        raise RunError(str(exc)) from None
    sft = config.loss_type == "sft_loss"
    replay = bool(config.load_debug_rollout_data)  # saved rollouts instead of an engine
    if not config.prompt_data and not replay and not config.disable_rollout_global_dataset:
        raise RunError("--prompt-data is required: a JSONL file with one prompt per line")
    require_wandb(config)
    records: list[Any] = []
    if sft:
        from miles_core.training.sft import load_sft_rows

        records = load_sft_rows(config.prompt_data, input_key=config.input_key, image_key=config.sft_image_key)
    elif config.prompt_data and not config.disable_rollout_global_dataset:
        from miles_core.rollout.data import load_prompts

        records = load_prompts(config.prompt_data, input_key=config.input_key, metadata_key=config.metadata_key)
    total_rollouts = number_of_rollouts(config, len(records))
    try:  # a bad schedule (min lr above lr, warmup past the decay) stops the run before any model loads
        schedule = lr_schedule_from_config(config, total_rollouts * config.num_steps_per_rollout)
    except ValueError as exc:
        raise RunError(f"learning-rate schedule: {exc}") from None
    data_source = None if sft or replay else _rollout_source(config, records)
    torch.manual_seed(config.seed)
    if config.deterministic_mode:
        # cuBLAS refuses deterministic mode without a fixed workspace; set it before CUDA starts.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    host = get_host()
    loss_fn = host.registries.loss.get(config.loss_type).load()
    # --rollout-num-engines: the run starts its engine servers once its output folder exists.
    own_fleet = not (sft or config.train_only or replay) and _starts_fleet(config)
    engine = None if sft or config.train_only or own_fleet else _engine(config)
    # The embedded engine shares its modules with the trainer; a remote one gets weight
    # syncs; with no engine (SFT, a replay) the trainer loads the family itself.
    family = engine.family if isinstance(engine, EmbeddedEngine) else load_family(config)
    try:  # the trainer's setup errors (attention backend, gradient checkpointing, hooks) are one line each
        trainer = Trainer(family, config, _backend(config), loss_fn)
        if cluster is not None:  # the ranks train; this trainer becomes their mirror
            trainer = cluster.wrap_trainer(trainer)
    except ValueError as exc:
        raise RunError(str(exc)) from None
    resumed = _restore(config, trainer, data_source)
    start = config.start_rollout_id if config.start_rollout_id is not None else (resumed or 0)
    out = output_directory(config, start if resumed is not None else None)
    document = config_document(config)
    (out / "config.yaml").write_text(yaml.safe_dump(document, sort_keys=False), encoding="utf-8")
    if resumed is not None:
        from miles_core.training.lr_schedule import resume_schedule

        schedule = resume_schedule(config, schedule, log)
    progress = Progress()
    fleet = None
    if own_fleet:
        engine, fleet = _start_fleet(config, out, log, cluster)
    with (out / "metrics.jsonl").open("a", encoding="utf-8") as metrics_file:
        if sft:
            loop = _sft_rollouts(config, trainer, records, schedule.lr_at, start, total_rollouts, progress)
        else:
            loop = _rl_rollouts(config, engine, trainer, data_source, schedule.lr_at, start, total_rollouts, out, progress,
                                log=log, scorer=cluster.reward_scorer() if cluster is not None else None)
        first: dict[str, Any] = {}
        logger = None
        failed = True
        try:
            logger = metrics_logger(config, document, out)
            async for metrics, samples in loop:
                first = first or metrics
                metrics_file.write(json.dumps(metrics) + "\n")
                metrics_file.flush()
                if logger is not None:
                    logger.log(metrics, samples)
                log(_summary(metrics, total_rollouts))
                rollout_id = metrics["rollout_id"]
                last = rollout_id + 1 == total_rollouts
                if config.save and (last or (config.save_interval and (rollout_id + 1) % config.save_interval == 0)):
                    _save(config, trainer, rollout_id, data_source, schedule)
            failed = False
        except Exception as exc:
            from miles_core.engine.http import EngineRequestError

            if isinstance(exc, EngineRequestError):  # an engine died or refused: one line naming its URL
                raise RunError(f"rollout engine failed: {' '.join(str(exc).split())}") from None
            raise
        finally:
            if engine is not None:
                await engine.close()
            if fleet is not None:
                await asyncio.to_thread(fleet.stop)
            if logger is not None:
                logger.finish(exit_code=1 if failed else 0)
    _save_weights(config, trainer, out)
    for line in _final_summary(first, metrics if first else {}):
        log(line)
    from miles_core.training.ci_check import check_ci_metric

    check_ci_metric(config, out / "metrics.jsonl")
    return out


def _final_summary(first: dict[str, Any], last: dict[str, Any]) -> list[str]:
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


def _summary(metrics: dict[str, Any], total: int) -> str:
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


def _engine(config: Config) -> Any:
    from miles_core.engine.factory import create_engine

    engine = create_engine(config)
    if not isinstance(engine, EmbeddedEngine) and not hasattr(engine, "update_weights_from_tensors"):
        raise RunError(
            f"--rollout-engine {config.rollout_engine}: this engine takes no tensor weight updates, "
            "so the run cannot sync the trained weights to it"
        )
    return engine


def _start_fleet(config: Config, out: Path, log: Callable[[str], None], cluster: Any = None) -> tuple[Any, Any]:
    """Start ``--rollout-num-engines`` serve-engine servers (logs under ``out/engines``;
    under ``--use-ray`` each on its Ray actor) and an
    :class:`~miles_core.engine.http.HttpEngine` over them."""
    from miles_core.engine.fleet import EngineFleet, FleetError
    from miles_core.engine.http import FaultTolerance, HttpEngine

    try:
        fault_tolerance = FaultTolerance.from_config(config)
    except ValueError as exc:
        raise RunError(str(exc)) from None
    log_dir = out / "engines"
    log(f"starting {config.rollout_num_engines} engine server(s) of {config.hf_checkpoint}, logs in {log_dir}")
    try:
        fleet = EngineFleet.from_config(config, log_dir) if cluster is None else cluster.engine_fleet(log_dir)
    except FleetError as exc:
        raise RunError(str(exc)) from None
    log(f"engine servers: {', '.join(fleet.urls)}")

    async def restart(index: int) -> str:  # --use-fault-tolerance: the run restarts the servers it started
        return await asyncio.to_thread(fleet.restart, index)

    try:
        engine = HttpEngine(fleet.urls, max_concurrency=config.sglang_server_concurrency,
                            decode_workers=config.rollout_parser_num_workers or 1,
                            request_timeout=config.get("miles_router_timeout"), fault_tolerance=fault_tolerance,
                            restart=restart if fault_tolerance is not None else None)
    except ValueError as exc:
        fleet.stop(timeout=5)
        raise RunError(f"--miles-router-timeout: {exc}") from None
    return engine, fleet


def _backend(config: Config) -> Any:
    from miles_core.plugin_manager import get_host
    from miles_core.refs import resolve_path_flag

    if config.sde_step_backend_path:
        return resolve_path_flag("--sde-step-backend-path", config.sde_step_backend_path, "sde_backend")
    return get_host().registries.sde_backend.get(config.diffusion_sde_type).load()


async def _rl_rollouts(
    config: Config, engine: Any, trainer: Any, data_source: Any, lr_at: Any, start: int, total: int, out: Path,
    progress: Any = None, *, log: Callable[[str], None] = lambda line: print(line, file=sys.stderr), scorer: Any = None,
):
    """Yield ``(metrics, samples)`` per rollout: generate (or replay) while scoring,
    filter, train, sync. ``scorer``: the reward (default: a
    :class:`~miles_core.training.rewards.RewardScorer` in this process)."""
    from miles_core.rollout.filters import RolloutFilters
    from miles_core.training.advantages import advantages_from_config
    from miles_core.training.debug_data import load_rollout_data, save_rollout_data, save_train_data
    from miles_core.training.evaluation import Evaluator, save_grid
    from miles_core.training.metrics_logging import Progress, custom_log_function
    from miles_core.training.rewards import reward_metrics as saved_reward_metrics
    from miles_core.training.weight_sync import snapshot_weights, sync_to_engine

    progress = progress or Progress(enabled=False)

    replay = engine is None  # --load-debug-rollout-data: no engine, no sync, no eval
    remote = not replay and not isinstance(engine, EmbeddedEngine)
    policy_weights = _rollout_policy_weights(config, trainer)
    # One sync at a time: a restarted engine's re-sync that overlapped a regular sync could
    # miss the regular one (it goes to healthy engines only) and rejoin with old weights.
    sync_lock = asyncio.Lock()

    async def sync_weights(pending: dict[str, float]) -> dict[str, float]:
        """Sync to a remote engine; a record's sync metrics add up the syncs since the last one."""
        async with sync_lock:
            with policy_weights():  # --ema-rollout-policy ema: the engine gets the EMA weights
                synced = (await sync_to_engine(engine, trainer.modules, config)).metrics()
        return {key: pending.get(key, 0) + value for key, value in synced.items()}

    supervisor = getattr(engine, "supervisor", None) if remote else None  # --use-fault-tolerance
    if supervisor is not None:
        async def resync(url: str) -> None:
            """A restarted (or re-admitted) engine gets the weights of the last sync, checksums
            checked, before it serves again."""
            async with sync_lock:
                # Copied at once, inside the EMA swap: the re-sync runs in the background and
                # the trainer may train (or swap) while it sends.
                with policy_weights():
                    weights = snapshot_weights(trainer.modules, config)
                one = engine.view(url)
                try:
                    await sync_to_engine(one, weights, config)
                finally:
                    await one.close()

        supervisor.prepare = resync
        faults_seen = {"retries": 0, "restarts": 0}

        def fault_metrics() -> dict[str, int]:
            """Retries and restarts since the previous record (left out of the comparison of
            a disturbed run with an undisturbed one: the only keys that differ, with perf/*)."""
            counts = {"retries": supervisor.retries, "restarts": supervisor.restarts}
            delta = {f"rollout/engine_{key}": counts[key] - faults_seen[key] for key in counts}
            faults_seen.update(counts)
            return delta

    # A remote engine starts from the trainer's weights (checkpoint, LoRA, or a resumed run's).
    pending_sync = await sync_weights({}) if remote else {}
    weights_change = not (config.debug_skip_optimizer_step or config.debug_rollout_only)
    rollouts = None if replay else _RolloutSource(config, engine, data_source, progress, total, scorer)
    filters = RolloutFilters(config)
    log_rollout = custom_log_function(config)
    log_eval = custom_log_function(config, evaluation=True)
    engine_weights = nullcontext if remote else policy_weights  # the embedded engine samples the trainer's modules
    # Builds the evaluation reward now: one that cannot be built stops the run before its first rollout.
    evaluator = Evaluator(config, engine, rollouts.scorer) if config.eval_interval and not replay else None
    samples_dir = out / "samples"
    pending_eval: dict[str, Any] = {}
    columns = config.n_samples_per_eval_prompt

    async def evaluate(tag: str, rollout_id: int) -> dict[str, Any]:
        with engine_weights():
            result = await evaluator.evaluate(rollout_id)
        metrics = dict(result.metrics)
        if await log_eval(rollout_id, result.samples, metrics):
            return {}  # the custom eval log function did the logging: no eval/* keys, no grids
        for name, images in result.images.items():
            save_grid(images, samples_dir / f"eval_{name}_{tag}.png", columns)
            if evaluator.first is not result:
                # Before and after, side by side: the same prompts and seeds, one row each.
                first = evaluator.first.images[name]
                pairs = [img for pair in zip(first, images) for img in pair]
                save_grid(pairs, samples_dir / f"eval_{name}_before_after.png", 2 * columns)
        return metrics

    if evaluator is not None and not config.skip_eval_before_train:
        pending_eval = await evaluate(f"{start:05d}_before", start)
    for rollout_id in range(start, total):
        began = time.perf_counter()
        if replay:
            samples, rewards = load_rollout_data(
                config.load_debug_rollout_data, rollout_id,
                subsample=config.load_debug_rollout_data_subsample, seed=config.rollout_seed,
            )
            generated = time.perf_counter()
            reward_metrics, reward_busy = saved_reward_metrics(samples), 0.0
        else:
            # Scoring starts as each microgroup returns (unless --no-streaming-reward) and
            # goes on while the rest generates; score() waits for what is left.
            with engine_weights():
                samples = await rollouts.generate(rollout_id)
            generated = time.perf_counter()
            rewards, reward_metrics, reward_busy = await rollouts.score(samples)
            if config.save_debug_rollout_data:
                save_rollout_data(config.save_debug_rollout_data, rollout_id, samples, rewards)
        kept = await filters.apply(rollout_id, samples)
        train_samples = kept.samples
        position = {id(sample): index for index, sample in enumerate(samples)}
        train_rewards = rewards[torch.tensor([position[id(sample)] for sample in train_samples], dtype=torch.long)]
        advantages = advantages_from_config(train_rewards, config, train_samples) if train_samples else None
        scored = time.perf_counter()
        metrics: dict[str, Any] = {"rollout_id": rollout_id}
        trains = advantages is not None and not config.debug_rollout_only
        if advantages is None:
            log(f"warning: rollout {rollout_id}: the rollout filters kept no prompt group "
                f"({kept.metrics['rollout/filter/groups_dropped']} dropped by --dynamic-sampling-filter-path, "
                f"{kept.metrics['rollout/filter/groups_unselected']} left out by --buffer-filter-path); "
                "no optimizer step this rollout")
        if trains:
            unit = "step" if config.loss_type == "nft" else "micro-batch"
            with progress.training(trainer, f"train {rollout_id + 1}/{total}", unit):
                metrics.update(trainer.train_rollout(train_samples, advantages, lr_at))
            if config.save_debug_train_data:
                save_train_data(config.save_debug_train_data, rollout_id, train_samples, train_rewards, advantages,
                                trainer.last_pairs, metrics)
        trained = time.perf_counter()
        if remote:
            if weights_change and trains:
                pending_sync = await sync_weights(pending_sync)
            metrics.update({"perf/weight_sync_time": 0.0, "perf/weight_sync_bytes": 0, **pending_sync})
            pending_sync = {}
            if supervisor is not None:
                metrics.update(fault_metrics())
        synced = time.perf_counter()
        rollout_metrics = {
            **reward_metrics,
            **({"rollout/advantages/abs_mean": float(advantages.abs().mean())} if advantages is not None else {}),
            "rollout/num_samples": len(train_samples),
            **kept.metrics,
            # The count is per request: every output of a microgroup carries its request's total.
            "rollout/log_prob_fallbacks": sum({s.output.request_id: s.output.log_prob_fallbacks for s in samples}.values()),
        }
        logged_samples = samples
        if await log_rollout(rollout_id, samples, rollout_metrics):
            logged_samples = []  # the custom log function did the logging: no rollout/* keys, no W&B media
        else:
            metrics.update(rollout_metrics)
        metrics.update({
            # Generation wall time (a replay: loading the file).
            "perf/rollout_time": generated - began,
            # From the end of generation until the training batch is ready: the wait for the
            # scoring still running, the reward metrics, the filters and the advantages.
            "perf/reward_time": scored - generated,
            # Seconds the reward's score() calls ran, summed (overlapping calls add up):
            # what scoring costs, whether or not it overlapped generation.
            "perf/reward_busy_time": reward_busy,
            "perf/train_time": trained - scored,
            "perf/step_time": synced - began,
        })
        metrics.update(pending_eval)
        pending_eval = {}
        if evaluator is not None and ((rollout_id + 1) % config.eval_interval == 0 or rollout_id + 1 == total):
            metrics.update(await evaluate(f"{rollout_id + 1:05d}", rollout_id))
        yield metrics, logged_samples


def _rollout_policy_weights(config: Config, trainer: Any) -> Callable[[], Any]:
    """A context-manager factory: under ``--ema-rollout-policy ema`` the trainer's modules
    hold the EMA weights inside it (restored bit for bit after), otherwise nothing."""
    if config.ema_rollout_policy != "ema":
        return nullcontext
    if trainer.ema is None:
        raise RunError("--ema-rollout-policy ema requires --use-ema")
    return lambda: trainer.ema.swap_into(trainer.named_trainable())


class _RolloutSource:
    """Prompts, the engine and the reward of a run: :meth:`generate` produces one
    rollout's samples (the built-in rollout, with a progress bar over its microgroups, or
    the checked samples of ``--rollout-function-path``) and starts scoring each
    microgroup as it returns; :meth:`score` waits for the scores."""

    def __init__(self, config: Config, engine: Any, data_source: Any, progress: Any, total: int,
                 scorer: Any = None) -> None:
        from miles_core.rollout.hooks import rollout_hook
        from miles_core.training.rewards import RewardScorer

        self.config = config
        self.engine = engine
        self.data_source = data_source
        self.progress = progress
        self.total = total
        self.scorer = scorer if scorer is not None else RewardScorer(config)
        self.hook = rollout_hook(config)
        self.streaming = not getattr(config, "no_streaming_reward", False)
        self._pending: StreamingScores | None = None

    async def generate(self, rollout_id: int) -> list[Any]:
        from miles_core.rollout.generate import diffusion_rollout
        from miles_core.rollout.hooks import check_samples

        config = self.config
        self._pending = pending = StreamingScores(self.scorer, config.n_samples_per_prompt)
        if self.hook is not None:
            # A rollout function hands its samples over at once: they are scored in score().
            samples = await self.hook(config, rollout_id, self.engine, self.data_source)
            return check_samples(self.hook, samples, config.n_samples_per_prompt)
        per_group = math.ceil(config.n_samples_per_prompt / config.rollout_microgroup_size)
        total = config.rollout_batch_size * per_group
        with self.progress.phase(f"rollout {rollout_id + 1}/{self.total}", total, "microgroup") as bar:
            async def on_microgroup(samples: list[Any]) -> None:
                bar.update(1)
                if self.streaming:
                    pending.add(samples)

            return await pending.guard(
                diffusion_rollout(config, rollout_id, self.engine, self.data_source, on_microgroup=on_microgroup)
            )

    async def score(self, samples: list[Any]) -> tuple[torch.Tensor, dict[str, float], float]:
        """Score what :meth:`generate` did not already send (everything without
        streaming), wait for all of it; return the rewards in sample order, the reward
        metrics of the rollout (the scorer's ``finish``) and the seconds the score calls
        ran, summed."""
        pending = self._pending or StreamingScores(self.scorer, self.config.n_samples_per_prompt)
        self._pending = None
        pending.add_rest(samples)
        await pending.wait()
        rewards = torch.tensor([_reward_value(s) for s in samples], dtype=torch.float32)
        # RewardError naming the reward when every sample's reward failed.
        return rewards, self.scorer.finish(samples), pending.busy


def _reward_value(sample: Any) -> float:
    return math.nan if sample.reward is None else float(sample.reward)


class StreamingScores:
    """The scoring of one rollout, started piece by piece while it generates.

    :meth:`add` takes the samples of one returned microgroup and starts a task scoring
    them; when the scorer needs whole prompt groups (``--group-rm``), a group's task
    starts when its last microgroup returns. :meth:`add_rest` scores whatever was not
    sent yet (a rollout function's samples, or all of them without streaming) in one
    call, :meth:`wait` waits for every task. A scoring task that fails stops the
    generation it overlaps (:meth:`guard`) and the error reaches the run."""

    def __init__(self, scorer: Any, group_size: int) -> None:
        self.scorer = scorer
        self.group_size = group_size
        self.whole_groups = bool(getattr(scorer, "needs_whole_groups", False))
        self.tasks: list[asyncio.Task] = []
        self.sent: set[int] = set()
        self.partial: dict[int, list[Any]] = {}
        self.busy = 0.0
        """Seconds the score calls ran, summed over calls."""
        self._failed: asyncio.Future | None = None

    def _failure(self) -> asyncio.Future:
        if self._failed is None:
            self._failed = asyncio.get_running_loop().create_future()
        return self._failed

    async def _score(self, samples: list[Any]) -> None:
        began = time.perf_counter()
        try:
            await self.scorer.score(samples)
        finally:
            self.busy += time.perf_counter() - began

    def _start(self, samples: list[Any]) -> None:
        self.sent.update(id(s) for s in samples)
        task = asyncio.ensure_future(self._score(samples))
        failure = self._failure()

        def done(task: asyncio.Task) -> None:
            if not task.cancelled() and task.exception() is not None and not failure.done():
                failure.set_exception(task.exception())

        task.add_done_callback(done)
        self.tasks.append(task)

    def add(self, samples: list[Any]) -> None:
        if not self.whole_groups:
            self._start(list(samples))
            return
        for sample in samples:
            group = self.partial.setdefault(sample.group_index, [])
            group.append(sample)
            if len(group) == self.group_size:
                del self.partial[sample.group_index]
                self._start(sorted(group, key=lambda s: s.index_in_group))

    def add_rest(self, samples: list[Any]) -> None:
        rest = [s for s in samples if id(s) not in self.sent]
        if rest:
            self._start(rest)

    async def guard(self, generation: Any) -> Any:
        """Await ``generation``; if a scoring task fails first, cancel it and raise
        that error. Whatever goes wrong, no scoring task is left running."""
        generating = asyncio.ensure_future(generation)
        failure = self._failure()
        try:
            await asyncio.wait({generating, failure}, return_when=asyncio.FIRST_COMPLETED)
            if not generating.done():
                generating.cancel()
                await asyncio.gather(generating, return_exceptions=True)
                failure.result()  # raises the scoring error
            return generating.result()
        except BaseException:
            if not generating.done():
                generating.cancel()
            self.cancel()
            raise

    async def wait(self) -> None:
        try:
            await asyncio.gather(*self.tasks)
        except BaseException:
            self.cancel()
            raise
        finally:
            failure = self._failed
            if failure is not None and failure.done() and not failure.cancelled():
                failure.exception()  # retrieved: no "exception was never retrieved" warning

    def cancel(self) -> None:
        for task in self.tasks:
            task.cancel()


async def _sft_rollouts(config: Config, trainer: Any, rows: list, lr_at: Any, start: int, total: int, progress: Any):
    from miles_core.rollout.data import PromptSource
    from miles_core.training.sft import sft_params

    params = sft_params(trainer.family, config)
    source = PromptSource(rows, batch_size=config.rollout_batch_size * config.n_samples_per_prompt, seed=config.rollout_seed)
    for rollout_id in range(start, total):
        began = time.perf_counter()
        metrics: dict[str, Any] = {"rollout_id": rollout_id}
        with progress.training(trainer, f"train {rollout_id + 1}/{total}", "step"):
            metrics.update(trainer.train_sft(source.batch(rollout_id), params, lr_at))
        metrics["perf/train_time"] = metrics["perf/step_time"] = time.perf_counter() - began
        yield metrics, ()


def _save_weights(config: Config, trainer: Any, out: Path) -> None:
    """The trained weights in a form plain diffusers loads: a LoRA (``out/lora``) or the
    full components (``out/model/<component>``)."""
    if config.debug_skip_optimizer_step or config.debug_rollout_only:
        return
    if config.use_lora:
        trainer.family.save_lora(out / "lora", trainer.modules)
    else:
        for name, module in trainer.modules.items():
            module.save_pretrained(str(out / "model" / name))


def run_sync(config: Config) -> Path:
    return asyncio.run(train(config))
