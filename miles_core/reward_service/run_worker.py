"""The routes of ``miles-core serve-reward --run-worker``: a ``--use-ray`` run's reward
worker, which the run starts on its worker bundles (:mod:`miles_core.cluster.reward_worker`)
and alone calls. They extend the reward wire (docs/rewards.md, "The reward wire") with
what a run needs of its reward and a client of ``POST /score`` does not, so that N workers
give the run exactly what its in-process scorer would:

- ``POST /worker/describe`` ``{"evaluation": bool}``: ``{"reward": name, "group_rm": bool,
  "deterministic_algorithms": bool}`` of the run's scorer (its evaluation scorer, which
  shares the scorer's reward models, with ``evaluation``);
- ``POST /worker/score`` ``{"wire_version": 1, "evaluation": bool, "samples": [...]}``,
  the samples as in ``POST /score`` (float32 pixels, each with its ``group``, ``seed`` and
  ``index_in_group``): each sample is scored as the run scores it (its
  ``metadata.rm_type`` routed to that reward), and the answer is ``{"outcomes": [...]}``,
  per sample its ``reward``, ``components``, ``failed``, ``failures`` (per reward, whether
  it failed) and ``scored_by`` (per reward, why it failed or null), what the run's
  reward metrics are computed from;
- ``POST /worker/counters`` ``{"evaluation": bool, "rewards": [name], "prefix": str}``:
  ``{"counters": {key: number}}``, what each reward counted since last asked
  (``pop_metrics``).

Answers are written by Python's json and may hold ``NaN`` (a failed sample's reward), which
the run's client reads back. A reward that cannot be used (an unknown ``rm_type``, an
evaluation reward that cannot be built) answers 422 with the scorer's one-line error.
"""

from __future__ import annotations

import asyncio
import json
import math
import numbers
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from miles_core.errors import RequestError, RewardError
from miles_core.reward_service.server import STATE, RewardState, create_reward_app, parse_json, request_samples
from miles_core.reward_service.wire import decode_request

OUTCOME_KEYS = ("reward", "components", "failed", "failures", "scored_by")


def _flag(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise RequestError(name, f"expected true or false, got {value!r:.40}")
    return value


def _object(raw: bytes) -> dict[str, Any]:
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise RequestError("body", f"expected a JSON object, got {type(body).__name__}")
    return body


def _scorer(state: RewardState, evaluation: bool) -> Any:
    """The scorer (or, built once, the evaluation scorer sharing its reward models)."""
    scorer = state.require()
    if not evaluation:
        return scorer
    with state.evaluation_lock:
        if state.evaluation_scorer is None:
            from miles_core.training.rewards import RewardScorer

            state.evaluation_scorer = RewardScorer(state.config, evaluation=True, share=scorer)
        return state.evaluation_scorer


async def _describe(request: web.Request) -> web.Response:
    import torch

    body = _object(await request.read())
    scorer = await asyncio.to_thread(_scorer, request.app[STATE], _flag(body, "evaluation"))
    return web.json_response(
        {
            "reward": scorer.name,
            "group_rm": scorer.needs_whole_groups,
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        }
    )


def encode_outcome(sample: Any, scored_by: Mapping[str, str | None]) -> dict[str, Any]:
    """What scoring set on ``sample`` and :meth:`RewardScorer.take_outcome` returned for it."""
    return {
        "reward": float(sample.reward),
        "components": {str(k): float(v) for k, v in dict(sample.reward_components).items()},
        "failed": bool(sample.reward_failed),
        "failures": {str(k): bool(v) for k, v in dict(getattr(sample, "reward_failures", {}) or {}).items()},
        "scored_by": {str(k): v for k, v in dict(scored_by).items()},
    }


def decode_outcomes(body: Any, n: int) -> list[dict[str, Any]]:
    """``/worker/score``'s answer: ``n`` outcomes, checked; :class:`RewardError` (one line)
    for anything else."""
    outcomes = body.get("outcomes") if isinstance(body, dict) else None
    if not isinstance(outcomes, list) or len(outcomes) != n:
        got = f"{len(outcomes)} outcomes" if isinstance(outcomes, list) else type(outcomes).__name__
        raise RewardError(f"reward worker answer: expected {n} outcomes, got {got}")
    for i, outcome in enumerate(outcomes):
        if not isinstance(outcome, dict) or sorted(outcome) != sorted(OUTCOME_KEYS):
            raise RewardError(f"reward worker answer: outcomes[{i}] must hold exactly {', '.join(OUTCOME_KEYS)}")
        reward = outcome["reward"]
        if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
            raise RewardError(f"reward worker answer: outcomes[{i}].reward must be a number, got {reward!r:.40}")
        for key in ("components", "failures", "scored_by"):
            if not isinstance(outcome[key], dict):
                raise RewardError(f"reward worker answer: outcomes[{i}].{key} must be an object")
        if not isinstance(outcome["failed"], bool) or math.isnan(float(reward)) != outcome["failed"]:
            raise RewardError(f"reward worker answer: outcomes[{i}]: a sample has failed exactly when its reward is NaN")
    return outcomes


async def _score(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.require()
    body = _object(await request.read())
    evaluation = _flag(body, "evaluation")
    body.pop("evaluation", None)
    parsed = await asyncio.to_thread(decode_request, body, max_samples=state.max_samples, max_values=state.max_values)
    scorer = await asyncio.to_thread(_scorer, state, evaluation)
    samples = request_samples(parsed, scorer.needs_whole_groups)
    try:
        await scorer.score(samples)
    finally:  # the scorer keeps each sample's outcome until it is taken
        scored_by = [scorer.take_outcome(sample) for sample in samples]
    return web.json_response({"outcomes": [encode_outcome(s, o) for s, o in zip(samples, scored_by)]}, dumps=json.dumps)


async def _counters(request: web.Request) -> web.Response:
    body = _object(await request.read())
    rewards = body.get("rewards")
    prefix = body.get("prefix", "")
    if not isinstance(rewards, list) or not all(isinstance(name, str) for name in rewards):
        raise RequestError("rewards", "expected a list of reward names")
    if not isinstance(prefix, str):
        raise RequestError("prefix", f"expected a string, got {type(prefix).__name__}")
    scorer = await asyncio.to_thread(_scorer, request.app[STATE], _flag(body, "evaluation"))
    return web.json_response({"counters": scorer.pop_counters(rewards, prefix)}, dumps=json.dumps)


def create_worker_app(config: Any, **options: Any) -> web.Application:
    """:func:`~miles_core.reward_service.server.create_reward_app` for a run's reward worker
    (same ``options``): ``/health``, ``/info`` and the ``/worker/*`` routes;
    :func:`~miles_core.reward_service.server.start_reward_server` starts it."""
    app = create_reward_app(config, **options, worker=True)
    app.add_routes([web.post("/worker/describe", _describe), web.post("/worker/score", _score), web.post("/worker/counters", _counters)])
    return app


__all__ = ["OUTCOME_KEYS", "create_worker_app", "decode_outcomes", "encode_outcome"]
