"""A resolved configuration as a plain document: what ``miles-core config`` prints and
a run writes to ``config.yaml``: every flag by group (secrets redacted), the derived
values, the component each slot uses and who provides it, and where each non-default
value came from."""

from __future__ import annotations

from typing import Any

from miles_core.config.model import Config, Source


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


SECRET_FLAGS = ("wandb_key", "api_key")
"""Values never written out (config.yaml, ``miles-core config``, W&B)."""


def user_values(config: Config, *, leave_out: tuple[str, ...] = ()) -> dict[str, Any]:
    """The values the user set (command line or ``--custom-config-path``) as a flat mapping
    of dest to plain value, which ``--custom-config-path`` reads back: what a process the
    run starts (a reward worker's ``serve-reward``) resolves its configuration from.
    :data:`SECRET_FLAGS` and ``leave_out`` are left out."""
    return {
        dest: _plain(config.get(dest))
        for dest in config
        if config.source(dest).user_set and dest not in SECRET_FLAGS and dest not in leave_out
    }


def config_document(config: Config) -> dict[str, Any]:
    document: dict[str, Any] = {}
    for group, values in config.as_dict().items():
        document[group] = {dest: "<redacted>" if dest in SECRET_FLAGS and value else _plain(value) for dest, value in values.items()}
    document["resolved"] = {
        "model_family": config.model_family,
        "world_size": config.world_size,
        "data_parallel_size": config.data_parallel_size,
        "sglang_args": list(config.sglang_args),
    }
    document["components"] = {
        slot: {"name": component.name, "provided_by": component.provider} for slot, component in sorted(config.components.items())
    }
    document["sources"] = {dest: config.source(dest).value for dest in config if config.source(dest) is not Source.DEFAULT}
    return document
