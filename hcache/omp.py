"""Which threads run torch's parallel regions.

libgomp keeps a team of worker threads per thread that starts a parallel region, and the
main thread's team lives as long as the process. Once its teams hold more threads than
there are CPUs, every worker spins only briefly before it sleeps on a futex, and waking a
sleeping worker costs tens of microseconds on a VM: small ops, a decode step's, then run
far slower. So one thread computes at a time with the full thread count (the engine's
loop, or a short-lived worker whose team ends with it), and the main thread stays serial
once `isolate_main` ran."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch

T = TypeVar("T")

# the compute thread count: torch's at import (before any thread of ours changed its own;
# a thread's count starts from whatever any thread set last)
_threads = torch.get_num_threads()


def compute_threads() -> int:
    return _threads


def isolate_main(threads: int | None = None) -> int:
    """Record the compute thread count (default: torch's current one) and make the calling
    (main) thread's own parallel regions serial, so that it never holds a team."""
    global _threads
    _threads = threads or _threads
    torch.set_num_threads(1)
    return _threads


def serial() -> None:
    """In a thread that only moves bytes (storage): its larger torch copies would each start
    a team of every core, and dozens of such threads would starve the compute thread."""
    torch.set_num_threads(1)


def copy_serial(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """`dst[...] = src` for a storage thread, outside torch's parallel regions (numpy copies
    the bytes). `serial()` is not enough there: a thread's first parallel torch op adopts
    the thread count another thread set last, starts a second team of every core, and
    from then on every parallel op of the compute thread runs slower (a decode step
    several times)."""
    if dst.device.type != "cpu" or src.device.type != "cpu" or dst.dtype != src.dtype or dst.shape != src.shape:
        return dst.copy_(src)
    np.copyto(dst.view(torch.uint8).numpy(), src.view(torch.uint8).numpy())
    return dst


def use_compute_threads(threads: int | None = None) -> None:
    """In a thread that computes (the engine's loop, a worker): the full thread count, as
    read in the thread that started it (a new thread's own count is whatever was set last)."""
    torch.set_num_threads(threads or compute_threads())


def on_worker(fn: Callable[[], T], name: str = "hcache-compute") -> T:
    """`fn()` on a fresh thread with the full thread count; its team ends with the thread."""
    out: list[T] = []
    err: list[BaseException] = []
    threads = compute_threads()

    def run() -> None:
        use_compute_threads(threads)
        try:
            out.append(fn())
        except BaseException as e:  # re-raised in the caller
            err.append(e)

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    t.join()
    if err:
        raise err[0]
    return out[0]
