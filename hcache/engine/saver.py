"""Feeding what forwards produce to the chunk store's two-stage saver.

Decode steps stage the whole batch in one ring entry: the compiled step's hidden
states and new K/V go in with one copy per kind (the eager forward writes each
layer's hidden states straight into it and the new K/V rows are gathered next to
them). A prefill piece spans many engine steps (decode steps run in between), so
holding a ring entry across them could block the ring behind it; a piece is
captured into the job's own buffers and staged with one copy when it ends."""

from __future__ import annotations

from collections.abc import Callable

import torch

from hcache.engine.block_pool import PagedCache
from hcache.engine.errors import Unavailable
from hcache.model.decode import StepOut
from hcache.storage.fetched import Fetched
from hcache.storage.layout import Kind, Stored
from hcache.storage.staging import StagedBatch
from hcache.storage.store import ChunkStore


def _kv_rows(cache: PagedCache, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = rows.shape[0]
    return cache.pool.k[layer].index_select(0, rows).view(n, -1), cache.pool.v[layer].index_select(0, rows).view(n, -1)


class Saver:
    """Rows of one owner. `base` is where the owner's own tokens start (a shared context before
    it). Rows `ahead` (fetched from the cluster, read by the turn's restore) go to the store
    first, with the first piece: staged at the start, their disk writes would compete with
    the restore for the cores."""

    def __init__(self, store: ChunkStore, owner: str, base: int = 0, ahead: Fetched | None = None):
        self.store, self.owner, self.base, self.ahead = store, owner, base, ahead
        self.kinds: list[Stored] = store.layer_kinds(store.owner_row(owner))
        self._n = self._cap = 0
        self._start = 0
        self._hidden: dict[int, torch.Tensor] = {}
        self._kv: dict[int, torch.Tensor] = {}

    def begin(self, start: int, n: int) -> dict[int, torch.Tensor]:
        """Buffers for a piece of `n` tokens at absolute position `start`; the forward copies
        layer l's input into `[l]` for each layer that stores H."""
        cfg, dt = self.store.model, self.store.dtype
        if n > self._cap:
            layers = list(enumerate(self.kinds))
            self._hidden = {i: torch.empty(n, cfg.hidden_size, dtype=dt) for i, k in layers if Kind.HIDDEN in k}
            self._kv = {i: torch.empty(n, 2, cfg.kv_dim, dtype=dt) for i, k in layers if Kind.KV in k}
            self._cap = n
        self._n, self._start = n, start
        return {i: t[:n] for i, t in self._hidden.items()}

    def after_layer(self, layer: int, cache: PagedCache, start: int, n: int) -> None:
        dst = self._kv.get(layer)
        if dst is not None:
            k, v = cache.kv_rows(layer, start, n)
            dst[:n, 0] = k
            dst[:n, 1] = v

    def submit(self) -> None:
        if self.ahead is not None:
            a, self.ahead = self.ahead, None
            stage_fetched(self.store, self.owner, a, a.release)  # the restore is done with them
        n = self._n
        batch = self.store.acquire([(self.owner, self._start - self.base, n)])
        for layer, t in batch.hidden.items():
            t.copy_(self._hidden[layer][:n])
        for layer, t in batch.kv.items():
            t.copy_(self._kv[layer][:n])
        self.store.submit(batch)


def stage_fetched(store: ChunkStore, owner: str, rows: Fetched, on_packed: Callable[[], None] | None) -> None:
    """Rows fetched from the cluster into the store, ahead of the turn's own: all of them, or
    the turn fails (one damaged in transit was recomputed by the restore, but the store takes
    rows of every stored kind; the turn's retry recomputes past the removed chunk)."""
    if not rows.intact():
        rows.release()
        err = rows.progress.error
        why = f"fetching its chunks from the cluster failed: {err}" if err else "a chunk failed its checksum"
        raise Unavailable(f"session {owner}: {why}; retry the turn")
    store.stage_rows(owner, rows.start, rows.hidden, rows.kv, on_packed)


def finish_decode(
    store: ChunkStore,
    batch: StagedBatch,
    caches: list[PagedCache],
    positions: list[int],
    step: StepOut | None = None,
) -> None:
    """A decode step's ring entry (from `store.acquire`, one row per sequence), then submit.
    `step`: the compiled step's output, whose hidden states and new K/V go in with one copy
    per kind; without it the forward wrote the hidden states and the new K/V rows are
    gathered from the pool."""
    if step is not None:
        for kind, src in ((Kind.HIDDEN, step.hidden), (Kind.KV, step.kv)):
            dst, layers = batch.whole(kind), batch.layers(kind)
            if dst is not None:
                dst.copy_(src if len(layers) == src.shape[0] else src[list(layers)])
    elif batch.kv:
        pool_rows = torch.cat([c.rows(p, 1) for c, p in zip(caches, positions, strict=True)])
        for layer, dst in batch.kv.items():
            k, v = _kv_rows(caches[0], layer, pool_rows)
            dst[:, 0] = k
            dst[:, 1] = v
    store.submit(batch, hold=True)
