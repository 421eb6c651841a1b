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
  ``metadata.rm_type`` routed to that reward), and the answer is ``{"outcomes": [...],
  "warnings": [...]}``: per sample its ``reward``, ``components``, ``failed``,
  ``failures`` (per reward, whether it failed) and ``scored_by`` (per reward, why it
  failed or null), what the run's reward metrics are computed from; and the scorer's
  warnings since the last answer (which failed samples and why), which the run logs;
- ``POST /worker/counters`` ``{"evaluation": bool, "rewards": [name], "prefix": str}``:
  ``{"counters": {key: number}}``, what each reward counted since last asked
  (``pop_metrics``).

A worker takes requests of any size: its run, its only client (it holds the secret), sends
each call's chunk whole, as the scorer in one process gets it. Answers are written by
Python's json and may hold ``NaN`` (a failed sample's reward), which the run's client reads
back. A reward that cannot be used (an unknown ``rm_type``, an evaluation reward that
cannot be built) answers 422 with the scorer's one-line error.
"""

from __future__ import annotations

import asyncio
import json
import math
import numbers
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from miles_core.errors import RequestError, RewardError
from miles_core.reward_service.server import STATE, create_reward_app, parse_json, request_samples
from miles_core.reward_service.wire import decode_request

OUTCOME_KEYS = ("reward", "components", "failed", "failures", "scored_by")
"""The fields of one sample's outcome in ``/worker/score``'s answer."""

NO_LIMIT = sys.maxsize
"""A worker's sample, value and body limits: none (see the module docstring)."""


@dataclass
class WorkerState:
    """What the worker routes keep beside the server's :class:`RewardState`."""

    evaluation_scorer: Any = None
    """The evaluation scorer, sharing the scorer's models (built when first asked)."""
    warnings: list[str] = field(default_factory=list)
    """The scorers' warnings not yet sent back."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def warn(self, message: str) -> None:
        with self.lock:
            self.warnings.append(message)

    def take_warnings(self) -> list[str]:
        with self.lock:
            taken, self.warnings = self.warnings, []
        return taken


WORKER = web.AppKey("reward_worker_state", WorkerState)


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


def _scorer(app: web.Application, evaluation: bool) -> Any:
    """The scorer (or, built once, the evaluation scorer sharing its reward models), its
    warnings kept for the run (in a thread: building may load a model)."""
    scorer = app[STATE].require()
    worker = app[WORKER]
    with worker.lock:
        scorer.warn = worker.warn
        if not evaluation:
            return scorer
        if worker.evaluation_scorer is None:
            from miles_core.training.rewards import RewardScorer

            worker.evaluation_scorer = RewardScorer(app[STATE].config, evaluation=True, share=scorer, warn=worker.warn)
        return worker.evaluation_scorer


async def _describe(request: web.Request) -> web.Response:
    import torch

    body = _object(await request.read())
    scorer = await asyncio.to_thread(_scorer, request.app, _flag(body, "evaluation"))
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


def apply_outcome(sample: Any, outcome: Mapping[str, Any]) -> dict[str, str | None]:
    """Set on ``sample`` what scoring it in one process would have (:func:`encode_outcome`'s
    inverse: a failed sample is also removed); returns its ``scored_by``."""
    sample.reward = float(outcome["reward"])
    sample.reward_components = {k: float(v) for k, v in outcome["components"].items()}
    sample.reward_failures = {k: bool(v) for k, v in outcome["failures"].items()}
    sample.reward_failed = outcome["failed"]
    if outcome["failed"]:
        sample.remove_sample = True
    return dict(outcome["scored_by"])


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


def _parse_score(raw: bytes) -> tuple[bool, Any]:
    """A ``/worker/score`` body (in a thread: parsing and decoding take a while)."""
    body = _object(raw)
    evaluation = _flag(body, "evaluation")
    body.pop("evaluation", None)
    return evaluation, decode_request(body, max_samples=NO_LIMIT, max_values=NO_LIMIT)


async def _score(request: web.Request) -> web.Response:
    request.app[STATE].require()
    evaluation, parsed = await asyncio.to_thread(_parse_score, await request.read())
    scorer = await asyncio.to_thread(_scorer, request.app, evaluation)
    samples = request_samples(parsed, scorer.needs_whole_groups)
    try:
        await scorer.score(samples)
    finally:  # the scorer keeps each sample's outcome until it is taken
        scored_by = [scorer.take_outcome(sample) for sample in samples]
    outcomes = [encode_outcome(s, o) for s, o in zip(samples, scored_by)]
    return web.json_response({"outcomes": outcomes, "warnings": request.app[WORKER].take_warnings()}, dumps=json.dumps)


async def _counters(request: web.Request) -> web.Response:
    body = _object(await request.read())
    rewards = body.get("rewards")
    prefix = body.get("prefix", "")
    if not isinstance(rewards, list) or not all(isinstance(name, str) for name in rewards):
        raise RequestError("rewards", "expected a list of reward names")
    if not isinstance(prefix, str):
        raise RequestError("prefix", f"expected a string, got {type(prefix).__name__}")
    scorer = await asyncio.to_thread(_scorer, request.app, _flag(body, "evaluation"))
    counters = await asyncio.to_thread(scorer.pop_counters, rewards, prefix)  # waits for the rewards' calls
    return web.json_response({"counters": counters}, dumps=json.dumps)


def create_worker_app(config: Any, **options: Any) -> web.Application:
    """:func:`~miles_core.reward_service.server.create_reward_app` for a run's reward worker
    (same ``options``, but no limits): ``/health``, ``/info`` and the ``/worker/*`` routes;
    :func:`~miles_core.reward_service.server.start_reward_server` starts it."""
    limits = {"max_samples": NO_LIMIT, "max_values": NO_LIMIT, "max_body_bytes": NO_LIMIT}
    app = create_reward_app(config, **{**options, **limits}, worker=True)
    app[WORKER] = WorkerState()
    app.add_routes([web.post("/worker/describe", _describe), web.post("/worker/score", _score), web.post("/worker/counters", _counters)])
    return app


__all__ = ["NO_LIMIT", "OUTCOME_KEYS", "WorkerState", "apply_outcome", "create_worker_app", "decode_outcomes", "encode_outcome"]
