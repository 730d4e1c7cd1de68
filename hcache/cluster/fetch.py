"""Bringing an owner's chunks from the cluster: the tokens past what the local store holds,
as far as every stored layer's chunks reach intact. One script call reads every chunk's
header to find how far that is (the tokens past the first chunk some layer lacks, or holds
for other tokens, are recomputed by the turn's prefill); then the chunks come layer by layer. A
turn restores straight from the fetched rows while later layers are still coming
(`background`), and stages them into the store behind it (cluster/chunks.py);
`hydrate` makes them durable at once (a context, read from the store by the sessions on it)."""

from __future__ import annotations

import math
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from hcache.cluster.tier import ChunkTier, chunk_key, chunk_rows, prefix_hash, read_header, unpack
from hcache.storage.buffers import FetchBuffers
from hcache.storage.fetched import Fetched, Progress
from hcache.storage.layout import CHUNK_TOKENS, Kind, num_chunks
from hcache.storage.store import ChunkStore


def fetch(
    store: ChunkStore,
    tier: ChunkTier,
    owner: str,
    tokens: list[int],
    pool: FetchBuffers | None = None,
    background: bool = False,
) -> Fetched:
    """The owner's own `tokens` (the record's) past the store's durable prefix of them, as
    far as the cluster holds every stored layer's chunks of exactly those tokens (their
    headers say so: one script call). The rows come layer by layer (one MGET per layer: one
    slot; the next layer's runs while this one is checked and copied), in the background
    with `background` (wait with `ready`/`wait`); a chunk whose body fails its checksum
    marks its layer bad. The store is not written: see `ChunkStore.stage_rows`, `hydrate`."""
    row = store.owner_row(owner)
    start, n = row.num_tokens, len(tokens)
    out = Fetched(start)
    kinds = store.layer_kinds(row)
    if start >= n or row.tokens != tokens[:start] or not any(kinds):
        return out  # nothing to fetch, local turns that differ, or nothing stored per layer
    streams = [(layer, kind) for layer, ks in enumerate(kinds) for kind in sorted(ks)]
    first = start // CHUNK_TOKENS
    prefixes = [prefix_hash(tokens[: i * CHUNK_TOKENS + chunk_rows(n, i)]) for i in range(first, num_chunks(n))]
    end = _reach(tier, owner, streams, n, first, prefixes)
    out.missing = int(end < n)
    if end <= start:
        return out
    out.tokens = end - start
    out.pool = pool or FetchBuffers(keep=0, headroom=0)
    shapes = {(la, k): (out.tokens, *store.shapes[k].shape[1:]) for la, k in streams}
    dt = {k: s.dtype for k, s in store.shapes.items()}
    out.bytes = sum(math.prod(sh) * dt[k].itemsize for (_, k), sh in shapes.items())
    out.memory = out.pool.take(out.bytes)
    off = 0
    for (layer, kind), sh in shapes.items():
        size = math.prod(sh) * dt[kind].itemsize
        (out.hidden if kind == Kind.HIDDEN else out.kv)[layer] = out.memory[off : off + size].view(dt[kind]).view(sh)
        off += size
    layers = sorted({la for la, _ in streams})
    out.progress = Progress({la: threading.Event() for la in layers})
    job = _LayerFetch(store, tier, owner, out, streams, n, first, prefixes)
    if background:
        threading.Thread(target=job.run, name="hcache-fetch", daemon=True).start()
    else:
        job.run()
    return out


def hydrate(store: ChunkStore, tier: ChunkTier, owner: str, tokens: list[int], meta: dict | None) -> Fetched:
    """`fetch`, then the rows before the first bad chunk staged into the store and made
    durable (with `meta`)."""
    got = fetch(store, tier, owner, tokens)
    if got.progress.error is not None:
        raise got.progress.error
    if got.progress.bad:  # a damaged chunk: what comes before it is still good
        got = got.head(min(got.progress.bad.values()) - got.start)
        got.missing = 1
    if got.tokens:
        store.stage_rows(owner, got.start, got.hidden, got.kv, got.release)
        store.mark_durable(owner, tokens[: got.start + got.tokens], meta)
    return got


def _reach(
    tier: ChunkTier, owner: str, streams: list[tuple[int, Kind]], n: int, first: int, prefixes: list[int]
) -> int:
    """How far (in tokens) every stream's chunks from index `first` on are there, for these
    tokens (`prefixes`: the token prefix hash of each chunk)."""
    idxs = range(first, num_chunks(n))
    heads = tier.headers([chunk_key(owner, layer, kind, i) for layer, kind in streams for i in idxs])
    reach = n
    for s in range(len(streams)):
        for j, i in enumerate(idxs):
            head = read_header(heads[s * len(idxs) + j])
            if head is None or head[1:] != (prefixes[j], chunk_rows(n, i)):
                reach = min(reach, i * CHUNK_TOKENS)
                break
    return reach


@dataclass
class _LayerFetch:
    store: ChunkStore
    tier: ChunkTier
    owner: str
    out: Fetched
    streams: list[tuple[int, Kind]]
    n: int
    first: int
    prefixes: list[int]

    def run(self) -> None:
        out, prog = self.out, self.out.progress
        layers = list(prog.layers)
        idxs = range(self.first, num_chunks(out.start + out.tokens))
        try:
            with ThreadPoolExecutor(1, thread_name_prefix="hcache-fetch-get") as pool:
                ahead = pool.submit(self._get, layers[0], idxs)
                for k, layer in enumerate(layers):
                    values = ahead.result()
                    if k + 1 < len(layers):
                        ahead = pool.submit(self._get, layers[k + 1], idxs)
                    self._place(layer, idxs, values)
                    prog.layers[layer].set()
        except BaseException as e:  # the cluster went away mid-fetch: what is not in is bad
            prog.error = e
            for layer, ev in prog.layers.items():
                if not ev.is_set():
                    prog.bad.setdefault(layer, out.start)
                    ev.set()
        finally:
            prog.done.set()

    def _kinds(self, layer: int) -> list[Kind]:
        return [k for la, k in self.streams if la == layer]

    def _get(self, layer: int, idxs: range) -> list[bytes | None]:
        return self.tier.get([chunk_key(self.owner, layer, k, i) for k in self._kinds(layer) for i in idxs])

    def _place(self, layer: int, idxs: range, values: list[bytes | None]) -> None:
        """Check every chunk of the layer and copy its rows (from the fetch's first token) in place."""
        out = self.out
        for s, kind in enumerate(self._kinds(layer)):
            shape = self.store.shapes[kind]
            dst = (out.hidden if kind == Kind.HIDDEN else out.kv)[layer]
            for j, i in enumerate(idxs):
                rows = chunk_rows(self.n, i)
                body = unpack(values[s * len(idxs) + j], self.prefixes[j], rows, shape.nbytes // CHUNK_TOKENS)
                lo = max(out.start, i * CHUNK_TOKENS)
                if body is None:  # evicted since, or damaged: dropped, so a retry stops before it
                    out.progress.bad[layer] = min(out.progress.bad.get(layer, lo), lo)
                    self.tier.drop([chunk_key(self.owner, layer, kind, i)])
                    return
                hi = min(i * CHUNK_TOKENS + rows, out.start + out.tokens)
                src = _rows(body, shape.dtype, shape.shape[1:])
                dst[lo - out.start : hi - out.start].copy_(src[lo - i * CHUNK_TOKENS : hi - i * CHUNK_TOKENS])


def _rows(body: memoryview, dtype: torch.dtype, width: tuple[int, ...]) -> torch.Tensor:
    """A chunk's rows in place (read only: they are only copied from)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns of any non-writable buffer
        return torch.frombuffer(body, dtype=dtype).view(-1, *width)
