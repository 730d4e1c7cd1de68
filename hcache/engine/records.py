"""Typed records the engine writes and hands out: a turn's stats, a restore's result,
the engine's state at one moment (what GetStats, /metrics and the dashboard show),
and the session meta the manifest keeps next to a session's token ids."""

from __future__ import annotations

import heapq
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from hcache.restore.plan import Plan
from hcache.storage.stats import DirUsage

RECENT_SESSIONS = 200  # rows of the dashboard's session table

if TYPE_CHECKING:
    from hcache.engine.block_pool import BlockPool
    from hcache.engine.scheduler import Scheduler
    from hcache.engine.sequence import Session
    from hcache.engine.sessions import Registry
    from hcache.storage.store import ChunkStore


@dataclass(frozen=True)
class ChunkStats:
    """Chunk traffic both ways: fetched before turns, uploaded behind them."""

    fetches: int
    tokens: int
    bytes_read: int
    misses: int
    skipped: int
    failed: int
    read_gbps: float
    uploaded_chunks: int
    uploaded_bytes: int
    upload_drops: int
    upload_failures: int


@dataclass
class ClusterCounters:
    """Totals since the engine started."""

    commits: int = 0  # turns acknowledged after their record was committed
    lease_conflicts: int = 0  # turns refused: another replica held the session
    takeovers: int = 0  # leases taken after their holder let them expire (it died)
    refused_commits: int = 0  # late commits the epoch fenced off
    errors: int = 0  # calls that could not reach the cluster
    adoptions: int = 0  # sessions this replica first saw in the cluster
    recomputes: int = 0  # turns that recomputed tokens another replica had computed
    recomputed_tokens: int = 0  # tokens of cluster records recomputed here (no local state)
    bytes_read: int = 0  # records read
    bytes_written: int = 0  # records committed


@dataclass(frozen=True)
class ClusterState:
    """What operators see of the cluster (no network call: the lease thread keeps it)."""

    url: str
    replica: str
    problems: list[str]  # as of the last check (empty: reachable and serving)
    checked: float  # Unix time of that check
    counters: ClusterCounters
    chunks: ChunkStats | None = None  # session chunks in the cluster (None: records only)


@dataclass
class Counters:
    """Totals since the engine started."""

    evictions: int = 0
    restores: int = 0
    fallback_layers: int = 0
    generated_tokens: int = 0
    expiries: int = 0  # sessions deleted for being idle longer than the TTL
    prefix_matches: int = 0  # resent conversations that continued a stored one (a fork)
    prefix_tokens: int = 0  # the tokens those forks shared instead of computing
    kv_handovers: int = 0  # forks that took their resident parent's KV memory instead of restoring


@dataclass(frozen=True)
class PlanSummary:
    """Layers per restore method, and the plan as one letter per layer (R, H or K)."""

    recompute: int = 0
    hidden: int = 0
    kv: int = 0
    layers: str = ""

    @classmethod
    def of(cls, plan: Plan | None) -> PlanSummary:
        if plan is None:
            return cls()
        c = plan.counts()
        return cls(c["recompute"], c["hidden"], c["kv"], plan.letters)


@dataclass(frozen=True)
class TurnStats:
    """How one turn went; sent with its stream's last event."""

    restore_ms: float = 0.0
    prefill_ms: float = 0.0
    ttft_ms: float = 0.0
    queue_ms: float = 0.0
    decode_ms: float = 0.0
    plan: PlanSummary = PlanSummary()
    prompt_tokens: int = 0  # fed this turn
    cached_tokens: int = 0  # kept from the session's state
    completion_tokens: int = 0
    bytes_read: int = 0
    fallback_layers: int = 0
    tbt_ms: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class RestoreResult:
    already_resident: bool = False
    num_tokens: int = 0
    restore_ms: float = 0.0
    predicted_ms: float = 0.0  # the planner's estimate (0: a forced method)
    bytes_read: int = 0
    fallback_layers: int = 0
    plan: PlanSummary = PlanSummary()


@dataclass(frozen=True)
class QueueDepth:
    """Sequences per phase."""

    waiting: int = 0
    restoring: int = 0
    prefill: int = 0
    decode: int = 0

    def by_phase(self) -> dict[str, int]:
        return {"waiting": self.waiting, "restoring": self.restoring, "prefill": self.prefill, "decode": self.decode}


@dataclass(frozen=True)
class SessionRow:
    """A session or context as the dashboard lists it."""

    id: str
    kind: str
    tokens: int
    resident: bool
    busy: bool
    turns: int
    last_plan: str  # e.g. "RE 2 / H 0 / KV 28"; "" before any restore
    last_restore_ms: float | None  # None before any restore

    @classmethod
    def of(cls, s: Session) -> SessionRow:
        p = s.last_plan
        return cls(
            s.id,
            s.kind,
            len(s.tokens),
            s.resident,
            s.busy,
            s.turns,
            p.mix() if p else "",
            s.last_restore_ms if p else None,
        )


@dataclass(frozen=True)
class StorageState:
    checksum_failures: int
    bytes_read: int
    read_bytes_by_dir: list[int]
    dirs: list[DirUsage]
    ring_used_bytes: int
    ring_capacity_bytes: int
    ring_waits: int  # times a full staging ring blocked a producer
    capacity_bytes: int  # what the store may hold (quotas, or the filesystems' room)
    occupied_bytes: int  # slots in use or reserved
    bytes_released: int  # chunks given up by the capacity policy
    demotions: int  # releases: an idle session or context gave up some of its layers

    @classmethod
    def of(cls, store: ChunkStore) -> StorageState:
        st, ring = store.stats, store.ring
        space = store.space()
        return cls(
            st.checksum_failures,
            st.bytes_read,
            list(st.read_bytes_by_dir),
            store.usage(),
            ring.used_bytes(),
            ring.capacity,
            ring.waits,
            space.capacity,
            space.used,
            st.bytes_released,
            st.demotions,
        )


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's and its store's state at one moment."""

    time: float  # Unix seconds
    model: str
    draining: bool
    counters: Counters
    queue: QueueDepth
    sessions: int
    contexts: int
    resident_sessions: int
    resident_bytes: int  # KV blocks held by sessions and contexts
    budget_bytes: int
    recent: list[SessionRow]  # the most recently used sessions and contexts first
    storage: StorageState
    cluster: ClusterState | None = None  # cluster mode only

    @classmethod
    def of(
        cls,
        model: str,
        draining: bool,
        counters: Counters,
        scheduler: Scheduler,
        registry: Registry,
        pool: BlockPool,
        storage: StorageState,
        cluster: ClusterState | None,
    ) -> EngineSnapshot:
        """Read under the engine's lock."""
        owners = list(registry.sessions.values())
        sessions = [s for s in owners if s.kind == "session"]
        recent = heapq.nlargest(RECENT_SESSIONS, owners, key=lambda s: s.last_used)
        per_block = pool.bytes_per_block(pool.cfg, pool.dtype)
        return cls(
            time=time.time(),
            model=model,
            draining=draining,
            counters=replace(counters),
            queue=scheduler.queue_depth(),
            sessions=len(sessions),
            contexts=len(owners) - len(sessions),
            resident_sessions=sum(s.resident for s in sessions),
            resident_bytes=(pool.num_blocks - pool.num_free) * per_block,
            budget_bytes=pool.num_blocks * per_block,
            recent=[SessionRow.of(s) for s in recent],
            storage=storage,
            cluster=cluster,
        )


@dataclass
class SessionMeta:
    """What the manifest keeps next to a session's token ids: enough to rebuild the session
    after a restart, or to take it back to its last durable turn."""

    prefix: list[int] = field(default_factory=list)  # token ids of the contexts placed before the conversation
    parent: str | None = None  # the context whose stored state covers tokens[:base]
    base: int = 0
    messages: list[dict[str, str]] = field(default_factory=list)
    mode: str = ""  # "" until the first turn, then "chat" or "tokens"
    pending: int | None = None  # the last sampled token (not fed yet), token mode
    labels: dict[str, str] = field(default_factory=dict)
    context_ids: list[str] = field(default_factory=list)
    turns: int = 0
    tenant: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "prefix": list(self.prefix),
            "parent": self.parent,
            "base": self.base,
            "messages": [dict(m) for m in self.messages],
            "mode": self.mode,
            "pending": self.pending,
            "labels": dict(self.labels),
            "context_ids": list(self.context_ids),
            "turns": self.turns,
            "tenant": self.tenant,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SessionMeta:
        """Missing keys take their defaults."""
        return cls(
            prefix=list(d.get("prefix", [])),
            parent=d.get("parent"),
            base=int(d.get("base", 0)),
            messages=[dict(m) for m in d.get("messages", [])],
            mode=d.get("mode", ""),
            pending=d.get("pending"),
            labels=dict(d.get("labels", {})),
            context_ids=list(d.get("context_ids", [])),
            turns=int(d.get("turns", 0)),
            tenant=d.get("tenant"),
        )
