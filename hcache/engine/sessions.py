"""Sessions and contexts as the store keeps them: loading them after a restart,
creating them, the restore source of a session (its shared context's chunks,
then its own), and the restore plan for what it stored."""

from __future__ import annotations

import secrets
import time

import torch

from hcache.engine.errors import FailedPrecondition, NotFound
from hcache.engine.records import SessionMeta
from hcache.engine.sequence import Session
from hcache.model.base import DecoderModel
from hcache.restore.partitioner import PlannedRestore, partition, partition_stored, storage_kinds
from hcache.restore.plan import Method, Plan
from hcache.restore.profile import Geometry, Profile
from hcache.restore.sources import RowsSource, SharedSource, StoreSource
from hcache.restore.state import StateSource
from hcache.storage.catalogue import Record
from hcache.storage.fetched import Fetched
from hcache.storage.layout import CHUNK_TOKENS, Kind, Stored, encode_layer_kinds
from hcache.storage.store import ChunkStore


def new_id(prefix: str = "") -> str:
    return prefix + secrets.token_hex(16)  # 128 random bits


def layer_kinds_for(
    policy: str, model: DecoderModel, profile: Profile, plan_tokens: int, kv_dtype: torch.dtype | None = None
) -> list[Stored]:
    """What every new owner stores per layer (KV stored in `kv_dtype`, default the model's)."""
    n = model.cfg.num_layers
    fixed = {"kv": {Kind.KV}, "hidden": {Kind.HIDDEN}, "both": {Kind.HIDDEN, Kind.KV}, "none": set()}
    if policy in fixed:
        return [frozenset(fixed[policy])] * n
    if policy != "auto":
        raise ValueError(f"store_kinds must be auto, kv, hidden, both or none, not {policy!r}")
    geom = Geometry.of(model.cfg, model.dtype.itemsize, (kv_dtype or model.dtype).itemsize)
    plan = partition(geom, profile, plan_tokens).plan
    return [frozenset({k}) if k else frozenset() for k in storage_kinds(plan)]


def stored_fingerprint(model: DecoderModel, store: ChunkStore) -> str:
    """The model's fingerprint, and the stored KV's dtype where it is not the model's: KV
    chunks of another dtype have another size, and their bits another rounding."""
    fp = model.fingerprint()
    return fp if store.kv_dtype == model.dtype else f"{fp}+kv-{str(store.kv_dtype).removeprefix('torch.')}"


class Registry:
    """Every session and context, in memory; the store is the truth across restarts."""

    def __init__(self, store: ChunkStore, model: DecoderModel, kinds: list[Stored]):
        self.store, self.model, self.kinds = store, model, kinds
        self.fingerprint = stored_fingerprint(model, store)
        self.sessions: dict[str, Session] = {}
        self._load()

    def _load(self) -> None:
        rows = {r.owner: r for r in self.store.owners()}
        for r in sorted(rows.values(), key=lambda r: r.kind != "context"):  # contexts first
            meta = SessionMeta.from_dict(r.meta)
            parent = meta.parent
            prefix_tokens = rows[parent].tokens if parent in rows else []
            s = Session.from_meta(r.owner, r.kind, meta, prefix_tokens + r.tokens, r.created, r.updated)
            if r.fingerprint.partition("+")[0] != self.fingerprint.partition("+")[0]:
                s.error = f"{r.kind} {r.owner} was saved by another model; it cannot be continued with this one"
            elif r.fingerprint != self.fingerprint:
                s.error = f"{r.kind} {r.owner} was stored with another --kv-dtype; serve it with the one it used"
            elif parent is not None and parent not in rows:
                s.error = f"session {r.owner} lost its context {parent}"
            self.sessions[r.owner] = s

    def get(self, sid: str, kind: str = "session", tenant: str | None = None) -> Session:
        """Another tenant's session is as unknown as a missing one."""
        s = self.sessions.get(sid)
        if s is None or s.kind != kind or (tenant is not None and s.tenant != tenant):
            gone = self.store.expired(sid) if s is None and kind == "session" else None
            if gone is not None and (tenant is None or gone[0] == tenant):
                when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(gone[1]))
                raise NotFound(f"session {sid[:64]!r} expired: it was idle past the session TTL and deleted at {when}")
            raise NotFound(f"{kind} {sid[:64]!r} not found")
        return s

    def bytes_per_token(self) -> int:
        row = {kind: s.nbytes // CHUNK_TOKENS for kind, s in self.store.shapes.items()}
        return sum(row[kind] for k in self.kinds for kind in k)

    def create(
        self,
        kind: str,
        labels: dict[str, str],
        context_ids: list[str],
        messages: list[dict],
        tenant: str | None = None,
        sid: str | None = None,
    ) -> Session:
        contexts = [self.get(c, "context", tenant) for c in context_ids]
        for c in contexts:
            if c.error:
                raise FailedPrecondition(c.error)
        prefix = [t for c in contexts for t in c.tokens]
        first = contexts[0] if contexts else None
        s = Session(
            id=sid or new_id("ctx-" if kind == "context" else ""),
            kind=kind,
            prefix=prefix,
            parent=first.id if first else None,
            base=len(first.tokens) if first else 0,
            tokens=list(first.tokens) if first else [],
            messages=messages,
            labels=labels,
            context_ids=context_ids,
            tenant=tenant,
        )
        self.store.create_owner(s.id, list(self.kinds), self.fingerprint, kind=kind, meta=s.meta().to_dict())
        self.sessions[s.id] = s
        return s

    def match(self, ids: list[int], tenant: str | None) -> tuple[Session, int] | None:
        """The idle chat session of `tenant` that shares the longest prefix with `ids`, leaving
        at least the last token of `ids` to feed, and how many tokens. Candidates come from the
        index of whole chunks; the shared prefix then runs on token by token into the next
        chunk. Among equals, one still in memory, then the most recently used. Called under
        the engine's lock, so the session stays idle meanwhile."""
        ns = Session("", "session", [], None, 0, [], mode="chat", tenant=tenant).index_as
        assert ns is not None
        best: tuple[int, bool, float, Session] | None = None
        for owner, n in self.store.find_prefix(ids[:-1], ns):
            if best is not None and n + CHUNK_TOKENS <= best[0]:
                break  # a shorter chunk match cannot reach past the best one's tokens
            s = self.sessions.get(owner)
            if (
                s is None
                or s.tenant != tenant
                or s.index_as != ns
                or s.busy
                or s.releasing
                or s.error
                or s.tokens[:n] != ids[:n]  # not only the hash
            ):
                continue
            k = n
            for a, b in zip(s.tokens[n : n + CHUNK_TOKENS], ids[n : len(ids) - 1], strict=False):
                if a != b:
                    break
                k += 1
            key = (k, s.cache is not None and s.cache.length >= k, s.last_used, s)
            best = key if best is None or key[:3] > best[:3] else best
        return (best[3], best[0]) if best is not None else None

    def fork(self, parent: Session, n: int, messages: list[dict], tenant: str | None) -> Session:
        """A new chat session whose first `n` tokens share `parent`'s stored state;
        `parent` stays as it was. Called under the engine's lock with `parent` idle."""
        s = Session(
            id=new_id(),
            kind="session",
            prefix=[],
            parent=None,
            base=0,
            tokens=parent.tokens[:n],
            messages=messages,
            mode="chat",
            tenant=tenant,
        )
        self.store.fork(parent.id, s.id, n, s.meta().to_dict(), s.index_as)
        self.sessions[s.id] = s
        return s

    def record(self, s: Session) -> Record:
        """What the cluster keeps of a new session or context (a fork: with its shared tokens)."""
        layers = self.store.owner_row(s.id).layer_kinds
        return Record(s.id, s.kind, self.fingerprint, layers, list(s.own_tokens), s.meta().to_dict())

    def adopt(self, rec: Record) -> Session:
        """A session or context first seen in the cluster: its local state is empty (its
        context's, for a session on one), and `history` holds what its turns fed."""
        if rec.fingerprint != self.fingerprint:
            raise FailedPrecondition(f"{rec.kind} {rec.owner} was saved by another model; it cannot be continued here")
        meta = SessionMeta.from_dict(rec.meta)
        base: list[int] = []
        if meta.parent is not None:
            parent = self.sessions.get(meta.parent)
            if parent is None or parent.kind != "context":
                raise FailedPrecondition(f"session {rec.owner} lost its context {meta.parent}")
            base = list(parent.tokens)
        self.store.create_owner(rec.owner, list(self.kinds), self.fingerprint, kind=rec.kind, meta=rec.meta)
        s = Session.from_meta(rec.owner, rec.kind, meta, base, rec.created, rec.updated)
        self.sessions[s.id] = s
        self.refresh(s, rec)
        return s

    @staticmethod
    def refresh(s: Session, rec: Record) -> None:
        """The conversation becomes the record's (another replica may have run turns); the
        local state stays as a cache of its common prefix."""
        if s.busy:
            return
        meta = SessionMeta.from_dict(rec.meta)
        s.rewind(meta)
        s.labels, s.updated = meta.labels, rec.updated
        history = s.tokens[: s.base] + rec.tokens
        s.history = None if history == s.tokens else history

    def delete(self, s: Session) -> None:
        if s.kind == "context":
            users = [o.id for o in self.sessions.values() if o.parent == s.id]
            if users:
                raise FailedPrecondition(f"context {s.id} is shared by {len(users)} session(s); delete them first")
        self.store.delete(s.id)
        del self.sessions[s.id]

    # --- restoring ----------------------------------------------------------
    def stored(self, s: Session, n: int) -> list[Stored]:
        """What every layer can be read as, for the first `n` tokens."""
        own = self.store.layer_kinds(self.store.owner_row(s.id))
        if s.parent is None:
            return own
        par = self.store.layer_kinds(self.store.owner_row(s.parent))
        return par if n <= s.base else [a & b for a, b in zip(par, own, strict=True)]

    def source(self, s: Session, n: int, fetched: Fetched | None = None) -> StateSource:
        """Where `n` tokens of `s` are read from: its context's chunks, then its own, then
        the rows `fetched` from the cluster past those (the first `fetched.tokens` of them)."""
        if s.error:
            raise FailedPrecondition(s.error)
        stored = n > s.base and (fetched is None or fetched.start > 0)
        own: StateSource | None = StoreSource(self.store, s.id, self.fingerprint) if stored else None
        if fetched is not None:
            lo = s.base + fetched.start
            heads = (self.model.cfg.num_kv_heads, self.model.cfg.head_dim)
            rows = RowsSource(s.tokens[lo : lo + fetched.tokens], fetched, heads)
            own = SharedSource(own, rows, fetched.start) if fetched.start else rows
        if s.parent is None:
            assert own is not None
            return own
        return SharedSource(StoreSource(self.store, s.parent, self.fingerprint), own, s.base)

    def plan(
        self,
        s: Session,
        n: int,
        profile: Profile,
        method: Method | None,
        cap_gbps: float | None,
        fetched: Fetched | None = None,
    ) -> tuple[Plan, float | None]:
        """The plan for restoring `n` tokens of `s`, and its predicted ms (auto only). With rows
        `fetched` into memory, every layer reads them (KV where stored: a copy beats a projection)."""
        L = self.model.cfg.num_layers
        stored = self.stored(s, n)
        if method == Method.RECOMPUTE:
            return Plan.uniform(L, method), None
        if method is not None:
            kind = Kind.HIDDEN if method == Method.HIDDEN else Kind.KV
            missing = [i for i, ks in enumerate(stored) if kind not in ks]
            if missing:
                raise FailedPrecondition(
                    f"{s.kind} {s.id} does not store {method.value} state for layers {missing[:8]}"
                    f"{'...' if len(missing) > 8 else ''}; it stores per layer {encode_layer_kinds(list(stored))}"
                )
            return Plan.uniform(L, method), None
        if fetched is not None and all(stored):
            return Plan(tuple(Method.KV if Kind.KV in ks else Method.HIDDEN for ks in stored)), None
        geom = Geometry.of(self.model.cfg, self.model.dtype.itemsize, self.store.kv_dtype.itemsize)
        res: PlannedRestore = partition_stored(geom, profile, n, stored, cap_gbps)
        return res.plan, res.makespan_ms
