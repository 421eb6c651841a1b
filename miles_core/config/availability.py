"""Flags that cannot take effect in this run: notes for hardware-only flags, errors for
flags whose feature this version lacks.

No accepted flag is silently ignored. A hardware-only flag (:attr:`Flag.hardware`) set
where its hardware is missing is logged as a note that says what it would do; a flag
marked :attr:`Flag.unavailable` set to anything but its default stops a training run.
"""

from __future__ import annotations

from typing import Any

from miles_core.config.fsdp_offload import fsdp_offload_notes
from miles_core.config.model import Config
from miles_core.machine import visible_gpu_count


def _shown(config: Config, dest: str) -> str:
    """``--flag value``, or just ``--flag`` for a switch."""
    flag, name = config.flag(dest), config.given_name(dest)
    return name if flag.type in ("bool", "tristate") and config.get(dest) is True else f"{name} {config.get(dest)}"


def _set_away_from_default(config: Config, dest: str) -> bool:
    flag = config.flag(dest)
    if not config.is_user_set(dest):
        return False
    value: Any = config.get(dest)
    default = flag.default
    if flag.type == "tristate" and default is None:
        return value is not None
    return value != default


def hardware_notes(config: Config) -> list[str]:
    """One note per hardware-only flag the user set, plus the ``--sglang-*``
    pass-through arguments when no sglang-diffusion engine is started."""
    gpus = visible_gpu_count()
    notes = []
    placed = _placed_by_ray(config)
    for dest in config:
        flag = config.flag(dest)
        if flag.hardware and flag.name not in placed and _set_away_from_default(config, dest):
            why = (
                "this run is a single process on a machine without GPUs"
                if not gpus
                else "without --use-ray the trainer is one process and places no work on several GPUs"
            )
            # --colocate takes effect everywhere through the turns it turns on; only its placement needs Ray.
            effect = "it places nothing (the turns it turns on still take effect)" if flag.name == "--colocate" else "it has no effect"
            notes.append(f"{_shown(config, dest)}: with the hardware it needs, it {flag.hardware} Here {why}, so {effect}")
    if config.sglang_args and config.get("rollout_engine") != "sglang":
        notes.append(
            f"{' '.join(config.sglang_args)}: --sglang-* arguments are passed to sglang-diffusion servers only; "
            f"--rollout-engine {config.get('rollout_engine')} starts none, so they have no effect"
        )
    return notes


def unavailable_errors(config: Config) -> list[str]:
    """One error per flag the user set whose feature this version lacks, and one when
    the train world size asks for several ranks."""
    errors = [
        f"{_shown(config, dest)}: {config.flag(dest).unavailable}"
        for dest in config
        if config.flag(dest).unavailable and _set_away_from_default(config, dest)
    ]
    if config.world_size > 1 and not config.get("use_ray"):
        errors.append(
            f"--actor-num-nodes {config.actor_num_nodes} x --actor-num-gpus-per-node {config.actor_num_gpus_per_node} "
            f"= world size {config.world_size}: several training ranks run as Ray actors; add --use-ray (or "
            "--ray-address), or pass --actor-num-gpus-per-node 1 to train in one process"
            + (
                f" (--sequence-parallel-size {config.get('sequence_parallel_size')} splits each sample over that many ranks)"
                if (config.get("sequence_parallel_size") or 1) > 1
                else ""
            )
        )
    return errors


RAY_PLACEMENT_FLAGS = (
    "--rollout-num-gpus",
    "--rollout-num-gpus-per-engine",
    "--num-gpus-per-node",
    "--colocate",
    "--colocate-reward",
    "--reward-num-workers",
    "--reward-num-gpus-per-worker",
)
"""Hardware-only flags that size the placement group of a ``--use-ray`` run (CPUs stand
in for GPUs where there are none)."""

DISTRIBUTED_FLAGS = (
    "--distributed-backend",
    "--distributed-timeout-minutes",
    "--dp-replicate-size",
    "--fsdp-reduce-dtype",
    "--fsdp-cpu-offload",
    "--fsdp-cpu-backend",
    "--sequence-parallel-size",
    "--ulysses-degree",
)
"""Hardware-only flags of the torch.distributed group, in effect with several training ranks."""


def _placed_by_ray(config: Config) -> set[str]:
    """The hardware-only flags this run reads: the placement flags under Ray, the
    process-group flags with several ranks."""
    placed: set[str] = set()
    if config.get("use_ray"):
        placed.update(RAY_PLACEMENT_FLAGS)
        if config.world_size > 1:
            placed.update(DISTRIBUTED_FLAGS)
    return placed


_LORA_SETTINGS = ("lora_rank", "lora_alpha", "lora_target_modules", "lora_init_weights")

# Flags read by one built-in loss only: dest -> the losses that read it. A custom loss
# gets the whole configuration, so it is never told a flag is unused.
_LOSS_ONLY: dict[str, tuple[str, ...]] = {
    "diffusion_clip_range": ("policy_loss",),
    "diffusion_adv_clip_max": ("policy_loss", "nft"),
    "diffusion_nft_beta": ("nft",),
    "diffusion_nft_timestep_fraction": ("nft",),
    "no_diffusion_nft_adaptive_weight": ("nft",),
    "no_diffusion_nft_shuffle_timesteps": ("nft",),
}

# Flags read by the supervised-row data side (a loss whose kind is ``supervised_rows``,
# whatever its name), so keyed on the loss's kind.
_SUPERVISED_ONLY = ("sft_image_key", "sft_video_key", "sft_audio_key", "sft_frame_stride")


_EVAL_SETTINGS = (
    "eval_prompt_data",
    "eval_config",
    "eval_input_key",
    "n_samples_per_eval_prompt",
    "diffusion_eval_num_steps",
    "skip_eval_before_train",
)


def loss_is(config: Config, name: str) -> bool:
    return config.get("loss_type") == name


def conflicting_flags(config: Config) -> list[str]:
    """Combinations where a flag the user set would do nothing and the intent is
    ambiguous: errors, so the run does not quietly do something else."""
    errors = [
        f"{config.flag(dest).name} requires --use-lora (without it the whole model is fine-tuned and LoRA settings do nothing)"
        for dest in _LORA_SETTINGS
        if not config.get("use_lora") and _set_away_from_default(config, dest)
    ]
    if config.get("custom_rm_path") and config.is_user_set("rm_type") and config.get("rm_type") is not None:
        errors.append(
            f"--rm-type {config.get('rm_type')} and --custom-rm-path {config.get('custom_rm_path')} are mutually "
            "exclusive (the custom reward replaces the registered one)"
        )
    return errors


def inert_notes(config: Config, trains_on: str | None = None) -> list[str]:
    """Flags the user set that the chosen loss, reference or engine does not read;
    ``trains_on``: the loss's kind of data (:data:`~miles_core.specs.TRAINING_DATA`)."""
    loss = config.get("loss_type")
    supervised = trains_on == "supervised_rows"
    notes = []
    if loss != "custom_loss":
        # The built-in losses' own flags: a plugin's loss, like custom_loss, gets the whole
        # configuration and may read any of them (GRPO-Guard clips like policy_loss).
        builtin = {name for losses in _LOSS_ONLY.values() for name in losses} | {"sft_loss"}
        for dest, losses in _LOSS_ONLY.items() if loss in builtin else ():
            if loss not in losses and _set_away_from_default(config, dest):
                notes.append(f"{_shown(config, dest)} has no effect with --loss-type {loss} (read by {' and '.join(losses)} only)")
        for dest in _SUPERVISED_ONLY if trains_on is not None and not supervised else ():
            if _set_away_from_default(config, dest):
                notes.append(
                    f"{_shown(config, dest)} has no effect with --loss-type {loss} (read only by losses that train on "
                    "supervised rows, e.g. sft_loss)"
                )
    # nft's old policy and DPO's log-ratios read the reference whatever the KL term says.
    reads_reference = loss == "nft" or trains_on == "preference_pairs"
    if (
        config.get("ref_mode") is not None
        and config.is_user_set("ref_mode")
        and not reads_reference
        and not config.get("diffusion_kl_beta")
    ):
        notes.append(
            f"--ref-mode {config.get('ref_mode')} has no effect: with --diffusion-kl-beta 0 no KL term compares against the reference"
        )
    if config.get("kl_space") is not None and config.is_user_set("kl_space") and not config.get("diffusion_kl_beta"):
        notes.append(f"--kl-space {config.get('kl_space')} has no effect: --diffusion-kl-beta is 0 (no KL term)")
    if _set_away_from_default(config, "diffusion_train_iter_order"):
        if config.get("micro_batch_size_sample") is None:
            notes.append(
                f"{_shown(config, 'diffusion_train_iter_order')} has no effect without the 2-D tile "
                "(--micro-batch-size-sample and --micro-batch-size-tstep)"
            )
        elif trains_on in ("nft_pairs", "supervised_rows", "preference_pairs"):
            notes.append(
                f"{_shown(config, 'diffusion_train_iter_order')} has no effect with --loss-type {loss}: its micro-batches are flat"
            )
    if config.get("eval_interval") is None:
        unused = [config.flag(dest).name for dest in _EVAL_SETTINGS if _set_away_from_default(config, dest)]
        if unused:
            notes.append(
                f"{', '.join(unused)}: no evaluation runs without --eval-interval, so "
                f"{'they have' if len(unused) > 1 else 'it has'} no effect"
            )
    if "--fsdp-cpu-backend" in _placed_by_ray(config):  # elsewhere its hardware note says it already
        notes.extend(fsdp_offload_notes(config))
    if config.get("diffusion_debug_mode") and trains_on in ("nft_pairs", "supervised_rows", "preference_pairs"):
        notes.append(
            f"--diffusion-debug-mode has no effect with --loss-type {loss}: the drift metrics compare the "
            "policy loss's recomputed log-probs with the engine's"
        )
    if supervised and config.get("diffusion_output_num_frames") == 1 and _set_away_from_default(config, "sft_frame_stride"):
        notes.append(f"{_shown(config, 'sft_frame_stride')} has no effect with --diffusion-output-num-frames 1 (a clip of frame 0)")
    if supervised:
        dumps = [
            config.flag(d).name
            for d in ("save_debug_rollout_data", "save_debug_train_data", "dump_details")
            if config.is_user_set(d) and config.get(d)
        ]
        if dumps:
            notes.append(
                f"{', '.join(dumps)}: --loss-type {loss} has no rollouts to dump, so "
                f"{'they have' if len(dumps) > 1 else 'it has'} no effect"
            )
    elif config.get("debug_rollout_only") and config.is_user_set("save_debug_train_data"):
        notes.append("--save-debug-train-data has no effect with --debug-rollout-only: nothing is trained")
    if not config.get("use_wandb"):
        unused = [
            config.flag(d).name
            for d in config
            if d.startswith("wandb_") or d == "disable_wandb_random_suffix"
            if _set_away_from_default(config, d)
        ]
        if unused:
            notes.append(
                f"{', '.join(unused)}: wandb logging is off without --use-wandb, so "
                f"{'they have' if len(unused) > 1 else 'it has'} no effect"
            )
    if config.get("lora_ipc_weight_sync") and config.get("rollout_engine") == "embedded":
        notes.append(
            "--lora-ipc-weight-sync has no effect with --rollout-engine embedded: the engine shares the "
            "trained module, so no weights are sent"
        )
    notes.extend(_fault_tolerance_notes(config))
    return notes


_HEALTH_CHECK_SETTINGS = (
    "rollout_health_check_interval",
    "rollout_health_check_timeout",
    "rollout_health_check_first_wait",
    "miles_router_health_check_failure_threshold",
)


def _fault_tolerance_notes(config: Config) -> list[str]:
    """Health-check settings without ``--use-fault-tolerance``; fault tolerance, or a
    request timeout, for an engine that has no servers (embedded)."""
    notes = []
    unused = [config.flag(dest).name for dest in _HEALTH_CHECK_SETTINGS if _set_away_from_default(config, dest)]
    if unused and not (config.get("use_fault_tolerance") or config.get("use_miles_router")):
        notes.append(
            f"{', '.join(unused)}: the engine health checks run only under --use-fault-tolerance or --use-miles-router, so "
            f"{'they have' if len(unused) > 1 else 'it has'} no effect"
        )
    if config.get("miles_router_max_connections") is not None and not config.get("use_miles_router"):
        notes.append(
            f"{_shown(config, 'miles_router_max_connections')}: no effect without --use-miles-router (it caps the "
            "router's connections to the engines)"
        )
    engine = config.get("rollout_engine")
    if engine == "embedded" and config.get("use_fault_tolerance"):
        notes.append(
            "--use-fault-tolerance has no effect with --rollout-engine embedded: the engine runs in the "
            "trainer's process, with no server to health-check or restart"
        )
    if engine == "embedded" and config.get("miles_router_timeout") is not None:
        notes.append(
            f"{_shown(config, 'miles_router_timeout')}: no effect with --rollout-engine embedded (it bounds "
            "the requests of --rollout-engine http and sglang)"
        )
    return notes
