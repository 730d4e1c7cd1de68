"""What the dashboard (`/dashboard.json`, drawn by static/) shows: the engine's snapshot as
JSON, per-directory read and write rates, and a rolling history of restores, TTFT and TBT
in 10-second buckets (fed by the metrics' `Telemetry` hooks)."""

from __future__ import annotations

import threading
import time
from collections import Counter as Tally
from collections import deque
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from hcache.engine.records import EngineSnapshot, StorageState

if TYPE_CHECKING:
    from hcache.engine.engine import Engine

BUCKET_S = 10  # history resolution
HISTORY = 90  # buckets kept (15 minutes)


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class History:
    """Restores by method mix, and TTFT, TBT and restore times, per 10-second bucket."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buckets: deque[dict[str, Any]] = deque(maxlen=HISTORY)

    def _bucket(self) -> dict[str, Any]:
        now = int(time.time()) // BUCKET_S * BUCKET_S
        if not self._buckets or self._buckets[-1]["t"] != now:
            self._buckets.append({"t": now, "mix": Tally(), "ttft": [], "tbt": [], "restore_ms": []})
        return self._buckets[-1]

    def restore(self, methods: str, ms: float) -> None:
        with self._lock:
            b = self._bucket()
            b["mix"][methods] += 1
            b["restore_ms"].append(ms)

    def add(self, what: str, ms: float) -> None:
        """A TTFT ("ttft") or TBT ("tbt") sample."""
        with self._lock:
            self._bucket()[what].append(ms)

    def rows(self) -> list[dict[str, Any]]:
        with self._lock:
            return [
                {
                    "t": b["t"],
                    "mix": dict(b["mix"]),
                    "ttft_p50": _pct(b["ttft"], 0.5),
                    "ttft_p99": _pct(b["ttft"], 0.99),
                    "tbt_p50": _pct(b["tbt"], 0.5),
                    "tbt_p99": _pct(b["tbt"], 0.99),
                    "restore_p50": _pct(b["restore_ms"], 0.5),
                }
                for b in self._buckets
            ]


class Dashboard:
    def __init__(self) -> None:
        self.history = History()
        self.engine: Engine | None = None
        self._rates: dict[str, tuple[float, float]] = {}  # dir -> (read MB/s, write MB/s)
        self._last: tuple[float, list[int], list[int]] | None = None

    def sample_rates(self) -> None:
        """Per-directory read/write MB/s since the previous sample (the HTTP server calls this every 2 s)."""
        if self.engine is None:
            return
        st = StorageState.of(self.engine.store)  # the snapshot's storage part, without the engine's lock
        now = time.monotonic()
        reads = st.read_bytes_by_dir
        writes = [u.bytes_written for u in st.dirs]
        if self._last is not None:
            t0, r0, w0 = self._last
            dt = max(1e-6, now - t0)
            for d, u in enumerate(st.dirs):
                self._rates[u.path] = ((reads[d] - r0[d]) / dt / 1e6, (writes[d] - w0[d]) / dt / 1e6)
        self._last = (now, reads, writes)

    def json(self) -> dict[str, Any]:
        assert self.engine is not None
        snap = self.engine.snapshot()
        return {
            "time": snap.time,
            "cluster": _cluster(snap),
            "model": snap.model,
            "draining": snap.draining,
            "sessions": _sessions(snap),
            "storage": self._storage(snap),
            "history": self.history.rows(),
            "totals": _totals(snap),
        }

    def _storage(self, snap: EngineSnapshot) -> list[dict[str, Any]]:
        out = []
        for u in snap.storage.dirs:
            rd, wr = self._rates.get(u.path, (0.0, 0.0))
            out.append(
                {
                    "path": u.path,
                    "used_bytes": u.used_bytes,
                    "free_bytes": u.fs_free_bytes,
                    "quota_bytes": u.quota_bytes,
                    "chunks": u.chunks,
                    "read_mbps": rd,
                    "write_mbps": wr,
                }
            )
        return out


def _sessions(snap: EngineSnapshot) -> list[dict[str, Any]]:
    return [
        {
            "id": r.id,
            "kind": r.kind,
            "tokens": r.tokens,
            "resident": r.resident,
            "busy": r.busy,
            "turns": r.turns,
            "plan": r.last_plan,
            "restore_ms": None if r.last_restore_ms is None else round(r.last_restore_ms, 1),
        }
        for r in snap.recent
    ]


def _cluster(snap: EngineSnapshot) -> dict[str, Any] | None:
    cl = snap.cluster
    if cl is None:
        return None
    return {
        "url": cl.url,
        "replica": cl.replica,
        "up": not cl.problems,
        "problems": cl.problems,
        "checked": cl.checked,
        **asdict(cl.counters),
    }


def _totals(snap: EngineSnapshot) -> dict[str, Any]:
    c, st = snap.counters, snap.storage
    return {
        "sessions": snap.sessions,
        "resident_sessions": snap.resident_sessions,
        "resident_bytes": snap.resident_bytes,
        "budget_bytes": snap.budget_bytes,
        "restores": c.restores,
        "evictions": c.evictions,
        "fallback_layers": c.fallback_layers,
        "checksum_failures": st.checksum_failures,
        "store_capacity_bytes": st.capacity_bytes,
        "store_occupied_bytes": st.occupied_bytes,
        "bytes_released": st.bytes_released,
        "demotions": st.demotions,
        "expiries": c.expiries,
        "prefix_matches": c.prefix_matches,
        "prefix_tokens": c.prefix_tokens,
        "generated_tokens": c.generated_tokens,
        "queue_depth": snap.queue.by_phase(),
    }
