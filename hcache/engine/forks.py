"""Resent conversations: the stored chat session that shares the longest prefix with one,
and a fork of it that shares that prefix's stored state copy-on-write."""

from __future__ import annotations

from hcache.engine.registry import Registry, new_id
from hcache.engine.session import Session, SessionMeta, index_namespace
from hcache.storage.layout import CHUNK_TOKENS


def longest_stored(registry: Registry, ids: list[int], tenant: str | None) -> tuple[Session, int] | None:
    """The idle chat session of `tenant` that shares the longest prefix with `ids`, leaving at
    least the last token of `ids` to feed, and how many tokens. Candidates come from the index
    of whole chunks; the shared prefix then runs on token by token into the next chunk. Among
    equals, one still in memory, then the most recently used. Called under the engine's lock,
    so the session stays idle meanwhile."""
    ns = index_namespace("session", SessionMeta(mode="chat", tenant=tenant))
    assert ns is not None
    best: tuple[int, bool, float, Session] | None = None
    for owner, n in registry.store.find_prefix(ids[:-1], ns):
        if best is not None and n + CHUNK_TOKENS <= best[0]:
            break  # a shorter chunk match cannot reach past the best one's tokens
        s = registry.sessions.get(owner)
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


def fork(registry: Registry, parent: Session, n: int, meta: SessionMeta) -> Session:
    """A new session whose first `n` tokens share `parent`'s stored state (`parent` has no
    context of its own: a context, or a session on none); `parent` stays as it was. Called
    under the engine's lock with `parent` idle."""
    s = Session(new_id(), "session", meta, parent.tokens[:n])
    registry.add(s, fork_of=(parent.id, n))
    return s
