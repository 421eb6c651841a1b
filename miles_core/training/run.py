"""The run behind ``miles-core train``: :func:`prepare_run` builds everything a run needs
(data, engine, trainer, restored state, run directory) into a
:class:`~miles_core.training.run_context.RunContext`; :func:`train` drives its loop and
writes one record per rollout to ``metrics.jsonl``, checkpoints, the final weights and
the summary.

The pieces live in their own modules: the run directory (:mod:`.run_directory`), saving
and restoring run state (:mod:`.run_state`), the engine or fleet (:mod:`.run_engine`), the
loops (:mod:`.rl_loop`, :func:`.sft.sft_rollouts`, chosen by :mod:`.loops`), scoring
(:mod:`.rollout_scoring`) and the console lines (:mod:`.run_summary`). Ray runs
(``--use-ray``) start their cluster session first: :func:`miles_core.launch.train`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from miles_core.config.model import Config
from miles_core.engine.base import RolloutEngine
from miles_core.engine.embedded import EmbeddedEngine
from miles_core.engine.factory import sde_backend
from miles_core.errors import ConfigError, EngineRequestError, MilesError, RunError, RunFailedError
from miles_core.model_loading import load_family
from miles_core.plugin_manager import loss_spec
from miles_core.report import write_report
from miles_core.specs import LossSpec
from miles_core.training.loops import rollouts, rolls_out
from miles_core.training.prompt_embeddings import precompute_prompt_embeddings
from miles_core.training.run_context import RunContext
from miles_core.training.run_directory import output_directory, save_weights
from miles_core.training.run_engine import check_engine_key, create_run_engine, start_fleet, started_servers
from miles_core.training.run_state import restore_run_state, save_run_state
from miles_core.training.run_summary import final_summary, rollout_line
from miles_core.training.threads import caller_threads, hand_compute_to_engine, on_compute_thread, run_thread_plan

Log = Callable[[str], None]
EngineFactory = Callable[[Config], RolloutEngine]
"""Builds a run's engine from its configuration (default: :func:`~.run_engine.create_run_engine`)."""


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


def number_of_rollouts(config: Config, num_rows: int, spec: LossSpec | None = None) -> int:
    """``--num-rollout``, or ``--num-epoch`` passes over ``num_rows`` rows of ``--prompt-data``."""
    if config.num_rollout is not None:
        return config.num_rollout
    if config.num_epoch is not None:
        spec = spec or loss_spec(config)
        # A supervised rollout consumes rollout_batch_size x n_samples_per_prompt rows; an
        # RL one rollout_batch_size prompts (each sampled n times).
        supervised = spec.trains_on == "supervised_rows"
        per_rollout = config.rollout_batch_size * (config.n_samples_per_prompt if supervised else 1)
        return math.ceil(config.num_epoch * num_rows / per_rollout)
    raise RunError("set --num-rollout (rollouts to run) or --num-epoch (passes over --prompt-data)")


def check_engine_images(config: Config, records: list, eval_datasets: dict[str, list] | None = None) -> None:
    """Refuse prompt rows with a conditioning image under ``--rollout-engine sglang``: its
    image-to-video ``denoising_env`` carries no image conditioning the trainer could
    replay (a one-line :class:`~miles_core.errors.ConfigError`). Text-only rows of a
    family whose image is optional train on sglang as any text-to-video family's do."""
    if config.get("rollout_engine") != "sglang":
        return
    from miles_core.config.eval_config import eval_datasets as resolve_eval_sets

    files = {d.name: d.source for d in resolve_eval_sets(config)} if eval_datasets else {}
    labels = {name: f"--eval-config {file} dataset {name}" if file else f"--eval-prompt-data {name}" for name, file in files.items()}
    sets = {
        "--prompt-data": records,
        **{labels.get(name, f"--eval-prompt-data {name}"): rows for name, rows in (eval_datasets or {}).items()},
    }
    for flag, rows in sets.items():
        row = next((r for r in rows if getattr(r, "image", None)), None)
        if row is not None:
            raise ConfigError(
                f"--rollout-engine sglang: {flag} has rows with a conditioning image ({row.image}), and image-to-video "
                "rollouts are not supported on sglang yet; use --rollout-engine embedded or http, or text-only rows"
            )


def _rollout_source(config: Config, records: list) -> Any:
    """The prompt source of an RL run: ``--data-source-path`` or the built-in one over
    ``--prompt-data`` (None under ``--disable-rollout-global-dataset`` without a data
    source: the ``--rollout-function-path`` function finds its own prompts). Loads the
    rollout function too, so a bad one fails before any model loads."""
    from miles_core.rollout.hooks import build_data_source, rollout_hook

    rollout_hook(config)
    return build_data_source(config, None if config.disable_rollout_global_dataset else records)


def build_trainer(config: Config, family: Any, spec: LossSpec | None = None) -> Any:
    """The :class:`~miles_core.training.trainer.Trainer` of a run on ``family``; its setup
    errors (attention backend, gradient checkpointing, hooks) are one line each."""
    from miles_core.plugin_manager import get_host
    from miles_core.training.trainer import Trainer

    spec = spec or loss_spec(config)
    loss_fn = get_host().registries.loss.get(spec.name).load()
    try:
        return Trainer(family, config, sde_backend(config), loss_fn)
    except ValueError as exc:
        raise RunError(str(exc)) from None


async def prepare_run(
    config: Config,
    *,
    log: Log = _stderr,
    cluster: Any = None,
    engine_factory: EngineFactory | None = None,
    progress: bool | None = None,
    on_phase: Callable[[str, Any], None] | None = None,
    before_load: Callable[[Config, Log], None] | None = None,
) -> RunContext:
    """Build a run: load its data, engine and trainer, restore ``--load``, create its
    directory (writing ``config.yaml``) and start the servers it owns. Nothing is
    generated or trained yet. ``cluster``: a started Ray session
    (:class:`~miles_core.cluster.session.RaySession`) whose ranks train and whose actors
    serve; ``engine_factory`` replaces :func:`~.run_engine.create_run_engine`; ``progress``:
    progress bars on or off (default: when stderr is a terminal); ``on_phase``: see
    :attr:`RunContext.on_phase <miles_core.training.run_context.RunContext.on_phase>`;
    ``before_load(config, log)``: called once the run's inputs are checked (prompts,
    images, evaluation sets, the schedule) and before any engine or model loads
    (``miles-core train``'s memory plan, :mod:`miles_core.planning`)."""
    import yaml

    from miles_core.config.determinism import apply_deterministic_mode
    from miles_core.config.document import config_document
    from miles_core.config.train_env import apply_train_env_vars
    from miles_core.training.lr_schedule import from_config as lr_schedule_from_config
    from miles_core.training.metrics_logging import Progress, require_trackers

    if config.get("use_ray") and cluster is None:
        raise RunError(
            "--use-ray: start the run with miles_core.launch.train (as `miles-core train` does), which starts the Ray session first"
        )
    try:
        apply_train_env_vars(config, log)
    except ValueError as exc:
        raise RunError(str(exc)) from None
    spec = loss_spec(config)
    supervised = not rolls_out(spec)
    replay = bool(config.load_debug_rollout_data)  # saved rollouts instead of an engine
    if not config.prompt_data and not replay and not config.disable_rollout_global_dataset:
        raise RunError("--prompt-data is required: a JSONL file with one prompt per line")
    require_trackers(config)  # --use-wandb / --use-tensorboard without their package: one line, now
    records: list[Any] = []
    if supervised:
        from miles_core.training.sft import load_sft_rows

        records = load_sft_rows(
            config.prompt_data,
            input_key=config.input_key,
            image_key=config.sft_image_key,
            video_key=config.sft_video_key,
            audio_key=config.sft_audio_key,
            num_frames=config.diffusion_output_num_frames,
            frame_stride=config.sft_frame_stride,
        )
    elif config.prompt_data and not config.disable_rollout_global_dataset:
        from miles_core.rollout.data import load_prompts, run_image_options

        records = load_prompts(
            config.prompt_data, input_key=config.input_key, metadata_key=config.metadata_key, **run_image_options(config)
        )
    eval_datasets = None
    if config.eval_interval and not supervised and not replay:
        from miles_core.training.evaluation import load_eval_datasets

        # Bad eval rows (an image-to-video family's rows without their image) stop the run
        # now, before any model loads, not at its first evaluation.
        eval_datasets = load_eval_datasets(config)
    check_engine_images(config, records, eval_datasets)
    total = number_of_rollouts(config, len(records), spec)
    try:  # a bad schedule (min lr above lr, warmup past the decay) stops the run before any model loads
        schedule = lr_schedule_from_config(config, total * config.num_steps_per_rollout)
    except ValueError as exc:
        raise RunError(f"learning-rate schedule: {exc}") from None
    data_source = None if supervised or replay else _rollout_source(config, records)
    if before_load is not None:
        before_load(config, log)
    torch.manual_seed(config.seed)
    apply_deterministic_mode(config)  # before CUDA starts (cuBLAS reads its workspace setting once)
    generates = not (supervised or config.train_only or replay)
    # --rollout-num-engines (and the embedded engine under --use-ray): the run starts its
    # engine servers once its output folder exists.
    own_fleet = generates and started_servers(config) > 0
    restore_threads = caller_threads()
    thread_plan = run_thread_plan(config, rolls_out=not supervised, log=log)
    engine = None
    fleet = None
    try:
        engine = (engine_factory or create_run_engine)(config) if generates and not own_fleet else None
        hand_compute_to_engine(thread_plan, engine)
        if engine is not None and config.get("rollout_engine_urls"):  # servers started by hand refuse a wrong key now
            await check_engine_key(engine)
        if cluster is not None:
            # The ranks load the model and train; the driver holds none of it (the embedded
            # engine runs on an actor of its own, synced from the ranks).
            try:
                trainer = cluster.start_trainer()
            except ValueError as exc:
                raise RunError(str(exc)) from None
        else:
            # The embedded engine shares its modules with the trainer; a remote one gets
            # weight syncs; with no engine (SFT, a replay) the trainer loads the family itself.
            family = engine.family if isinstance(engine, EmbeddedEngine) else load_family(config)
            trainer = build_trainer(config, family, spec)
        if supervised:
            from miles_core.model_loading import family_class
            from miles_core.training.sft import check_sft_run

            # A frame count the VAE cannot encode, or rows without the audio the family
            # denoises (or with too little of it), stop the run here, on the driver, before
            # any rank trains (the driver of Ray ranks holds no family).
            on_ranks = cluster is not None and not config.model_backend_path
            check_sft_run(trainer, config, records, family_class(config) if on_ranks else None)
        resumed = restore_run_state(config, trainer, data_source)
        start = config.start_rollout_id if config.start_rollout_id is not None else (resumed or 0)
        out = output_directory(config, start if resumed is not None else None, log)
        (out / "config.yaml").write_text(yaml.safe_dump(config_document(config), sort_keys=False), encoding="utf-8")
        if resumed is not None:
            from miles_core.training.lr_schedule import resume_schedule

            schedule = resume_schedule(config, schedule, log)
        # On the compute thread: the encodings are the calls the engine would make, at its thread count.
        await on_compute_thread(
            thread_plan,
            engine,
            functools.partial(
                precompute_prompt_embeddings, config, records, engine=engine, trainer=trainer, out=out, supervised=supervised, log=log
            ),
        )
        if own_fleet:
            engine, fleet = start_fleet(config, out, log, cluster, threads=thread_plan.engine_server_threads)
    except BaseException:
        if engine is not None:
            await engine.close()
        restore_threads()
        raise
    return RunContext(
        config=config,
        trainer=trainer,
        loss_spec=spec,
        schedule=schedule,
        out=out,
        start=start,
        total=total,
        engine=engine,
        data_source=data_source,
        rows=records if supervised else [],
        eval_datasets=eval_datasets,
        resumed=resumed is not None,
        resumed_from=None if resumed is None else resumed - 1,
        progress=Progress(enabled=progress),
        scorer=cluster.reward_scorer((out / "rewards").absolute()) if cluster is not None and generates else None,
        fleet=fleet,
        log=log,
        on_phase=on_phase,
        thread_plan=thread_plan,
        restore_threads=restore_threads,
    )


async def train(
    config: Config,
    *,
    log: Log = _stderr,
    cluster: Any = None,
    engine_factory: EngineFactory | None = None,
    on_phase: Callable[[str, Any], None] | None = None,
    before_load: Callable[[Config, Log], None] | None = None,
) -> Path:
    """Run the training loop; return the run directory. ``log`` is the console: every line
    also goes to ``RUN_DIR/train.log`` (:mod:`~miles_core.training.run_log`, at
    ``--log-level``). ``cluster``, ``engine_factory``, ``on_phase`` and ``before_load``: see
    :func:`prepare_run`."""
    from miles_core.training.run_log import RunLog

    # Attached here, or nested in the caller's block (miles_core.launch under --use-ray), whose
    # end then closes the file; the error that ends the run is the file's last line.
    with RunLog.of(log, config).attached() as run_log:
        return await logged_train(
            config, log=run_log, cluster=cluster, engine_factory=engine_factory, on_phase=on_phase, before_load=before_load
        )


async def logged_train(
    config: Config,
    *,
    log: Any,
    cluster: Any = None,
    engine_factory: EngineFactory | None = None,
    on_phase: Callable[[str, Any], None] | None = None,
    before_load: Callable[[Config, Log], None] | None = None,
) -> Path:
    """:func:`train` with its :class:`~miles_core.training.run_log.RunLog` (``log``), which
    starts writing ``RUN_DIR/train.log`` once the run directory exists."""
    from miles_core.config.document import config_document
    from miles_core.training.checkpoint_on_failure import FailureCheckpoint
    from miles_core.training.ci_check import check_ci_metric
    from miles_core.training.guard import stop_for_alarm
    from miles_core.training.metrics_logging import metrics_logger

    run = await prepare_run(config, log=log, cluster=cluster, engine_factory=engine_factory, on_phase=on_phase, before_load=before_load)
    out = run.out
    log.open(out)  # the lines logged so far, then every line as it is logged
    on_failure = FailureCheckpoint(run)
    first: dict[str, Any] = {}
    metrics: dict[str, Any] = {}
    with (out / "metrics.jsonl").open("a", encoding="utf-8") as metrics_file:
        logger = None
        failed = True
        try:
            logger = metrics_logger(config, config_document(config), out)
            guard_stop = None  # --guard-stop-on-alarm: the error to stop with once the final weights are written
            run.trackers = logger  # the RL loop logs each evaluation's media to it
            stream = rollouts(run)
            async for metrics, samples in stream:
                first = first or metrics
                metrics_file.write(json.dumps(metrics) + "\n")
                metrics_file.flush()
                if logger is not None:
                    logger.log(metrics, samples)
                log(rollout_line(metrics, run.total))
                if any(key.startswith(("eval/", "guard/")) for key in metrics):
                    await write_run_report(out, log)  # report.html at every evaluation
                rollout_id = metrics["rollout_id"]
                last = rollout_id + 1 == run.total
                save = bool(config.save and (last or (config.save_interval and (rollout_id + 1) % config.save_interval == 0)))
                if save:
                    if run.turns is not None:  # --offload-train: the trainer's state comes back for the save
                        await run.turns.enter("checkpoint")
                    save_run_state(
                        config, run.trainer, rollout_id, run.data_source, run.schedule, resumed_from=run.resumed_from, guard=run.guard
                    )
                on_failure.recorded_rollout(rollout_id, saved=save)
                if config.get("guard_stop_on_alarm") and metrics.get("guard/alarms"):  # checkpointed, then stop (exit 3)
                    guard_stop = await stop_for_alarm(run, rollout_id, metrics, saved=save)
                    await stream.aclose()  # the loop's generator ends here, not whenever it is collected
                    break
            failed = False
        except BaseException as exc:
            # An engine, the router, a reward worker, a weight-update group or the cluster
            # failed, or the user stopped the run: keep a checkpoint of the last rollout the
            # trainer holds exactly (checkpoint_on_failure says which), before the servers stop.
            await on_failure.keep(exc)
            await write_run_report(out, log)  # what the run recorded until it failed
            if isinstance(exc, EngineRequestError):  # an engine died or refused: one line naming its URL
                raise RunFailedError(f"rollout engine failed: {' '.join(str(exc).split())}") from None
            raise
        finally:
            await run.close()
            if logger is not None:
                logger.finish(exit_code=1 if failed else 0)
    save_weights(config, run.trainer, out)
    for line in final_summary(first, metrics):
        log(line)
    await write_run_report(out, log)
    if guard_stop is not None:
        raise guard_stop
    check_ci_metric(config, out / "metrics.jsonl")
    return out


async def write_run_report(out: Path, log: Log) -> None:
    """Rewrite ``RUN_DIR/report.html`` (atomically, off the event loop's thread). A report
    that cannot be written is a warning: it never stops the run."""
    try:
        await asyncio.to_thread(write_report, [out], out / "report.html")
    except (MilesError, OSError, ValueError) as exc:
        log(f"warning: {out / 'report.html'}: the run report was not written: {' '.join(str(exc).split())}")


def run_sync(config: Config) -> Path:
    """:func:`train` in a fresh event loop (a run without ``--use-ray``)."""
    return asyncio.run(train(config))
