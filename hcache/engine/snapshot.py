"""The engine's state at one moment, as GetStats, /metrics and the dashboard show it."""

from __future__ import annotations

import heapq
import time
from dataclasses import replace

from hcache.engine.block_pool import BlockPool
from hcache.engine.parts import Parts
from hcache.engine.records import EngineSnapshot, StorageState

RECENT_SESSIONS = 200  # rows of the dashboard's session table


def take(model: str, draining: bool, parts: Parts, pool: BlockPool, storage: StorageState) -> EngineSnapshot:
    """Read under the engine's lock; `storage` (disk usage) is read before, outside it."""
    owners = list(parts.registry.sessions.values())
    sessions = [s for s in owners if s.kind == "session"]
    recent = heapq.nlargest(RECENT_SESSIONS, owners, key=lambda s: s.last_used)
    per_block = pool.bytes_per_block(pool.cfg, pool.dtype)
    return EngineSnapshot(
        time=time.time(),
        model=model,
        draining=draining,
        counters=replace(parts.counters),
        queue=parts.scheduler.queue_depth(),
        sessions=len(sessions),
        contexts=len(owners) - len(sessions),
        resident_sessions=sum(s.resident for s in sessions),
        resident_bytes=(pool.num_blocks - pool.num_free) * per_block,
        budget_bytes=pool.num_blocks * per_block,
        recent=[s.row() for s in recent],
        storage=storage,
        cluster=parts.sharing.state(),
    )
