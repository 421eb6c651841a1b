"""Applying a run's thread plan (:mod:`miles_core.config.thread_plan`) to this process."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

from miles_core.config.model import Config
from miles_core.config.thread_plan import ThreadPlan, plan_threads, this_machine
from miles_core.engine.embedded import EmbeddedEngine
from miles_core.engine.torch_threads import pin_current_thread, set_interop_threads, set_new_thread_default

T = TypeVar("T")


def run_thread_plan(config: Config, *, rolls_out: bool, log: Callable[[str], None]) -> ThreadPlan:
    """This run's plan on this machine; logs it (and its warning: a count above the cores)
    and gives the main thread its count: the compute threads when it computes, else one
    from the start (the model loads at one thread then), since libgomp keeps a thread's
    team once it has run one, and an idle team still counts against the cores: two teams of
    two on two cores make every thread stop spinning and wait on a futex at each op."""
    plan = plan_threads(this_machine(), config, os.environ, rolls_out=rolls_out)
    if plan.warning:
        log(f"warning: {plan.warning}")
    log(plan.describe())
    set_interop_threads(plan.interop_threads)
    pin_current_thread(plan.worker_threads if plan.shared_compute_thread else plan.compute_threads)
    set_new_thread_default(plan.worker_threads)
    return plan


def hand_compute_to_engine(plan: ThreadPlan, engine: Any) -> bool:
    """With the embedded engine in this process, its worker thread becomes the compute
    thread and the main thread drops to the worker count; returns whether it did."""
    if not (plan.shared_compute_thread and isinstance(engine, EmbeddedEngine)):
        return False
    engine.pin_compute_threads(plan.compute_threads)
    # After the engine's pin, which set torch's count for new threads to the compute count:
    # this thread and every thread started later (reward scoring, to_thread jobs) get the
    # worker count.
    pin_current_thread(plan.worker_threads)
    return True


def caller_threads() -> Callable[[], None]:
    """A function that gives the calling thread (and new threads) back the torch thread
    count it has now: a run restores it when it ends, for a program that goes on. (Not
    the inter-op pool: torch sizes it once per process.)"""
    import torch

    threads = torch.get_num_threads()

    def restore() -> None:
        pin_current_thread(threads)

    return restore


async def on_compute_thread(plan: ThreadPlan | None, engine: Any, fn: Callable[[], T]) -> T:
    """``fn()`` on the run's compute thread: the embedded engine's worker when the plan
    shares it (so the work sees the compute thread's torch threads), else here."""
    if plan is not None and plan.shared_compute_thread and isinstance(engine, EmbeddedEngine):
        return await engine.run_compute(fn)
    return fn()
