"""Stage 2 of saving, the packing side: the packer turns staged batches into per-owner
64-token chunks (one open chunk per owner, layer and kind) and hands each full one, or a
flushed tail, to its directory's writer (dir_writer.py)."""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from hcache import omp
from hcache.storage.buffers import ChunkBuf, ChunkPools
from hcache.storage.dir_writer import ChunkWrite, DirWriter
from hcache.storage.errors import StorageError, StorageFull
from hcache.storage.layout import CHUNK_TOKENS, ChunkShape, Kind, decode_layer_kinds
from hcache.storage.manifest import Manifest
from hcache.storage.placement import Placement
from hcache.storage.staging import StagedBatch, StagingRing
from hcache.storage.stats import StoreStats

log = logging.getLogger(__name__)


@dataclass
class OpenOwner:
    """Packing state of one owner: the chunk being filled for each stored layer."""

    kinds: list[frozenset[Kind]]
    next_token: int
    chunks: dict[tuple[int, Kind], ChunkBuf] = field(default_factory=dict)
    pending: deque[Future] = field(default_factory=deque)
    loaded: bool = False  # open chunks hold the durable tail rows
    scatter: dict[Kind, list[Scatter]] | None = None  # over `chunks`; None when they changed
    pairs: list[tuple[int, Kind]] = field(init=False)  # every (layer, kind) stored, layer-major

    def __post_init__(self) -> None:
        self.pairs = [(layer, k) for layer, ks in enumerate(self.kinds) for k in sorted(ks, key=lambda k: k.value)]


@dataclass
class Scatter:
    """Open chunks of one kind cut from one arena: slots `slots` of `arena` hold `layers`.
    `index` is where those layers are in a staged batch whose layers are `index_of`."""

    arena: np.ndarray
    slots: np.ndarray
    layers: list[int]
    index_of: tuple[int, ...] = ()
    index: np.ndarray | None = None

    def rows_in(self, batch_layers: tuple[int, ...]) -> np.ndarray:
        if batch_layers != self.index_of:
            pos = {layer: i for i, layer in enumerate(batch_layers)}
            self.index_of, self.index = batch_layers, np.array([pos[la] for la in self.layers], dtype=np.intp)
        assert self.index is not None
        return self.index


def _byte_rows(t: torch.Tensor, kind: Kind) -> np.ndarray:
    """Staged rows `[..., rows, *row]` (a row: `[hidden]` or `[2, kv_dim]`) as their bytes,
    `[..., rows, row_bytes]` numpy, a view where the strides allow."""
    lead = t.shape[: -1 if kind == Kind.HIDDEN else -2]
    return t.view(torch.uint8).numpy().reshape(*lead, -1)


def _scatter_plan(chunks: dict[tuple[int, Kind], ChunkBuf]) -> dict[Kind, list[Scatter]]:
    groups: dict[tuple[Kind, int], tuple[np.ndarray, list[int], list[int]]] = {}
    for (layer, kind), buf in chunks.items():
        _, slots, layers = groups.setdefault((kind, id(buf.arena)), (buf.arena, [], []))
        slots.append(buf.slot)
        layers.append(layer)
    plan: dict[Kind, list[Scatter]] = {}
    for (kind, _), (arena, slots, layers) in groups.items():
        plan.setdefault(kind, []).append(Scatter(arena, np.array(slots, dtype=np.intp), layers))
    return plan


@dataclass
class FlushTail:
    """Write the owner's tail chunks (unless write_tail is False); the result is
    (every write of the owner not yet known to have succeeded, tokens staged so far)."""

    owner: str
    done: Future
    write_tail: bool = True


@dataclass
class Forget:
    owner: str
    done: Future


class Packer(threading.Thread):
    """Packs staged rows into chunks, places each full or tail chunk and queues its write
    with its directory's writer."""

    def __init__(
        self,
        manifest: Manifest,
        placement: Placement,
        shapes: dict[Kind, ChunkShape],
        chunks: ChunkPools,
        ring: StagingRing,
        writers: list[DirWriter],
        stats: StoreStats,
    ):
        super().__init__(name="hcache-packer", daemon=True)
        self.manifest, self.placement, self.shapes, self.chunks = manifest, placement, shapes, chunks
        self.ring, self.writers, self.stats = ring, writers, stats
        self.inbox: queue.Queue = queue.Queue()
        self.owners: dict[str, OpenOwner] = {}
        self.errors: dict[str, Exception] = {}  # owner -> why some of its staged rows were lost
        self.seq = 0

    def run(self) -> None:
        omp.serial()
        while (item := self.inbox.get()) is not None:
            try:
                if isinstance(item, StagedBatch):
                    self._pack(item)
                elif isinstance(item, FlushTail):
                    item.done.set_result(self._flush_tail(item.owner, item.write_tail))
                elif isinstance(item, Forget):
                    st = self.owners.pop(item.owner, None)
                    for (_, kind), buf in st.chunks.items() if st else ():
                        self.chunks[kind].give(buf)
                    item.done.set_result(None)
            except Exception as e:  # the caller waiting on this item gets the error; packing goes on
                log.exception("packer: %s", e)
                if isinstance(item, (FlushTail, Forget)):
                    item.done.set_exception(e)
                elif isinstance(item, StagedBatch):
                    for seg in item.segments:
                        self.errors[seg.owner] = e
            finally:
                if isinstance(item, StagedBatch):
                    self.ring.release(item)

    def _owner(self, owner: str) -> OpenOwner:
        st = self.owners.get(owner) or self._open(owner)
        if not st.loaded:
            self._load_tail(owner, st)
        return st

    def _open(self, owner: str) -> OpenOwner:
        """An owner's open state from its manifest row (no chunks open yet)."""
        row = self.manifest.owner(owner)
        st = self.owners[owner] = OpenOwner(decode_layer_kinds(row.layer_kinds), row.num_tokens)
        return st

    def _load_tail(self, owner: str, st: OpenOwner) -> None:
        """After a restart (or a truncation) the durable tail rows come back from disk."""
        st.chunks.clear()
        st.scatter = None
        if st.next_token % CHUNK_TOKENS:
            idx = st.next_token // CHUNK_TOKENS
            for layer, kinds in enumerate(st.kinds):
                for kind in kinds:
                    buf = st.chunks[(layer, kind)] = self.chunks[kind].take()
                    omp.copy_serial(buf.t, self.placement.read_chunk(self.shapes[kind], self.stats, owner, layer, idx))
        st.loaded = True

    def _pack(self, batch: StagedBatch) -> None:
        # each kind's staged rows as bytes, `[layers, rows, row_bytes]`, made once per batch; a
        # token's row goes into all of an owner's open chunks of a kind with one numpy
        # assignment per arena (`Scatter`): this thread holds the GIL while it packs, and a
        # decode step's batch is a row per sequence
        srcs: dict[Kind, tuple[tuple[int, ...], np.ndarray | dict[int, np.ndarray]]] = {}

        def src(kind: Kind) -> tuple[tuple[int, ...], np.ndarray | dict[int, np.ndarray]]:
            got = srcs.get(kind)
            if got is None:
                whole = batch.whole(kind)
                if whole is not None:  # in the ring: one strided view over its layers
                    a: np.ndarray | dict[int, np.ndarray] = _byte_rows(whole, kind)
                else:
                    a = {layer: _byte_rows(t, kind) for layer, t in batch.per_layer(kind).items()}
                got = srcs[kind] = (batch.layers(kind), a)
            return got

        for seg in batch.segments:
            st = self._owner(seg.owner)
            if seg.start != st.next_token:
                raise StorageError(f"owner {seg.owner}: rows start at {seg.start}, expected {st.next_token}")
            pairs = st.pairs
            done = 0
            while done < seg.n:
                pos = st.next_token + done
                idx, off = divmod(pos, CHUNK_TOKENS)
                take = min(seg.n - done, CHUNK_TOKENS - off)
                rows = slice(seg.row + done, seg.row + done + take)
                if off == 0 or len(st.chunks) < len(pairs):
                    for pair in pairs:
                        if off == 0 or pair not in st.chunks:
                            st.chunks[pair] = self.chunks[pair[1]].take()
                    st.scatter = None
                if st.scatter is None:
                    st.scatter = _scatter_plan(st.chunks)
                for kind, groups in st.scatter.items():
                    batch_layers, a = src(kind)
                    width = self.shapes[kind].nbytes // CHUNK_TOKENS
                    cols = slice(off * width, (off + take) * width)
                    for g in groups:
                        if take == 1 and not isinstance(a, dict):  # a decode step's row: one assignment
                            g.arena[g.slots, cols] = a[g.rows_in(batch_layers), rows].reshape(len(g.layers), -1)
                            continue
                        for slot, layer, i in zip(g.slots, g.layers, g.rows_in(batch_layers), strict=True):
                            g.arena[slot, cols] = (a[layer] if isinstance(a, dict) else a[i])[rows].reshape(-1)
                if off + take == CHUNK_TOKENS:
                    for layer, kind in pairs:
                        self._emit(seg.owner, st, layer, idx, kind, st.chunks.pop((layer, kind)), CHUNK_TOKENS)
                    st.scatter = None
                done += take
            st.next_token += seg.n

    def _emit(self, owner: str, st: OpenOwner, layer: int, idx: int, kind: Kind, data: ChunkBuf, n: int) -> None:
        self.seq += 1
        w = ChunkWrite(owner, layer, idx, kind, data, n, self.seq)
        # drop writes known to have succeeded (they finish about in order); failed ones stay to be reported
        while st.pending and st.pending[0].done() and st.pending[0].exception() is None:
            st.pending.popleft()
        st.pending.append(w.future)
        self._dispatch(w)

    def _dispatch(self, w: ChunkWrite) -> None:
        """Place a chunk, then queue its write."""
        shape = self.shapes[w.kind]
        try:
            w.dir, w.slot = self.placement.place(shape, w.owner, w.layer, w.idx, w.ntokens == CHUNK_TOKENS)
        except StorageFull as e:
            w.future.set_exception(e)
            return
        w.slab = shape.slab
        self.writers[w.dir].inbox.put(w)

    def _flush_tail(self, owner: str, write_tail: bool) -> tuple[list[Future], int]:
        """The open tail chunks themselves go to disk and leave memory, so an idle session holds
        no buffers here; its next rows reload the tail."""
        st = self.owners.get(owner)
        if st is None:
            if not write_tail:
                return [], 0
            st = self._open(owner)  # nothing open: what is on disk is current
        n = st.next_token % CHUNK_TOKENS
        if n and write_tail and st.loaded:
            idx = st.next_token // CHUNK_TOKENS
            for layer, kind in st.pairs:  # a loaded tail has every pair open
                self._emit(owner, st, layer, idx, kind, st.chunks[(layer, kind)], n)
            st.chunks.clear()
            st.scatter = None
            st.loaded = False
        return list(st.pending), st.next_token
