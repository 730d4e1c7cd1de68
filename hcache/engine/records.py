"""Typed records the engine writes and hands out: a turn's stats, a restore's result, and
the engine's state at one moment (what GetStats, /metrics and the dashboard show)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hcache.restore.plan import Plan
from hcache.storage.stats import DirUsage

if TYPE_CHECKING:
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
    placed_tokens: int = 0  # a blend's: context tokens placed from storage instead of prefilled
    recomputed_tokens: int = 0  # of those, recomputed by the blend
    context_fallbacks: list[str] = field(default_factory=list)  # contexts partly recomputed: unreadable chunks


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
