"""Bringing an owner's chunks from the cluster into the local store: the tokens past what
the store holds, as far as every stored layer's chunks reach intact. The store then
restores them like any other durable turn (its planner prices its own disks), and the
tokens past the first chunk the cluster lacks are recomputed by the turn's prefill."""

from __future__ import annotations

import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from hcache.storage.chunk_tier import ChunkTier, chunk_key, chunk_rows, prefix_hash, unpack
from hcache.storage.layout import CHUNK_TOKENS, Kind, num_chunks
from hcache.storage.store import ChunkStore

WINDOW = 8  # chunks per stream per MGET: 512 tokens of every layer in memory at a time


@dataclass
class Hydrated:
    tokens: int = 0  # tokens whose state came from the cluster
    bytes: int = 0  # chunk bytes fetched (the ones used)
    missing: int = 0  # 1 if the fetch stopped at a missing or unusable chunk


def hydrate(
    store: ChunkStore, tier: ChunkTier, owner: str, tokens: list[int], meta: dict | None, window: int = WINDOW
) -> Hydrated:
    """The owner's own `tokens` (the record's) past the store's durable prefix of them, a
    window of `window` chunks of every layer at a time (one MGET each: one slot; the next
    window's MGET runs while this one is checked and staged), up to the first chunk some
    layer lacks; then made durable. Returns what came."""
    row = store.owner_row(owner)
    start, n = row.num_tokens, len(tokens)
    out = Hydrated()
    kinds = store.layer_kinds(row)
    if start >= n or row.tokens != tokens[:start] or not any(kinds):
        return out  # nothing to fetch, local turns that differ, or nothing stored per layer
    streams = [(layer, kind) for layer, ks in enumerate(kinds) for kind in sorted(ks)]
    windows = [range(lo, min(lo + window, num_chunks(n))) for lo in range(start // CHUNK_TOKENS, num_chunks(n), window)]

    def get(idxs: range) -> list[bytes | None]:
        return tier.get([chunk_key(owner, layer, kind, i) for layer, kind in streams for i in idxs])

    pos = start  # rows staged so far
    with ThreadPoolExecutor(1, thread_name_prefix="hcache-hydrate") as pool:
        ahead = pool.submit(get, windows[0])
        for w, idxs in enumerate(windows):
            values = ahead.result()
            if w + 1 < len(windows):
                ahead = pool.submit(get, windows[w + 1])
            for i in idxs:
                got = _chunk(store, streams, tokens, i, values[i - idxs[0] :: len(idxs)], pos, out)
                if got is None:
                    ahead.cancel()
                    break  # past a missing chunk the turn's prefill recomputes
                out.bytes += _stage(store, owner, got, pos)
                pos = i * CHUNK_TOKENS + chunk_rows(n, i)
            else:
                continue
            break
    if pos > start:
        store.mark_durable(owner, tokens[:pos], meta)
    out.tokens = pos - start
    return out


def _chunk(
    store: ChunkStore,
    streams: list[tuple[int, Kind]],
    tokens: list[int],
    i: int,
    values: list[bytes | None],
    pos: int,
    out: Hydrated,
) -> dict[tuple[int, Kind], torch.Tensor] | None:
    """Chunk `i` of every stream (`values`, in stream order), its rows from token `pos` on, in
    place; None if some stream's chunk is missing or not of exactly these tokens."""
    rows = chunk_rows(len(tokens), i)
    pre = prefix_hash(tokens[: i * CHUNK_TOKENS + rows])
    parts = {}
    for (layer, kind), value in zip(streams, values, strict=True):
        shape = store.shapes[kind]
        body = unpack(value, pre, rows, shape.nbytes // CHUNK_TOKENS)
        if body is None:
            out.missing += 1
            return None
        parts[(layer, kind)] = _rows(body, store.dtype, shape.shape[1:])[pos - i * CHUNK_TOKENS :]
    return parts


def _rows(body: memoryview, dtype: torch.dtype, width: tuple[int, ...]) -> torch.Tensor:
    """A chunk's rows in place (read only: they are only copied from)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns of any non-writable buffer
        return torch.frombuffer(body, dtype=dtype).view(-1, *width)


def _stage(store: ChunkStore, owner: str, parts: dict[tuple[int, Kind], torch.Tensor], lo: int) -> int:
    """One chunk's rows of every stream, from token `lo`, into the store."""
    hidden = {layer: t for (layer, kind), t in parts.items() if kind == Kind.HIDDEN}
    kv = {layer: t for (layer, kind), t in parts.items() if kind != Kind.HIDDEN}
    store.save_rows(owner, lo, hidden, kv)
    return sum(t.numel() * t.element_size() for t in parts.values())
