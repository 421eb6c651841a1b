"""Building the engine a configuration selects with ``--rollout-engine``."""

from __future__ import annotations

from typing import Any

from miles_core.engine.base import RolloutEngine


def create_engine(config: Any, **options: Any) -> RolloutEngine:
    """The registered engine named by ``config.rollout_engine``, built with its
    ``from_config`` (``options`` passed on: a run gives an engine that starts its own
    servers the run's secret as ``api_key``)."""
    from miles_core.plugin_manager import get_host

    engine_cls = get_host().registries.rollout_engine.get(config.rollout_engine).load()
    if not (isinstance(engine_cls, type) and issubclass(engine_cls, RolloutEngine)):
        raise TypeError(f"rollout engine {config.rollout_engine!r} is not a RolloutEngine subclass: {engine_cls!r}")
    return engine_cls.from_config(config, **options)


def sde_backend(config: Any) -> Any:
    """The step backend class of a run: ``--sde-step-backend-path``, or the registered
    ``--diffusion-sde-type``. The engine and the trainer both take theirs from here."""
    from miles_core.plugin_manager import get_host
    from miles_core.refs import resolve_path_flag

    if config.sde_step_backend_path:
        return resolve_path_flag("--sde-step-backend-path", config.sde_step_backend_path, "sde_backend")
    return get_host().registries.sde_backend.get(config.diffusion_sde_type).load()
