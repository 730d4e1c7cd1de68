"""What goes to the packer (stage 2 of saving), in order. A decode step's batch may be
held back: the packer gets it with up to HELD_STEPS - 1 others, or with the next item
sent, so it wakes once for them. Woken every step, its GIL turns and wake-ups took
time from every decode step."""

from __future__ import annotations

import queue
import threading

from hcache.storage.staging import StagedBatch

HELD_STEPS = 16  # decode batches handed to the packer together


class Outbox:
    def __init__(self, inbox: queue.Queue):
        self.inbox = inbox
        self.held: list[StagedBatch] = []  # decode steps' batches not yet sent
        self._lock = threading.Lock()

    def submit(self, batch: StagedBatch, hold: bool = False) -> None:
        with self._lock:
            if hold and len(self.held) < HELD_STEPS - 1:
                self.held.append(batch)
                return
            self._send(batch)

    def send(self, item: object = None) -> None:
        """The held batches, then `item` (None: only the held ones)."""
        with self._lock:
            self._send(item)

    def _send(self, item: object) -> None:  # under the lock: everything reaches the packer in order
        for b in self.held:
            self.inbox.put(b)
        self.held.clear()
        if item is not None:
            self.inbox.put(item)
