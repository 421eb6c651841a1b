"""A run's memory plan: what each training rank and each engine holds at each phase of the
run, the peak against the device's memory, and the smallest change that makes it fit.

The counts come from :func:`~miles_core.planning.measure.measure_run` (the meta device:
exact bytes of weights, adapters, master copies, gradients, optimizer state, and the
activations and transients of one micro-batch, one sampling forward and one decode). What
a one-process count cannot see is added by a stated rule (docs/design.md, "Planning
memory"):

- **FSDP** (training ranks > 1): the trained components and their training state are
  divided by the ranks; two of the largest block's unsharded weights are added (the
  block being gathered and the one prefetched).
- **Sequence parallelism** (``--sequence-parallel-size`` S): a micro-batch's activations are
  divided by S (each rank holds its share of the tokens).
- **The allocator's slack** is not added: the plan is a floor, to be compared with a GPU
  that has the whole of ``--gpu-memory-gb`` free.

Phases follow the code path: one rank loads the whole pipeline onto its device; with
several, each builds the trained components on the meta device and receives its shard
from rank 0, one full tensor at a time (``load``); the embedded engine samples in the training process
(``rollout``: sampling forward or decode, whichever is larger); ``train`` is one micro-batch
through its optimizer step. ``--precompute-prompt-embeddings`` frees the text encoders after
the start. A rollout's samples are held on the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from miles_core.planning.measure import Measurements

GIB = 1 << 30


@dataclass(frozen=True)
class Term:
    """Bytes one thing holds at a phase."""

    name: str
    nbytes: int
    detail: str = ""


@dataclass(frozen=True)
class Phase:
    """What is resident at one phase's peak."""

    name: str
    terms: tuple[Term, ...]

    @property
    def nbytes(self) -> int:
        return sum(term.nbytes for term in self.terms)

    def largest(self) -> Term:
        return max(self.terms, key=lambda term: term.nbytes)


@dataclass(frozen=True)
class Setting:
    """The memory-relevant choices of a run, the ones a fix may change."""

    world: int
    """Training ranks (FSDP shards over them)."""
    sequence_parallel: int
    gradient_checkpointing: bool
    precompute_prompt_embeddings: bool
    embedded_engine: bool
    microgroup: int = 1
    """Outputs an engine samples at once (``--rollout-microgroup-size``)."""
    vae_tiling: bool = False

    @classmethod
    def from_config(cls, config: Any) -> Setting:
        return cls(
            world=int(config.world_size),
            sequence_parallel=int(config.sequence_parallel_size),
            gradient_checkpointing=bool(config.gradient_checkpointing),
            precompute_prompt_embeddings=bool(config.precompute_prompt_embeddings),
            embedded_engine=config.rollout_engine == "embedded",
            microgroup=int(config.rollout_microgroup_size),
            vae_tiling=bool(config.vae_tiling),
        )

    def flags(self, base: Setting) -> list[str]:
        """The command-line changes from ``base`` to this setting."""
        out = []
        if self.gradient_checkpointing and not base.gradient_checkpointing:
            out.append("--gradient-checkpointing")
        if self.precompute_prompt_embeddings and not base.precompute_prompt_embeddings:
            out.append("--precompute-prompt-embeddings")
        if self.world != base.world:
            nodes, per_node = (1, self.world) if self.world <= 8 else (self.world // 8, 8)
            out.append(f"--actor-num-nodes {nodes} --actor-num-gpus-per-node {per_node} ({self.world} training GPUs)")
        if self.sequence_parallel != base.sequence_parallel:
            out.append(f"--sequence-parallel-size {self.sequence_parallel}")
        if self.microgroup != base.microgroup:
            out.append(f"--rollout-microgroup-size {self.microgroup}")
        if self.vae_tiling and not base.vae_tiling:
            out.append("--vae-tiling")
        return out


@dataclass(frozen=True)
class Fix:
    """The smallest change found that makes the plan fit."""

    flags: tuple[str, ...]
    peak: int
    phase: str


@dataclass
class MemoryPlan:
    """A plan for one configuration (see the module docstring)."""

    measurements: Measurements
    setting: Setting
    capacity: int
    capacity_source: str
    rank: list[Phase]
    engine: list[Phase] | None
    host: list[Term]
    load_host: list[Term]
    """Host memory held only while the ranks load (:func:`load_host_terms`)."""
    on_host: bool
    """The run computes on the host (no GPU): the host terms count against the capacity too,
    and so does every training rank's share (they all run on this host)."""
    fix: Fix | None = None
    notes: list[str] = field(default_factory=list)

    def peak(self) -> Phase:
        """The training rank's phase with the most bytes (host terms added when the run
        computes on the host)."""
        phases = self.rank
        if self.on_host:
            # Every training rank of the run computes on this host (a local Ray cluster):
            # the host holds each rank's share, and the rollout's samples once.
            ranks = self.setting.world
            phases = [
                Phase(
                    p.name,
                    (
                        *(Term(f"{t.name} x {ranks} ranks", t.nbytes * ranks, t.detail) for t in p.terms),
                        *self.host,
                        *(self.load_host if p.name == "load" else ()),
                    ),
                )
                if ranks > 1
                else Phase(p.name, (*p.terms, *self.host))
                for p in phases
            ]
        return max(phases, key=lambda phase: phase.nbytes)

    def engine_peak(self) -> Phase | None:
        return None if not self.engine else max(self.engine, key=lambda phase: phase.nbytes)

    @property
    def fits(self) -> bool:
        engine = self.engine_peak()
        return self.peak().nbytes <= self.capacity and (engine is None or engine.nbytes <= self.capacity)

    def as_dict(self) -> dict[str, Any]:
        """The plan as JSON-able data (``miles-core plan --json``)."""

        def phases(items: list[Phase] | None) -> list[dict[str, Any]] | None:
            if items is None:
                return None
            return [{"phase": p.name, "bytes": p.nbytes, "terms": [asdict(t) for t in p.terms]} for p in items]

        peak = self.peak()
        engine = self.engine_peak()
        return {
            "checkpoint": self.measurements.checkpoint,
            "family": self.measurements.family,
            "dtype": self.measurements.dtype,
            "size": {"height": self.measurements.height, "width": self.measurements.width, "frames": self.measurements.num_frames},
            "micro_batch": self.measurements.micro_batch,
            "microgroup": self.measurements.microgroup,
            "setting": asdict(self.setting),
            "components": [asdict(c) for c in self.measurements.components],
            "activations": {
                ("with" if gc else "without") + "_gradient_checkpointing": asdict(count) for gc, count in self.measurements.step.items()
            },
            "training_rank": phases(self.rank),
            "engine": phases(self.engine),
            "host": [asdict(t) for t in self.host],
            "host_while_loading": [asdict(t) for t in self.load_host],
            "peak": {"phase": peak.name, "bytes": peak.nbytes, "largest_term": asdict(peak.largest())},
            "engine_peak": None if engine is None else {"phase": engine.name, "bytes": engine.nbytes},
            "capacity": {"bytes": self.capacity, "source": self.capacity_source},
            "fits": self.fits,
            "fix": None if self.fix is None else asdict(self.fix),
            "notes": [*self.measurements.notes, *self.notes],
        }


def gib(nbytes: int) -> str:
    """Bytes for people: MiB below 1 GiB, two decimals below 10 GiB, one above."""
    if nbytes < GIB:
        return f"{nbytes / (1 << 20):.1f} MiB"
    return f"{nbytes / GIB:.2f} GiB" if nbytes < 10 * GIB else f"{nbytes / GIB:.1f} GiB"


def _shard(nbytes: int, world: int) -> int:
    return -(-nbytes // world)


def rank_phases(m: Measurements, s: Setting) -> list[Phase]:
    """A training rank's phases at setting ``s`` (the module docstring's rules)."""
    sharded = f"sharded 1/{s.world}" if s.world > 1 else "whole"
    if s.world > 1:
        # Each rank builds the trained components on the meta device and receives its shard
        # from rank 0, one full tensor at a time (miles_core.training.rank_loading).
        whole = [
            Term(f"{c.name} weights", _shard(c.nbytes, s.world), f"{c.dtype}, {c.parameters / 1e9:.2f}B params, {sharded}")
            if c.role == "trained"
            else Term(f"{c.name} weights", c.nbytes, f"{c.dtype}, {c.parameters / 1e9:.2f}B params, whole")
            for c in m.components
        ]
        whole.append(Term("tensor in flight", m.largest_tensor, "the largest trained tensor, broadcast whole from rank 0"))
    else:
        whole = [Term(f"{c.name} weights", c.nbytes, f"{c.dtype}, {c.parameters / 1e9:.2f}B params, whole") for c in m.components]
    resident = []
    for c in m.components:
        if c.role == "trained":
            resident.append(Term(f"{c.name} weights", _shard(c.nbytes, s.world), f"{c.dtype}, {c.parameters / 1e9:.2f}B params, {sharded}"))
        elif c.role == "encoder" and s.precompute_prompt_embeddings:
            continue  # freed once the prompts are encoded
        else:
            resident.append(Term(f"{c.name} weights", c.nbytes, f"{c.dtype}, frozen, whole"))
    state = [
        Term(name.replace("_", " "), _shard(nbytes, s.world), sharded)
        for name, nbytes in m.train_state.items()
        if nbytes and name != "gradients"
    ]
    phases = [Phase("load", tuple(whole))]
    sampling = rollout_term(m, s)
    if s.embedded_engine and sampling.nbytes:
        phases.append(Phase("rollout", (*resident, *state, sampling)))
    train = [*resident, *state]
    grads = _shard(m.train_state.get("gradients", 0), s.world)
    optimizer = Term("gradients + optimizer step", grads + _shard(m.optimizer_peak, s.world), f"{sharded}; the step's temporaries")
    step = m.step.get(s.gradient_checkpointing)
    if step is not None:
        how = "with" if s.gradient_checkpointing else "without"
        split = f", tokens split {s.sequence_parallel} ways" if s.sequence_parallel > 1 else ""
        backward = Term(
            "micro-batch forward+backward",
            _shard(step.peak, s.sequence_parallel),
            f"micro-batch {m.micro_batch}, {how} gradient checkpointing{split}: activations held "
            f"{gib(_shard(step.retained, s.sequence_parallel))}, the backward's buffers included",
        )
        if backward.nbytes + grads >= optimizer.nbytes:
            train += [Term("gradients", grads, sharded), backward]
        else:
            train.append(optimizer)
    else:
        train.append(optimizer)
    if s.world > 1:
        train.append(Term("FSDP all-gather", 2 * m.largest_block, "two of the largest block's weights, unsharded"))
    phases.append(Phase("train", tuple(train)))
    return phases


def rollout_term(m: Measurements, s: Setting) -> Term:
    """The larger of a microgroup's sampling forward and one VAE decode call at ``s``."""
    sampling = m.sampling.at(s.microgroup)
    decode = m.decode.get(s.vae_tiling) or m.decode.get(False)
    chunk = min(m.decode_batch_size, s.microgroup)
    decoded = decode.at(chunk) if decode is not None else 0
    if sampling >= decoded:
        return Term("sampling forward", sampling, f"microgroup {s.microgroup}")
    tiled = ", tiled" if s.vae_tiling and True in m.decode else ""
    return Term("VAE decode", decoded, f"{chunk} output{'s' if chunk > 1 else ''} at once{tiled}, pixels included")


def engine_phases(m: Measurements, s: Setting) -> list[Phase]:
    """A separate engine's phases: its whole pipeline, then a microgroup's sampling or decode."""
    weights = tuple(Term(f"{c.name} weights", c.nbytes, f"{c.dtype}, whole") for c in m.components)
    return [Phase("load", weights), Phase("rollout", (*weights, rollout_term(m, s)))]


def host_terms(m: Measurements) -> list[Term]:
    """Host memory throughout the run: an SFT run's prompt cache at its bound, else a
    rollout's samples."""
    if m.sft_cache_bytes:
        return [Term("SFT prompt cache", m.sft_cache_bytes, "at its bound: the trainer's prompt encodings on the host")]
    if not m.trajectory_bytes:
        return []
    return [
        Term(
            "rollout samples",
            m.trajectory_bytes * m.samples_per_rollout,
            f"{m.samples_per_rollout} samples x {gib(m.trajectory_bytes)} (fp32 trajectory latents, conditioning, pixels)",
        )
    ]


def load_host_terms(m: Measurements, s: Setting) -> list[Term]:
    """Host memory while the ranks load: with several, rank 0's copy of the trained weights
    (each rank's shard is broadcast from it; freed once the trainer is built)."""
    if s.world < 2:
        return []
    trained = sum(c.nbytes for c in m.components if c.role == "trained")
    return [Term("rank 0's trained weights", trained, "while the ranks load: each rank's shard is broadcast from them")]


def build_plan(
    m: Measurements, s: Setting, *, capacity: int, capacity_source: str, on_host: bool, fix_options: dict[str, Any]
) -> MemoryPlan:
    """The plan of ``m`` at setting ``s``; when it does not fit, the first change of
    :func:`candidate_settings` that makes it fit is its :attr:`MemoryPlan.fix`."""
    plan = _plan(m, s, capacity, capacity_source, on_host)
    if not plan.fits:
        rollout = {
            "microgroups": [d for d in range(s.microgroup - 1, 0, -1) if m.n_samples_per_prompt % d == 0],
            "tiling": True in m.decode,
        }
        for candidate in candidate_settings(s, **rollout, **fix_options):
            trial = _plan(m, candidate, capacity, capacity_source, on_host)
            if trial.fits:
                peak = trial.peak()
                plan.fix = Fix(tuple(candidate.flags(s)), peak.nbytes, peak.name)
                break
    if not on_host and (m.trajectory_bytes or m.sft_cache_bytes):
        plan.notes.append(
            f"{'the SFT prompt cache is' if m.sft_cache_bytes else 'rollout samples are'} held in host memory, not on the device"
        )
    return plan


def _plan(m: Measurements, s: Setting, capacity: int, source: str, on_host: bool) -> MemoryPlan:
    return MemoryPlan(
        measurements=m,
        setting=s,
        capacity=capacity,
        capacity_source=source,
        rank=rank_phases(m, s),
        engine=None if s.embedded_engine else engine_phases(m, s),
        host=host_terms(m),
        load_host=load_host_terms(m, s),
        on_host=on_host,
    )


def candidate_settings(
    s: Setting,
    *,
    sequence_parallel: bool,
    precompute: bool,
    max_world: int = 64,
    microgroups: Sequence[int] = (),
    tiling: bool = False,
) -> list[Setting]:
    """The changes a fix may make, in the order they are tried (the least disruptive
    first): at the configured GPUs, then more training GPUs (doubling), then sequence
    parallelism over the ranks; at each, the training side (gradient checkpointing,
    precomputed prompt embeddings, both) and within that the rollout side (the VAE's
    tiling, then smaller ``microgroups``, largest first, each also tiled)."""
    rollout = [(s.microgroup, s.vae_tiling)]
    if tiling:
        rollout.append((s.microgroup, True))
    for size in microgroups:
        rollout += [(size, s.vae_tiling)] + ([(size, True)] if tiling else [])
    train = [(s.gradient_checkpointing, s.precompute_prompt_embeddings), (True, s.precompute_prompt_embeddings)]
    if precompute:
        train += [(s.gradient_checkpointing, True), (True, True)]
    layouts = [(s.world, s.sequence_parallel)]
    world = s.world * 2
    while world <= max_world:
        layouts.append((world, s.sequence_parallel))
        world *= 2
    if sequence_parallel:
        layouts += [(max(s.world, degree), degree) for degree in (2, 4, 8) if degree > s.sequence_parallel]
    unique: list[Setting] = []
    for world, degree in layouts:
        # Sequence parallelism is only tried with gradient checkpointing (it splits tokens,
        # a step without checkpointing keeps every layer's).
        for gc, pre in train if degree == s.sequence_parallel else [(True, p) for _, p in train]:
            for microgroup, tiled in rollout:
                candidate = replace(
                    s,
                    world=world,
                    sequence_parallel=degree,
                    gradient_checkpointing=gc,
                    precompute_prompt_embeddings=pre,
                    microgroup=microgroup,
                    vae_tiling=tiled,
                )
                if candidate != s and candidate not in unique:
                    unique.append(candidate)
    return unique


def render(plan: MemoryPlan) -> str:
    """The plan as the text ``miles-core plan`` prints."""
    m = plan.measurements
    frames = f"x{m.num_frames} frames" if m.num_frames else ""
    s = plan.setting
    lines = [
        f"memory plan: {m.checkpoint} (family {m.family}), {m.dtype}, {m.height}x{m.width}{frames}, "
        f"micro-batch {m.micro_batch}, microgroup {m.microgroup}{', CFG' if m.cfg else ''}, "
        f"{s.world} training rank{'s' if s.world > 1 else ''}"
        + (f", sequence parallel {s.sequence_parallel}" if s.sequence_parallel > 1 else ""),
        "",
        "components:",
    ]
    for c in m.components:
        lines.append(f"  {c.name:<18} {c.class_name:<34} {c.parameters / 1e9:>7.3f}B params  {c.dtype:<9} {gib(c.nbytes):>10}  {c.role}")
    if m.step:
        lines.append("")
        lines.append("one micro-batch (counted on the meta device):")
        for gc, count in sorted(m.step.items()):
            how = "with   " if gc else "without"
            lines.append(
                f"  {how} gradient checkpointing: saved for backward {gib(count.saved)}, held {gib(count.retained)}, step peak {gib(count.peak)}"
            )
    lines.append("")
    lines.append(f"training rank ({'the run computes on the host' if plan.on_host else 'device'}):")
    for phase in plan.rank:
        lines.append(f"  {phase.name}: {gib(phase.nbytes)}")
        for term in phase.terms:
            lines.append(f"    {term.name:<28} {gib(term.nbytes):>10}  {term.detail}")
    if plan.engine:
        lines.append("each engine (device):")
        for phase in plan.engine:
            lines.append(f"  {phase.name}: {gib(phase.nbytes)}")
    if plan.host or plan.load_host:
        lines.append("host:")
        for term in (*plan.host, *plan.load_host):
            lines.append(f"  {term.name:<30} {gib(term.nbytes):>10}  {term.detail}")
    peak = plan.peak()
    lines.append("")
    verdict = "fits" if plan.fits else "does NOT fit"
    lines.append(
        f"peak: {gib(peak.nbytes)} at {peak.name} (largest term: {peak.largest().name}, {gib(peak.largest().nbytes)}) "
        f"of {gib(plan.capacity)} ({plan.capacity_source}): {verdict}"
    )
    if not plan.fits:
        if plan.fix is not None:
            lines.append(f"fix: {' '.join(plan.fix.flags)} -> peak {gib(plan.fix.peak)} at {plan.fix.phase}")
        else:
            lines.append(
                "fix: no change the planner tries (gradient checkpointing, precomputed prompts, smaller microgroups, VAE "
                "tiling, up to 64 GPUs, sequence parallelism) fits"
            )
    for note in [*m.notes, *plan.notes]:
        lines.append(f"note: {note}")
    return "\n".join(lines)


__all__ = [
    "GIB",
    "Fix",
    "MemoryPlan",
    "Phase",
    "Setting",
    "Term",
    "build_plan",
    "candidate_settings",
    "engine_phases",
    "gib",
    "host_terms",
    "load_host_terms",
    "rank_phases",
    "render",
    "rollout_term",
]
