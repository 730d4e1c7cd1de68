"""Sessions composed of several stored contexts in the caller's order (RAG: retrieved
documents before a question), in one of three modes:

- exact: the state a prefill in that order gives. The session starts as a fork of the
  longest stored state that leads the composition: its first context, or a composition
  stored before that shares its first documents (found by the prefix index). Its first
  turn prefills the rest, and its stored state leads the next such composition.
- blend: each context's stored KV placed at its offset, a fraction of their tokens
  recomputed so that they attend to the documents before them (CacheBlend,
  restore/blend.py). Approximate: the state is its own, so the session stores KV only.
- concat: blend with nothing recomputed, the floor a blend must beat.

One context is exact in every mode: placed at offset 0, it is what its prefill gave."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from hcache.engine.block_pool import PagedCache
from hcache.engine.errors import FailedPrecondition, InvalidArgument, NotFound
from hcache.engine.forks import fork, longest_stored
from hcache.engine.prefill import PrefillReport
from hcache.engine.registry import Registry, new_id
from hcache.engine.saver import Saver
from hcache.engine.session import Session, SessionMeta
from hcache.model.base import DecoderModel
from hcache.restore.blend import Blend, Document
from hcache.restore.plan import Method
from hcache.restore.planning import RestorePlanner
from hcache.storage.layout import Kind

MODES = ("exact", "blend", "concat")


@dataclass(frozen=True)
class Composition:
    """How a session places its contexts; `fraction`: of their tokens a blend recomputes."""

    mode: str = "exact"
    fraction: float = 0.15

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InvalidArgument(f"context mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if not 0.0 <= self.fraction <= 1.0:  # NaN fails too
            raise InvalidArgument(f"blend fraction must be within 0..1, not {self.fraction}")


def compose(
    registry: Registry,
    contexts: list[Session],
    how: Composition,
    messages: list[dict[str, str]],
    labels: dict[str, str],
    tenant: str | None,
) -> tuple[Session, int]:
    """A new session on `contexts`, and how many of its tokens an earlier composition's
    stored state gives it (0: none did). Called under the engine's lock."""
    ids = [c.id for c in contexts]
    if len(contexts) < 2:
        return registry.create("session", labels, ids, messages, tenant), 0
    prefix = [t for c in contexts for t in c.tokens]
    meta = SessionMeta(prefix=prefix, messages=messages, labels=labels, context_ids=ids, tenant=tenant)
    if how.mode != "exact":
        meta.compose, meta.fraction = how.mode, how.fraction if how.mode == "blend" else 0.0
        s = Session(new_id(), "session", meta, [])
        kv = frozenset({Kind.KV})
        registry.add(s, kinds=[kv] * len(registry.kinds))
        return s, 0
    first = contexts[0]
    lead = longest_stored(registry, [*prefix, -1], tenant)  # -1: no token, so it may match them all
    if lead is not None and lead[1] > len(first.tokens):
        return fork(registry, lead[0], lead[1], meta), lead[1]
    return fork(registry, first, len(first.tokens), meta), 0


def documents(
    registry: Registry, planner: RestorePlanner, s: Session, method: Method | None, cap_gbps: float | None
) -> list[Document]:
    """How a blend's first turn reads each of its contexts (by `method`, or the planner's
    choice). Under the engine's lock."""
    docs = []
    for cid in s.meta.context_ids:
        c = registry.sessions.get(cid)
        if c is None or c.kind != "context":
            raise NotFound(f"context {cid!r} not found: it was deleted after session {s.id} was created")
        if c.error:
            raise FailedPrecondition(c.error)
        n = len(c.tokens)
        plan, _ = planner.plan(c.lineage, n, method, cap_gbps)
        docs.append(Document(c.id, c.tokens, plan, planner.source(c.lineage, c.tokens, n)))
    return docs


class BlendJob:
    """A blend's first turn: its documents placed and blended into `cache`, its suffix run
    after them, then every layer's K/V to the store in pieces the saver's ring holds."""

    def __init__(
        self,
        model: DecoderModel,
        cache: PagedCache,
        docs: list[Document],
        suffix: list[int],
        fraction: float,
        saver: Saver,
        piece_tokens: int,
    ):
        self.model, self.cache, self.saver, self.piece = model, cache, saver, max(1, piece_tokens)
        self.blend = Blend(model, cache, docs, suffix, fraction)
        self.report = PrefillReport(ms_by_method=dict.fromkeys((m.value for m in Method), 0.0))

    @property
    def last_hidden(self) -> torch.Tensor | None:
        return self.blend.last_hidden

    def wait_storage(self, timeout: float) -> None:
        self.blend.wait_storage(timeout)

    def run(self) -> Iterator[bool]:
        t0 = time.perf_counter()
        yield from self.blend.run()
        b, r = self.blend.report, self.report
        r.restore_ms, r.wait_ms, r.bytes_read = b.restore_ms, b.wait_ms, b.bytes_read
        r.fallback_layers, r.context_fallbacks = b.fallback_layers, list(b.fallbacks)
        r.placed_tokens, r.recomputed_tokens = b.placed_tokens, b.recomputed_tokens
        total = self.cache.length
        for lo in range(0, total, self.piece):
            n = min(self.piece, total - lo)
            self.saver.begin(lo, n)
            for layer in range(self.model.cfg.num_layers):
                self.saver.after_layer(layer, self.cache, lo, n)
            self.saver.submit()
            yield True
        r.prefill_ms = (time.perf_counter() - t0) * 1e3
