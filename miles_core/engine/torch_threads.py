"""Torch's intra-op thread count is per thread: each thread takes the process-wide count
at its first parallel op and keeps its own afterwards. These set it for one thread, and
for the threads not yet started, without touching the others (the run's thread plan,
:mod:`miles_core.config.thread_plan`, decides the counts)."""

from __future__ import annotations

import threading


def pin_current_thread(threads: int) -> None:
    """Give the calling thread ``threads`` torch threads for good."""
    import torch

    # The first call makes torch give this thread the process-wide count; only a count set
    # after it stays this thread's, whatever other threads set later.
    torch.get_num_threads()
    torch.set_num_threads(threads)


def set_new_thread_default(threads: int) -> None:
    """Threads that have not run torch yet take ``threads``; threads that have (the
    caller too) keep theirs. (torch can set the process-wide count only from a thread,
    which it also sets: a throwaway one does it.)"""
    setter = threading.Thread(target=pin_current_thread, args=(threads,), name="torch-thread-default")
    setter.start()
    setter.join()


def set_interop_threads(threads: int) -> bool:
    """Size torch's inter-op pool, which torch allows once and only before it starts;
    returns whether it was set (False: already started or set, left as it is)."""
    import torch

    if torch.get_num_interop_threads() == threads:
        return True
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError:
        return False
    return True
