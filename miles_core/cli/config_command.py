"""``miles-core config [train flags]``: resolve and validate a run's configuration and
print it as YAML: every flag by group, derived values, the component each slot uses
and the plugin that provides it, and where each non-default value came from."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from miles_core.config.document import config_document
from miles_core.config.model import Config
from miles_core.config.resolve import resolve_config, training_errors
from miles_core.errors import ConfigError


def resolve_for_command(argv: Sequence[str], prog: str, *, training: bool) -> Config:
    """Resolve a command line, printing every warning; a bad configuration raises
    :class:`~miles_core.errors.ConfigError` with every violation. Rules only a training
    run needs are errors for ``train`` and warnings for ``config``."""
    config = resolve_config(argv, prog=prog)
    later = training_errors(config)
    if training and later:
        raise ConfigError(later)
    for note in config.notes:
        print(f"{prog}: warning: {note}", file=sys.stderr)
    if not training:
        for message in later:
            print(f"{prog}: warning: a training run would stop here: {message}", file=sys.stderr)
    return config


def run(argv: Sequence[str], prog: str = "miles-core config") -> int:
    import yaml

    config = resolve_for_command(argv, prog, training=False)
    sys.stdout.write(yaml.safe_dump(config_document(config), sort_keys=False, default_flow_style=False))
    return 0
