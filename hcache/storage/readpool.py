"""The read I/O threads: per-directory readers, each of which reads a request and then
checks and places it."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from hcache import omp
from hcache.storage.readplan import Request
from hcache.storage.throttle import wait_until


class ReadPool:
    """Per-directory reader threads; each checks (and places) the request it read at once,
    while its bytes are still in the CPU's cache. Reads land in place
    in layer buffers; the pool's aligned bounce buffers (bounded: bytes in flight stay
    bounded however many directories) serve only requests holding tails, or chunks that
    cannot land in place, so they do not cap how many requests are in flight. Unwanted
    slots inside a request all go to one shared discard area."""

    def __init__(self, n_dirs: int, depth: int, buf_bytes: int, make_buffer: Callable[[int], Any], discard_bytes: int):
        self.queues = [queue.Queue() for _ in range(n_dirs)]
        self.buffers: queue.Queue = queue.Queue()
        self._make, self._buf_bytes, self._made, self._max = make_buffer, buf_bytes, 0, depth + n_dirs
        self._lock = threading.Lock()
        self.discard = memoryview(make_buffer(discard_bytes))
        self.threads = [
            threading.Thread(target=self._loop, args=(q,), name=f"hcache-reader-{d}", daemon=True)
            for d, q in enumerate(self.queues)
            for _ in range(depth)
        ]
        for t in self.threads:
            t.start()

    def submit(self, d: int, fn: Callable[[Request], None], req: Request) -> None:
        self.queues[d].put((fn, req))

    def take(self) -> Any:
        """A bounce buffer: made on first need, then reused; waits while all are in use."""
        with self._lock:
            if self.buffers.empty() and self._made < self._max:
                self._made += 1
                return self._make(self._buf_bytes)
        return self.buffers.get()

    def give(self, buf: Any) -> None:
        self.buffers.put(buf)

    def _loop(self, q: queue.Queue) -> None:
        omp.serial()
        while (item := q.get()) is not None:
            fn, req = item
            # a capped request waits for its turn here, holding no buffer
            wait_until(req.not_before)
            fn(req)

    def close(self) -> None:
        for q in self.queues:
            for _ in range(len(self.threads)):
                q.put(None)
