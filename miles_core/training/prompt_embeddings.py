"""``--precompute-prompt-embeddings`` in a run: which prompts it will request, where the
store applies, and handing the store to the engine, the trainer and the servers it starts.

:func:`precompute_prompt_embeddings` is the one call in :func:`~.run.prepare_run`. It
builds the requests the run will send exactly as the rollout and the evaluation build
them (training prompts of ``--prompt-data``, every ``--eval-prompt-data`` set; SFT rows
with :func:`~.sft.sft_request`), so ``family.resolve_params`` gives the parameters the
engine will see, and encodes each distinct one once (:mod:`miles_core.engine.prompt_store`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from miles_core.config.model import Config
from miles_core.engine.embedded import EmbeddedEngine
from miles_core.engine.prompt_store import FLAG, PromptStore, conditioning_key, write_manifest
from miles_core.request import RolloutRequest

Log = Callable[[str], None]

MANIFEST = "prompt_embeddings.json"
"""The run folder's manifest that the serve-engine servers it starts read (``--prompt-embeddings``)."""


def cache_folder(config: Config, out: Path) -> Path:
    """``--prompt-embeddings-cache``, else ``OUTPUT_DIR/prompt_embeddings``."""
    return Path(config.prompt_embeddings_cache) if config.prompt_embeddings_cache else out / "prompt_embeddings"


def not_applicable(config: Config) -> str | None:
    """Why the store cannot serve this run (None when it can): engines that encode
    themselves (any but the embedded engine and an http fleet the run starts, plugins'
    engines included), or prompts that are not known at start-up."""
    if config.rollout_engine == "sglang":
        return "sglang-diffusion servers encode prompts themselves"
    if config.rollout_engine not in ("embedded", "http"):
        return f"--rollout-engine {config.rollout_engine} encodes prompts itself"
    if config.get("use_ray"):
        return "under --use-ray the engine and trainer load their models on Ray actors"
    if config.rollout_engine == "http" and config.rollout_engine_urls:
        return "servers given by --rollout-engine-urls encode prompts themselves (start them with serve-engine --prompt-embeddings)"
    for dest, flag, why in (
        ("data_source_path", "--data-source-path", "its prompts are unknown at start"),
        ("disable_rollout_global_dataset", "--disable-rollout-global-dataset", "the prompts are unknown at start"),
        ("rollout_function_path", "--rollout-function-path", "a custom rollout supplies its own prompts"),
        ("eval_function_path", "--eval-function-path", "a custom evaluation supplies its own requests"),
        ("custom_generate_function_path", "--custom-generate-function-path", "a custom generate function may change the requests"),
    ):
        if config.get(dest):
            return f"{flag}: {why}"
    return None


def run_requests(config: Config, records: Sequence[Any], *, supervised: bool) -> list[RolloutRequest]:
    """One request per prompt the run will send, built as the rollout, the evaluation and
    SFT build them (seeds and step selections do not enter an encoding)."""
    if supervised:
        from miles_core.training.sft import sft_request

        return [sft_request(config, row.prompt) for row in records]
    from miles_core.config.eval_config import eval_datasets
    from miles_core.rollout.evaluation import eval_requests
    from miles_core.rollout.generate import RolloutSettings
    from miles_core.rollout.seeds import Microgroup

    settings = RolloutSettings.from_config(config)
    microgroup = Microgroup(group_index=0, offset=0, size=1, seed=0)
    requests = [settings.request(record.prompt, microgroup, (), (), image=record.image) for record in records]
    from miles_core.training.evaluation import load_eval_records

    for dataset in eval_datasets(config):  # each eval set's requests as the evaluation makes them (its own keys and steps)
        requests += eval_requests(config, load_eval_records(config, dataset), dataset)
    return requests


def distinct(family: Any, requests: Sequence[RolloutRequest]) -> list[RolloutRequest]:
    """``requests`` with one per distinct conditioning key, in first-seen order."""
    seen: dict[Any, RolloutRequest] = {}
    for request in requests:
        seen.setdefault(conditioning_key(request.prompt, request.negative_prompt, family.resolve_params(request)), request)
    return list(seen.values())


def precompute_prompt_embeddings(
    config: Config, records: Sequence[Any], *, engine: Any, trainer: Any, out: Path, supervised: bool, log: Log
) -> PromptStore | None:
    """Build the run's store (or say in one line why it cannot apply, leaving the
    per-engine cache as it is), free the text encoders and hand it on: to the embedded
    engine's conditioning cache, the trainer's SFT cache, and, for servers the run starts,
    a manifest ``out/prompt_embeddings.json`` they load. Returns the store (None: off)."""
    manifest = out / MANIFEST
    manifest.unlink(missing_ok=True)  # a resumed run's old one must not reach new servers
    if not config.precompute_prompt_embeddings:
        return None
    why = not_applicable(config)
    if why is None and not supervised and engine is None and not config.get("rollout_num_engines"):
        why = "no engine generates in this run"
    if why is not None:
        log(f"{FLAG}: does not apply ({why}); prompts are encoded per engine as without it")
        return None
    if isinstance(engine, EmbeddedEngine):
        family = engine.family  # shared with the trainer
    else:
        family = trainer.family
    requests = distinct(family, run_requests(config, records, supervised=supervised))
    folder = cache_folder(config, out)
    store = PromptStore.build(family, requests, folder, log=log)
    if config.rollout_engine == "http":
        write_manifest(manifest, folder, requests)
    store.free_encoders()
    if isinstance(engine, EmbeddedEngine):
        engine.conditioning_cache.store = store
    prompt_cache = getattr(trainer, "prompt_cache", None)
    if prompt_cache is not None:
        prompt_cache.store = store
    stats = store.stats
    log(
        f"{FLAG}: {len(store.entries)} prompt encodings ({stats.loaded} from {folder}, {stats.encoded} encoded, "
        f"{stats.rebuilt} rebuilt) in {stats.total_s:.2f}s; text encoders freed ({store.freed_bytes / 2**20:.1f} MiB)"
    )
    return store


def server_arguments(config: Config, out: Path) -> list[str]:
    """The serve-engine arguments that preload the run's store (none when it does not apply)."""
    manifest = out / MANIFEST
    return ["--prompt-embeddings", str(manifest.absolute())] if config.precompute_prompt_embeddings and manifest.is_file() else []
