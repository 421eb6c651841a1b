"""``--use-distributed-post``: how many post actors each node runs.

The reference reads the count from the environment, ``MILES_HTTP_POST_ACTORS_PER_NODE``
(default 1); so does miles-core. The value is checked when the configuration resolves, so
a bad one stops the run before anything starts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

POST_ACTORS_ENV = "MILES_HTTP_POST_ACTORS_PER_NODE"
DEFAULT_POST_ACTORS = 1


def post_actors_per_node(environ: Mapping[str, str] | None = None) -> int:
    """``MILES_HTTP_POST_ACTORS_PER_NODE`` (unset or empty: 1); ``ValueError`` with a
    one-line message naming the variable unless it is a positive integer."""
    raw = (os.environ if environ is None else environ).get(POST_ACTORS_ENV, "").strip()
    if not raw:
        return DEFAULT_POST_ACTORS
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{POST_ACTORS_ENV}={raw!r}: the post actors per node (--use-distributed-post) must be a positive integer")
    return value


def distributed_post_errors(config: Any) -> list[str]:
    """The rules of ``--use-distributed-post``: a Ray run (the post actors are Ray actors),
    posting to engine servers the run starts (it knows their nodes; the driver posts to
    servers given by URL), not through the miles router (which posts from its own
    process), and a valid ``MILES_HTTP_POST_ACTORS_PER_NODE``."""
    if not config.get("use_distributed_post"):
        return []
    errors = []
    if not config.get("use_ray"):
        errors.append("--use-distributed-post requires --use-ray (its post actors are Ray actors on the engines' nodes)")
    engine = config.get("rollout_engine")
    if engine not in ("embedded", "http", "sglang") or (engine == "http" and config.get("rollout_engine_urls")):
        given = "--rollout-engine-urls" if engine == "http" else f"--rollout-engine {engine}"
        errors.append(
            f"--use-distributed-post posts to the engine servers the run starts on its nodes; {given} names none "
            "(drop --use-distributed-post: the driver posts to them)"
        )
    if config.get("use_miles_router"):
        errors.append(
            "--use-distributed-post and --use-miles-router cannot be combined: the router posts the requests from its own process"
        )
    try:
        post_actors_per_node()
    except ValueError as exc:
        errors.append(str(exc))
    return errors


__all__ = ["DEFAULT_POST_ACTORS", "POST_ACTORS_ENV", "distributed_post_errors", "post_actors_per_node"]
