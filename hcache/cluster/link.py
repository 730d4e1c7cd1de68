"""The engine's side of a shared session catalogue (`--cluster`): the lease a turn runs
under, kept alive while it runs, and the turn's commit, after which it is acknowledged.
Nothing here holds the engine's lock: a slow or unreachable cluster never stalls the loop."""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from hcache.cluster.tier import ChunkTier
from hcache.engine.records import ChunkStats, ClusterCounters, ClusterState
from hcache.storage.catalogue import Catalogue, Lease, Record
from hcache.storage.errors import ClusterUnavailable, LeaseHeld, StorageError

log = logging.getLogger(__name__)


def replica_name() -> str:
    """Unique per process: two replicas on one host (or in one test) differ."""
    return f"{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(2)}"


def record_bytes(rec: Record) -> int:
    return 4 * len(rec.tokens) + len(str(rec.meta))


class ClusterLink:
    def __init__(
        self,
        catalogue: Catalogue,
        holder: str | None = None,
        renew_every_s: float | None = None,
        chunks: ChunkTier | None = None,
        chunk_policy: str = "auto",
    ):
        """`chunks`: sessions' chunks go to the cluster too; `chunk_policy` says when a replica
        fetches them (auto: when cheaper than recomputing; always; off: upload only)."""
        self.cat = catalogue
        self.tier, self.chunk_policy = chunks, chunk_policy
        self.chunk_stats: Callable[[], ChunkStats | None] = lambda: None  # the engine's, once it runs
        self.holder = holder or replica_name()
        ttl = getattr(catalogue, "ttl_ms", 10_000) / 1e3
        self.renew_every_s = renew_every_s or ttl / 3
        self.counters = ClusterCounters()
        self._held: dict[str, Lease] = {}
        self._problems: list[str] = []
        self._checked = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="hcache-leases", daemon=True)
        self._thread.start()

    @contextmanager
    def _counted(self) -> Iterator[None]:
        """A call to the catalogue; one that cannot reach the cluster is counted."""
        try:
            yield
        except ClusterUnavailable:
            self.counters.errors += 1
            raise

    def get(self, owner: str) -> Record | None:
        with self._counted():
            rec = self.cat.get(owner)
        if rec is not None:
            self.counters.bytes_read += record_bytes(rec)
        return rec

    def create(self, rec: Record) -> None:
        with self._counted():
            self.cat.create(rec)
        self.counters.bytes_written += record_bytes(rec)

    def lease(self, owner: str) -> tuple[Lease, Record]:
        """The session's lease and its record as of the last acknowledged turn."""
        try:
            with self._counted():
                lease = self.cat.acquire(owner, self.holder)
        except LeaseHeld:
            self.counters.lease_conflicts += 1
            raise
        try:
            rec = self.get(owner)
            if rec is None:
                raise StorageError(f"session {owner} was deleted")
        except BaseException:
            self.release(lease)
            raise
        self.counters.takeovers += lease.takeover
        if lease.takeover:
            log.warning("took over session %s (epoch %d): its last holder's lease expired", owner, lease.epoch)
        with self._lock:
            self._held[owner] = lease
        return lease, rec

    def commit(self, lease: Lease, tokens: list[int], meta: dict[str, Any]) -> None:
        """The turn becomes the record's: it may be acknowledged."""
        try:
            with self._counted():
                self.cat.commit_turn(lease, tokens, meta)
        except ClusterUnavailable:
            raise
        except StorageError:
            self.counters.refused_commits += 1
            raise
        self.counters.commits += 1
        self.counters.bytes_written += 4 * len(tokens) + len(str(meta))

    def delete(self, lease: Lease) -> None:
        try:
            with self._counted():
                self.cat.delete(lease)
        finally:
            with self._lock:
                self._held.pop(lease.owner, None)

    def release(self, lease: Lease) -> None:
        """Best effort: a lease not given back expires."""
        with self._lock:
            if self._held.get(lease.owner) == lease:
                del self._held[lease.owner]
        try:
            with self._counted():
                self.cat.release(lease)
        except StorageError as e:
            log.warning("releasing the lease of %s: %s", lease.owner, e)

    def problems(self) -> list[str]:
        """Asks the cluster now."""
        self._problems, self._checked = self.cat.problems(), time.time()
        return self._problems

    def state(self) -> ClusterState:
        url = getattr(self.cat, "url", self.cat.name)
        counters = replace(self.counters)
        return ClusterState(url, self.holder, list(self._problems), self._checked, counters, self.chunk_stats())

    def _renew(self) -> None:
        self.problems()
        while not self._stop.wait(self.renew_every_s):
            self.problems()
            with self._lock:
                held = list(self._held.values())
            for lease in held:
                try:
                    with self._counted():
                        renewed = self.cat.renew(lease)
                    if not renewed:
                        log.warning("lost the lease of %s (epoch %d): its commit is refused", lease.owner, lease.epoch)
                except StorageError as e:
                    log.warning("renewing the lease of %s: %s", lease.owner, e)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.cat.close()
