"""The engine's lock lets a waiting caller in between the loop's steps."""

from __future__ import annotations

import threading
import time

from engine_helpers import wait_until

from hcache.engine.lock import EngineLock


def _steps_while_callers_wait(lock: EngineLock, calls: int = 50) -> list[int]:
    """A loop that takes the lock back to back for steps of 4 ms that let go of the GIL (as
    torch ops do) and 1 ms that hold it (Python), and a caller: how many steps ended while
    each call waited for the lock."""
    stop = threading.Event()
    ended = [0]

    def loop() -> None:
        while not stop.is_set():
            with lock.step():
                time.sleep(0.004)
                t = time.perf_counter() + 0.001
                while time.perf_counter() < t:
                    pass
                ended[0] += 1

    t = threading.Thread(target=loop)
    t.start()
    counts = []
    try:
        time.sleep(0.02)
        for _ in range(calls):
            before = ended[0]
            with lock:
                counts.append(ended[0] - before)
            time.sleep(0.002)
    finally:
        stop.set()
        t.join()
    return counts


def test_a_caller_waits_out_at_most_the_step_under_way() -> None:
    # with a plain RLock the loop takes the lock again before the woken caller does, and a
    # call waits out several steps (a public call, a whole decode)
    counts = _steps_while_callers_wait(EngineLock())
    assert max(counts) <= 2, counts  # the step under way, and one that passed the gate as the caller came


def test_callers_back_to_back_do_not_hold_the_loop_up() -> None:
    lock = EngineLock()
    stop = threading.Event()
    steps = [0]

    def caller() -> None:
        while not stop.is_set():
            with lock:
                pass

    def loop() -> None:
        while not stop.is_set():
            with lock.step():
                time.sleep(0.002)
                steps[0] += 1

    threads = [threading.Thread(target=caller) for _ in range(3)] + [threading.Thread(target=loop)]
    for t in threads:
        t.start()
    try:
        # the loop lets through the callers that had come when it asked, not every later one:
        # it keeps stepping (with a plain lock three callers back to back starve it)
        wait_until(lambda: steps[0] >= 20, "the loop to make 20 steps among callers back to back", timeout=30)
    finally:
        stop.set()
        for t in threads:
            t.join()


def test_the_lock_is_reentrant_and_serves_a_condition() -> None:
    lock = EngineLock()
    cond = threading.Condition(lock)
    got = []

    def waiter() -> None:
        with lock, lock:  # re-entrant
            got.append(cond.wait(timeout=5))

    t = threading.Thread(target=waiter)
    t.start()
    for _ in range(500):  # until the waiter waits (it let go of the lock, both levels)
        with lock:
            if cond._waiters:  # type: ignore[attr-defined]
                cond.notify()
                break
        time.sleep(0.01)
    t.join(5)
    assert got == [True]
    with lock.step():  # nobody waits: the loop's hold is taken at once
        assert lock._is_owned()
