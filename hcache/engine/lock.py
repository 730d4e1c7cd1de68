"""The engine's lock. The loop holds it for every step and takes it again at once; a plain
lock lets it do so before a waiting caller's thread even wakes, so a public call (a new
session, a turn, a status read) could wait out a whole decode. Here callers count
themselves in first, and before its next step the loop lets through as many callers as
had come by then (not later ones: a stream of callers must not hold the loop up either)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class EngineLock:
    """A re-entrant lock (`with lock:`, and a `threading.Condition` can be built on it)
    that gives way to waiting callers between the loop's steps (`with lock.step():`)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._gate = threading.Condition(threading.Lock())
        self._arrived = 0  # callers that came for the lock
        self._admitted = 0  # of them, those that got it (or gave up)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        with self._caller():
            return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> EngineLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    @contextmanager
    def step(self) -> Iterator[None]:
        """The loop's hold for one step: taken once as many callers got the lock as had
        come for it when the loop asked."""
        with self._gate:
            arrived = self._arrived
            while self._admitted < arrived:
                self._gate.wait()
        with self._lock:
            yield

    @contextmanager
    def _caller(self) -> Iterator[None]:
        """Counted in while it waits for the lock, out once it has it (or gave up)."""
        with self._gate:
            self._arrived += 1
        try:
            yield
        finally:
            with self._gate:
                self._admitted += 1
                self._gate.notify_all()

    # what threading.Condition uses of a lock: a wait lets go of every level the owner
    # holds and, like any caller, takes them back ahead of the loop
    def _release_save(self) -> Any:
        return self._lock._release_save()  # type: ignore[attr-defined]

    def _acquire_restore(self, state: Any) -> None:
        with self._caller():
            self._lock._acquire_restore(state)  # type: ignore[attr-defined]

    def _is_owned(self) -> bool:
        return self._lock._is_owned()  # type: ignore[attr-defined]
