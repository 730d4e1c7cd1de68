"""Bringing an owner's chunks from the cluster into the local store: the tokens past what
the store holds, as far as every stored layer's chunks reach intact. The store then
restores them like any other durable turn (its planner prices its own disks), and the
tokens past the first chunk the cluster lacks are recomputed by the turn's prefill."""

from __future__ import annotations

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
    missing: int = 0  # (layer, kind) streams cut short by a missing or unusable chunk


def hydrate(
    store: ChunkStore, tier: ChunkTier, owner: str, tokens: list[int], meta: dict | None, window: int = WINDOW
) -> Hydrated:
    """The owner's own `tokens` (the record's) past the store's durable prefix of them, a
    window of `window` chunks of every layer at a time (one MGET each: one slot), checked and
    staged, up to the first chunk some layer lacks; then made durable. Returns what came."""
    row = store.owner_row(owner)
    start, n = row.num_tokens, len(tokens)
    out = Hydrated()
    kinds = store.layer_kinds(row)
    if start >= n or row.tokens != tokens[:start] or not any(kinds):
        return out  # nothing to fetch, local turns that differ, or nothing stored per layer
    streams = [(layer, kind) for layer, ks in enumerate(kinds) for kind in sorted(ks)]
    pos = start  # rows staged so far
    for lo in range(start // CHUNK_TOKENS, num_chunks(n), window):
        idxs = range(lo, min(lo + window, num_chunks(n)))
        values = tier.get([chunk_key(owner, layer, kind, i) for layer, kind in streams for i in idxs])
        end = idxs[-1] * CHUNK_TOKENS + chunk_rows(n, idxs[-1])
        reach = end  # every stream's intact rows reach this token
        parts: dict[tuple[int, Kind], list[memoryview]] = {}
        prefixes = [prefix_hash(tokens[: i * CHUNK_TOKENS + chunk_rows(n, i)]) for i in idxs]
        for j, (layer, kind) in enumerate(streams):
            row_bytes = store.shapes[kind].nbytes // CHUNK_TOKENS
            got = parts[(layer, kind)] = []
            for i, pre, value in zip(idxs, prefixes, values[j * len(idxs) : (j + 1) * len(idxs)], strict=True):
                body = unpack(value, pre, chunk_rows(n, i), row_bytes)
                if body is None:
                    reach = min(reach, i * CHUNK_TOKENS)
                    out.missing += 1
                    break
                got.append(body)
        if reach > pos:
            out.bytes += _stage(store, owner, parts, pos, reach, lo * CHUNK_TOKENS)
            pos = reach
        if reach < end:
            break  # past a missing chunk the turn's prefill recomputes
    if pos > start:
        store.mark_durable(owner, tokens[:pos], meta)
    out.tokens = pos - start
    return out


def _stage(
    store: ChunkStore, owner: str, parts: dict[tuple[int, Kind], list[memoryview]], lo: int, hi: int, base: int
) -> int:
    """Rows `lo:hi` of every stream (whose chunks start at token `base`) into the store."""
    hidden: dict[int, torch.Tensor] = {}
    kv: dict[int, torch.Tensor] = {}
    size = 0
    for (layer, kind), chunks in parts.items():
        width = store.shapes[kind].shape[1:]
        t = torch.frombuffer(bytearray(b"".join(chunks)), dtype=store.dtype).view(-1, *width)[lo - base : hi - base]
        (hidden if kind == Kind.HIDDEN else kv)[layer] = t
        size += t.numel() * t.element_size()
    store.save_rows(owner, lo, hidden, kv)
    return size
