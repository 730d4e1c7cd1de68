"""What the engine's threads share: its config, the store and the sessions in it, the queues,
the lock every change happens under, the counters and the events that wake the threads. The
loop, the finisher and the reclaimer each take this one object."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from hcache.config import EngineConfig
from hcache.engine.lock import EngineLock
from hcache.engine.records import Counters
from hcache.engine.registry import Registry
from hcache.engine.scheduler import Scheduler
from hcache.engine.sharing import Sharing
from hcache.engine.telemetry import Telemetry
from hcache.storage.store import ChunkStore


@dataclass(eq=False)
class Parts:
    cfg: EngineConfig
    store: ChunkStore
    registry: Registry
    scheduler: Scheduler
    sharing: Sharing
    telemetry: Telemetry
    lock: EngineLock = field(default_factory=EngineLock)
    work: threading.Event = field(default_factory=threading.Event)  # the loop has work
    reclaim: threading.Event = field(default_factory=threading.Event)  # the reclaimer should look at the store

    def __post_init__(self) -> None:
        self.counters: Counters = self.scheduler.counters
        self.settled = threading.Condition(self.lock)  # a session the reclaimer held is free again

    def turn_ended(self) -> None:
        """A turn became durable: the loop may admit more, and the store has grown."""
        self.work.set()
        self.reclaim.set()
