"""The engine in cluster mode (`--cluster`): sessions whose records live in the shared
catalogue, leased one writer at a time; a replica adopts a session or context it lacks, and
fetches the cluster's chunks of the turns it lacks for the turn about to run. Every network
call runs outside the engine's lock."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from hcache.engine import checks
from hcache.engine.errors import FailedPrecondition, NotFound
from hcache.engine.lock import EngineLock
from hcache.engine.records import SessionMeta
from hcache.engine.sampler import SamplingParams
from hcache.engine.sequence import Sequence, Session
from hcache.storage.catalogue import Lease, Record
from hcache.storage.errors import LeaseHeld, UnknownOwner

if TYPE_CHECKING:
    from hcache.engine.cluster import ClusterLink
    from hcache.engine.cluster_chunks import ClusterChunks
    from hcache.engine.reclaimer import Reclaimer
    from hcache.engine.scheduler import Scheduler
    from hcache.engine.sessions import Registry


class ClusterTurns:
    """Mixed into `Engine`: what its public calls do with the cluster."""

    cluster: ClusterLink | None
    chunks: ClusterChunks | None
    registry: Registry
    reclaimer: Reclaimer
    scheduler: Scheduler
    lock: EngineLock
    _adopting: threading.Lock
    _sequence: Callable[..., Sequence]
    _submit: Callable[[Sequence], None]
    _wait: Callable[[Sequence], None]

    def _publish(self, s: Session) -> None:
        """A new session or context's record goes to the cluster; without it, it is not created."""
        assert self.cluster is not None
        try:
            self.cluster.create(self.registry.record(s))
        except BaseException:
            with self.lock:
                self.scheduler.evict(s)  # a fork may hold its parent's memory already
                self.registry.delete(s)
            raise

    def _turn_refused(self, sid: str, lease: Lease) -> None:
        """A turn whose lease was taken was refused before it was queued: the rows its lease
        fetched are dropped and the lease goes back."""
        assert self.cluster is not None
        with self.lock:
            s = self.registry.sessions.get(sid)
            if s is not None and s.fetched is not None:
                s.drop_fetched()
                s.busy = False
        self.cluster.release(lease)

    def _delete_in_cluster(self, sid: str, tenant: str | None) -> None:
        """Delete the session or context from the cluster, under its lease; a context that
        sessions here share is refused."""
        assert self.cluster is not None
        lease = self._lease(sid, tenant, any_kind=True)
        try:
            with self.lock:
                s = self.reclaimer.settle(sid, tenant, self.registry.sessions[sid].kind)
                checks.not_busy(s)
                if s.kind == "context" and any(o.parent == s.id for o in self.registry.sessions.values()):
                    raise FailedPrecondition(f"context {s.id} is shared by sessions here; delete them first")
            self.cluster.delete(lease)
        except BaseException:
            self.cluster.release(lease)
            raise

    def _record(self, sid: str, tenant: str | None, kind: str | None = "session") -> Record:
        """The cluster's record; another tenant's is as unknown as a missing one."""
        assert self.cluster is not None
        rec = self.cluster.get(sid)
        if rec is None or (kind is not None and rec.kind != kind) or (tenant is not None and rec.tenant != tenant):
            raise NotFound(f"{kind or 'session'} {sid[:64]!r} not found")
        return rec

    def _lease(self, sid: str, tenant: str | None, any_kind: bool = False, fetch: bool = False) -> Lease:
        """The session's lease, its context recomputed here if this replica lacks it, and the
        local session adopted or brought up to the record's last turn (`fetch`: with the
        cluster's chunks of what it lacks, for the turn about to run)."""
        assert self.cluster is not None
        try:
            lease, rec = self.cluster.lease(sid)
        except UnknownOwner:
            raise NotFound(f"session {sid[:64]!r} not found") from None
        except LeaseHeld as e:
            if e.holder != self.cluster.holder:
                raise
            raise FailedPrecondition(f"session {sid} is busy with another request") from None
        try:
            if (tenant is not None and rec.tenant != tenant) or (rec.kind != "session" and not any_kind):
                raise NotFound(f"session {sid[:64]!r} not found")
            parent = rec.meta.get("parent")
            if parent:
                self._ensure_context(parent, tenant)
            with self.lock:
                s = self.registry.sessions.get(sid)
                if s is None:
                    s = self.registry.adopt(rec)
                    self.cluster.counters.adoptions += 1
                else:
                    self.registry.refresh(s, rec)
            if fetch:
                self._fetch_chunks(s, rec)
        except BaseException:
            self.cluster.release(lease)
            raise
        return lease

    def _fetch_chunks(self, s: Session, rec: Record) -> None:
        """A session whose local state is behind its record, and not resident: the cluster's
        chunks of the turns it lacks come into memory (as far as they reach), for the turn
        about to run to restore from instead of recomputing them; it stages them into the
        store behind it. Runs under the session's lease; with rows fetched the session stays
        busy for that turn (`_queue_turn` takes it, or `drop_fetched`)."""
        with self.lock:
            if self.chunks is None or s.history is None or s.resident or s.busy or s.kind != rec.kind:
                return
            if s.history[: len(s.tokens)] != s.tokens:
                return  # the local turns were rewritten: the turn truncates them first
            s.busy = True
        got = None
        try:
            got = self.chunks.fetch_rows(s.id, rec.tokens)
        finally:
            with self.lock:
                if got is None:
                    s.busy = False
                else:
                    s.fetched = got
                    s.tokens = s.history[: len(s.tokens) + got.tokens]
                    if s.tokens == s.history:
                        s.history = None

    def _ensure_context(self, cid: str, tenant: str | None) -> None:
        """A context precomputed on another replica: recompute it here from its record's tokens."""
        assert self.cluster is not None
        with self._adopting:
            if cid in self.registry.sessions:
                return
            rec = self._record(cid, tenant, "context")
            if not rec.tokens:
                raise FailedPrecondition(f"context {cid} is still being computed on another replica")
            with self.lock:
                ctx = self.registry.adopt(rec)
                ctx.busy = True
            self.cluster.counters.adoptions += 1
            try:
                got = self.chunks.fetch(cid, rec.tokens, rec.meta) if self.chunks is not None else 0
            except BaseException:
                with self.lock:
                    self.registry.delete(ctx)
                raise
            with self.lock:
                ctx.tokens = list(rec.tokens[:got])
                if got == len(rec.tokens):  # all of it came from the cluster's chunks
                    ctx.history, ctx.busy = None, False
                    return
            self.cluster.counters.recomputed_tokens += len(rec.tokens) - got
            self.cluster.counters.recomputes += 1
            rest = list(rec.tokens[got:])
            seq = self._sequence(ctx, rest, got, SamplingParams(max_new_tokens=1), [], sample=False)
            self._submit(seq)
            try:
                self._wait(seq)
            except BaseException:
                with self.lock:  # no half-computed context stays here as if it were whole
                    self.registry.delete(ctx)
                raise

    @staticmethod
    def _view(rec: Record) -> Session:
        """A session this replica holds nothing of, as the cluster records it."""
        s = Session.from_meta(rec.owner, rec.kind, SessionMeta.from_dict(rec.meta), [], rec.created, rec.updated)
        s.history = rec.tokens  # its context's tokens are not counted
        return s
