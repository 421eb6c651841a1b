"""Configuration rules of ``--compile`` (regional compilation of the transformer's
repeated blocks, :mod:`miles_core.regional_compile`): combinations that cannot work and
a machine that cannot compile are one-line errors before any model loads."""

from __future__ import annotations

from miles_core.config.model import Config


def compile_errors(config: Config, *, gpus: int) -> list[str]:
    """One line per reason ``--compile`` cannot run in this configuration."""
    if not config.get("compile"):
        return []
    errors = []
    if config.get("use_ray") and config.world_size > 1:
        # fully_shard wraps the same blocks the compile wraps, and its parameter
        # all-gathers run in hooks around them; that pairing is not verified here.
        errors.append(
            f"--compile with {config.world_size} training ranks (FSDP2 shards the blocks --compile compiles, "
            "which is not supported yet): train on one rank (--actor-num-nodes 1 --actor-num-gpus-per-node 1) "
            "or drop --compile"
        )
    sp = int(config.get("sequence_parallel_size") or 1)
    if sp > 1:
        # The sequence-parallel attention processors exchange tokens between ranks inside
        # the blocks: collectives a compiled block graph would have to capture.
        errors.append(
            f"--compile with --sequence-parallel-size {sp} (its attention exchanges tokens between ranks inside the "
            "blocks --compile compiles, which is not supported yet): drop one of them"
        )
    from miles_core.regional_compile import compile_unavailable

    problem = compile_unavailable(cuda=gpus > 0)
    if problem is not None:
        errors.append(f"--compile: {problem}; drop --compile to run eager")
    return errors


__all__ = ["compile_errors"]
