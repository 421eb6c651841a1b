"""The trainer: recomputes the policy's log-probabilities on recorded SDE steps through
the same family prediction and SDE backend as the engine, and takes optimizer steps on
the selected loss.

Trainable weights are LoRA adapters (PEFT, through diffusers' adapter API so the
result saves as a diffusers LoRA) or the full components named by
``--update-weight-target-module`` (several for Wan 2.2's two experts: adapters, optimizer,
EMA and weight sync are per component). With the embedded engine the trainer and the
engine share the family's modules, so weight sync costs nothing.

Each optimizer step's samples are this data-parallel rank's share
(``--train-dp-split-mode``, :mod:`miles_core.training.data_parallel`); the sample-to-pair
conversion and the micro-batch preparation may be replaced by hooks
(:mod:`miles_core.training.train_hooks`).

The optimizer steps master weights in ``--fsdp-master-dtype``: copies of parameters kept
in another dtype (:mod:`miles_core.training.master_weights`), or the parameters themselves.

With a data-parallel size above 1 in an initialized process group the trainable
components are sharded with FSDP2 and training is collective (every rank is given the
whole rollout); see :mod:`miles_core.training.fsdp` for the semantics and what every rank
must call.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from miles_core.engine.sampler import ConditioningCache
from miles_core.errors import RunError, TrainingStopped
from miles_core.family import Conditioning, ModelFamily
from miles_core.plugin_manager import loss_spec
from miles_core.rollout.sample import Sample
from miles_core.sde import SdeBackend, score_streams
from miles_core.training.backend_options import enable_gradient_checkpointing, set_attention_backend
from miles_core.training.data_parallel import shard_for_rank
from miles_core.training.master_weights import MasterWeights
from miles_core.training.pairs import (
    TrainPair,
    conditioning_from_env,
    micro_batches,
    on_device,
    params_from_env,
    shares_forward,
)
from miles_core.training.rank_loading import trained_names
from miles_core.training.train_hooks import batch_preparer, pair_source

log = logging.getLogger("miles_core.training")


SFT_PROMPT_CACHE_BYTES = 8 << 30
"""Host bytes the SFT prompt cache may hold (8 GiB: 4,096 prompts of SD3 at 2.8 MB each fit;
LTX-2's 12.6 MB encodings keep the ~680 most recent), the least recently used going first."""

SFT_PROMPT_CACHE_ENTRIES = 4096
"""Prompts the SFT prompt cache keeps at most (within :data:`SFT_PROMPT_CACHE_BYTES`)."""


def target_modules(config: Any, family: ModelFamily) -> dict[str, torch.nn.Module]:
    components = family.components()
    names = trained_names(config)
    unknown = [n for n in names if n not in components]
    if unknown:
        raise ValueError(
            f"--update-weight-target-module {config.update_weight_target_module}: unknown component(s) "
            f"{', '.join(unknown)}; this family trains {', '.join(components)}"
        )
    return {name: components[name] for name in names}


def _splits_sequences(config: Any) -> bool:
    """Whether this trainer will split samples over ranks (``--sequence-parallel-size`` > 1
    in an initialized process group)."""
    if int(getattr(config, "sequence_parallel_size", 1) or 1) <= 1:
        return False
    from miles_core.training import fsdp

    return fsdp.is_active()


def _lora_init(value: str) -> Any:
    # The reference maps kaiming-uniform to PEFT's default init (True); other names pass through.
    return True if value in ("kaiming-uniform", "kaiming_uniform", "default") else value


class Trainer:
    def __init__(
        self,
        family: ModelFamily,
        config: Any,
        backend_cls: type[SdeBackend],
        loss_fn: Any,
        *,
        dp_rank: int = 0,
        sources: dict[str, torch.nn.Module] | None = None,
    ) -> None:
        self.family = family
        self.config = config
        self.dp_rank = dp_rank
        """This process's data-parallel rank (of ``config.data_parallel_size``). ``dp_rank`` is
        given as the process group's rank; under sequence parallelism it becomes ``rank //
        --sequence-parallel-size`` once the components are sharded."""
        # Hooks first: a bad path fails before any module is touched.
        self.pairs_from = pair_source(config, family)
        self.prepare = batch_preparer(config)
        self.backend = backend_cls(noise_level=config.diffusion_noise_level, log_prob_no_const=config.diffusion_log_prob_no_const)
        self.loss_fn = loss_fn
        self.modules = target_modules(config, family)
        self.frozen_components = [name for name in family.components() if name not in self.modules]
        """The family's denoisers this run does not train (Wan 2.2 training one expert):
        they keep sampling their steps in the engine, and the steps they denoise are left
        out of training (``train/num_pairs_frozen``)."""
        for module in family.components().values():
            module.requires_grad_(False)
        sources = {} if sources is None else sources
        if config.use_lora:
            from peft import LoraConfig

            def lora() -> LoraConfig:
                return LoraConfig(
                    r=config.lora_rank,
                    lora_alpha=config.lora_alpha,
                    target_modules=list(config.lora_target_modules),
                    init_lora_weights=_lora_init(config.lora_init_weights),
                )

            for component, module in self.modules.items():
                if component in sources:
                    # Rank 0 of a sharded trainer: the loaded copy draws the adapters' initial
                    # values (what every rank starts from), the meta module only their shapes,
                    # so the generator advances as in a whole load.
                    sources[component].add_adapter(lora())
                    with torch.random.fork_rng(devices=[]):
                        module.add_adapter(lora())
                else:
                    module.add_adapter(lora())
                for name, parameter in module.named_parameters():
                    parameter.requires_grad_("lora_" in name)
        else:
            for name in self.modules:
                for _, parameter in family.trainable_parameters(name):
                    parameter.requires_grad_(True)
        if config.fsdp_attention_backend and not _splits_sequences(config):
            # Under sequence parallelism it is set once the family installed its processors.
            set_attention_backend(self.modules, config.fsdp_attention_backend)
        if config.gradient_checkpointing:
            enable_gradient_checkpointing(self.modules)
        self.engine_dtypes = {name: {k: p.dtype for k, p in module.named_parameters()} for name, module in self.modules.items()}
        """Each parameter's dtype before sharding casts the trainable ones to
        ``--fsdp-master-dtype``: the dtype an engine holds it in, in which the ranks send
        weights and write the final ones (:mod:`miles_core.training.rank_weights`)."""
        self.mesh: Any = None
        """The FSDP2 device mesh when the trainable components are sharded (a data-parallel
        size above 1 in an initialized process group, :mod:`miles_core.training.fsdp`)."""
        self.dp_world = 1
        """The data-parallel ranks that train different samples (``config.data_parallel_size``
        when sharded)."""
        self.sp_size = 1
        """The ranks that split each sample's tokens (``--sequence-parallel-size``, when sharded)."""
        self.reduce_world = 1
        """The ranks FSDP2 averages gradients over (the world size when sharded)."""
        if config.world_size > 1:
            from miles_core.training import fsdp

            if fsdp.is_active():
                from miles_core.training.sequence_parallel import layout_from_config

                self.mesh = fsdp.shard_modules(self.modules, config, family, dp_rank=dp_rank, sources=sources)
                # Under sequence parallelism the SP ranks of one data-parallel group train the
                # same samples: the data split uses the data-parallel coordinates.
                layout = layout_from_config(config, dp_rank)
                self.dp_rank, self.dp_world, self.sp_size, self.reduce_world = layout.dp_rank, layout.dp, layout.sp, layout.world
        self.parameters = [p for m in self.modules.values() for p in m.parameters() if p.requires_grad]
        if not self.parameters:
            raise ValueError("nothing to train: no parameter of the target modules requires a gradient")
        from miles_core.model_loading import torch_dtype

        self.masters = MasterWeights(self.parameters, torch_dtype(config.fsdp_master_dtype))
        """What the optimizer steps (``--fsdp-master-dtype``): master copies of parameters in
        another dtype, the parameters themselves otherwise (always under FSDP2, whose shards
        are cast to it); see :mod:`miles_core.training.master_weights`."""
        self.optimizer = torch.optim.AdamW(
            self.masters.masters,
            lr=config.lr,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
        )
        self.optimizer_steps = 0
        self.prompt_cache = ConditioningCache(max_entries=SFT_PROMPT_CACHE_ENTRIES, on_host=True, max_bytes=SFT_PROMPT_CACHE_BYTES)
        """SFT prompt encodings (frozen text encoders): each prompt is encoded once, kept in
        host memory (at most :data:`SFT_PROMPT_CACHE_BYTES`) and copied to the device when
        a micro-batch uses it."""
        self.on_progress: Callable[[int, int], None] | None = None
        """Called as ``(done, total)`` during a rollout's training: after each micro-batch
        (policy loss) or optimizer step (nft, SFT); the run's progress bar."""
        self._progress = [0, 0]
        self.stop_requested = threading.Event()
        """Set from another thread while :meth:`train_rollout` runs on the compute thread:
        it stops after the current micro-batch with :class:`~miles_core.errors.TrainingStopped`.
        The caller clears it before the call."""
        self.last_pairs: list[TrainPair] = []
        """This rank's train pairs of the latest :meth:`train_rollout` (``--save-debug-train-data``)."""
        self.ema = None
        self.loss_spec = loss_spec(config)
        from miles_core.config.resolve import kl_space

        self.kl_space = kl_space(config, self.loss_spec)
        """Where the ``--diffusion-kl-beta`` term compares policy and reference (``--kl-space``)."""
        means = sorted({"mean", "old_mean"} & set(self.loss_spec.batch_keys))
        if means and len(family.latent_streams) > 1:
            # The log-prob is the joint over every stream; one stream's means would not match it.
            raise RunError(
                f"--loss-type {config.loss_type} reads the step means ({', '.join(means)}) of one latent stream, and the "
                f"{family.name} family denoises {len(family.latent_streams)} ({', '.join(family.latent_streams)}); such a loss "
                "runs on single-stream families in this version"
            )
        self.old_means: dict[int, torch.Tensor] = {}
        """The old policy's step mean of each of this rollout's train pairs (by ``id``), for a
        loss that asks for ``old_mean``."""
        if config.use_ema or self.loss_spec.keeps_ema:
            # DiffusionNFT's "old" policy is an EMA of the live one (--ref-mode ema, the
            # reference's automatic choice under nft).
            from miles_core.training.ema import EMA

            self.ema = EMA.from_config(config, self.named_masters())

    @property
    def primary(self) -> str:
        """The family's primary latent stream (the one the losses' tensors are of)."""
        return self.family.latent_streams[0]

    def _clip_gradients(self) -> torch.Tensor:
        """Clip to ``--clip-grad``; a non-finite norm stops the run instead of writing
        NaN into the weights."""
        clip = self.config.clip_grad if self.config.clip_grad > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.masters.masters, clip)
        if self.mesh is not None and hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()  # the global norm over every rank's shards
        if not torch.isfinite(norm):
            raise FloatingPointError(
                f"non-finite gradient norm ({float(norm)}) at optimizer step {self.optimizer_steps}; "
                "the weights were not updated (lower --lr, or check the reward and advantages)"
            )
        return norm

    def _add_micro_batch(self, sums: dict[str, float], loss: torch.Tensor, metrics: dict[str, Any], weight: float) -> None:
        """Backpropagate a micro-batch's share of the step's loss (not in the alignment
        probe) and add its metrics."""
        if not self.config.debug_skip_optimizer_step:
            if self.mesh is None:
                (loss * weight).backward()
            else:
                # FSDP2 averages gradients over the ranks; ``weight`` is a share of the whole step.
                # Under sequence parallelism the SP ranks' backwards add up to the sample's
                # gradient (each reaches its own tokens), so the scale is the world size.
                (loss * (weight * self.reduce_world)).backward()
        _accumulate(sums, loss, metrics, weight)

    def _end_step(self, sums: dict[str, float], per_step: dict[str, list[float]]) -> None:
        """Finish an optimizer step and record its metrics."""
        sums = self._global_sums(sums)
        self.finish_step(sums, skip=self.config.debug_skip_optimizer_step)
        for key, value in sums.items():
            per_step[key].append(value)
        self._progress_tick()

    def finish_step(self, sums: dict[str, float], *, skip: bool) -> None:
        """Clip, step, update the EMA (unless ``skip``: the alignment probe), record lr."""
        if not skip:
            self.masters.gather_gradients()
            sums["grad_norm"] = float(self._clip_gradients())
            self.optimizer.step()
            self.masters.copy_to_model()
            self.optimizer_steps += 1
            self._after_optimizer_step()
        sums["lr"] = self.optimizer.param_groups[0]["lr"]

    def _global_sums(self, sums: dict[str, float]) -> dict[str, float]:
        """The step's metric sums over every rank (collective when sharded; weights are
        shares of the whole step, so the sum is the world-size-1 value)."""
        if self.mesh is None:
            return sums
        from miles_core.training import fsdp

        return fsdp.combine_sums(self._dp_gather(dict(sums)))

    def _dp_gather(self, obj: Any) -> list[Any]:
        """Every data-parallel group's ``obj`` (collective over all ranks): the first
        sequence-parallel rank's of each group, whose SP ranks computed the same one."""
        from miles_core.training import fsdp

        return fsdp.all_gather_object(obj)[:: self.sp_size]

    def _check_plans(self, plans: list[list[Any]], first_step: int) -> None:
        """Under FSDP2, exchange this rank's micro-batch plan of the coming optimizer
        steps and stop on a mismatch before any forward (collective)."""
        if self.mesh is not None:
            from miles_core.training import fsdp

            fsdp.check_plans(fsdp.all_gather_object(plans), first_step=first_step)

    def named_trainable(self) -> dict[str, torch.Tensor]:
        """Trainable parameters as ``component.parameter`` names (EMA, checkpoints)."""
        return {
            f"{component}.{name}": parameter
            for component, module in self.modules.items()
            for name, parameter in module.named_parameters()
            if parameter.requires_grad
        }

    def named_masters(self) -> dict[str, torch.Tensor]:
        """The optimizer's tensors under :meth:`named_trainable`'s names: the master copy
        of each parameter that has one (``--fsdp-master-dtype``), else the parameter."""
        return {name: self.masters.master_of(parameter) for name, parameter in self.named_trainable().items()}

    def _progress_start(self, total: int) -> None:
        self._progress = [0, total]

    def _progress_tick(self) -> None:
        self._progress[0] += 1
        if self.on_progress is not None:
            self.on_progress(*self._progress)
        if self.stop_requested.is_set():
            self.stop_requested.clear()
            raise TrainingStopped(*self._progress)

    def _step_windows(self, count: int) -> list[range]:
        """The sample indices of each optimizer step: ``--num-steps-per-rollout``
        contiguous windows of ``--global-batch-size`` samples for a full rollout (the
        config guarantees ``rollout size = global batch x steps``). A smaller batch (a
        subsampled replay, ``--load-debug-rollout-data-subsample``, or groups dropped by a
        rollout filter) is spread over the same number of steps, window sizes differing by
        at most one, so the learning-rate schedule and the EMA advance as planned; with
        fewer samples than steps, one step per sample (never a step without samples)."""
        steps = min(self.config.num_steps_per_rollout, count)
        if steps == 0:
            return []
        size, extra = divmod(count, steps)
        bounds = [0]
        for step in range(steps):
            bounds.append(bounds[-1] + size + (1 if step < extra else 0))
        return [range(start, end) for start, end in zip(bounds, bounds[1:])]

    def _rank_share(self, items: Sequence[Any]) -> list[Any]:
        """This rank's share of one optimizer step's samples (``--train-dp-split-mode``)."""
        config = self.config
        return shard_for_rank(items, self.dp_rank, config.data_parallel_size, config.train_dp_split_mode)

    def _after_optimizer_step(self) -> None:
        if self.ema is not None:
            # The EMA averages the masters: the trained weights, before rounding.
            self.ema.update(self.named_masters(), self.optimizer_steps)

    # -- state ---------------------------------------------------------------------------

    def trainable_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """The weights training changes, per component (LoRA tensors, or everything):
        full CPU tensors, gathered from the shards under FSDP2 (collective); the master
        weights, in ``--fsdp-master-dtype``, where the parameters are kept in another dtype."""
        if self.mesh is not None:
            from miles_core.training.fsdp import full_tensor

            return {
                name: {k: full_tensor(p) for k, p in module.named_parameters() if p.requires_grad} for name, module in self.modules.items()
            }
        return {
            name: {k: self.masters.master_of(p).detach().cpu().clone() for k, p in module.named_parameters() if p.requires_grad}
            for name, module in self.modules.items()
        }

    def load_trainable_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """Load :meth:`trainable_state` of a run at any world size and master dtype (cast:
        the masters take the saved values, the parameters their rounding)."""
        from miles_core.weights import load_named_tensors

        missing = set(self.modules) - set(state)
        if missing:
            raise ValueError(f"the checkpoint has no weights for {', '.join(sorted(missing))}")
        for name, module in self.modules.items():
            expected = {k for k, p in module.named_parameters() if p.requires_grad}
            if set(state[name]) != expected:
                raise ValueError(
                    f"the checkpoint's {name} weights do not match this run's trainable parameters "
                    f"({len(state[name])} saved, {len(expected)} here): same --use-lora / LoRA settings?"
                )
            if self.mesh is not None:
                from miles_core.training.fsdp import load_full_tensors

                load_full_tensors(module, state[name], module_name=name)
            else:
                load_named_tensors(module, state[name], module_name=name)
                parameters = dict(module.named_parameters())
                self.masters.load((parameters[k], value) for k, value in state[name].items())

    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer's state in ``optimizer.state_dict()``'s index-keyed format, with
        full tensors under FSDP2 (collective), so it loads at any world size."""
        if self.mesh is None:
            return self.optimizer.state_dict()
        from miles_core.training.fsdp import full_optimizer_state

        return full_optimizer_state(self.optimizer)

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """Load :meth:`optimizer_state` of a run at any world size (each rank keeps its
        shard under FSDP2)."""
        if self.mesh is None:
            self.optimizer.load_state_dict(state)
            return
        from miles_core.training.fsdp import load_full_optimizer_state

        load_full_optimizer_state(self.optimizer, state)

    # -- supervised flow matching ------------------------------------------------------

    def train_sft(self, rows: Sequence[Any], params: Any, lr_at: Any = None) -> dict[str, Any]:
        """``num_steps_per_rollout`` optimizer steps of ``global_batch_size`` rows each
        on the flow-matching loss (see :mod:`miles_core.training.sft`)."""
        from miles_core.training.sft import sft_batch, sft_stream_loss

        config = self.config
        gbs = config.global_batch_size
        per_step: dict[str, list[float]] = defaultdict(list)
        self._progress_start(config.num_steps_per_rollout)
        for step in range(config.num_steps_per_rollout):
            step_rows = rows[step * gbs : (step + 1) * gbs]
            window = self._rank_share(step_rows)
            size = config.micro_batch_size
            self._check_plans([[None] * len(range(0, len(window), size))], step)
            if lr_at is not None:
                for group in self.optimizer.param_groups:
                    group["lr"] = lr_at(self.optimizer_steps)
            self.optimizer.zero_grad(set_to_none=True)
            # Noise and steps depend only on (--seed, optimizer step): a resumed run draws the
            # same. Ranks above 0 draw from their own stream (see miles_core.training.fsdp).
            seed = config.seed * 1_000_003 + self.optimizer_steps
            generator = torch.Generator().manual_seed(seed if self.dp_rank == 0 else (seed + self.dp_rank * 2**40) % 2**63)
            sums: dict[str, float] = defaultdict(float)
            for start in range(0, len(window), size):
                chunk = window[start : start + size]
                data = sft_batch(self.family, chunk, params, generator, self.prompt_cache, frame_stride=config.sft_frame_stride)
                velocity = self.family.predict(data["x_t"], data["timestep"], data["cond"], params)
                # Every latent stream the family encodes (LTX-2: video and audio), summed.
                loss, metrics = sft_stream_loss(self.loss_fn, velocity, data, config)
                # A share of the whole step's rows (of this rank's when nothing is sharded).
                weight = len(chunk) / (len(step_rows) if self.mesh is not None else len(window))
                self._add_micro_batch(sums, loss, metrics, weight)
            self._end_step(sums, per_step)
        return _per_step_summary(per_step)

    # -- DiffusionNFT ----------------------------------------------------------------------

    def train_nft(self, samples: Sequence[Sample], advantages: torch.Tensor, lr_at: Any = None) -> dict[str, Any]:
        """DiffusionNFT on the rollout's final latents: per sample, a permutation of the
        schedule's steps (in order with --no-diffusion-nft-shuffle-timesteps), the first
        ``int(T x --diffusion-nft-timestep-fraction)`` trained; ``x_t = (1-σ)·x0 + σ·ε``;
        ``v_old`` from the EMA ("old") policy. Noise and permutations come from a
        generator seeded by ``(--seed, optimizer step)``."""
        config = self.config
        primary = self.family.latent_streams[0]
        per_step: dict[str, list[float]] = defaultdict(list)
        self.last_pairs = []
        step_windows = self._step_windows(len(samples))
        self._progress_start(len(step_windows))
        frozen: list[tuple[str, int]] = []
        trained_items = 0
        for step, step_window in enumerate(step_windows):
            window = self._rank_share(step_window)
            if lr_at is not None:
                for group in self.optimizer.param_groups:
                    group["lr"] = lr_at(self.optimizer_steps)
            self.optimizer.zero_grad(set_to_none=True)
            generator = torch.Generator().manual_seed(config.seed * 1_000_003 + self.optimizer_steps)
            # The whole step's draws on every rank (its own share trained): each item gets
            # the timestep and noise it gets at world size 1.
            items = []
            frozen_before = len(frozen)
            for index in step_window:
                if samples[index].remove_sample:
                    continue  # removed by a per-sample filter: counted for advantages only
                output = samples[index].output
                trajectory = output.dit_trajectory
                steps = int(trajectory["timesteps"].shape[0])
                count = max(1, int(steps * config.diffusion_nft_timestep_fraction))
                order = (torch.arange(steps) if config.no_diffusion_nft_shuffle_timesteps else torch.randperm(steps, generator=generator))[
                    :count
                ]
                final = {name: trajectory[name][-1] for name in self.family.latent_streams}
                params = params_from_env(output.denoising_env, steps) if self.frozen_components else None
                for k in order.tolist():
                    if params is not None:
                        denoiser = self.family.denoiser_for(trajectory["timesteps"][k], params)
                        if denoiser not in self.modules:
                            frozen.append((denoiser, k))  # a frozen expert's step: nothing to train
                            continue
                    items.append((index, k, final, trajectory, output.denoising_env))
            if not items and len(frozen) > frozen_before:
                # Every drawn step of this optimizer step is a frozen expert's: no step taken.
                self._progress_tick()
                continue
            trained_items += len(items)
            mine = set(window)
            mine_count = sum(1 for item in items if item[0] in mine)
            sums: dict[str, float] = defaultdict(float)
            size = config.micro_batch_size
            groups = nft_groups(items)
            self._check_plans([[None] * sum(len(range(0, sum(1 for item in group if item[0] in mine), size)) for group in groups)], step)
            for chunk, noise in nft_micro_batches(groups, mine, size, generator, self.family.latent_streams):
                sigma = torch.tensor([float(tr["sigmas"][k]) for _, k, _, tr, _ in chunk])
                x0 = {name: torch.stack([f[name] for _, _, f, _, _ in chunk]) for name in self.family.latent_streams}
                shape = (-1,) + (1,) * (x0[primary].ndim - 1)
                x_t = {name: (1 - sigma.view(shape)) * x0[name] + sigma.view(shape) * noise[name] for name in x0}
                timestep = torch.stack([tr["timesteps"][k] for _, k, _, tr, _ in chunk])
                cond = Conditioning.cat([conditioning_from_env(env) for *_, env in chunk])
                params = params_from_env(chunk[0][4], int(chunk[0][3]["timesteps"].shape[0]))
                device_x_t = {n: v.to(self.family.device, self.family.dtype) for n, v in x_t.items()}
                # The old policy first: swapping EMA weights in and out after the new
                # forward would modify tensors its backward needs.
                v_old = self._reference_velocity(device_x_t, timestep, cond, params)[primary]
                loss_batch: dict[str, torch.Tensor] = {}
                if config.diffusion_kl_beta > 0:
                    # DiffusionNFT's KL reference is the base model (the adapter disabled), not the old policy.
                    loss_batch["v_ref"] = self._reference_velocity(device_x_t, timestep, cond, params, "lora_base")[primary]
                v_new = self.family.predict(device_x_t, timestep, cond, params)[primary]
                adv = torch.tensor([float(advantages[i]) for i, *_ in chunk])
                loss_batch.update(
                    v_new=v_new,
                    v_old=v_old,
                    x_t=x_t[primary].to(v_new.device),
                    x0=x0[primary].to(v_new.device),
                    sigma=sigma.to(v_new.device),
                    advantages=adv.to(v_new.device),
                )
                loss, metrics = self.loss_fn(loss_batch, config)
                # A share of the whole step's items (of this rank's when nothing is sharded).
                weight = len(chunk) / (len(items) if self.mesh is not None else mine_count)
                self._add_micro_batch(sums, loss, metrics, weight)
            self._end_step(sums, per_step)
        if frozen and not trained_items:
            log.warning(
                self._nothing_trainable(
                    frozen, "the steps --loss-type nft drew reached", "draw more steps per sample (--diffusion-nft-timestep-fraction)"
                )
            )
        result = _per_step_summary(per_step)
        if self.frozen_components:
            result["train/num_pairs_frozen"] = len(frozen)
        return result

    # -- online DPO ----------------------------------------------------------------------

    def train_preferences(self, samples: Sequence[Sample], advantages: torch.Tensor, lr_at: Any = None) -> dict[str, Any]:
        """Online Diffusion-DPO / Flow-DPO on the rollout's preference pairs
        (:func:`~miles_core.training.preferences.preference_pairs`: each group's best and worst
        final sample), spread over ``--num-steps-per-rollout`` optimizer steps. Per pair, one
        schedule step drawn uniformly (a trained denoiser's) and one noise ε re-noise both
        samples, ``x_t = (1-σ)·x0 + σ·ε``; the loss gets the policy's and the reference
        policy's velocities on both and the targets ``ε - x0``. Draws come from a generator
        seeded by ``(--seed, optimizer step)``, as DiffusionNFT's."""
        from miles_core.training.preferences import preference_pairs

        config = self.config
        pairs = preference_pairs(samples, [float(a) for a in advantages])
        per_step: dict[str, list[float]] = defaultdict(list)
        self.last_pairs = []
        step_windows = self._step_windows(len(pairs))
        self._progress_start(len(step_windows))
        for step, step_window in enumerate(step_windows):
            window = self._rank_share(step_window)
            generator = torch.Generator().manual_seed(config.seed * 1_000_003 + self.optimizer_steps)
            # The whole step's draws on every rank, in pair order: each pair gets the step and
            # noise it gets at world size 1.
            draws = {id(pairs[index]): self._preference_draw(samples, pairs[index], generator) for index in step_window}
            chunks = self._preference_chunks(samples, [pairs[index] for index in window], draws, config.micro_batch_size)
            self._check_plans([[denoiser for denoiser, _ in chunks]], step)
            if lr_at is not None:
                for group in self.optimizer.param_groups:
                    group["lr"] = lr_at(self.optimizer_steps)
            self.optimizer.zero_grad(set_to_none=True)
            sums: dict[str, float] = defaultdict(float)
            for _, chunk in chunks:
                loss_batch = self._preference_batch(samples, chunk, [draws[id(pair)] for pair in chunk])
                loss, metrics = self.loss_fn(loss_batch, config)
                # A share of the whole step's pairs (of this rank's when nothing is sharded).
                weight = len(chunk) / (len(step_window) if self.mesh is not None else len(window))
                self._add_micro_batch(sums, loss, metrics, weight)
            self._end_step(sums, per_step)
        result = _per_step_summary(per_step)
        result["train/num_pairs"] = len(pairs)
        result["train/num_groups_without_preference"] = len({s.group_index for s in samples}) - len(pairs)
        return result

    def _preference_chunks(
        self, samples: Sequence[Sample], pairs: list[Any], draws: dict[int, tuple[int, Any]], size: int
    ) -> list[tuple[str, list[Any]]]:
        """Consecutive pairs in micro-batches of at most ``size`` that can share a forward:
        the same denoiser at their drawn steps (Wan 2.2's experts never share one), the same
        generation parameters and the same tensor shapes
        (:func:`~miles_core.training.pairs.shares_forward`: an image-conditioned pair never
        batches with a text-only one). ``(denoiser, pairs)`` per micro-batch."""
        chunks: list[tuple[str, list[Any]]] = []
        key = None
        for pair in pairs:
            output = samples[pair.chosen].output
            trajectory = output.dit_trajectory
            steps = int(trajectory["timesteps"].shape[0])
            params = params_from_env(output.denoising_env, steps)
            denoiser = self.family.denoiser_for(trajectory["timesteps"][draws[id(pair)][0]], params)
            final = {name: trajectory[name][-1] for name in self.family.latent_streams}
            this = (final, conditioning_from_env(output.denoising_env), params, denoiser)
            fits = (
                key is not None and len(chunks[-1][1]) < size and this[2:] == key[2:] and shares_forward(key[0], key[1], this[0], this[1])
            )
            if fits:
                chunks[-1][1].append(pair)
            else:
                chunks.append((denoiser, [pair]))
                key = this
        return chunks

    def _preference_draw(self, samples: Sequence[Sample], pair: Any, generator: torch.Generator) -> tuple[int, dict[str, torch.Tensor]]:
        """One pair's schedule step and noise (shared by its chosen and rejected sample)."""
        output = samples[pair.chosen].output
        trajectory = output.dit_trajectory
        steps = int(trajectory["timesteps"].shape[0])
        eligible = list(range(steps))
        if self.frozen_components:
            params = params_from_env(output.denoising_env, steps)
            eligible = [k for k in eligible if self.family.denoiser_for(trajectory["timesteps"][k], params) in self.modules]
            if not eligible:
                raise ValueError(
                    self._nothing_trainable(
                        [(c, 0) for c in self.frozen_components], "a preference pair's schedule", "train another denoiser"
                    )
                )
        k = eligible[int(torch.randint(len(eligible), (1,), generator=generator))]
        noise = {name: torch.randn(trajectory[name][-1].shape, generator=generator) for name in self.family.latent_streams}
        return k, noise

    def _preference_batch(
        self, samples: Sequence[Sample], chunk: list[Any], drawn: list[tuple[int, dict[str, torch.Tensor]]]
    ) -> dict[str, torch.Tensor]:
        """The loss batch of a micro-batch of preference pairs: one forward of the policy
        and one of the reference on the chosen rows followed by the rejected rows."""
        primary = self.primary
        streams = self.family.latent_streams
        rows = [pair.chosen for pair in chunk] + [pair.rejected for pair in chunk]
        steps = [k for k, _ in drawn] * 2
        noises = [noise for _, noise in drawn] * 2
        outputs = [samples[i].output for i in rows]
        sigma = torch.tensor([float(out.dit_trajectory["sigmas"][k]) for out, k in zip(outputs, steps)])
        x0 = {name: torch.stack([out.dit_trajectory[name][-1] for out in outputs]) for name in streams}
        noise = {name: torch.stack([n[name] for n in noises]) for name in streams}
        shape = (-1,) + (1,) * (x0[primary].ndim - 1)
        x_t = {name: (1 - sigma.view(shape)) * x0[name] + sigma.view(shape) * noise[name] for name in streams}
        timestep = torch.stack([out.dit_trajectory["timesteps"][k] for out, k in zip(outputs, steps)])
        cond = Conditioning.cat([conditioning_from_env(out.denoising_env) for out in outputs])
        params = params_from_env(outputs[0].denoising_env, int(outputs[0].dit_trajectory["timesteps"].shape[0]))
        device_x_t = {n: v.to(self.family.device, self.family.dtype) for n, v in x_t.items()}
        # The reference first: swapping weights after the policy's forward would modify
        # tensors its backward needs.
        v_ref = self._reference_velocity(device_x_t, timestep, cond, params)[primary]
        v = self.family.predict(device_x_t, timestep, cond, params)[primary]
        target = (noise[primary] - x0[primary]).to(v.device)
        half = len(chunk)
        return {
            "v_chosen": v[:half],
            "v_rejected": v[half:],
            "ref_v_chosen": v_ref[:half],
            "ref_v_rejected": v_ref[half:],
            "target_chosen": target[:half],
            "target_rejected": target[half:],
            "sigma": sigma[:half].to(v.device),
            "reward_chosen": torch.tensor([_reward(samples[p.chosen]) for p in chunk], device=v.device),
            "reward_rejected": torch.tensor([_reward(samples[p.rejected]) for p in chunk], device=v.device),
        }

    # -- one rollout -----------------------------------------------------------------

    def train_rollout(self, samples: Sequence[Sample], advantages: torch.Tensor, lr_at: Any = None) -> dict[str, Any]:
        """Take ``num_steps_per_rollout`` optimizer steps over the rollout's samples
        (``global_batch_size`` samples each; a batch that rollout filters made smaller is
        spread over the same steps, see :meth:`_step_windows`); return the rollout's
        training metrics, per-step values as lists (``train/clipfrac_per_step``)."""
        config = self.config
        if self.loss_spec.trains_on == "nft_pairs":
            return self.train_nft(samples, advantages, lr_at)
        if self.loss_spec.trains_on == "preference_pairs":
            return self.train_preferences(samples, advantages, lr_at)
        pairs = self.pairs_from(config, samples, advantages)
        # A frozen expert's steps (Wan 2.2 training one expert) are not trained: left out
        # here, from the whole rollout, so every rank leaves out the same ones.
        frozen = [p for p in pairs if p.denoiser is not None and p.denoiser not in self.modules]
        if frozen:
            pairs = [p for p in pairs if p.denoiser is None or p.denoiser in self.modules]
            if not pairs:
                # A window drawn per request can fall on the frozen expert's steps alone in
                # one rollout and reach the trained one in the next: not an error, a rollout
                # without an optimizer step (train/num_pairs 0), said in the log.
                log.warning(
                    self._nothing_trainable(
                        [(p.denoiser, p.step) for p in frozen],
                        "the SDE window reached",
                        f"if every rollout says so, move the SDE window onto the steps of {', '.join(self.modules)} "
                        "(--diffusion-sde-window-range)",
                    )
                )
        trained_samples = {p.sample_index for p in pairs}
        per_step: dict[str, list[float]] = defaultdict(list)
        drift_by_step: dict[int, list[float]] = defaultdict(list)
        windows = []
        for step_window in self._step_windows(len(samples)):
            if not any(i in trained_samples for i in step_window):
                # Only a frozen expert's steps in these samples, or no SDE step at all (a window
                # drawn onto the last step, which is never trained): no optimizer step.
                continue
            mine = set(self._rank_share(step_window))
            windows.append([p for p in pairs if p.sample_index in mine])
        pairs = [p for window in windows for p in window]
        self.last_pairs = pairs
        totals = self._policy_totals(windows)
        wants_means = "old_mean" in self.loss_spec.batch_keys
        try:
            if config.diffusion_recompute_old_log_prob or wants_means:
                # Window by window, with the micro-batches training will use: the first
                # step's ratio is then exactly 1.
                for window in windows:
                    self._recompute_old(window, log_probs=config.diffusion_recompute_old_log_prob, means=wants_means)
            self._progress_start(sum(len(micro_batches(window, config)) for window in windows) if self.on_progress else 0)
            for index, window in enumerate(windows):
                metrics = self._optimizer_step(window, drift_by_step, lr_at, None if totals is None else totals[index])
                for key, value in metrics.items():
                    per_step[key].append(value)
        finally:
            self.old_means = {}
        result = _per_step_summary(per_step)
        if totals is not None:
            # Every rank's drift per SDE step: (sum, count) pairs gathered (collective).
            drift = {k: (math.fsum(values), len(values)) for k, values in drift_by_step.items()}
            gathered = self._dp_gather(drift)
            steps = sorted({k for ranks in gathered for k in ranks})
            for k in steps:
                parts = [ranks[k] for ranks in gathered if k in ranks]
                result[f"train/log_prob_abs_diff_step_{k}"] = math.fsum(s for s, _ in parts) / sum(n for _, n in parts)
            result["train/num_pairs"] = sum(count for count, _ in totals)
        else:
            if drift_by_step:
                for k, values in sorted(drift_by_step.items()):
                    result[f"train/log_prob_abs_diff_step_{k}"] = sum(values) / len(values)
            result["train/num_pairs"] = len(pairs)
        if self.frozen_components:
            result["train/num_pairs_frozen"] = len(frozen)  # the whole rollout's (every rank sees it)
        return result

    def _nothing_trainable(self, frozen: Sequence[tuple[str, int]], reached: str, fix: str) -> str:
        """The one line of a rollout whose every step is a frozen denoiser's: which
        denoisers and steps it reached, and the two ways out (``fix``, or training them)."""
        denoisers = sorted({name for name, _ in frozen})
        steps = ", ".join(str(k) for k in sorted({k for _, k in frozen}))
        return (
            f"--update-weight-target-module {self.config.update_weight_target_module}: no optimizer step in this rollout, "
            f"no step of it is denoised by a trained component: {reached} only {', '.join(denoisers)} (step(s) {steps}), which "
            f"{'stays' if len(denoisers) == 1 else 'stay'} frozen; {fix}, or train {' and '.join(denoisers)} too "
            f"(--update-weight-target-module {','.join([*self.modules, *denoisers])})"
        )

    def _policy_totals(self, windows: list[list[TrainPair]]) -> list[tuple[int, int]] | None:
        """Under FSDP2 (collective): exchange the ranks' micro-batch plans (stop on a
        mismatch, before any forward) and return each optimizer step's ``(pairs, kept
        pairs)`` over all ranks; None when nothing is sharded."""
        if self.mesh is None:
            return None
        from miles_core.training import fsdp

        local = {
            "plans": [[batch[0].denoiser for batch in micro_batches(window, self.config)] for window in windows],
            "counts": [(len(window), sum(1 for p in window if p.loss_mask > 0)) for window in windows],
        }
        gathered = fsdp.all_gather_object(local)
        fsdp.check_plans([ranks["plans"] for ranks in gathered])  # every rank's, SP ranks too
        gathered = gathered[:: self.sp_size]  # counts: one per data-parallel group
        return [
            (sum(ranks["counts"][i][0] for ranks in gathered), sum(ranks["counts"][i][1] for ranks in gathered))
            for i in range(len(windows))
        ]

    @torch.no_grad()
    def _recompute_old(self, pairs: list[TrainPair], *, log_probs: bool, means: bool) -> None:
        """The old policy's values from the trainer's own forward, before any update of this
        rollout: its log-probs (``--diffusion-recompute-old-log-prob``, instead of the
        engine's, so batch-geometry drift between the two never enters the ratio) and its
        step means (a loss asking for ``old_mean``, GRPO-Guard's)."""
        for batch in micro_batches(pairs, self.config):
            log_prob, _, mean, _ = self._log_prob(on_device(self.prepare(batch), self.family.device))
            for row, pair in enumerate(batch):
                if log_probs:
                    pair.old_log_prob = float(log_prob[row])
                if means:
                    # Kept on the CPU: one latent per pair of the whole rollout (video: MBs each).
                    self.old_means[id(pair)] = mean[row].detach().cpu()

    def _optimizer_step(
        self,
        pairs: list[TrainPair],
        drift_by_step: dict[int, list[float]],
        lr_at: Any,
        totals: tuple[int, int] | None = None,
    ) -> dict[str, float]:
        """One optimizer step on this rank's ``pairs``; ``totals`` is the step's ``(pairs,
        kept pairs)`` over all ranks under FSDP2 (None: this rank's own)."""
        config = self.config
        skip = config.debug_skip_optimizer_step
        if lr_at is not None and not skip:
            lr = lr_at(self.optimizer_steps)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = defaultdict(float)
        count, kept = totals if totals is not None else (len(pairs), sum(1 for p in pairs if p.loss_mask > 0))
        total = max(1, count)
        # The loss is the mean over the pairs that are not masked (a removed sample still
        # counted for its group's advantages, but trains nothing).
        kept_total = max(1, kept)
        kl_on = config.diffusion_kl_beta > 0
        for batch in micro_batches(pairs, config):
            data = on_device(self.prepare(batch), self.family.device)
            # The reference forward (which may swap weights) before the policy's graph exists.
            reference = None
            if kl_on and self.kl_space == "velocity":
                reference = self._reference_velocity(data["x"], data["timestep"], data["cond"], data["params"])[self.primary]
            elif kl_on:
                reference = self._reference_mean(data)
            with torch.set_grad_enabled(not skip):
                log_prob, velocity, mean, scale = self._log_prob(data)
                keep = data["loss_mask"] > 0
                loss_batch = {
                    "log_prob": log_prob[keep],
                    "old_log_prob": data["old_log_prob"][keep],
                    "advantages": data["advantages"][keep],
                }
                if kl_on and self.kl_space == "velocity":
                    loss_batch.update(velocity=velocity[keep], ref_velocity=reference[keep])
                elif kl_on:
                    loss_batch.update(mean=mean[keep], ref_mean=reference[keep], std=scale[keep])
                if self.loss_spec.batch_keys:
                    extra = self._transition_keys(batch, data, velocity, mean, scale)
                    loss_batch.update({key: value[keep] for key, value in extra.items()})
                if bool(keep.any()):
                    loss, metrics = self.loss_fn(loss_batch, config)
                    weight = int(keep.sum()) / kept_total
                    self._add_micro_batch(sums, loss, metrics, weight)
                elif self.mesh is not None and not skip:
                    # Nothing kept here, but FSDP2's backward collectives pair up across
                    # ranks: a zero-weight backward keeps this rank in step.
                    (log_prob.sum() * 0.0).backward()
            diff = (log_prob.detach() - data["old_log_prob"]).abs()
            sums["log_prob_mean_abs_diff"] += float(diff.sum()) / total
            sums["log_prob_max_abs_diff"] = max(sums["log_prob_max_abs_diff"], float(diff.max()))
            for pair, value in zip(batch, diff.tolist()):
                drift_by_step[pair.step].append(value)
            if data["engine_velocity"] is not None:
                out = (velocity.detach() - data["engine_velocity"]).abs()
                sums["model_output_mean_abs_diff"] += float(out.flatten(1).mean(1).sum()) / total
                sums["model_output_max_abs_diff"] = max(sums["model_output_max_abs_diff"], float(out.max()))
            self._progress_tick()
        sums = self._global_sums(sums)
        self.finish_step(sums, skip=skip)
        return dict(sums)

    def _transition_keys(
        self, batch: list[TrainPair], data: dict[str, Any], velocity: torch.Tensor, mean: torch.Tensor, scale: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """The :data:`~miles_core.specs.TRANSITION_BATCH_KEYS` the loss's spec asks for, one
        row per pair of the micro-batch (the primary latent stream's)."""
        keys = self.loss_spec.batch_keys
        out: dict[str, torch.Tensor] = {}
        if "mean" in keys:
            out["mean"] = mean
        if "old_mean" in keys:
            out["old_mean"] = torch.stack([self.old_means[id(pair)] for pair in batch]).to(mean.device)
        if "noise_scale" in keys:
            out["noise_scale"] = scale
        if "transition_std" in keys:
            x = data["x"][self.primary]
            _, std = self.backend.mean_std(x, velocity.detach(), data["sigma"], data["sigma_next"], sigma_max=data["sigma_max"])
            out["transition_std"] = std.expand((x.shape[0],) + (1,) * (x.ndim - 1))
        for key in ("sigma", "sigma_next"):
            if key in keys:
                out[key] = data[key]
        return out

    def _log_prob(self, data: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        family = self.family
        velocity = family.predict(data["x"], data["timestep"], data["cond"], data["params"])
        result = score_streams(
            self.backend,
            data["x_next"],
            data["x"],
            velocity,
            data["sigma"],
            data["sigma_next"],
            sigma_max=data["sigma_max"],
        )
        primary = family.latent_streams[0]
        return result.log_prob, velocity[primary], result.mean[primary], result.noise_scale

    def reference_mode(self) -> str:
        """``--ref-mode``, or the automatic choice: ``ema`` for a loss that keeps an EMA
        (nft's old policy), else ``lora_base`` under LoRA, else ``none``."""
        mode = self.config.ref_mode
        if mode is None:
            mode = "ema" if self.loss_spec.keeps_ema else ("lora_base" if self.config.use_lora else "none")
        return mode

    def kl_reference(self) -> str | None:
        """The reference :meth:`reference_kl` measures against: :meth:`reference_mode`, or
        the EMA when that is ``none`` and the trainer keeps one; None when there is none
        (full fine-tuning without an EMA)."""
        mode = self.reference_mode()
        if mode == "none":
            return "ema" if self.ema is not None else None
        return mode

    @torch.no_grad()
    def reference_kl(self, max_pairs: int = 32) -> float | None:
        """Flow-GRPO's KL term, ``||μ_policy − μ_ref||² / (2·s²)`` averaged over each
        transition's elements (:func:`~miles_core.losses.kl_to_reference`), then over at
        most ``max_pairs`` of the latest :meth:`train_rollout`'s transitions, evenly spaced
        (so every SDE step the rollout trained on is represented), against
        :meth:`kl_reference`. None without a reference or without transitions to measure on
        (before this process trained a rollout, e.g. at a resumed run's first evaluation, and
        under DiffusionNFT, which trains on final latents, not transitions).
        The reward-hacking guard's KL (:mod:`miles_core.training.guard`)."""
        from miles_core.losses import kl_to_reference

        mode = self.kl_reference()
        if mode is None:
            return None
        pairs = self.last_pairs
        if not pairs:
            return None
        stride = max(1, math.ceil(len(pairs) / max_pairs))
        chosen = pairs[::stride][:max_pairs]
        total, count = 0.0, 0
        for batch in micro_batches(chosen, self.config):
            data = on_device(self.prepare(batch), self.family.device)
            ref_mean = self._reference_mean(data, mode)
            _, _, mean, scale = self._log_prob(data)
            kl = kl_to_reference(mean.double(), ref_mean.double(), scale.double() if torch.is_tensor(scale) else scale)
            total += float(kl.sum())
            count += kl.numel()
        return total / max(1, count)

    @torch.no_grad()
    def _reference_velocity(
        self, x: Any, timestep: torch.Tensor, cond: Any, params: Any, mode: str | None = None
    ) -> dict[str, torch.Tensor]:
        """The reference policy's velocity: the EMA weights (``ema``) or the model with
        LoRA disabled (``lora_base``); ``mode`` defaults to :meth:`reference_mode`."""
        mode = mode or self.reference_mode()
        if mode == "ema":
            if self.ema is None:
                raise ValueError("--ref-mode ema needs --use-ema")
            with self.ema.swap_into(self.named_trainable()):
                return self.family.predict(x, timestep, cond, params)
        if mode == "lora_base":
            modules = list(self.modules.values())
            for module in modules:
                module.disable_adapters()
            try:
                return self.family.predict(x, timestep, cond, params)
            finally:
                for module in modules:
                    module.enable_adapters()
        raise ValueError(f"--ref-mode {mode}: the KL term, nft and DPO need a reference policy (lora_base or ema)")

    @torch.no_grad()
    def _reference_mean(self, data: dict[str, Any], mode: str | None = None) -> torch.Tensor:
        """The reference policy's step mean, for the KL term."""
        velocity = self._reference_velocity(data["x"], data["timestep"], data["cond"], data["params"], mode)
        result = score_streams(
            self.backend,
            data["x_next"],
            data["x"],
            velocity,
            data["sigma"],
            data["sigma_next"],
            sigma_max=data["sigma_max"],
        )
        return result.mean[self.family.latent_streams[0]]


def nft_groups(items: list[Any]) -> list[list[Any]]:
    """One step's nft items ``(sample, step, final latents, trajectory, env)`` as groups
    that can share a forward (:func:`~miles_core.training.pairs.shares_forward`, and the
    same generation parameters): an image-to-video family's image-conditioned items never
    batch with its text-only ones. Groups in order of first appearance, items in order."""
    groups: list[list[Any]] = []
    keys: list[tuple[Any, Any, Any]] = []
    for item in items:
        key = (item[2], conditioning_from_env(item[4]), params_from_env(item[4], int(item[3]["timesteps"].shape[0])))
        at = next((i for i, (x, cond, params) in enumerate(keys) if params == key[2] and shares_forward(x, cond, key[0], key[1])), None)
        if at is None:
            groups.append([item])
            keys.append(key)
        else:
            groups[at].append(item)
    return groups


def nft_micro_batches(
    groups: list[list[Any]],
    mine: set[int],
    size: int,
    generator: torch.Generator,
    streams: Sequence[str],
) -> Iterator[tuple[list[Any], dict[str, torch.Tensor]]]:
    """This rank's nft micro-batches of at most ``size`` items of one group
    (:func:`nft_groups`) and their noise. The noise is drawn as world size 1 draws it
    (one ``randn`` per stream for each ``size`` items of a group, group by group) and each
    of this rank's items keeps its own rows; a micro-batch made of one such draw whole
    (always, at world size 1) gets that draw itself."""
    for items in groups:
        kept: list[Any] = []
        rows: dict[str, list[torch.Tensor]] = {name: [] for name in streams}
        for start in range(0, len(items), size):
            chunk = items[start : start + size]
            noise = {name: torch.randn((len(chunk), *chunk[0][2][name].shape), generator=generator) for name in streams}
            if not kept and all(item[0] in mine for item in chunk):
                yield chunk, noise
                continue
            for row, item in enumerate(chunk):
                if item[0] not in mine:
                    continue
                kept.append(item)
                for name in streams:
                    rows[name].append(noise[name][row])
                if len(kept) == size:
                    yield kept, {name: torch.stack(values) for name, values in rows.items()}
                    kept, rows = [], {name: [] for name in streams}
        if kept:
            yield kept, {name: torch.stack(values) for name, values in rows.items()}


def _reward(sample: Sample) -> float:
    """A sample's reward for the metrics (NaN when it has none)."""
    return float("nan") if sample.reward is None else float(sample.reward)


def _accumulate(sums: dict[str, float], loss: torch.Tensor, metrics: dict[str, Any], weight: float) -> None:
    """Add one micro-batch's loss and metrics, weighted by its share of the step."""
    sums["loss"] += float(loss.detach()) * weight
    for key, value in metrics.items():
        if key != "loss":
            sums[key] += float(value.detach() if torch.is_tensor(value) else value) * weight


def _per_step_summary(per_step: dict[str, list[float]]) -> dict[str, Any]:
    """``train/<key>`` (mean over the rollout's optimizer steps) and
    ``train/<key>_per_step`` (the list)."""
    result: dict[str, Any] = {}
    for key, values in per_step.items():
        result[f"train/{key}"] = sum(values) / len(values)
        result[f"train/{key}_per_step"] = values
    return result
