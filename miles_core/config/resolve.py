"""From a command line to a resolved, validated :class:`Config`.

Order: parse the command line; apply ``--custom-config-path``; fill defaults; resolve
``auto`` values from the machine, the model family and its defaults, the batch knobs,
the selected components and dotted-path flags; check the reference's rules; run each
plugin's validation hook. Nothing heavy is imported: families are matched from the
checkpoint's JSON files and name (:mod:`miles_core.family_match`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from miles_core.config.availability import conflicting_flags, hardware_notes, inert_notes, unavailable_errors
from miles_core.config.compile_rules import compile_errors
from miles_core.config.config_file import load_config_file
from miles_core.config.distributed_post import distributed_post_errors
from miles_core.config.document import SECRET_FLAGS
from miles_core.config.fsdp_offload import fsdp_offload_errors
from miles_core.config.model import Component, Config, Source
from miles_core.config.parser import flag_entries, parse_command_line
from miles_core.config.sequence_parallel import sequence_parallel_errors
from miles_core.config.sync_path import run_sync_path
from miles_core.errors import ComponentLoadError, ConfigError, FamilyMatchError, PathFlagError
from miles_core.family_match import checkpoint_problem, default_guidance_scale, default_lora_targets, match_family
from miles_core.machine import visible_gpu_count
from miles_core.plugin_manager import PluginHost, get_host
from miles_core.refs import resolve_path_flag
from miles_core.specs import FAMILY_GENERATION_OPTIONS


def resolve_config(
    argv: Sequence[str],
    *,
    host: PluginHost | None = None,
    prog: str = "miles-core config",
    scope: str = "train",
    extend: Callable[[Any], Sequence[str]] | None = None,
) -> Config:
    """Parse, resolve and validate; raise :class:`ConfigError` listing every violation.

    ``scope="reward"`` resolves only what scoring needs (``miles-core score``): the
    reward flags and their plugins' checks, with no checkpoint, batch or step rules.
    ``extend`` adds a command's own arguments to the parser (see
    :func:`~miles_core.config.parser.parse_command_line`); their values land in
    ``config.command_arguments``.

    A malformed command line (unknown flag, value of the wrong type) exits with status
    2 from the parser itself.
    """
    host = host or get_host()
    entries = flag_entries(host.flags)
    typed, sglang_args = parse_command_line(argv, entries, host.registries, prog, extend)
    config = Config(entries)
    config.sglang_args = sglang_args
    config.command_arguments = typed.pop("__command__", {})
    for dest, entry in entries.items():
        flag = entry.flag
        default = flag.default
        if isinstance(default, (dict, list)):
            default = type(default)(default)  # never share a mutable default
        config.set(dest, "auto" if flag.auto else default, Source.DEFAULT)
    for dest, value in typed.items():
        config.set(dest, value, Source.COMMAND_LINE)
    if config.custom_config_path:
        for dest, value in load_config_file(config.custom_config_path, entries).items():
            if config.source(dest) is Source.COMMAND_LINE and config.get(dest) != value:
                was, now = ("<redacted>", "<redacted>") if dest in SECRET_FLAGS else (repr(config.get(dest)), repr(value))
                config.notes.append(
                    f"{config.custom_config_path}: key {dest!r} overrides {entries[dest].flag.name} {was} from the command line with {now}"
                )
            config.set(dest, value, Source.CONFIG_FILE)
    _Resolver(config, host).run(scope)
    return config


class _Resolver:
    def __init__(self, config: Config, host: PluginHost) -> None:
        self.config = config
        self.host = host
        self.errors: list[str] = []
        self.out_of_range: set[str] = set()
        """Dests whose value is outside the flag's declared range (already reported)."""

    def v(self, dest: str) -> Any:
        return self.config.get(dest)

    def trains_on(self) -> str | None:
        """What ``--loss-type`` trains on (:data:`~miles_core.specs.TRAINING_DATA`); None
        for a loss no plugin registered (reported on its own)."""
        spec = registry_spec(self.host, "loss", self.v("loss_type"))
        return spec.trains_on if spec is not None else None

    def name(self, dest: str) -> str:
        return self.config.flag(dest).name

    def fail(self, message: str) -> None:
        self.errors.append(message)

    def run(self, scope: str = "train") -> None:
        self.resolve_aliases()
        self.check_declared_ranges()
        self.resolve_machine()
        self.resolve_registry_choices()
        if scope == "train":
            self.resolve_family()
            self.resolve_batch()
        self.resolve_components()
        self.check_rewards()
        self.resolve_reward_workers()
        if scope == "train":
            self.resolve_debug()
            self.check_rules()
            self.resolve_offload()
            self.check_ranges()
            self.check_step_selection()
            self.check_guard()
            self.errors.extend(conflicting_flags(self.config))
        if self.errors:
            raise ConfigError(self.errors)
        self.mirror_aliases()
        self.config.freeze()
        self.config.notes.extend(hardware_notes(self.config) + inert_notes(self.config, self.trains_on()))
        plugin_errors = self.host.validate(self.config)
        if plugin_errors:
            raise ConfigError(plugin_errors)

    # -- aliases ---------------------------------------------------------------------

    def resolve_aliases(self) -> None:
        """A value given to an alias flag (:attr:`~miles_core.config.flag.Flag.alias_of`)
        sets the flag it names, which then reports it under the alias's name; both given
        with different values is an error naming both."""
        c = self.config
        for dest in c:
            alias = c.flag(dest)
            if alias.alias_of is None or not c.is_user_set(dest) or c.get(dest) is None or alias.range_error(c.get(dest)):
                continue  # (a value outside the alias's range is reported by check_declared_ranges)
            target = alias.alias_of[2:].replace("-", "_")
            if c.is_user_set(target):
                if c.get(target) != c.get(dest):
                    self.fail(
                        f"{alias.name} {c.get(dest)} and {alias.alias_of} {c.get(target)} disagree: {alias.name} is "
                        f"another name for {alias.alias_of}; give one of them"
                    )
                continue
            c.set(target, c.get(dest), c.source(dest))
            c.given_as[target] = alias.name

    def mirror_aliases(self) -> None:
        """An alias not given holds the resolved value of the flag it names."""
        c = self.config
        for dest in c:
            alias = c.flag(dest).alias_of
            if alias is not None and not c.is_user_set(dest):
                c.set(dest, c.get(alias[2:].replace("-", "_")), Source.DERIVED)

    # -- machine ---------------------------------------------------------------------

    def resolve_machine(self) -> None:
        c = self.config
        machine_errors = len(self.errors)
        gpus = visible_gpu_count()
        for dest in ("actor_num_gpus_per_node", "num_gpus_per_node"):
            value = self.v(dest)
            if value == "auto":
                c.set(dest, max(gpus, 1), Source.MACHINE)
            else:
                try:
                    count = int(value)
                except (TypeError, ValueError):
                    self.fail(f"{self.name(dest)} {value}: expected a positive integer or auto")
                    continue
                if count < 1:
                    self.fail(f"{self.name(dest)} {value}: must be at least 1")
                c.set(dest, count, c.source(dest))
        auto_values = {
            "distributed_backend": "nccl" if gpus else "gloo",
            "diffusion_forward_dtype": "bf16" if gpus else "fp32",
            "diffusion_generator_device": "cpu",
        }
        for dest, value in auto_values.items():
            if self.v(dest) == "auto":
                c.set(dest, value, Source.MACHINE)
        if self.v("diffusion_generator_device") == "cuda" and not gpus and self.v("rollout_engine") != "http":
            # cuda draws on the model's device; without a GPU that would silently be the CPU.
            # (An http engine's servers, started by hand elsewhere, draw it on theirs.)
            self.fail(
                "--diffusion-generator-device cuda: no NVIDIA GPU is visible here (the noise is drawn on the "
                "model's GPU); use cpu (or auto)"
            )
        if len(self.errors) == machine_errors and "actor_num_nodes" not in self.out_of_range:
            world = self.v("actor_num_nodes") * self.v("actor_num_gpus_per_node")
            sp = self.v("sequence_parallel_size")
            c.world_size = world
            if "sequence_parallel_size" in self.out_of_range:
                return
            if world % sp:
                self.fail(
                    f"--sequence-parallel-size {sp} must divide the train world size {world} "
                    "(--actor-num-nodes x --actor-num-gpus-per-node): it splits each sample over that many training ranks"
                )
            else:
                c.data_parallel_size = world // sp
            if "dp_replicate_size" not in self.out_of_range and c.data_parallel_size % self.v("dp_replicate_size"):
                self.fail(f"--dp-replicate-size {self.v('dp_replicate_size')} must divide the data-parallel size {c.data_parallel_size}")

    # -- registries ------------------------------------------------------------------

    def resolve_registry_choices(self) -> None:
        for dest in self.config:
            flag = self.config.flag(dest)
            value = self.v(dest)
            if flag.registry and value is not None and value not in self.host.registries[flag.registry]:
                self.fail(self.host.registries[flag.registry].unknown_message(value, flag=flag.name))

    # -- model family ----------------------------------------------------------------

    def resolve_family(self) -> None:
        c = self.config
        checkpoint = self.v("hf_checkpoint")
        family_name = self.v("diffusion_model_family")
        custom = self.v("train_pipeline_config_path")
        registry = self.host.registries.model_family
        if not checkpoint:
            self.fail("--hf-checkpoint is required: the diffusers pipeline to train (hub id or local directory)")
        if custom and family_name:
            self.fail("--train-pipeline-config-path and --diffusion-model-family are mutually exclusive")
            return
        spec = None
        if custom:
            c.model_family = None
            spec = self.base_family_spec(custom)
        elif family_name:
            if family_name not in registry:
                return  # already reported by resolve_registry_choices
            spec = registry.get(family_name).spec
        elif checkpoint:
            try:
                spec = match_family(checkpoint, registry).spec
            except FamilyMatchError as exc:
                self.fail(str(exc))
                return
            c.set("diffusion_model_family", spec.name, Source.DERIVED)
        if spec is not None and not custom:
            c.model_family = spec.name
            c.components["model_family"] = Component.from_registration(registry.get(spec.name))
        self.resolve_family_defaults(spec)

    def base_family_spec(self, path: str) -> Any:
        """The registered family a ``--train-pipeline-config-path`` class derives from,
        whose recipe defaults then apply; None for a class of its own (or a bad path,
        which :meth:`resolve_components` reports)."""
        try:
            custom_cls = resolve_path_flag("--train-pipeline-config-path", path, "model_family")
        except PathFlagError:
            return None
        for registration in self.host.registries.model_family:
            try:
                if issubclass(custom_cls, registration.load()):
                    return registration.spec
            except ComponentLoadError:
                continue
        self.config.notes.append(
            f"--train-pipeline-config-path {path}: derives from no registered family, so no family recipe defaults "
            "apply (microgroup size 1, --diffusion-sde-type sde, no default LoRA targets)"
        )
        return None

    def resolve_family_defaults(self, spec: Any) -> None:
        c = self.config
        n = self.v("n_samples_per_prompt")
        if self.v("rollout_microgroup_size") is None:
            recipe = spec.rollout_microgroup_size if spec else 1
            c.set("rollout_microgroup_size", max(1, min(recipe, n or 1)), Source.FAMILY if spec else Source.DERIVED)
        elif spec is not None and spec.max_microgroup_size is not None and self.v("rollout_microgroup_size") > spec.max_microgroup_size:
            self.fail(
                f"--rollout-microgroup-size {self.v('rollout_microgroup_size')}: the {spec.name} family supports at "
                f"most {spec.max_microgroup_size} output(s) per request (its forward packs one sample)"
            )
        if self.v("diffusion_sde_type") is None:
            c.set("diffusion_sde_type", spec.default_sde_type if spec else "sde", Source.FAMILY if spec else Source.DERIVED)
        if spec is None:
            return
        guidance = default_guidance_scale(spec, self.v("hf_checkpoint") or "")
        if guidance is None and not spec.supports_cfg_training:
            guidance = 1.0  # the flag's default samples with CFG, which such a family refuses to train on
        if guidance is not None and not c.is_user_set("diffusion_guidance_scale"):
            c.set("diffusion_guidance_scale", float(guidance), Source.FAMILY)
        for option, flag_name in FAMILY_GENERATION_OPTIONS.items():
            dest = flag_name[2:].replace("-", "_")
            default = self.config.flag(dest).default
            if option not in spec.generation_options and self.v(dest) not in (None, default):
                self.fail(
                    f"{flag_name} {self.v(dest)}: the {spec.name} family does not read it "
                    f"(it reads {', '.join(FAMILY_GENERATION_OPTIONS[o] for o in spec.generation_options) or 'none of the family-specific generation flags'})"
                )
        if self.v("lora_target_modules") is None:
            try:
                c.set("lora_target_modules", list(default_lora_targets(spec, self.v("hf_checkpoint") or "")), Source.FAMILY)
            except FamilyMatchError as exc:
                self.fail(str(exc))
        if not c.is_user_set("update_weight_target_module"):
            # The family's trainable components (Wan 2.2: both experts), unless the user
            # names the modules to train.
            c.set("update_weight_target_module", ",".join(spec.trainable_components), Source.FAMILY)
        elif not self.v("train_pipeline_config_path"):  # a class of one's own declares its own components
            self.check_update_targets(spec)
        if self.v("diffusion_height") is None or self.v("diffusion_width") is None:
            checkpoint = self.v("hf_checkpoint")
            if checkpoint and Path(checkpoint).is_dir():
                try:
                    family_cls = self.host.registries.model_family.get(spec.name).load()
                    size = family_cls.native_size(checkpoint)
                except (ComponentLoadError, OSError, ValueError) as exc:
                    self.fail(f"--hf-checkpoint {checkpoint}: cannot read the {spec.name} pipeline's native size: {exc}")
                    return
                if size is not None:
                    for dest, value in zip(("diffusion_height", "diffusion_width"), size):
                        if self.v(dest) is None:
                            c.set(dest, int(value), Source.FAMILY)

    def check_update_targets(self, spec: Any) -> None:
        """``--update-weight-target-module`` names modules the family trains (its spec's
        ``trainable_components``, which a matched checkpoint holds), at least one."""
        value = self.v("update_weight_target_module")
        names = [name.strip() for name in str(value).split(",") if name.strip()]
        unknown = [name for name in names if name not in spec.trainable_components]
        modules = ", ".join(spec.trainable_components)
        if not names:
            self.fail(f"--update-weight-target-module {value!r}: names no module to train (the {spec.name} family's: {modules})")
        elif unknown:
            self.fail(
                f"--update-weight-target-module {value}: {', '.join(unknown)} "
                f"{'is not a trainable module' if len(unknown) == 1 else 'are not trainable modules'} of the {spec.name} "
                f"family's checkpoint (its trainable modules: {modules})"
            )

    # -- batch knobs -----------------------------------------------------------------

    def resolve_batch(self) -> None:
        c = self.config
        rbs = self.v("rollout_batch_size")
        n = self.v("n_samples_per_prompt")
        if rbs is None:
            self.fail("--rollout-batch-size is required: prompts per rollout")
            return
        if n is None or {"rollout_batch_size", "n_samples_per_prompt"} & self.out_of_range:
            return  # reported by check_declared_ranges
        total = rbs * n
        gbs, steps = self.v("global_batch_size"), self.v("num_steps_per_rollout")
        rule = f"rollout_batch_size x n_samples_per_prompt = global_batch_size x num_steps_per_rollout ({rbs} x {n} = {total})"
        if gbs is not None and steps is not None:
            if gbs * steps != total:
                self.fail(
                    f"--global-batch-size {gbs} and --num-steps-per-rollout {steps} contradict {rule}: {gbs} x {steps} = {gbs * steps}"
                )
                return
        elif gbs is not None:
            if "global_batch_size" in self.out_of_range:
                return
            if total % gbs:
                self.fail(f"--global-batch-size {gbs} must divide {rbs} x {n} = {total} samples per rollout ({rule})")
                return
            c.set("num_steps_per_rollout", total // gbs, Source.DERIVED)
        else:
            steps = 1 if steps is None else steps
            if "num_steps_per_rollout" in self.out_of_range:
                return
            if total % steps:
                self.fail(f"--num-steps-per-rollout {steps} must divide {rbs} x {n} = {total} samples per rollout ({rule})")
                return
            if self.v("num_steps_per_rollout") is None:
                c.set("num_steps_per_rollout", steps, Source.DERIVED)
            c.set("global_batch_size", total // steps, Source.DERIVED)
        gbs = self.v("global_batch_size")
        dp = c.data_parallel_size
        if gbs % dp:
            self.fail(f"--global-batch-size {gbs} must be divisible by the data-parallel size {dp}")
        microgroup = self.v("rollout_microgroup_size")
        if microgroup is not None and microgroup > n:
            self.fail(
                f"--rollout-microgroup-size {microgroup} exceeds --n-samples-per-prompt {n}: a microgroup is part of one prompt's group"
            )
        mbs_sample, mbs_tstep = self.v("micro_batch_size_sample"), self.v("micro_batch_size_tstep")
        if (mbs_sample is None) != (mbs_tstep is None):
            self.fail("--micro-batch-size-sample and --micro-batch-size-tstep must be set together (a 2-D sample x tstep tile)")
        elif mbs_sample is not None:
            if not {"micro_batch_size_sample", "micro_batch_size_tstep"} & self.out_of_range:
                c.set("micro_batch_size", mbs_sample * mbs_tstep, Source.DERIVED)
        over = self.v("over_sampling_batch_size")
        if over is not None and over != rbs:
            self.fail(f"--over-sampling-batch-size {over} must equal --rollout-batch-size {rbs}")

    # -- components and dotted paths ---------------------------------------------------

    def resolve_components(self) -> None:
        c = self.config
        registries = self.host.registries
        for kind, dest in (
            ("loss", "loss_type"),
            ("sde_backend", "diffusion_sde_type"),
            ("reward", "rm_type"),
            ("rollout_engine", "rollout_engine"),
        ):
            name = self.v(dest)
            if name is not None and name in registries[kind]:
                c.components[kind] = Component.from_registration(registries[kind].get(name))
        for dest in c:
            flag = c.flag(dest)
            value = self.v(dest)
            if flag.path_kind is None or value is None:
                continue
            if dest == "diffusion_step_strategy_path" and value in registries["step_strategy"]:
                # A registered strategy's name (a plugin's, e.g. mixgrpo) rather than a path.
                c.components["step_strategy"] = Component.from_registration(registries["step_strategy"].get(value))
                continue
            try:
                resolve_path_flag(flag.name, value, flag.path_kind)
            except PathFlagError as exc:
                self.fail(str(exc))
                continue
            slot = {
                "sde_step_backend_path": "sde_backend",
                "custom_loss_function_path": "loss",
                "custom_rm_path": "reward",
                "train_pipeline_config_path": "model_family",
                "diffusion_step_strategy_path": "step_strategy",
            }.get(dest)
            if slot:
                c.components[slot] = Component(slot, value, f"{flag.name} {value}")
        if self.v("loss_type") == "custom_loss" and self.v("custom_loss_function_path") is None:
            self.fail("--loss-type custom_loss requires --custom-loss-function-path")
        if self.v("custom_loss_function_path") is not None and self.v("loss_type") != "custom_loss":
            self.fail("--custom-loss-function-path is used only with --loss-type custom_loss")

    def check_rewards(self) -> None:
        """The reward mixtures (``--reward-weights``, ``--eval-reward-weights``): known
        names, finite weights, not combined with a single reward; and
        ``--reward-aggregation advantage``, which needs a mixture and the built-in
        normalisation."""
        import math

        from miles_core.config.model import Component

        v, registry = self.v, self.host.registries.reward
        for dest, alone in (("reward_weights", ("rm_type", "custom_rm_path")), ("eval_reward_weights", ("eval_rm_type",))):
            weights, flag = v(dest), self.name(dest)
            if weights is None:
                continue
            if not weights:
                self.fail(f"{flag} {{}}: name at least one registered reward and its weight")
                continue
            for other in alone:
                if v(other) is not None:
                    self.fail(f"{flag} and {self.name(other)} are mutually exclusive (the mixture is the reward)")
            for reward, weight in weights.items():
                if reward not in registry:
                    self.fail(registry.unknown_message(reward, flag=flag))
                if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
                    self.fail(f"{flag}: the weight of {reward} is {weight!r}; weights must be finite numbers")
            if dest == "reward_weights" and all(name in registry for name in weights):
                providers = sorted({str(registry.get(name).plugin) for name in weights})
                label = " + ".join(f"{w:g}*{n}" if isinstance(w, (int, float)) else f"{w!r}*{n}" for n, w in weights.items())
                self.config.components["reward"] = Component("reward", label, ", ".join(providers))
        if v("reward_aggregation") == "advantage":
            if v("reward_weights") is None:
                self.fail(
                    "--reward-aggregation advantage requires --reward-weights (it normalises each reward of the mixture within its group)"
                )
            if v("custom_reward_post_process_path") is not None:
                self.fail(
                    "--reward-aggregation advantage and --custom-reward-post-process-path are mutually "
                    "exclusive (the custom function replaces the normalisation)"
                )
        unused = [self.name(d) for d in ("eval_reward_key", "eval_rm_type", "eval_reward_weights") if v(d) is not None]
        if unused and v("eval_interval") is None:
            self.config.notes.append(
                f"{', '.join(unused)}: no evaluation runs without --eval-interval, so "
                f"{'they have' if len(unused) > 1 else 'it has'} no effect"
            )

    def resolve_reward_workers(self) -> None:
        """``--reward-num-gpus-per-worker`` unset: 1 when a reward the flags name runs a
        model (its spec's ``uses_gpu``), else 0. A colocated reward worker takes the
        reference's share of a rollout device instead, so a value given with
        ``--colocate-reward`` is refused."""
        c, v = self.config, self.v
        gpus = v("reward_num_gpus_per_worker")
        if gpus is None:
            registry = self.host.registries.reward
            named = [v("rm_type"), v("eval_rm_type"), *(v("reward_weights") or {}), *(v("eval_reward_weights") or {})]
            if v("eval_config"):  # a dataset's rm_type scores its rows
                from miles_core.config.eval_config import eval_config_rewards

                named += eval_config_rewards(self.config)
            model = any(isinstance(n, str) and n in registry and getattr(registry.get(n).spec, "uses_gpu", False) for n in named)
            c.set("reward_num_gpus_per_worker", 1.0 if model else 0.0, Source.DERIVED)
        elif v("colocate_reward"):
            self.fail(
                f"{c.given_name('reward_num_gpus_per_worker')} {gpus:g} and --colocate-reward cannot be combined: a colocated "
                "reward worker takes a 0.05 share of a rollout device (drop one of them)"
            )

    # -- debug dumps and replays -------------------------------------------------------

    def resolve_debug(self) -> None:
        """``--dump-details DIR`` fills the save templates not given; a replay
        (``--load-debug-rollout-data``) is a train-only run, as in the reference."""
        c = self.config
        details = self.v("dump_details")
        if details:
            for dest, sub in (("save_debug_rollout_data", "rollout_data"), ("save_debug_train_data", "train_data")):
                if self.v(dest) is None:
                    c.set(dest, str(Path(details) / sub / "{}.msgpack"), Source.DERIVED)
        for dest in ("save_debug_rollout_data", "load_debug_rollout_data", "save_debug_train_data"):
            template = self.v(dest)
            if template is None:
                continue
            try:
                paths = {template.format(i, rollout_id=i) for i in (0, 1)}
            except (IndexError, KeyError, ValueError) as exc:
                self.fail(f"{self.name(dest)} {template}: not a path template ({type(exc).__name__}: {exc}); use {{}} or {{rollout_id}}")
                continue
            if len(paths) == 1:
                self.fail(f"{self.name(dest)} {template}: the template needs {{}} or {{rollout_id}} for the rollout id")
        sft = self.trains_on() == "supervised_rows"
        if self.v("debug_rollout_only") and sft:
            self.fail(f"--debug-rollout-only: --loss-type {self.v('loss_type')} has no rollouts, only training on --prompt-data rows")
        if self.v("load_debug_rollout_data"):
            if sft:
                self.fail("--load-debug-rollout-data replays RL rollouts; --loss-type sft_loss trains on --prompt-data rows")
            elif self.v("debug_rollout_only"):
                self.fail("--load-debug-rollout-data replays saved rollouts for training; --debug-rollout-only does not train")
            elif not self.v("train_only"):
                c.set("train_only", True, Source.DERIVED)
        elif self.v("train_only") and not sft and not self.v("debug_rollout_only"):  # that one: check_rules
            self.fail("--train-only requires --load-debug-rollout-data (the saved rollouts to train on; no engine starts)")
        if self.v("train_only") and not sft and self.v("eval_interval") is not None:
            c.notes.append("--eval-interval is ignored under --train-only: no engine starts to evaluate with")

    # -- the reference's rules ----------------------------------------------------------

    def check_rules(self) -> None:
        v = self.v
        requires = [
            ("save_interval", "save", "--save-interval requires --save (where to write checkpoints)"),
            ("save_keep_last", "save", "--save-keep-last requires --save (the checkpoints it rotates)"),
            ("lora_ipc_weight_sync", "use_lora", "--lora-ipc-weight-sync requires --use-lora (it sends only lora_A/lora_B)"),
            ("colocate_reward", "colocate", "--colocate-reward requires --colocate"),
            ("ckpt_step", "load", "--ckpt-step requires --load"),
            (
                "prompt_embeddings_cache",
                "precompute_prompt_embeddings",
                "--prompt-embeddings-cache requires --precompute-prompt-embeddings (the cache it keeps)",
            ),
            (
                "load_debug_rollout_data_subsample",
                "load_debug_rollout_data",
                "--load-debug-rollout-data-subsample requires --load-debug-rollout-data",
            ),
        ]
        for dest, needed, message in requires:
            # "is": --ckpt-step 0 is a step (0 == False would let it pass without --load).
            if v(dest) is not None and v(dest) is not False and v(needed) in (None, False):
                self.fail(message)
        if v("precompute_prompt_embeddings"):
            family = registry_spec(self.host, "model_family", self.config.model_family)
            trained = [c for c in getattr(family, "trainable_components", ()) if c.startswith("text_encoder")]
            if trained:
                self.fail(
                    f"--precompute-prompt-embeddings: the family trains {', '.join(trained)}, so encodings computed "
                    "once would go stale; drop the flag"
                )
        if v("ray_address") and not v("use_ray"):
            self.config.set("use_ray", True, Source.DERIVED)  # a cluster address means running on it
        self.errors.extend(distributed_post_errors(self.config))
        if v("eval_interval") is not None and not (v("eval_prompt_data") or v("eval_config")):
            self.fail("--eval-interval requires an evaluation dataset (--eval-prompt-data NAME PATH or --eval-config FILE)")
        if v("eval_config"):
            from miles_core.config.eval_config import eval_config_problems

            self.errors.extend(eval_config_problems(self.config, self.host.registries.reward))
            if v("eval_prompt_data"):
                self.config.notes.append(
                    f"--eval-prompt-data is ignored: --eval-config {v('eval_config')} names the eval datasets (it overrides --eval-prompt-data)"
                )
        if v("eval_prompt_data") and len(v("eval_prompt_data")) % 2:
            self.fail("--eval-prompt-data takes NAME PATH pairs, got an odd number of values")
        if v("train_only") and v("debug_rollout_only"):
            self.fail("--train-only and --debug-rollout-only are mutually exclusive")
        loss = registry_spec(self.host, "loss", v("loss_type"))
        if v("diffusion_recompute_old_log_prob") and not (loss is not None and loss.needs_sde_steps):
            self.fail("--diffusion-recompute-old-log-prob applies to --loss-type policy_loss only (losses whose spec needs SDE steps)")
        if v("use_ema") and v("ref_mode") != "ema" and v("ema_rollout_policy") != "ema" and not (loss is not None and loss.keeps_ema):
            self.fail("--use-ema needs a consumer: --ref-mode ema, --ema-rollout-policy ema, or --loss-type nft")
        if v("ema_rollout_policy") == "ema" and not v("use_ema"):
            self.fail("--ema-rollout-policy ema requires --use-ema")
        if v("ref_mode") == "lora_base" and not v("use_lora"):
            self.fail("--ref-mode lora_base requires --use-lora (the reference is the model with LoRA disabled)")
        if "sequence_parallel_size" not in self.out_of_range and self.config.world_size % v("sequence_parallel_size") == 0:
            family = registry_spec(self.host, "model_family", self.config.model_family)
            self.errors.extend(sequence_parallel_errors(self.config, family, visible_gpu_count()))
        self.errors.extend(fsdp_offload_errors(self.config))
        self.errors.extend(compile_errors(self.config, gpus=visible_gpu_count()))
        if v("lr_warmup_iters") and v("lr_warmup_fraction") is not None:
            self.fail("--lr-warmup-iters and --lr-warmup-fraction are mutually exclusive")
        if v("lr_decay_style") == "wsd" and v("lr_wsd_decay_iters") is None:
            self.fail("--lr-decay-style wsd requires --lr-wsd-decay-iters")
        self.check_schedule_ci_env_rules()
        urls = v("rollout_engine_urls")
        engines = v("rollout_num_engines")
        if engines is not None and v("rollout_engine") != "sglang" and (v("rollout_engine") != "http" or urls):
            self.fail(
                "--rollout-num-engines starts engine servers for --rollout-engine http without --rollout-engine-urls; drop one of them"
            )
        if v("rollout_engine") == "http" and not urls and engines is None:
            self.fail(
                "--rollout-engine http requires --rollout-engine-urls (base URLs of running engine servers)"
                " or --rollout-num-engines N (servers the run starts)"
            )
        per_engine = v("rollout_num_gpus_per_engine")
        serve_engines = v("rollout_engine") == "embedded" or (v("rollout_engine") == "http" and not urls)
        if v("use_ray") and per_engine is not None and per_engine > 1 and serve_engines:
            # Our server runs one model replica on one device; sglang-diffusion splits one over several.
            self.fail(
                f"--rollout-num-gpus-per-engine {per_engine} and --rollout-engine {v('rollout_engine')}: a miles-core "
                "serve-engine server runs on one device; use more engines (--rollout-num-engines) or --rollout-engine sglang"
            )
        for url in (urls or "").split(","):
            if urls and not (url.startswith(("http://", "https://")) and len(url.split("://", 1)[1]) > 0):
                self.fail(f"--rollout-engine-urls: {url!r} is not an http:// or https:// base URL")
        if v("api_key") is not None and v("api_key_file") is not None:
            self.fail("--api-key and --api-key-file are mutually exclusive: give the key one way")
        keys = " and ".join(flag for flag, dest in (("--api-key", "api_key"), ("--api-key-file", "api_key_file")) if v(dest) is not None)
        if keys and not urls:
            self.fail(
                f"{keys}: the key of engine servers started by hand goes with --rollout-engine-urls; the servers a run starts "
                "get a fresh secret of the run"
            )
        if v("use_miles_router") and (v("rollout_engine") != "http" or urls or engines is None):
            self.fail(
                "--use-miles-router routes the engine servers the run starts: it needs --rollout-engine http "
                f"--rollout-num-engines N, not --rollout-engine {v('rollout_engine')}" + (" --rollout-engine-urls" if urls else "")
            )
        if v("num_rollout") is not None and v("num_epoch") is not None:
            self.config.notes.append("--num-epoch is ignored because --num-rollout is set (as in the reference)")
        try:  # the path a sync takes is chosen again when it runs (the same pure function)
            run_sync_path(self.config, cuda=visible_gpu_count() > 0)
        except ConfigError as exc:
            self.fail(str(exc))
        self.check_run_hooks()

    def resolve_offload(self) -> None:
        """``--offload`` turns on ``--offload-train`` and ``--offload-rollout``; so does
        ``--colocate``, whose trainer and engines share devices and take turns. Unset, each
        resolves to True or False; turned off against either, it is an error. The engine
        must be able to release its memory (:attr:`RolloutEngineSpec.releases_memory`)."""
        c, v = self.config, self.v
        why = {
            "offload": "--offload turns on --offload-train and --offload-rollout",
            "colocate": "colocated trainer and engines share the devices and take turns",
        }
        for dest in ("offload_train", "offload_rollout"):
            if v(dest) is None:
                c.set(dest, bool(v("offload") or v("colocate")), Source.DERIVED)
                continue
            for on in ("offload", "colocate"):
                if v(on) and v(dest) is False:
                    self.fail(f"--{on} and --no-{self.name(dest)[2:]} cannot be combined: {why[on]}; drop one of them")
        generates = not (self.trains_on() == "supervised_rows" or v("train_only") or v("load_debug_rollout_data"))
        turned_on = [self.name(d) for d in ("offload", "offload_train", "offload_rollout") if c.is_user_set(d) and v(d)]
        if turned_on and not generates:
            what = (
                f"--loss-type {v('loss_type')} trains on --prompt-data rows"
                if self.trains_on() == "supervised_rows"
                else "replayed rollouts train"
            )
            c.notes.append(
                f"{', '.join(turned_on)}: {what} with no rollout engine, so the trainer has no turns to take and "
                f"{'they have' if len(turned_on) > 1 else 'it has'} no effect"
            )
        engine = registry_spec(self.host, "rollout_engine", v("rollout_engine"))
        if v("offload_rollout") and generates and engine is not None and not engine.releases_memory:
            cause = next(
                (self.name(d) for d in ("offload_rollout", "offload", "colocate") if c.is_user_set(d) and v(d)), "--offload-rollout"
            )
            self.fail(
                f"{cause} and --rollout-engine {v('rollout_engine')} cannot be combined: that engine cannot release its "
                "memory while the trainer trains (its RolloutEngineSpec does not declare releases_memory)"
            )

    def check_run_hooks(self) -> None:
        """The rollout, data and logging hooks of docs/customization.md: the signature each
        is called with, and when they apply."""
        v = self.v
        kinds = {
            "rollout_function_path": "rollout_function",
            "eval_function_path": "eval_function",
            "custom_generate_function_path": "generate_function",
            "data_source_path": "data_source",
            "custom_rollout_log_function_path": "log_function",
            "custom_eval_rollout_log_function_path": "log_function",
            "model_backend_path": "model_backend",
        }
        for dest, kind in kinds.items():
            flag = self.name(dest)
            if v(dest) is None or any(e.startswith(f"{flag} ") for e in self.errors):  # not importable: reported
                continue
            try:
                resolve_path_flag(flag, v(dest), kind)
            except PathFlagError as exc:
                self.fail(str(exc))
        rollout_fn, evaluates = v("rollout_function_path"), v("eval_interval") is not None
        if (
            rollout_fn
            and evaluates
            and v("eval_function_path") is None
            and not any(e.startswith("--rollout-function-path ") for e in self.errors)
        ):
            try:
                resolve_path_flag("--rollout-function-path", rollout_fn, "eval_function")
            except PathFlagError:
                self.fail(
                    f"--rollout-function-path {rollout_fn}: it also runs the evaluations (no --eval-function-path), "
                    "so it must accept the keyword argument evaluation (True for an evaluation)"
                )
        prompts_from = v("data_source_path") or rollout_fn
        if v("disable_rollout_global_dataset"):
            if not prompts_from:
                self.fail(
                    "--disable-rollout-global-dataset: nothing would supply the prompts; give --data-source-path "
                    "(a prompt source) or --rollout-function-path (a rollout that finds its own prompts)"
                )
            if v("num_rollout") is None:
                self.fail("--disable-rollout-global-dataset requires --num-rollout (--num-epoch counts passes over --prompt-data)")
            if v("prompt_data"):
                self.config.notes.append("--prompt-data is not loaded under --disable-rollout-global-dataset")
        generation = (
            "rollout_function_path",
            "eval_function_path",
            "custom_generate_function_path",
            "data_source_path",
            "disable_rollout_global_dataset",
        )
        logging = ("custom_rollout_log_function_path", "custom_eval_rollout_log_function_path")
        given = [self.name(dest) for dest in (*generation, *logging) if v(dest) not in (None, False)]
        if given and self.trains_on() == "supervised_rows":
            self.fail(f"{', '.join(given)}: RL rollout hooks; --loss-type sft_loss trains on --prompt-data rows with no rollout")
        given = [self.name(dest) for dest in generation if v(dest) not in (None, False)]
        if given and v("load_debug_rollout_data"):  # (the log functions still see the replayed rollouts)
            self.config.notes.append(f"{', '.join(given)}: ignored under --load-debug-rollout-data (no rollout is generated)")
        for dest in ("eval_function_path", "custom_eval_rollout_log_function_path"):
            if v(dest) is not None and not evaluates:
                self.config.notes.append(f"{self.name(dest)}: never called without --eval-interval (no evaluation runs)")

    def check_schedule_ci_env_rules(self) -> None:
        """Flow shifts, SFT encoders, the LR schedule on resume, the CI metric check and
        the training environment."""
        from miles_core.config.train_env import train_env_vars_errors

        v = self.v
        sft = self.trains_on() == "supervised_rows"
        if v("fsdp_flow_shift") is not None and not sft:
            self.fail(
                "--fsdp-flow-shift applies to --loss-type sft_loss only: RL losses train on the sigmas the "
                "engine recorded (shape those with --diffusion-flow-shift)"
            )
        if v("diffusion_flow_shift") is not None and sft:
            self.fail(
                "--diffusion-flow-shift shapes the rollout engine's schedule and --loss-type sft_loss runs no "
                "engine: use --fsdp-flow-shift for the SFT sigma grid"
            )
        if v("sft_encoder_checkpoint") and not sft:
            self.fail("--sft-encoder-checkpoint requires --loss-type sft_loss (rollouts encode with --hf-checkpoint's encoders)")
        if sft:
            keys = {dest: v(dest) for dest in ("input_key", "sft_image_key", "sft_video_key", "sft_audio_key")}
            for value in sorted({k for k in keys.values() if list(keys.values()).count(k) > 1}):
                same = [self.name(dest) for dest, key in keys.items() if key == value]
                which = "both" if len(same) == 2 else "all"
                self.fail(
                    f"{', '.join(same)}: an SFT row keeps its prompt, image, video and audio under different keys ({which} are {value!r})"
                )
        if v("override_lr_scheduler") and v("use_checkpoint_lr_scheduler") and self.config.source("use_checkpoint_lr_scheduler").user_set:
            self.fail(
                "--override-lr-scheduler and --use-checkpoint-lr-scheduler are mutually exclusive "
                "(the command line's learning-rate schedule or the checkpoint's)"
            )
        key, threshold = v("ci_metric_checker_key"), v("ci_metric_checker_threshold")
        if v("ci_test") and (key is None or threshold is None):
            self.fail("--ci-test requires --ci-metric-checker-key and --ci-metric-checker-threshold (the metric the run must reach)")
        elif not v("ci_test") and (key is not None or threshold is not None):
            self.fail("--ci-metric-checker-key and --ci-metric-checker-threshold require --ci-test")
        for message in train_env_vars_errors(v("train_env_vars") or {}):
            self.fail(message)

    def check_guard(self) -> None:
        """The reward-hacking guard's flags: ``--guard-thresholds`` items, and guard flags
        that would do nothing (without evaluations, or with ``--no-guard``) are errors."""
        from miles_core.config.guard_flags import parse_thresholds

        try:
            parse_thresholds(self.v("guard_thresholds"))
        except ConfigError as exc:
            self.fail(str(exc))
        dests = ("guard_threshold", "guard_thresholds", "guard_kl_max", "guard_rm_type", "guard_stop_on_alarm")
        given = [self.name(d) for d in dests if self.config.source(d).user_set]
        if not given:
            return
        if self.v("no_guard"):
            self.fail(f"--no-guard and {', '.join(given)} are mutually exclusive (the guard is off)")
        elif self.v("eval_interval") is None:
            self.fail(f"{', '.join(given)}: the guard checks evaluations; set --eval-interval and --eval-prompt-data")

    def check_declared_ranges(self) -> None:
        """Every flag's value (from the command line, the YAML file or a default) against
        the range its record declares (:attr:`~miles_core.config.flag.Flag.range`), one
        line per flag outside it, whatever other flags are given."""
        for dest in self.config:
            message = self.config.flag(dest).range_error(self.v(dest))
            if message is not None:
                self.out_of_range.add(dest)
                self.fail(message)

    def check_ranges(self) -> None:
        """Ranges that depend on another flag (each flag's own range is declared)."""
        window = self.v("diffusion_sde_window_range")
        steps = self.v("diffusion_num_steps")
        if window is None or steps is None or {"diffusion_sde_window_range", "diffusion_num_steps"} & self.out_of_range:
            return
        # hi may be T (the reference's default window [0, T)): the last step then stays the
        # deterministic step of the window (step_strategies.sde_window).
        if not 0 <= window[0] < window[1] <= steps:
            self.fail(
                f"--diffusion-sde-window-range {window[0]},{window[1]}: need 0 <= lo < hi <= --diffusion-num-steps "
                f"{steps} (a window reaching the last step runs it deterministically)"
            )
        elif window[0] == steps - 1:
            self.fail(
                f"--diffusion-sde-window-range {window[0]},{window[1]}: the window holds only the last step "
                f"(--diffusion-num-steps {steps} - 1), which is never an SDE step: nothing would be trained"
            )

    def check_step_selection(self) -> None:
        """The step flags against the schedule: the last step (sigma' = 0) is never an SDE
        step, so at most ``T - 1`` steps can be, and a window or candidate list must hold
        ``--diffusion-num-sde-steps`` of them (a window reaching the last step holds it as
        its deterministic step). The window's bounds are checked in :meth:`check_ranges`."""
        steps, n = self.v("diffusion_num_steps"), self.v("diffusion_num_sde_steps")
        if steps is None or n is None or {"diffusion_num_steps", "diffusion_num_sde_steps"} & self.out_of_range:
            return  # already reported by check_declared_ranges
        if n > steps - 1:
            self.fail(f"--diffusion-num-sde-steps {n} exceeds --diffusion-num-steps {steps} - 1 (the last step is never an SDE step)")
            return  # no window or candidate list can hold that many
        window = self.v("diffusion_sde_window_range")
        if window is not None and 0 <= window[0] < window[1] <= steps and window[1] - window[0] < n:
            self.fail(
                f"--diffusion-sde-window-range {window[0]},{window[1]}: the window holds {window[1] - window[0]} "
                f"step(s), fewer than --diffusion-num-sde-steps {n}"
            )
        candidates = self.v("diffusion_sde_candidate_steps")
        if candidates is not None and "diffusion_sde_candidate_steps" not in self.out_of_range:
            outside = [k for k in candidates if not 0 <= k < steps - 1]
            if outside:
                self.fail(
                    f"--diffusion-sde-candidate-steps {','.join(map(str, outside))}: need 0 <= step < "
                    f"--diffusion-num-steps {steps} - 1 (the last step is never an SDE step)"
                )
            elif len(set(candidates)) != len(candidates):
                self.fail(f"--diffusion-sde-candidate-steps {','.join(map(str, candidates))}: a step is repeated")
            elif len(candidates) < n:
                self.fail(
                    f"--diffusion-sde-candidate-steps {','.join(map(str, candidates))}: {len(candidates)} step(s), "
                    f"fewer than --diffusion-num-sde-steps {n}"
                )


def training_errors(config: Config, *, host: PluginHost | None = None) -> list[str]:
    """Rules that only a training run needs, reported by ``config`` as warnings and
    enforced by ``train``: inspecting a configuration (``miles-core config`` with the
    reference's defaults) stays possible while a run that could not learn is refused."""
    host = host or get_host()
    errors: list[str] = []
    checkpoint = config.get("hf_checkpoint")
    if checkpoint and not config.get("model_backend_path"):
        # Matching reports this already; with --diffusion-model-family the path is read
        # only now (a configuration may be written where the model is not).
        problem = checkpoint_problem(checkpoint)
        if problem is not None:
            errors.append(f"--hf-checkpoint {problem}")
    loss = config.get("loss_type")
    registry = host.registries.loss
    needs_sde = loss in registry and getattr(registry.get(loss).spec, "needs_sde_steps", False)
    # A loss trains on supervised rows (SFT) by its spec, whatever its name.
    supervised = loss in registry and getattr(registry.get(loss).spec, "trains_on", None) == "supervised_rows"
    if needs_sde and config.diffusion_num_sde_steps == 0 and config.diffusion_step_strategy_path is None:
        steps = config.diffusion_num_steps
        errors.append(
            f"--loss-type {loss} trains on SDE steps but --diffusion-num-sde-steps is 0 (no step would be "
            f"trained): set it, e.g. --diffusion-num-sde-steps {max(steps - 1, 1)} (every step but the last, as "
            f"flow_grpo trains) or 2 for a cheaper window"
        )
    if needs_sde and (config.diffusion_sde_type == "ode" or config.diffusion_noise_level == 0):
        errors.append(
            f"--loss-type {loss} needs stochastic steps, but --diffusion-sde-type {config.diffusion_sde_type} with "
            f"--diffusion-noise-level {config.diffusion_noise_level} samples deterministically (no log-prob to train on)"
        )
    errors.extend(_reference_errors(config, registry.get(loss).spec if loss in registry else None))
    family = registry_spec(host, "model_family", config.model_family)
    if family is not None and config.data_parallel_size > 1 and not config.train_pipeline_config_path:
        trained = {name.strip() for name in str(config.update_weight_target_module).split(",") if name.strip()}
        frozen = [name for name in family.trainable_components if name not in trained]
        if frozen and trained:
            errors.append(
                f"--update-weight-target-module {config.update_weight_target_module}: training part of the {family.name} "
                f"family's denoisers ({', '.join(frozen)} frozen) runs on one data-parallel rank in this version, and the "
                f"data-parallel size is {config.data_parallel_size} (the ranks' shares would hold different numbers of "
                "trainable steps, so their micro-batch plans would differ); train every denoiser, or use one data-parallel "
                "rank (sequence parallelism is fine)"
            )
    if family is not None and not family.supports_cfg_training and not supervised and config.diffusion_guidance_scale > 1:
        errors.append(
            f"--diffusion-guidance-scale {config.diffusion_guidance_scale}: the {family.name} family does not train "
            "with classifier-free guidance (as in the reference), so rollouts must sample without it; use "
            "--diffusion-guidance-scale 1 (its recipe does)"
        )
    errors.extend(_image_input_errors(config, *family_image_input(config, host=host), loss, supervised=supervised))
    if config.diffusion_step_strategy_path:
        errors.extend(_dry_run_step_strategy(config))
    errors.extend(unavailable_errors(config))
    return errors


def kl_space(config: Any, spec: Any) -> str:
    """Where the ``--diffusion-kl-beta`` term compares policy and reference: ``--kl-space``,
    or, unset, ``velocity`` for a loss that trains without SDE transitions (DiffusionNFT's
    KL) and ``latent`` (Flow-GRPO's) otherwise."""
    if config.kl_space is not None:
        return str(config.kl_space)
    return "latent" if spec is None or spec.trains_on == "sde_transitions" else "velocity"


def _reference_errors(config: Config, spec: Any) -> list[str]:
    """The reference policy a run needs (the KL term, DiffusionNFT's old policy, DPO's
    log-ratios) exists; the KL term is in a space the loss's data has."""
    errors: list[str] = []
    loss = config.loss_type
    keeps_ema = bool(spec is not None and spec.keeps_ema)
    ref_mode = config.ref_mode
    if ref_mode is None:  # the reference's automatic choice
        ref_mode = "ema" if keeps_ema else ("lora_base" if config.use_lora else "none")
    beta = config.diffusion_kl_beta
    space = kl_space(config, spec)
    transitions = spec is None or spec.trains_on == "sde_transitions"
    where = f"--kl-space {space} " if config.kl_space is not None else ""
    if beta > 0 and spec is not None and spec.trains_on == "preference_pairs":
        errors.append(
            f"--diffusion-kl-beta {beta}: --loss-type {loss} has no KL term (its log-ratios already compare the policy "
            "with the reference policy); leave it at 0"
        )
    elif beta > 0 and space == "latent" and not transitions:
        errors.append(
            f"--kl-space latent: --loss-type {loss} trains on {spec.trains_on}, which have no SDE step means to compare; "
            "use --kl-space velocity (or leave it unset)"
        )
    if beta > 0 and keeps_ema:
        # DiffusionNFT's KL is against the base model (the adapter disabled), not its old policy (the EMA).
        if not config.use_lora:
            errors.append(
                f"--diffusion-kl-beta {beta} with --loss-type {loss} measures the KL against the base model (the LoRA "
                "adapter disabled, as DiffusionNFT does), which needs --use-lora; full fine-tuning keeps no base copy"
            )
    elif beta > 0 and ref_mode == "none":
        errors.append(
            f"--diffusion-kl-beta {beta} {where}needs a reference policy: --use-lora (reference = LoRA disabled) or "
            "--use-ema --ref-mode ema"
        )
    if spec is not None and spec.needs_reference and ref_mode == "none":
        errors.append(
            f"--loss-type {loss} compares the policy with a reference policy, and there is none: --use-lora (reference = "
            "LoRA disabled) or --use-ema --ref-mode ema"
        )
    if ref_mode == "ema" and not config.use_ema and not keeps_ema:
        errors.append("--ref-mode ema requires --use-ema (the EMA is the reference)")
    if keeps_ema and config.ref_mode == "none":
        errors.append(f"--ref-mode none: --loss-type {loss} needs its reference policy (the EMA); use --ref-mode ema or leave it unset")
    if spec is not None and spec.trains_on == "preference_pairs" and config.data_parallel_size > 1:
        errors.append(
            f"--loss-type {loss}: preference pairs (one per group whose rewards differ) train on one data-parallel rank in "
            f"this version, and the data-parallel size is {config.data_parallel_size} (the ranks' shares of pairs would "
            "differ); use one data-parallel rank (sequence parallelism is fine)"
        )
    window = config.diffusion_sde_window_range
    if (
        window is not None
        and window[1] == config.diffusion_num_steps
        and config.data_parallel_size > 1
        and transitions
        and not config.diffusion_step_strategy_path
    ):
        errors.append(
            f"--diffusion-sde-window-range {window[0]},{window[1]}: a window drawn onto the last step trains one step fewer, "
            f"so the data-parallel ranks (size {config.data_parallel_size}) would hold different numbers of train pairs; use "
            f"hi <= {window[1] - 1}, or one data-parallel rank"
        )
    groups = config.n_samples_per_prompt
    if spec is not None and groups < spec.min_group_size:
        errors.append(
            f"--n-samples-per-prompt {groups}: --loss-type {loss} needs groups of at least {spec.min_group_size} samples "
            "(a preference pair is a group's best and worst sample)"
            if spec.trains_on == "preference_pairs"
            else f"--n-samples-per-prompt {groups}: --loss-type {loss} needs groups of at least {spec.min_group_size} samples"
        )
    return errors


def _image_input_errors(config: Config, image_input: str, family: str, loss: str | None, *, supervised: bool) -> list[str]:
    """What an image-to-video family (``image_input`` not ``"none"``) cannot train with yet.
    ``supervised``: the loss trains on supervised rows (its spec's ``trains_on``). Rows with
    an image on sglang are refused once the rows are read
    (:func:`~miles_core.training.run.check_engine_images`): an optional image leaves
    text-to-video runs on sglang possible."""
    errors: list[str] = []
    if image_input == "none":
        return errors
    if image_input == "required" and supervised:
        errors.append(
            f"--loss-type {loss}: the {family} family is image-to-video, and SFT with a conditioning image is not "
            "implemented (each row would need its first frame as the condition); train it with an RL loss"
        )
    if image_input == "required" and config.rollout_engine == "sglang":
        errors.append(
            f"--rollout-engine sglang: the {family} family is image-to-video, and sglang-diffusion's image-to-video "
            "denoising_env is not verified against this family's; use --rollout-engine embedded or http"
        )
    if not supervised and config.image_key in (config.input_key, config.eval_input_key):
        errors.append(f"--image-key {config.image_key!r}: a prompt row keeps its prompt and its image under different keys")
    elif not supervised and config.get("eval_config"):  # each --eval-config set has its own keys
        from miles_core.config.eval_config import eval_datasets

        try:
            datasets = eval_datasets(config)
        except ConfigError:  # the file's own problem, reported by eval_config_problems
            datasets = []
        for dataset in datasets:
            key = dataset.image_key or config.image_key
            if key == dataset.input_key:
                flag = "image_key" if dataset.image_key else "--image-key"
                errors.append(
                    f"{dataset.where}: {flag} {key!r} is also its input_key: a prompt row keeps its prompt and its image under different keys"
                )
    return errors


def family_image_input(config: Any, *, host: PluginHost | None = None) -> tuple[str, str]:
    """``(image_input, family name)`` of the configuration's model family: its registered
    spec's (read without importing the family), or a ``--train-pipeline-config-path``
    class's own attribute; ``("none", ...)`` when neither is known."""
    host = host or get_host()
    spec = registry_spec(host, "model_family", getattr(config, "model_family", None))
    if spec is not None:
        return spec.image_input, spec.name
    path = getattr(config, "train_pipeline_config_path", None)
    if path:
        try:
            cls = resolve_path_flag("--train-pipeline-config-path", path, "model_family")
        except PathFlagError:
            return "none", path
        return getattr(cls, "image_input", "none"), getattr(cls, "__name__", path)
    return "none", str(getattr(config, "model_family", None))


def registry_spec(host: PluginHost, kind: str, name: str | None) -> Any:
    """The spec registered under ``name`` in registry ``kind``, or None."""
    registry = host.registries[kind]
    return registry.get(name).spec if name is not None and name in registry else None


def _dry_run_step_strategy(config: Config) -> list[str]:
    """Run a chosen step strategy once on the first rollout's seed, so a missing flag it
    needs (``--diffusion-sde-candidate-steps``) is reported before anything loads."""
    from miles_core.plugin_manager import step_strategy
    from miles_core.step_strategies import select_steps

    strategy = step_strategy(config)
    try:
        select_steps(config, seed=config.rollout_seed, epoch=0, strategy=strategy)
    except ValueError as exc:
        return [f"--diffusion-step-strategy-path {config.diffusion_step_strategy_path}: {exc}"]
    return []
