"""Stage 2 of saving. The packer turns staged batches into per-owner 64-token chunks
(one open chunk per owner, layer and kind); each directory's writer thread writes its
chunks, fsyncs them as a group and only then commits their manifest rows in one
transaction. A tail chunk (< 64 tokens) is written to a fresh slot and replaces the
previous version copy-on-write."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from hcache.storage.errors import StorageError
from hcache.storage.layout import CHUNK_TOKENS, Kind, checksum
from hcache.storage.manifest import ChunkRow
from hcache.storage.readpool import one_core_copies
from hcache.storage.staging import StagedBatch

if TYPE_CHECKING:
    from hcache.storage.store import ChunkStore

log = logging.getLogger(__name__)


@dataclass
class ChunkBuf:
    """A chunk being filled: `t` is the chunk-shaped tensor over the aligned slot memory `mem`."""

    mem: memoryview
    t: torch.Tensor


@dataclass
class ChunkWrite:
    owner: str
    layer: int
    idx: int
    kind: Kind
    data: ChunkBuf  # owned by this write; returned to the pool once written
    ntokens: int
    seq: int
    dir: int = -1
    slab: str = ""
    slot: int = -1
    future: Future = field(default_factory=Future)


@dataclass
class OpenOwner:
    """Packing state of one owner: the chunk being filled for each stored layer."""

    kinds: list[frozenset[Kind]]
    next_token: int
    chunks: dict[tuple[int, Kind], ChunkBuf] = field(default_factory=dict)
    pending: deque[Future] = field(default_factory=deque)
    loaded: bool = False  # open chunks hold the durable tail rows


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
    def __init__(self, store: ChunkStore):
        super().__init__(name="hcache-packer", daemon=True)
        self.store = store
        self.inbox: queue.Queue = queue.Queue()
        self.owners: dict[str, OpenOwner] = {}
        self.seq = 0

    def run(self) -> None:
        one_core_copies()
        while (item := self.inbox.get()) is not None:
            try:
                if isinstance(item, StagedBatch):
                    self._pack(item)
                elif isinstance(item, FlushTail):
                    item.done.set_result(self._flush_tail(item.owner, item.write_tail))
                elif isinstance(item, Forget):
                    st = self.owners.pop(item.owner, None)
                    for (_, kind), buf in st.chunks.items() if st else ():
                        self.store.free_chunk(kind, buf)
                    item.done.set_result(None)
            except Exception as e:  # the caller waiting on this item gets the error; packing goes on
                log.exception("packer: %s", e)
                if isinstance(item, (FlushTail, Forget)):
                    item.done.set_exception(e)
                elif isinstance(item, StagedBatch):
                    for seg in item.segments:
                        self.store.poison(seg.owner, e)
            finally:
                if isinstance(item, StagedBatch):
                    self.store.ring.release(item)

    def _owner(self, owner: str) -> OpenOwner:
        st = self.owners.get(owner)
        if st is None:
            row = self.store.owner_row(owner)
            st = self.owners[owner] = OpenOwner(self.store.layer_kinds(row), row.num_tokens)
        if not st.loaded:
            self._load_tail(owner, st)
        return st

    def _load_tail(self, owner: str, st: OpenOwner) -> None:
        """After a restart (or a truncation) the durable tail rows come back from disk."""
        st.chunks.clear()
        if st.next_token % CHUNK_TOKENS:
            idx = st.next_token // CHUNK_TOKENS
            for layer, kinds in enumerate(st.kinds):
                for kind in kinds:
                    buf = st.chunks[(layer, kind)] = self.store.new_chunk(kind)
                    buf.t.copy_(self.store.read_chunk(owner, layer, idx, kind))
        st.loaded = True

    def _pack(self, batch: StagedBatch) -> None:
        for seg in batch.segments:
            st = self._owner(seg.owner)
            if seg.start != st.next_token:
                raise StorageError(f"owner {seg.owner}: rows start at {seg.start}, expected {st.next_token}")
            done = 0
            while done < seg.n:
                pos = st.next_token + done
                idx, off = divmod(pos, CHUNK_TOKENS)
                take = min(seg.n - done, CHUNK_TOKENS - off)
                rows = slice(seg.row + done, seg.row + done + take)
                for layer, kind in ((la, k) for la, ks in enumerate(st.kinds) for k in ks):
                    buf = st.chunks.get((layer, kind))
                    if buf is None or off == 0:
                        buf = st.chunks[(layer, kind)] = self.store.new_chunk(kind)
                    buf.t[off : off + take] = (batch.hidden if kind == Kind.HIDDEN else batch.kv)[layer][rows]
                    if off + take == CHUNK_TOKENS:
                        self._emit(seg.owner, st, layer, idx, kind, buf, CHUNK_TOKENS)
                        del st.chunks[(layer, kind)]
                done += take
            st.next_token += seg.n

    def _emit(self, owner: str, st: OpenOwner, layer: int, idx: int, kind: Kind, data: ChunkBuf, n: int) -> None:
        self.seq += 1
        w = ChunkWrite(owner, layer, idx, kind, data, n, self.seq)
        # drop writes known to have succeeded (they finish about in order); failed ones stay to be reported
        while st.pending and st.pending[0].done() and st.pending[0].exception() is None:
            st.pending.popleft()
        st.pending.append(w.future)
        self.store.dispatch(w)

    def _flush_tail(self, owner: str, write_tail: bool) -> tuple[list[Future], int]:
        """The open tail chunks themselves go to disk and leave memory, so an idle session holds
        no buffers here; its next rows reload the tail."""
        st = self.owners.get(owner)
        if st is None:
            if not write_tail:
                return [], 0
            row = self.store.owner_row(owner)  # nothing open: what is on disk is current
            st = self.owners[owner] = OpenOwner(self.store.layer_kinds(row), row.num_tokens)
        n = st.next_token % CHUNK_TOKENS
        if n and write_tail and st.loaded:
            idx = st.next_token // CHUNK_TOKENS
            for (layer, kind), buf in sorted(st.chunks.items(), key=lambda kv: kv[0]):
                self._emit(owner, st, layer, idx, kind, buf, n)
            st.chunks.clear()
            st.loaded = False
        return list(st.pending), st.next_token


class DirWriter(threading.Thread):
    """Writes one directory's chunks; fsync per group, then one manifest transaction."""

    def __init__(self, store: ChunkStore, index: int, group_bytes: int = 16 << 20):
        super().__init__(name=f"hcache-writer-{index}", daemon=True)
        self.store, self.index = store, index
        self.slot_max = max(s.slot_bytes for s in store.shapes.values())
        self.group_bytes = max(group_bytes, self.slot_max)
        self.inbox: queue.Queue = queue.Queue()
        self.bytes_written = 0

    def run(self) -> None:
        one_core_copies()
        while (first := self.inbox.get()) is not None:
            group, size, stop = [first], self.slot_max, False
            while size + self.slot_max <= self.group_bytes:
                try:
                    nxt = self.inbox.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                group.append(nxt)
                size += self.slot_max
            t0 = time.perf_counter()
            self._write_group(group)
            if self.store.on_flush is not None:
                self.store.on_flush(self.index, time.perf_counter() - t0)
            if stop:
                break

    def _write_group(self, group: list[ChunkWrite]) -> None:
        """Chunks in consecutive slots of a slab go out as one vectored write; then one
        fdatasync per slab, then one manifest transaction for the whole group."""
        group.sort(key=lambda w: (w.slab, w.slot))
        rows: list[ChunkRow] = []
        slabs = set()
        try:
            run: list[ChunkWrite] = []
            for w in [*group, None]:
                if run and (w is None or w.slab != run[-1].slab or w.slot != run[-1].slot + 1):
                    slab = self.store.slab(self.index, run[0].slab)
                    slab.write_slots(run[0].slot, [x.data.mem for x in run])
                    slabs.add(slab)
                    run = []
                if w is not None:
                    run.append(w)
                    crc = checksum(w.data.mem[: self.store.shapes[w.kind].nbytes])
                    rows.append(ChunkRow(w.owner, w.layer, w.idx, w.kind.value, w.dir, w.slab, w.slot, w.ntokens, crc))
            for slab in slabs:
                slab.sync()
            self.store.commit(group, rows)
        except Exception as e:
            err = self.store.storage_error(e, self.index)
            for w in group:
                self.store.release_slot(w.dir, w.slab, w.slot)
                self.store.free_chunk(w.kind, w.data)
                if not w.future.done():
                    w.future.set_exception(err)
            return
        self.bytes_written += sum(len(w.data.mem) for w in group)
        for w in group:
            self.store.free_chunk(w.kind, w.data)
            w.future.set_result(None)
