"""Bringing an owner's chunks from the cluster into the local store: the tokens past what
the store holds, as far as every stored layer's chunks reach intact. The store then
restores them like any other durable turn (its planner prices its own disks), and the
tokens past the first chunk the cluster lacks are recomputed by the turn's prefill."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hcache.storage.chunk_tier import ChunkTier, chunk_key, chunk_rows, unpack
from hcache.storage.layout import CHUNK_TOKENS, Kind, num_chunks
from hcache.storage.store import ChunkStore


@dataclass
class Hydrated:
    tokens: int = 0  # tokens whose state came from the cluster
    bytes: int = 0  # chunk bytes fetched (the ones used)
    missing: int = 0  # (layer, kind) streams cut short by a missing or unusable chunk


def hydrate(store: ChunkStore, tier: ChunkTier, owner: str, tokens: list[int], meta: dict | None) -> Hydrated:
    """The owner's own `tokens` (the record's) past the store's durable prefix of them: fetched
    layer by layer (one MGET each), checked, staged and made durable. Returns what came."""
    row = store.owner_row(owner)
    start, n = row.num_tokens, len(tokens)
    out = Hydrated()
    if start >= n or row.tokens != tokens[:start]:
        return out
    kinds = store.layer_kinds(row)
    if not any(kinds):
        return out  # it stores nothing: every layer is recomputed anyway
    first = start // CHUNK_TOKENS
    idxs = range(first, num_chunks(n))
    reach = n  # every stream's intact rows reach this token
    got: dict[tuple[int, Kind], list[memoryview]] = {}
    for layer, ks in enumerate(kinds):
        order = sorted(ks)
        keys = [chunk_key(owner, layer, k, i) for k in order for i in idxs]
        values = tier.get(keys)
        for j, kind in enumerate(order):
            shape = store.shapes[kind]
            row_bytes = shape.nbytes // CHUNK_TOKENS
            parts = got[(layer, kind)] = []
            for i, value in zip(idxs, values[j * len(idxs) : (j + 1) * len(idxs)], strict=True):
                rows = chunk_rows(n, i)
                body = unpack(value, tokens[: i * CHUNK_TOKENS + rows], rows, row_bytes)
                if body is None:
                    reach = min(reach, i * CHUNK_TOKENS)
                    out.missing += 1
                    break
                parts.append(body)
        if reach <= start:
            return Hydrated(missing=out.missing)  # a stream has nothing past the store's rows
    hidden: dict[int, torch.Tensor] = {}
    kv: dict[int, torch.Tensor] = {}
    skip = start - first * CHUNK_TOKENS
    for (layer, kind), parts in got.items():
        shape = store.shapes[kind]
        t = torch.frombuffer(bytearray(b"".join(parts)), dtype=store.dtype).view(-1, *shape.shape[1:])
        t = t[skip : reach - first * CHUNK_TOKENS]
        (hidden if kind == Kind.HIDDEN else kv)[layer] = t
        out.bytes += t.numel() * t.element_size()
    if hidden or kv:
        store.save_rows(owner, start, hidden, kv)
    store.mark_durable(owner, tokens[:reach], meta)
    out.tokens = reach - start
    return out
