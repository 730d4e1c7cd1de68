"""Cluster mode's side of the engine (`--cluster`, `engine/sharing.py`'s seam): sessions
whose records live in the shared catalogue, leased one writer at a time; a replica adopts a
session or context it lacks, and fetches the cluster's chunks of the turns it lacks for the
turn about to run. Every network call runs outside the engine's lock."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from hcache.cluster.chunks import ClusterChunks
from hcache.cluster.link import ClusterLink
from hcache.engine import checks
from hcache.engine.errors import FailedPrecondition, NotFound
from hcache.engine.records import ClusterState
from hcache.engine.sampler import SamplingParams
from hcache.engine.sequence import Sequence
from hcache.engine.session import Session, SessionMeta
from hcache.engine.sharing import Host, Sharing
from hcache.storage.catalogue import Lease, Record
from hcache.storage.errors import LeaseHeld, UnknownOwner

if TYPE_CHECKING:
    from hcache.storage.fetched import Fetched


class ClusterSharing(Sharing):
    """Records and leases through `link`; with its chunk tier, chunks too (`ClusterChunks`)."""

    def __init__(self, link: ClusterLink):
        self.link = link
        self.chunks: ClusterChunks | None = None
        self._adopting = threading.Lock()  # one context recomputed from the cluster at a time
        self._engine: Host | None = None

    @property
    def engine(self) -> Host:
        assert self._engine is not None, "attach() first"
        return self._engine

    def attach(self, engine: Host) -> None:
        self._engine = engine
        if self.link.tier is not None:
            per_token = engine.registry.bytes_per_token()
            layers = engine.model.cfg.num_layers
            self.chunks = ClusterChunks(
                engine.store, self.link.tier, engine.profile, layers, per_token, self.link.chunk_policy
            )
            self.link.chunk_stats = self.chunks.stats

    # --- the seam ---------------------------------------------------------------------
    def before_create(self, context_ids: list[str], tenant: str | None) -> None:
        for c in context_ids:
            self._ensure_context(c, tenant)

    def created(self, s: Session) -> None:
        self._publish(s)

    def lease_context(self, ctx: Session) -> Lease | None:
        self._publish(ctx)
        lease, _ = self.link.lease(ctx.id)
        return lease

    def lease_turn(self, sid: str, tenant: str | None) -> Lease | None:
        return self._lease(sid, tenant, fetch=True)

    def turn_queued(self, s: Session, keep: int) -> None:
        if s.history is not None:  # turns run elsewhere, recomputed here
            lacking = max(0, len(s.history) - keep)
            self.link.counters.recomputed_tokens += lacking
            self.link.counters.recomputes += lacking > 0

    def commit(self, seq: Sequence, tokens: list[int], meta: dict[str, Any]) -> None:
        if seq.lease is None:
            return
        s = seq.session
        self.link.commit(seq.lease, tokens, meta)
        self.link.release(seq.lease)
        seq.lease = None
        if self.chunks is not None:
            # a first turn uploads every chunk: a fork's shared ones are its own in the cluster
            self.chunks.after_turn(s.id, tokens, 0 if s.meta.turns <= 1 else seq.keep - s.base)

    def release(self, lease: Lease) -> None:
        self.link.release(lease)

    def before_delete(self, sid: str, tenant: str | None) -> None:
        self._delete_in_cluster(sid, tenant)

    def get(self, sid: str, tenant: str | None) -> Session | None:
        """The cluster's word on its turns, even if this replica never ran one."""
        e = self.engine
        rec = self._record(sid, tenant)
        with e.lock:
            s = e.registry.sessions.get(sid)
            if s is None or s.kind != "session":
                return self._view(rec)
            e.registry.refresh(s, rec)
            return s

    def used(self, fetched: Fetched) -> None:
        if self.chunks is not None:
            self.chunks.used(fetched)

    def problems(self) -> list[str]:
        return self.link.problems()

    def state(self) -> ClusterState | None:
        return self.link.state()

    def close(self) -> None:
        if self.chunks is not None:
            self.chunks.close()
        self.link.close()

    # --- how ------------------------------------------------------------------------------
    def _publish(self, s: Session) -> None:
        """A new session or context's record goes to the cluster; without it, it is not created."""
        try:
            self.link.create(self.engine.registry.record(s))
        except BaseException:
            with self.engine.lock:
                self.engine.scheduler.evict(s)  # a fork may hold its parent's memory already
                self.engine.registry.delete(s)
            raise

    def turn_refused(self, sid: str, lease: Lease) -> None:
        """A turn whose lease was taken was refused before it was queued: the rows its lease
        fetched are dropped and the lease goes back."""
        with self.engine.lock:
            s = self.engine.registry.sessions.get(sid)
            if s is not None and s.fetched is not None:
                s.drop_fetched()
                s.busy = False
        self.link.release(lease)

    def _delete_in_cluster(self, sid: str, tenant: str | None) -> None:
        """Delete the session or context from the cluster, under its lease; a context that
        sessions here share is refused."""
        lease = self._lease(sid, tenant, any_kind=True)
        try:
            with self.engine.lock:
                s = self.engine.reclaimer.settle(sid, tenant, self.engine.registry.sessions[sid].kind)
                checks.not_busy(s)
                if s.kind == "context" and any(o.meta.parent == s.id for o in self.engine.registry.sessions.values()):
                    raise FailedPrecondition(f"context {s.id} is shared by sessions here; delete them first")
            self.link.delete(lease)
        except BaseException:
            self.link.release(lease)
            raise

    def _record(self, sid: str, tenant: str | None, kind: str | None = "session") -> Record:
        """The cluster's record; another tenant's is as unknown as a missing one."""
        rec = self.link.get(sid)
        if rec is None or (kind is not None and rec.kind != kind) or (tenant is not None and rec.tenant != tenant):
            raise NotFound(f"{kind or 'session'} {sid[:64]!r} not found")
        return rec

    def _lease(self, sid: str, tenant: str | None, any_kind: bool = False, fetch: bool = False) -> Lease:
        """The session's lease, its context recomputed here if this replica lacks it, and the
        local session adopted or brought up to the record's last turn (`fetch`: with the
        cluster's chunks of what it lacks, for the turn about to run)."""
        try:
            lease, rec = self.link.lease(sid)
        except UnknownOwner:
            raise NotFound(f"session {sid[:64]!r} not found") from None
        except LeaseHeld as e:
            if e.holder != self.link.holder:
                raise
            raise FailedPrecondition(f"session {sid} is busy with another request") from None
        try:
            if (tenant is not None and rec.tenant != tenant) or (rec.kind != "session" and not any_kind):
                raise NotFound(f"session {sid[:64]!r} not found")
            parent = rec.meta.get("parent")
            if parent:
                self._ensure_context(parent, tenant)
            with self.engine.lock:
                s = self.engine.registry.sessions.get(sid)
                if s is None:
                    s = self.engine.registry.adopt(rec)
                    self.link.counters.adoptions += 1
                else:
                    self.engine.registry.refresh(s, rec)
            if fetch:
                self._fetch_chunks(s, rec)
        except BaseException:
            self.link.release(lease)
            raise
        return lease

    def _fetch_chunks(self, s: Session, rec: Record) -> None:
        """A session whose local state is behind its record, and not resident: the cluster's
        chunks of the turns it lacks come into memory (as far as they reach), for the turn
        about to run to restore from instead of recomputing them; it stages them into the
        store behind it. Runs under the session's lease; with rows fetched the session stays
        busy for that turn (`_queue_turn` takes it, or `drop_fetched`)."""
        with self.engine.lock:
            if self.chunks is None or s.history is None or s.resident or s.busy or s.kind != rec.kind:
                return
            if s.history[: len(s.tokens)] != s.tokens:
                return  # the local turns were rewritten: the turn truncates them first
            s.busy = True
        got = None
        try:
            got = self.chunks.fetch_rows(s.id, rec.tokens)
        finally:
            with self.engine.lock:
                if got is None:
                    s.busy = False
                else:
                    s.fetched = got
                    s.tokens = s.history[: len(s.tokens) + got.tokens]
                    if s.tokens == s.history:
                        s.history = None

    def _ensure_context(self, cid: str, tenant: str | None) -> None:
        """A context precomputed on another replica: recompute it here from its record's tokens."""
        with self._adopting:
            if cid in self.engine.registry.sessions:
                return
            rec = self._record(cid, tenant, "context")
            if not rec.tokens:
                raise FailedPrecondition(f"context {cid} is still being computed on another replica")
            with self.engine.lock:
                ctx = self.engine.registry.adopt(rec)
                ctx.busy = True
            self.link.counters.adoptions += 1
            try:
                got = self.chunks.fetch(cid, rec.tokens, rec.meta) if self.chunks is not None else 0
            except BaseException:
                with self.engine.lock:
                    self.engine.registry.delete(ctx)
                raise
            with self.engine.lock:
                ctx.tokens = list(rec.tokens[:got])
                if got == len(rec.tokens):  # all of it came from the cluster's chunks
                    ctx.history, ctx.busy = None, False
                    return
            self.link.counters.recomputed_tokens += len(rec.tokens) - got
            self.link.counters.recomputes += 1
            rest = list(rec.tokens[got:])
            seq = self.engine.sequence(ctx, rest, got, SamplingParams(max_new_tokens=1), [], sample=False)
            try:
                self.engine.compute(seq)
            except BaseException:
                with self.engine.lock:  # no half-computed context stays here as if it were whole
                    self.engine.registry.delete(ctx)
                raise

    @staticmethod
    def _view(rec: Record) -> Session:
        """A session this replica holds nothing of, as the cluster records it."""
        s = Session(rec.owner, rec.kind, SessionMeta.from_dict(rec.meta), [], rec.created, rec.updated)
        s.history = rec.tokens  # its context's tokens are not counted
        return s
