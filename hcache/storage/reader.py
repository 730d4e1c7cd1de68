"""Reads an owner's chunks back, layer by layer. Chunks that sit next to each other
in a slab are coalesced into one large O_DIRECT request; each directory keeps
several requests in flight; a bounded window of layers runs ahead of the consumer.
Every chunk is checked against its checksum before its rows are used."""

from __future__ import annotations

import math
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from hcache.config import StorageConfig
from hcache.storage.buffers import LayerBuffers
from hcache.storage.errors import ChunkError
from hcache.storage.layout import ALIGN, CHUNK_TOKENS, UNSIGNED, ChunkShape, Kind, checksum, digests, num_chunks
from hcache.storage.manifest import ChunkRow
from hcache.storage.placement import Placement
from hcache.storage.readplan import Landing, ReadPlan, Request, Want, is_tail, run_end, scatter_plan
from hcache.storage.readpool import ReadPool
from hcache.storage.stats import StoreStats
from hcache.storage.throttle import TokenBucket

OPENING_LAYERS = 3  # the first layers with reads, whose requests go alone, one layer after the other


@dataclass(eq=False)  # hashed by identity: per-request tallies key on it
class LayerSlot:
    want: Want
    shape: tuple[int, ...]
    remaining: int
    out: torch.Tensor | None = None  # taken from the layer buffer pool when the first chunk lands
    mem: memoryview | None = None  # `out`'s buffer as bytes, for reads in place
    lent: bool = False  # `out` is the caller's (rows of its cache), not the buffer pool's
    ready: threading.Event = field(default_factory=threading.Event)
    error: ChunkError | None = None


@dataclass(eq=False)
class _Gate:
    """One opening layer's requests: how many are unfinished, and when all are."""

    layer: int | None = None
    left: int = 0
    done: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class ReadParts:
    """What of the store every owner's reads work with (the store makes one)."""

    shapes: dict[Kind, ChunkShape]
    slabs: Placement  # the slab files
    pool: ReadPool  # the I/O threads
    buffers: LayerBuffers  # where whole layers land
    throttle: TokenBucket  # the read cap
    stats: StoreStats
    cfg: StorageConfig


class OwnerReader:
    """Fetches parts of one owner's stored layers; `get(layer, kind)` blocks until that part is whole."""

    def __init__(
        self,
        owner: str,
        wants: list[Want],
        window: int,
        plan: ReadPlan,
        parts: ReadParts,
        into: dict[tuple[int, Kind], torch.Tensor] | None = None,
    ):
        """Read `wants` of `owner` by `plan` (made for them) out of the slab files;
        a want's rows land in `into[(layer, kind)]` where given (the caller's memory, say its
        cache's rows, shaped as `get` returns them: no copy follows the read), else in a
        buffer of the reader's. Reads into the caller's memory may run until `settle()`."""
        self.owner, self.shapes, self.slabs, self.pool = owner, parts.shapes, parts.slabs, parts.pool
        self.buffers, self.throttle, self.stats, self.cfg = parts.buffers, parts.throttle, parts.stats, parts.cfg
        shapes = parts.shapes
        self.window = max(1, window)
        self.slots: dict[tuple[int, Kind], LayerSlot] = {}
        self.bytes_read = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._outstanding = 0  # requests submitted and not yet done
        self._closed = False
        self._cursor = min((w.layer for w in wants), default=0)
        for w, got in zip(wants, plan.chunks, strict=True):
            if w.lo % CHUNK_TOKENS or not 0 <= w.lo <= w.hi:
                raise ValueError(f"bad token range {w.lo}:{w.hi}")
            width = shapes[w.kind].width
            n = w.hi - w.lo
            first, last = w.lo // CHUNK_TOKENS, num_chunks(w.hi)
            slot = self.slots[(w.layer, w.kind)] = LayerSlot(
                w, (n, width) if w.kind == Kind.HIDDEN else (n, 2, width), last - first
            )
            dest = (into or {}).get((w.layer, w.kind))
            if dest is not None:
                if tuple(dest.shape) != slot.shape or dest.dtype != shapes[w.kind].dtype or not dest.is_contiguous():
                    raise ValueError(f"layer {w.layer}: rows to land in must be a contiguous {slot.shape}")
                slot.out, slot.lent = dest, True
            if isinstance(got, ChunkError):
                slot.error = got
            if slot.error is not None or slot.remaining == 0:
                slot.ready.set()
        self._slot_of = {(layer, k.value): slot for (layer, k), slot in self.slots.items()}
        # bytes wanted per layer: the read-ahead covers at least `prefetch_bytes` past the
        # consumer, so small layers are not held back while it is busy (say, recomputing)
        self._layer_bytes: dict[int, int] = defaultdict(int)
        for slot in self.slots.values():
            self._layer_bytes[slot.want.layer] += math.prod(slot.shape) * shapes[slot.want.kind].dtype.itemsize
        self._last_layer = max(self._layer_bytes, default=0)
        self._slot_bytes = {s.slab: s.slot_bytes for s in shapes.values()}
        self._plan = plan.requests()
        self._planning, self._fresh = threading.Lock(), True
        self._next = next(self._plan, None)
        # the first layers' requests are read alone, a layer at a time: beside the later ones
        # they would share the device, and the consumer waits on them with little else to do.
        # The later ones are queued all the same (a close still drains them) and wait in `_run`.
        self._gates = [_Gate() for _ in range(OPENING_LAYERS)]
        self._gating = True
        self._issue()
        with self._lock:
            self._gating = False
            for g in self._gates:
                if g.left == 0:
                    g.done.set()

    def _issue(self) -> None:
        """Submit requests whose first layer is inside the window: `window` layers past the
        consumer, or more while those hold less than `prefetch_bytes`. Requests come in layer
        order over all directories, so a read cap is booked in that order here (booked by the
        reader threads, requests for later layers could take the bandwidth first)."""
        with self._lock:
            horizon = self._cursor + self.window
            ahead = sum(self._layer_bytes.get(i, 0) for i in range(self._cursor, horizon))
            while horizon <= self._last_layer and ahead < self.cfg.prefetch_bytes:
                ahead += self._layer_bytes.get(horizon, 0)
                horizon += 1
        # the plan is made on the way, outside `_lock`, which reader threads take to start
        with self._planning:
            while (q := self._next) is not None and q.min_layer < horizon:
                with self._lock:
                    if self._closed:
                        return
                    self._outstanding += 1
                    q.gate = self._gate(q.min_layer)
                q.not_before = self.throttle.reserve(q.count * self._slot_bytes[q.slab])
                self.pool.submit(q.dir, self._run, q)
                if self._fresh:  # let the first reader have the GIL: the rest is planned meanwhile
                    self._fresh = False
                    time.sleep(0)
                self._next = next(self._plan, None)

    def _gate(self, layer: int) -> int:
        """The gate of a request whose first layer is `layer` (under the lock): that of the
        opening layer it reads, or `OPENING_LAYERS` past them."""
        if not self._gating:
            return len(self._gates)
        for i, g in enumerate(self._gates):
            if g.layer is None:
                g.layer = layer
            if g.layer == layer:
                g.left += 1
                return i
        return len(self._gates)

    def _run(self, q: Request) -> None:
        """On a reader thread: read the request's slots, then check them here, while the
        bytes just read are still in the CPU's cache (a verifier thread of its own would read
        them again from memory, taking cores from a turn that runs alongside). A request
        first waits for the opening layers' before it (FIFO queues: those are taken first,
        so the wait always ends)."""
        try:
            for g in self._gates[: q.gate]:
                g.done.wait()
            try:
                self._read(q)
            finally:
                if q.gate < len(self._gates):
                    with self._lock:
                        g = self._gates[q.gate]
                        g.left -= 1
                        if g.left == 0 and not self._gating:
                            g.done.set()
        finally:
            with self._lock:
                self._outstanding -= 1
                if self._outstanding == 0:
                    self._idle.notify_all()

    def settle(self) -> None:
        """Issue no more reads and wait out those in flight: after this, nothing lands in
        memory lent by `into` (requests not yet started are dropped, their chunks failed)."""
        with self._lock:
            self._closed = True
            while self._outstanding:
                self._idle.wait()
            for slot in self.slots.values():  # parts never asked of the disk: `get` fails, never waits
                if not slot.ready.is_set():
                    w = slot.want
                    slot.error = slot.error or ChunkError(self.owner, w.layer, w.lo // CHUNK_TOKENS, "read dropped")
                    slot.ready.set()

    def _read(self, q: Request) -> None:
        if self._closed:
            for r in q.chunks:
                self._fail(r, "read dropped")
            return
        shape = self.shapes[Kind(q.chunks[0].kind)]
        pool = self.pool
        buf = None
        try:  # any failure is this request's unfinished chunks' failure, never a hang
            slab = self.slabs.slab(q.dir, q.slab)
            sb = slab.slot_bytes
            piece = shape.nbytes
            targets, landings = scatter_plan(q, piece, sb, lambda r: self._dest(r, piece), pool.discard)
            bounce = None
            if any(ld.mem is None for ld in landings):
                buf = pool.take()
                bounce = memoryview(buf)
                targets = [bounce[t[0] : t[0] + t[1]] if isinstance(t, tuple) else t for t in targets]
            n = slab.scatter(q.first, targets)
            self._check(q, shape, sb, landings, bounce, n)
        except Exception as e:
            for r in q.chunks:
                self._fail(r, f"read error: {e}")
        finally:
            if buf is not None:
                pool.give(buf)

    def _check(
        self,
        q: Request,
        shape: ChunkShape,
        sb: int,
        landings: list[Landing],
        bounce: memoryview | None,
        n: int,
    ) -> None:
        """Verify every chunk of a finished read; those read in place are done, the rest are
        copied out of the bounce buffer. A run read in place is hashed in one call and
        compared as one list: this runs beside a turn, for thousands of chunks a restore."""
        with self._lock:
            self.bytes_read += n
        self.stats.count_read(n, q.dir, sum(ld.count for ld in landings if ld.mem is not None))
        good: list[ChunkRow] = []
        nb, chunks = shape.nbytes, q.chunks
        last = q.first + (n - nb) // sb if n >= nb else q.first - 1  # the last slot read whole
        for ld in landings:
            rows = chunks[ld.first : ld.first + ld.count]
            k = min(ld.count, max(0, last - rows[0].slot + 1))  # read whole: a run's slots are consecutive
            for r in rows[k:]:
                self._fail(r, "slot beyond the end of its slab")
            if ld.mem is None:
                if k and checksum(bounce[ld.at : ld.at + nb]) == rows[0].checksum:
                    good.append(rows[0])
                elif k:
                    self._mismatch(rows[0])
                continue
            got = digests(ld.mem, ld.at, ld.stride, k, nb)
            want = [r.checksum & UNSIGNED for r in rows[:k]]
            if got != want:
                for r, g, w in zip(rows[:k], got, want, strict=True):
                    if g != w:
                        self._mismatch(r)
                        k -= 1
            if k:
                self._done(self._slot_of[(rows[0].layer, rows[0].kind)], k)
        if not good:
            return
        # chunks of one layer in consecutive slots, with evenly spaced indices (chunk c of a
        # layer lives in directory (layer + c) mod N), take one strided copy
        whole = torch.frombuffer(bounce[:n], dtype=torch.uint8)
        i = 0
        while i < len(good):
            j = run_end(good, i, self._slot_of[(good[i].layer, good[i].kind)].want.hi // CHUNK_TOKENS)
            self._place_run(q, sb, whole, good[i:j], shape)
            i = j

    def _dest(self, r: ChunkRow, piece: int) -> tuple[memoryview | None, Want]:
        """Where chunk `r` may land in place (see `_in_place`), and the rows its layer wants."""
        slot = self._slot_of[(r.layer, r.kind)]
        return self._in_place(slot, piece), slot.want

    def _in_place(self, slot: LayerSlot, piece: int) -> memoryview | None:
        """The bytes of the slot's layer buffer, if O_DIRECT can read chunks straight into it."""
        with self._lock:
            self._take(slot)
            assert slot.out is not None
            root = slot.out if slot.lent or slot.out._base is None else slot.out._base
            if piece % ALIGN or root.data_ptr() % ALIGN or not root.is_contiguous():
                return None
            if slot.mem is None:
                slot.mem = memoryview(root.view(-1).view(torch.uint8).numpy())
            return slot.mem

    def _take(self, slot: LayerSlot) -> None:
        """Give the slot its layer buffer (under the lock)."""
        if slot.out is None:
            slot.out = self.buffers.take(slot.shape, self.shapes[slot.want.kind].dtype)

    def _place_run(
        self, q: Request, slot_bytes: int, whole: torch.Tensor, run: list[ChunkRow], shape: ChunkShape
    ) -> None:
        first, k = run[0], len(run)
        off = (first.slot - q.first) * slot_bytes
        raw = whole[off : off + k * slot_bytes].view(k, slot_bytes)
        chunks = raw[:, : shape.nbytes].view(shape.dtype).view(k, *shape.shape)
        step = run[1].idx - first.idx if k > 1 else 1
        slot = self.slots[(first.layer, Kind(first.kind))]
        lo, hi = slot.want.lo, slot.want.hi
        with self._lock:
            self._take(slot)
        start = first.idx * CHUNK_TOKENS - lo  # row in the output
        with torch.inference_mode():  # lent rows may be an inference tensor (a cache made in the engine's loop)
            if is_tail(first, hi):  # the partial last chunk: only its valid rows
                slot.out[start:] = chunks[0, : hi - first.idx * CHUNK_TOKENS]
            else:
                full = (hi - lo) // CHUNK_TOKENS
                c0 = start // CHUNK_TOKENS
                sel = slice(c0, c0 + step * (k - 1) + 1, step)
                slot.out[: full * CHUNK_TOKENS].view(full, *shape.shape)[sel] = chunks
        self._done(slot, k)

    def _mismatch(self, r: ChunkRow) -> None:
        self.stats.count_checksum_failure()
        self._fail(r, "checksum mismatch")

    def _fail(self, r: ChunkRow, reason: str) -> None:
        slot = self.slots[(r.layer, Kind(r.kind))]
        if slot.error is None:
            slot.error = ChunkError(self.owner, r.layer, r.idx, reason)
        self._done(slot)

    def _done(self, slot: LayerSlot, count: int = 1) -> None:
        with self._lock:
            slot.remaining -= count
            if slot.remaining == 0:
                slot.ready.set()

    def _slot(self, layer: int, kind: Kind | None) -> LayerSlot:
        if kind is None:
            mine = [k for (lay, k) in self.slots if lay == layer]
            if len(mine) != 1:
                raise ValueError(f"layer {layer}: say which kind ({mine})")
            kind = mine[0]
        return self.slots[(layer, kind)]

    def get(self, layer: int, kind: Kind | None = None) -> torch.Tensor:
        """The rows asked for: `[n, hidden]` for H, `[n, 2, kv_dim]` (each token's K then V) for KV."""
        slot = self._slot(layer, kind)
        self._advance(layer)
        slot.ready.wait()
        if slot.error is not None:
            raise slot.error
        if slot.out is None:  # no tokens
            with self._lock:
                self._take(slot)
        return slot.out

    def ready(self, layer: int, kind: Kind | None = None) -> bool:
        """Would `get` return at once? (Moves the read-ahead window like `get` does.)"""
        slot = self._slot(layer, kind)
        self._advance(layer)
        return slot.ready.is_set()

    def _advance(self, layer: int) -> None:
        """Move the read-ahead window on to `layer`. Where it already stands, everything in it
        was issued: the consumer asks several times per layer, beside a turn's work."""
        with self._lock:
            if layer <= self._cursor:
                return
            self._cursor = layer
        self._issue()

    def wait(self, layer: int, kind: Kind | None, timeout: float) -> bool:
        return self._slot(layer, kind).ready.wait(timeout)

    def release(self, layer: int, kind: Kind | None = None) -> None:
        """The caller is done with `get`'s tensor: its memory serves the next read."""
        for (lay, k), slot in self.slots.items():
            if lay == layer and (kind is None or k == kind) and slot.out is not None and slot.ready.is_set():
                if not slot.lent:
                    self.buffers.give(slot.out)
                slot.out, slot.mem = None, None
