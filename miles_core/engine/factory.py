"""Building the engine a configuration selects with ``--rollout-engine``."""

from __future__ import annotations

from typing import Any

from miles_core.engine.base import RolloutEngine


def create_engine(config: Any) -> RolloutEngine:
    """The registered engine named by ``config.rollout_engine``, built with its
    ``from_config``."""
    from miles_core.plugin_manager import get_host

    engine_cls = get_host().registries.rollout_engine.get(config.rollout_engine).load()
    if not (isinstance(engine_cls, type) and issubclass(engine_cls, RolloutEngine)):
        raise TypeError(f"rollout engine {config.rollout_engine!r} is not a RolloutEngine subclass: {engine_cls!r}")
    return engine_cls.from_config(config)
