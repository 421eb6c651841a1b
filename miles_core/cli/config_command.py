"""``miles-core config [train flags]``: resolve and validate a run's configuration and
print it as YAML: every flag by group, derived values, the component each slot uses
and the plugin that provides it, and where each non-default value came from."""

from __future__ import annotations

import sys
from typing import Any, Sequence

from miles_core.config.errors import ConfigError
from miles_core.config.model import Config, Source
from miles_core.config.resolve import resolve_config, training_errors


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


SECRET_FLAGS = ("wandb_key",)
"""Values never written out (config.yaml, ``miles-core config``, W&B)."""


def config_document(config: Config) -> dict[str, Any]:
    document: dict[str, Any] = {}
    for group, values in config.as_dict().items():
        document[group] = {
            dest: "<redacted>" if dest in SECRET_FLAGS and value else _plain(value) for dest, value in values.items()
        }
    document["resolved"] = {
        "model_family": config.model_family,
        "world_size": config.world_size,
        "data_parallel_size": config.data_parallel_size,
        "sglang_args": list(config.sglang_args),
    }
    document["components"] = {
        slot: {"name": component.name, "provided_by": component.provider}
        for slot, component in sorted(config.components.items())
    }
    document["sources"] = {
        dest: config.source(dest).value for dest in config if config.source(dest) is not Source.DEFAULT
    }
    return document


def resolve_for_command(argv: Sequence[str], prog: str, *, training: bool) -> Config | None:
    """Resolve a command line, printing every error (one line each) and warning; None
    when the configuration is bad. Rules only a training run needs are errors for
    ``train`` and warnings for ``config``."""
    try:
        config = resolve_config(argv, prog=prog)
        later = training_errors(config)
        if training and later:
            raise ConfigError(later)
    except ConfigError as exc:
        for message in exc.messages:
            print(f"{prog}: error: {message}", file=sys.stderr)
        return None
    for note in config.notes:
        print(f"{prog}: warning: {note}", file=sys.stderr)
    if not training:
        for message in later:
            print(f"{prog}: warning: a training run would stop here: {message}", file=sys.stderr)
    return config


def run(argv: Sequence[str], prog: str = "miles-core config") -> int:
    import yaml

    config = resolve_for_command(argv, prog, training=False)
    if config is None:
        return 2
    sys.stdout.write(yaml.safe_dump(config_document(config), sort_keys=False, default_flow_style=False))
    return 0
