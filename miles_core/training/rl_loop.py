"""The reinforcement-learning loop (Flow-GRPO, DiffusionNFT and any loss that trains on
rollouts): per rollout, generate (or replay saved rollouts) while scoring, filter,
compute advantages, train, sync the weights to a remote engine, evaluate. With
``--offload-train`` / ``--offload-rollout`` the trainer and the engine take turns
(:mod:`miles_core.training.offload`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import nullcontext
from typing import Any

import torch

from miles_core.config.model import Config
from miles_core.engine.embedded import EmbeddedEngine
from miles_core.errors import RunError
from miles_core.training.offload import TurnTaking
from miles_core.training.rollout_scoring import RolloutSource
from miles_core.training.run_context import RunContext


async def rl_rollouts(run: RunContext) -> AsyncIterator[tuple[dict[str, Any], list[Any]]]:
    """Yield ``(metrics, samples)`` per rollout of ``run`` (from ``run.start`` to
    ``run.total``): generate (or replay) while scoring, filter, train, sync. The reward is
    ``run.scorer`` (default: a :class:`~miles_core.training.rewards.RewardScorer` in this
    process)."""
    from miles_core.rollout.filters import RolloutFilters
    from miles_core.training.advantages import advantages_from_config
    from miles_core.training.debug_data import load_rollout_data, save_rollout_data, save_train_data
    from miles_core.training.evaluation import EvalArchive, EvalMedia, Evaluator
    from miles_core.training.guard import guard_for_run
    from miles_core.training.metrics_logging import Progress, custom_log_function
    from miles_core.training.rewards import reward_metrics as saved_reward_metrics
    from miles_core.training.run_state import restored_guard_state
    from miles_core.training.sync_dispatch import sync_weights as sync_along_path
    from miles_core.training.weight_sync import snapshot_weights, sync_to_engine

    config, engine, trainer, data_source = run.config, run.engine, run.trainer, run.data_source
    lr_at, start, total, out, log = run.schedule.lr_at, run.start, run.total, run.out, run.log
    progress = run.progress or Progress(enabled=False)

    replay = engine is None  # --load-debug-rollout-data: no engine, no sync, no eval
    remote = not replay and not isinstance(engine, EmbeddedEngine)
    policy_weights = rollout_policy_weights(config, trainer)
    # One sync at a time: a restarted engine's re-sync that overlapped a regular sync could
    # miss the regular one (it goes to healthy engines only) and rejoin with old weights.
    sync_lock = asyncio.Lock()
    # --offload-train / --offload-rollout: each phase takes its turn (no engine, no turns).
    turns = None if replay else TurnTaking.from_run(config, trainer, engine, run.on_phase)
    run.turns = turns

    async def turn(phase: str) -> None:
        if turns is not None:
            await turns.enter(phase)

    # Training ranks on Ray send the weights themselves (the driver holds none), the EMA
    # swapped in on the ranks under --ema-rollout-policy ema.
    ranks_sync = getattr(trainer, "sync_to_engine", None)
    ema_policy = config.ema_rollout_policy == "ema"

    async def sync_weights(pending: dict[str, float]) -> dict[str, float]:
        """Sync to a remote engine; a record's sync metrics add up the syncs since the last one."""
        async with sync_lock:
            if ranks_sync is not None:
                synced = (await ranks_sync(engine, ema=ema_policy)).metrics()
            else:
                with policy_weights():  # --ema-rollout-policy ema: the engine gets the EMA weights
                    synced = (await sync_along_path(engine, trainer.modules, config)).metrics()
        return {key: pending.get(key, 0) + value for key, value in synced.items()}

    supervisor = getattr(engine, "supervisor", None) if remote else None  # --use-fault-tolerance
    if supervisor is not None:

        async def resync(url: str) -> None:
            """A restarted (or re-admitted) engine gets the weights of the last sync, checksums
            checked, before it serves again."""
            async with sync_lock, turns.trainer_resident():  # an offloaded trainer comes back for the copy
                one = engine.view(url)
                try:
                    if ranks_sync is not None:
                        # The ranks run one call at a time: they send the weights they hold
                        # when the call reaches them (training, if running, finishes first).
                        await ranks_sync(one, ema=ema_policy)
                    else:
                        # Copied at once, inside the EMA swap: the re-sync runs in the
                        # background and the trainer may train (or swap) while it sends.
                        with policy_weights():
                            weights = snapshot_weights(trainer.modules, config)
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
    await turn("sync")
    pending_sync = await sync_weights({}) if remote else {}
    weights_change = not (config.debug_skip_optimizer_step or config.debug_rollout_only)
    rollouts = None if replay else RolloutSource(config, engine, data_source, progress, total, run.scorer)
    filters = RolloutFilters(config)
    log_rollout = custom_log_function(config)
    log_eval = custom_log_function(config, evaluation=True)
    engine_weights = nullcontext if remote else policy_weights  # the embedded engine samples the trainer's modules
    # The thread plan's compute thread: the embedded engine's, so training and generation
    # share one OpenMP pool (two pools on few cores slow every op down).
    plan = run.thread_plan
    on_engine_thread = isinstance(engine, EmbeddedEngine) and plan is not None and plan.shared_compute_thread
    # Builds the evaluation reward now: one that cannot be built stops the run before its first rollout.
    evaluator = Evaluator(config, engine, rollouts.scorer, run.eval_datasets) if config.eval_interval and not replay else None
    # The reward-hacking guard checks every evaluation (its judge reward is built now, too).
    guard = (
        guard_for_run(
            config,
            trainer,
            engine,
            out,
            log,
            on_engine_thread=on_engine_thread,
            training_scorer=rollouts.scorer,
            turns=turns,
            state=restored_guard_state(config) if run.resumed else None,  # compare with the original run's baselines
        )
        if evaluator is not None
        else None
    )
    run.guard = guard  # checkpoints keep its baselines
    pending_eval: dict[str, Any] = {}
    # Every evaluation's samples under samples/eval/ with their manifest, and the captioned grids.
    archive = EvalArchive(out, config.n_samples_per_eval_prompt, config.diffusion_fps)

    async def evaluate(tag: str, rollout_id: int, trained_rollouts: int) -> dict[str, Any]:
        await turn("eval")
        with engine_weights():
            result = await evaluator.evaluate(rollout_id)
        if guard is not None:  # the reward-hacking guard: guard/* metrics, guard.jsonl, one line per alarm
            result.metrics.update(await guard.after_evaluation(result, rollout_id, trained_rollouts))
        metrics = dict(result.metrics)
        if await log_eval(rollout_id, result.samples, metrics):
            # The custom eval log function did the logging: no eval/* keys, no archive, no
            # grids; the guard's keys stay (--guard-stop-on-alarm reads them from the record).
            return {key: value for key, value in metrics.items() if key.startswith("guard/")}
        rows = archive.save(result, tag, rollout_id, trained_rollouts)
        grids = archive.save_grids(result, rows, tag)
        if run.trackers is not None:  # W&B / TensorBoard: the grids and each sample (videos playable)
            run.trackers.log_eval(EvalMedia.of(result, rows, grids, tag, rollout_id, out, trained_rollouts=trained_rollouts))
        return metrics

    if evaluator is not None and not config.skip_eval_before_train:
        pending_eval = await evaluate(f"{start:05d}_before", start, start)
    for rollout_id in range(start, total):
        began = time.perf_counter()
        if replay:
            samples, rewards = load_rollout_data(
                config.load_debug_rollout_data,
                rollout_id,
                subsample=config.load_debug_rollout_data_subsample,
                seed=config.rollout_seed,
            )
            generated = time.perf_counter()
            reward_metrics, reward_busy = saved_reward_metrics(samples), 0.0
        else:
            # Scoring starts as each microgroup returns (unless --no-streaming-reward) and
            # goes on while the rest generates; score() waits for what is left.
            await turn("rollout")
            with engine_weights():
                samples = await rollouts.generate(rollout_id)
            generated = time.perf_counter()
            rewards, reward_metrics, reward_busy = await rollouts.score(samples)
            if guard is not None:  # the training reward of the guard's reward gap
                guard.training_reward(reward_metrics)
            await turn("train")
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
            log(
                f"warning: rollout {rollout_id}: the rollout filters kept no prompt group "
                f"({kept.metrics['rollout/filter/groups_dropped']} dropped by --dynamic-sampling-filter-path, "
                f"{kept.metrics['rollout/filter/groups_unselected']} left out by --buffer-filter-path); "
                "no optimizer step this rollout"
            )
        if trains:
            unit = "micro-batch" if run.loss_spec.trains_on == "sde_transitions" else "step"
            run.settled = None  # mid-step the trainer holds no rollout's end state: nothing to checkpoint
            with progress.training(trainer, f"train {rollout_id + 1}/{total}", unit):
                if on_engine_thread:
                    trainer.stop_requested.clear()  # a stop that came after an earlier rollout's last micro-batch
                    job = asyncio.ensure_future(engine.run_compute(trainer.train_rollout, train_samples, advantages, lr_at))
                    try:
                        metrics.update(await asyncio.shield(job))
                    except asyncio.CancelledError:
                        # Stopped (Ctrl-C): the compute thread stops after its micro-batch, not
                        # the rollout; wait for it, so that nothing closes the engine or hands the
                        # caller its threads back while it still writes the weights.
                        trainer.stop_requested.set()
                        await asyncio.wait([job])
                        if not job.cancelled():
                            job.exception()  # TrainingStopped, or the rollout's end: superseded by the stop
                        raise
                else:
                    metrics.update(trainer.train_rollout(train_samples, advantages, lr_at))
            if config.save_debug_train_data:
                save_train_data(
                    config.save_debug_train_data, rollout_id, train_samples, train_rewards, advantages, trainer.last_pairs, metrics
                )
        run.settled = rollout_id  # trained (or nothing to train): the trainer holds this rollout's end state
        trained = time.perf_counter()
        await turn("sync")  # the engine resumes (and takes the weights) before the next generation
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
        metrics.update(
            {
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
            }
        )
        metrics.update(pending_eval)
        pending_eval = {}
        if evaluator is not None and ((rollout_id + 1) % config.eval_interval == 0 or rollout_id + 1 == total):
            metrics.update(await evaluate(f"{rollout_id + 1:05d}", rollout_id, rollout_id + 1))
        yield metrics, logged_samples
    await turn("done")


def rollout_policy_weights(config: Config, trainer: Any) -> Callable[[], Any]:
    """A context-manager factory: under ``--ema-rollout-policy ema`` the trainer's modules
    hold the EMA weights inside it (restored bit for bit after), otherwise nothing."""
    if config.ema_rollout_policy != "ema":
        return nullcontext
    if trainer.ema is None:
        raise RunError("--ema-rollout-policy ema requires --use-ema")
    return lambda: trainer.ema.swap_into(trainer.named_trainable())
