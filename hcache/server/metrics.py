"""Prometheus metrics (through prometheus_client, on its own registry). The engine reports
events through the `Telemetry` hooks, which also feed the dashboard's history
(dashboard.py); store and engine state is read at scrape time."""

from __future__ import annotations

import re
import threading
from collections import Counter as Tally
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hcache.engine.records import ClusterState
from hcache.engine.telemetry import Telemetry
from hcache.kernels.cpu import cpu
from hcache.server.dashboard import Dashboard

if TYPE_CHECKING:
    from hcache.engine.engine import Engine

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TBT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1, 2.5)


class Metrics(Telemetry):
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.restore_seconds = Histogram(
            "hcache_restore_seconds",
            "Time to bring a session's KV back, by method mix and plan",
            ["methods", "plan"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram("hcache_ttft_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.tbt = Histogram("hcache_tbt_seconds", "Time between tokens", buckets=TBT_BUCKETS, registry=r)
        self.flush = Histogram(
            "hcache_flush_seconds",
            "Write + fsync + manifest commit of one chunk group",
            ["dir"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.requests = Counter("hcache_requests", "RPCs by method and status code", ["rpc", "code"], registry=r)
        Info("hcache_cpu", "The CPU kind and the kernel each hot path takes on it", registry=r).info(cpu().paths())
        self.dashboard = Dashboard()
        self.engine: Engine | None = None
        r.register(_ThreadCollector())

    def attach(self, engine: Engine) -> None:
        """Read engine and store state at scrape time; time flushes."""
        self.engine = self.dashboard.engine = engine
        self.registry.register(_StateCollector(engine))
        engine.store.on_flush = lambda d, s: self.flush.labels(str(engine.store.dirs[d])).observe(s)

    # --- Telemetry hooks (called on the engine's threads) ---------------------------
    def on_restore(self, methods: str, plan: str, ms: float) -> None:
        self.restore_seconds.labels(methods, plan).observe(ms / 1e3)
        self.dashboard.history.restore(methods, ms)

    def on_ttft(self, ms: float) -> None:
        self.ttft.observe(ms / 1e3)
        self.dashboard.history.add("ttft", ms)

    def on_tbt(self, ms: float) -> None:
        self.tbt.observe(ms / 1e3)
        self.dashboard.history.add("tbt", ms)


class _ThreadCollector(Collector):
    """The process's Python threads by pool (the name less its numbers): a leak shows as a pool
    that grows with the sessions served."""

    def collect(self) -> Iterator[Metric]:
        pools = Tally(re.sub(r"[-_]?\d+", "", t.name) for t in threading.enumerate())
        g = GaugeMetricFamily("hcache_threads", "Python threads by pool", labels=["pool"])
        for pool, n in sorted(pools.items()):
            g.add_metric([pool], n)
        yield g


class _StateCollector(Collector):
    """Gauges and counters that are engine or store state, read from one snapshot per scrape."""

    def __init__(self, engine: Engine):
        self.e = engine

    def collect(self) -> Iterator[Metric]:
        snap = self.e.snapshot()
        c, st = snap.counters, snap.storage
        yield GaugeMetricFamily(
            "hcache_decode_compiled",
            "1 once decode steps run the compiled graph (0: eager, while it compiles or by configuration)",
            int(self.e.runner.graph is not None),
        )
        yield CounterMetricFamily("hcache_checksum_failures", "Chunks that failed their checksum", st.checksum_failures)
        yield CounterMetricFamily(
            "hcache_recompute_fallback_layers", "Layers recomputed because stored state was unusable", c.fallback_layers
        )
        yield CounterMetricFamily("hcache_evictions", "Sessions whose KV left memory", c.evictions)
        yield CounterMetricFamily("hcache_restores", "Restores", c.restores)
        yield CounterMetricFamily("hcache_generated_tokens", "Tokens generated", c.generated_tokens)
        yield CounterMetricFamily(
            "hcache_storage_released_bytes",
            "Chunk bytes idle sessions gave up to keep the store under its capacity",
            st.bytes_released,
        )
        yield CounterMetricFamily(
            "hcache_sessions_demoted", "Releases: an idle session or context gave up some of its layers", st.demotions
        )
        yield CounterMetricFamily("hcache_sessions_expired", "Sessions deleted for being idle past the TTL", c.expiries)
        yield CounterMetricFamily(
            "hcache_prefix_matches", "Resent conversations that continued a stored one", c.prefix_matches
        )
        yield CounterMetricFamily(
            "hcache_prefix_shared_tokens", "Tokens those conversations shared from the stored one", c.prefix_tokens
        )
        yield GaugeMetricFamily(
            "hcache_storage_capacity_bytes", "What the store may hold, all directories", st.capacity_bytes
        )
        yield GaugeMetricFamily(
            "hcache_storage_occupied_bytes", "Slots in use or reserved, all directories", st.occupied_bytes
        )
        yield CounterMetricFamily("hcache_staging_producer_waits", "Times a full staging ring blocked", st.ring_waits)
        yield GaugeMetricFamily("hcache_staging_ring_used_bytes", "Staging ring occupancy", st.ring_used_bytes)
        yield GaugeMetricFamily("hcache_staging_ring_capacity_bytes", "Staging ring size", st.ring_capacity_bytes)
        yield GaugeMetricFamily("hcache_sessions", "Sessions known", snap.sessions)
        yield GaugeMetricFamily("hcache_resident_sessions", "Sessions whose KV is in memory", snap.resident_sessions)
        yield GaugeMetricFamily("hcache_resident_bytes", "KV memory held by sessions", snap.resident_bytes)
        yield GaugeMetricFamily("hcache_resident_budget_bytes", "KV memory budget", snap.budget_bytes)
        q = GaugeMetricFamily("hcache_queue_depth", "Sequences per phase", labels=["phase"])
        for phase, n in snap.queue.by_phase().items():
            q.add_metric([phase], n)
        yield q
        rd = CounterMetricFamily("hcache_storage_read_bytes", "Bytes read per storage directory", labels=["dir"])
        wr = CounterMetricFamily("hcache_storage_written_bytes", "Bytes written per storage directory", labels=["dir"])
        used = GaugeMetricFamily("hcache_storage_used_bytes", "Bytes held by chunks per directory", labels=["dir"])
        free = GaugeMetricFamily("hcache_storage_free_bytes", "Free bytes of the filesystem", labels=["dir"])
        for d, u in enumerate(st.dirs):
            rd.add_metric([u.path], st.read_bytes_by_dir[d])
            wr.add_metric([u.path], u.bytes_written)
            used.add_metric([u.path], u.used_bytes)
            free.add_metric([u.path], u.fs_free_bytes)
        yield from (rd, wr, used, free)
        by_source = CounterMetricFamily(
            "hcache_restores_by_source", "Session state brought back, by where it came from", labels=["source"]
        )
        chunks = snap.cluster.chunks if snap.cluster is not None else None
        fetched = chunks.fetches if chunks is not None else 0
        by_source.add_metric(["local"], max(0, c.restores - fetched))  # a fetch then restores locally
        if snap.cluster is not None:
            by_source.add_metric(["cluster"], fetched)
            by_source.add_metric(["recompute"], snap.cluster.counters.recomputes)
        yield by_source
        if snap.cluster is not None:
            yield from _cluster_metrics(snap.cluster)


def _cluster_metrics(cl: ClusterState) -> Iterator[Metric]:
    k = cl.counters
    yield GaugeMetricFamily("hcache_cluster_up", "1 when the session cluster answered the last check", not cl.problems)
    yield CounterMetricFamily("hcache_cluster_read_bytes", "Record bytes read from the cluster", k.bytes_read)
    yield CounterMetricFamily("hcache_cluster_written_bytes", "Record bytes written to the cluster", k.bytes_written)
    yield CounterMetricFamily("hcache_cluster_commits", "Turns acknowledged after their record commit", k.commits)
    yield CounterMetricFamily(
        "hcache_cluster_lease_takeovers", "Leases taken after their holder let them expire", k.takeovers
    )
    yield CounterMetricFamily(
        "hcache_cluster_lease_conflicts", "Turns refused: another replica held the session", k.lease_conflicts
    )
    yield CounterMetricFamily(
        "hcache_cluster_refused_commits", "Late commits fenced off by the epoch", k.refused_commits
    )
    yield CounterMetricFamily("hcache_cluster_errors", "Calls that could not reach the cluster", k.errors)
    yield CounterMetricFamily(
        "hcache_cluster_recomputed_tokens", "Tokens of cluster records recomputed here", k.recomputed_tokens
    )
    ch = cl.chunks
    if ch is None:
        return
    yield CounterMetricFamily("hcache_cluster_chunk_read_bytes", "Chunk bytes fetched from the cluster", ch.bytes_read)
    yield CounterMetricFamily(
        "hcache_cluster_chunk_tokens", "Tokens whose state came from the cluster's chunks", ch.tokens
    )
    yield CounterMetricFamily(
        "hcache_cluster_chunk_misses", "Chunk fetches cut short by an evicted or unusable chunk", ch.misses
    )
    yield CounterMetricFamily(
        "hcache_cluster_chunk_uploaded_bytes", "Chunk bytes put in the cluster", ch.uploaded_bytes
    )
    yield CounterMetricFamily(
        "hcache_cluster_chunk_upload_drops", "Turns whose chunk upload was dropped (cluster slow)", ch.upload_drops
    )
    yield CounterMetricFamily(
        "hcache_cluster_chunk_upload_failures", "Turns whose chunk upload failed", ch.upload_failures
    )
    yield GaugeMetricFamily("hcache_cluster_chunk_read_gbps", "Measured chunk read bandwidth", ch.read_gbps)
