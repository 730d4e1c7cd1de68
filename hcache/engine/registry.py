"""Every session and context: loaded from the store after a restart, created, adopted from
the cluster, deleted. The store is the truth across restarts."""

from __future__ import annotations

import secrets
import time
from array import array

import xxhash

from hcache.engine.errors import FailedPrecondition, NotFound
from hcache.engine.session import Session, SessionMeta
from hcache.model.base import DecoderModel
from hcache.storage.catalogue import Record
from hcache.storage.layout import CHUNK_TOKENS, Stored
from hcache.storage.store import ChunkStore


def new_id(prefix: str = "") -> str:
    return prefix + secrets.token_hex(16)  # 128 random bits


def content_key(tokens: list[int], tenant: str | None) -> tuple[str | None, int, bytes]:
    """What finds a context by its token ids: the tenant's, same length, same 128-bit hash."""
    return tenant, len(tokens), xxhash.xxh3_128_digest(array("I", tokens).tobytes())


def stored_fingerprint(model: DecoderModel, store: ChunkStore) -> str:
    """The model's fingerprint, and the stored KV's dtype where it is not the model's: KV
    chunks of another dtype have another size, and their bits another rounding."""
    fp = model.fingerprint()
    return fp if store.kv_dtype == model.dtype else f"{fp}+kv-{str(store.kv_dtype).removeprefix('torch.')}"


class Registry:
    def __init__(self, store: ChunkStore, model: DecoderModel, kinds: list[Stored]):
        self.store, self.kinds = store, kinds
        self.fingerprint = stored_fingerprint(model, store)
        self.sessions: dict[str, Session] = {}
        self._contexts: dict[tuple[str | None, int, bytes], str] = {}  # content_key -> durable context
        self._load()

    def _load(self) -> None:
        rows = {r.owner: r for r in self.store.owners()}
        for r in sorted(rows.values(), key=lambda r: r.kind != "context"):  # contexts first
            meta = SessionMeta.from_dict(r.meta)
            parent = meta.parent
            prefix_tokens = rows[parent].tokens if parent in rows else []
            s = Session(r.owner, r.kind, meta, prefix_tokens + r.tokens, r.created, r.updated)
            if r.fingerprint.partition("+")[0] != self.fingerprint.partition("+")[0]:
                s.error = f"{r.kind} {r.owner} was saved by another model; it cannot be continued with this one"
            elif r.fingerprint != self.fingerprint:
                s.error = f"{r.kind} {r.owner} was stored with another --kv-dtype; serve it with the one it used"
            elif parent is not None and parent not in rows:
                s.error = f"session {r.owner} lost its context {parent}"
            self.sessions[r.owner] = s
            if s.kind == "context" and s.tokens and not s.error:
                self.index_context(s)

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

    def context_of(self, tokens: list[int], tenant: str | None) -> Session | None:
        """The tenant's durable context of exactly these tokens, if one is stored."""
        s = self.sessions.get(self._contexts.get(content_key(tokens, tenant), ""))
        return s if s is not None and s.tokens == tokens else None

    def index_context(self, s: Session) -> None:
        """`s`, a context, is durable: later precomputes of the same tokens return it."""
        self._contexts[content_key(s.tokens, s.tenant)] = s.id

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
        first = contexts[0] if contexts else None
        meta = SessionMeta(
            prefix=[t for c in contexts for t in c.tokens],
            parent=first.id if first else None,
            base=len(first.tokens) if first else 0,
            messages=messages,
            labels=labels,
            context_ids=context_ids,
            tenant=tenant,
        )
        s = Session(sid or new_id("ctx-" if kind == "context" else ""), kind, meta, list(first.tokens) if first else [])
        self.add(s)
        return s

    def add(self, s: Session, fork_of: tuple[str, int] | None = None, kinds: list[Stored] | None = None) -> None:
        """A new session stored: empty (storing `kinds` per layer, default the engine's), or
        sharing the first tokens of `fork_of` (owner, tokens)."""
        if fork_of is None:
            stored = list(kinds or self.kinds)
            self.store.create_owner(s.id, stored, self.fingerprint, kind=s.kind, meta=s.meta.to_dict())
        else:
            self.store.fork(fork_of[0], s.id, fork_of[1], s.meta.to_dict(), s.index_as)
        self.sessions[s.id] = s

    def record(self, s: Session) -> Record:
        """What the cluster keeps of a new session or context (a fork: with its shared tokens)."""
        layers = self.store.owner_row(s.id).layer_kinds
        return Record(s.id, s.kind, self.fingerprint, layers, list(s.own_tokens), s.meta.to_dict())

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
        s = Session(rec.owner, rec.kind, meta, base, rec.created, rec.updated)
        self.sessions[s.id] = s
        self.refresh(s, rec)
        return s

    @staticmethod
    def refresh(s: Session, rec: Record) -> None:
        """The conversation becomes the record's (another replica may have run turns); the
        local state stays as a cache of its common prefix."""
        if s.busy:
            return
        s.meta, s.updated = SessionMeta.from_dict(rec.meta), rec.updated
        history = s.tokens[: s.base] + rec.tokens
        s.history = None if history == s.tokens else history

    def delete(self, s: Session) -> None:
        if s.kind == "context":
            users = [o.id for o in self.sessions.values() if s.id in o.reads]
            if users:
                raise FailedPrecondition(f"context {s.id} is shared by {len(users)} session(s); delete them first")
        self.store.delete(s.id)
        del self.sessions[s.id]
        if s.kind == "context" and self._contexts.get(key := content_key(s.tokens, s.tenant)) == s.id:
            del self._contexts[key]
