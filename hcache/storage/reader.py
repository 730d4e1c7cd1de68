"""Reads an owner's chunks back, layer by layer. Chunks that sit next to each other
in a slab are coalesced into one large O_DIRECT request; each directory keeps
several requests in flight; a bounded window of layers runs ahead of the consumer.
Every chunk is checked against its checksum before its rows are used."""

from __future__ import annotations

import bisect
import heapq
import math
import operator
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from hcache.storage.errors import ChunkError
from hcache.storage.layout import CHUNK_TOKENS, ChunkShape, Kind, checksum, checksum_parts, num_chunks
from hcache.storage.manifest import ChunkRow
from hcache.storage.throttle import wait_until

ALIGN = 4096  # O_DIRECT: every read target's address and length

if TYPE_CHECKING:
    from hcache.storage.store import ChunkStore


@dataclass
class Request:
    dir: int
    slab: str
    first: int
    count: int
    chunks: list[ChunkRow]
    min_layer: int
    not_before: float = 0.0  # under a read cap: when its bytes may go (booked in layer order)


@dataclass(frozen=True)
class Want:
    """Tokens `lo:hi` of one layer's `kind` (`lo` on a chunk boundary)."""

    layer: int
    kind: Kind
    lo: int
    hi: int


@dataclass(eq=False)  # hashed by identity: per-request tallies key on it
class LayerSlot:
    want: Want
    shape: tuple[int, ...]
    remaining: int
    out: torch.Tensor | None = None  # taken from the store's buffer pool when the first chunk lands
    mem: memoryview | None = None  # `out`'s buffer as bytes, for reads in place
    ready: threading.Event = field(default_factory=threading.Event)
    error: ChunkError | None = None


_SLOT, _LAYER, _IDX, _DIR, _SLAB = map(operator.attrgetter, ("slot", "layer", "idx", "dir", "slab"))


def plan_requests(
    rows: list[ChunkRow],
    slot_bytes: dict[str, int],
    max_bytes: int,
    max_gap: int = 2,
    first_bytes: int = 0,
    ahead: int = 1 << 30,
) -> Iterator[Request]:
    """Requests, made as they are asked for, in the order a restore consumes layers. Each
    starts at the earliest chunk of the lowest layer not yet asked for and runs forward over
    wanted slots of its slab at most `max_gap` apart, taking other layers' chunks too when
    they are less than `ahead` layers later (needed soon anyway), so a layer is whole after
    the requests that precede the next layer's, however its extents are spread through the
    slab. A slab's first request is at most `first_bytes` and each next one may be twice the
    last, up to `max_bytes`: the first layers arrive soon, and the bulk comes in requests
    large enough for the device's full bandwidth.

    It works on extents (one layer's chunks in nearby slots, rising indices), not chunks,
    and yields each request as it is made, so the first read starts while later ones are
    planned."""
    n = len(rows)
    if not n:
        return
    slabs = list(slot_bytes)
    slab_of = {name: i for i, name in enumerate(slabs)}
    grp = np.fromiter(map(_DIR, rows), np.int64, n) * len(slabs)
    grp += np.fromiter(map(slab_of.__getitem__, map(_SLAB, rows)), np.int64, n)
    slot = np.fromiter(map(_SLOT, rows), np.int64, n)
    layer = np.fromiter(map(_LAYER, rows), np.int64, n)
    idx = np.fromiter(map(_IDX, rows), np.int64, n)
    o = np.lexsort((slot, grp))  # slab by slab, in slot order
    g, s, lay, ix = grp[o], slot[o], layer[o], idx[o]
    cut = np.ones(n, dtype=bool)
    cut[1:] = (g[1:] != g[:-1]) | (s[1:] - s[:-1] > max_gap) | (lay[1:] != lay[:-1]) | (ix[1:] <= ix[:-1])
    starts = np.flatnonzero(cut).tolist()
    ends = [*starts[1:], n]
    s_, g_, lay_, ix_ = s.tolist(), g.tolist(), lay.tolist(), ix.tolist()
    by_slot = [rows[i] for i in o.tolist()]
    per_slot = [slot_bytes[name] for name in slabs]
    size = dict.fromkeys(g[starts].tolist(), min(first_bytes or max_bytes, max_bytes))
    off = list(starts)  # an extent's first position not yet asked for (taken parts are prefixes)
    heap = [(lay_[p], ix_[p], e) for e, p in enumerate(starts)]
    heapq.heapify(heap)
    while heap:
        lo_layer, lo_idx, e = heapq.heappop(heap)
        p = off[e]
        if p == ends[e]:
            continue
        if ix_[p] != lo_idx:  # an earlier request took this extent's head: queue the rest
            heapq.heappush(heap, (lo_layer, ix_[p], e))
            continue
        k = g_[p]
        first, stop = s_[p], lo_layer + ahead
        bound = first + max(1, size[k] // per_slot[k % len(slabs)])  # slots at or past this do not fit
        j, f = p, e
        while True:
            q = bisect.bisect_left(s_, bound, j, ends[f])
            off[f] = q
            if q < ends[f]:  # the size bound cut this extent: its rest is queued again
                if f == e:
                    heapq.heappush(heap, (lo_layer, ix_[q], e))
                j = q
                break
            j, f = q, f + 1
            # on into the next extent of the slab: untouched, near enough, soon needed
            if f == len(starts) or off[f] != starts[f] or g_[j] != k or lay_[j] >= stop or s_[j] - s_[j - 1] > max_gap:
                break
        last = s_[j - 1]
        size[k] = min(2 * size[k], max_bytes)
        yield Request(k // len(slabs), slabs[k % len(slabs)], first, last - first + 1, by_slot[p:j], lo_layer)


_NTOKENS = operator.attrgetter("ntokens")


def _first_bad(owner: str, w: Want, have: dict[int, ChunkRow]) -> ChunkError:
    """The error for the first of `w`'s chunks that is missing or holds too few tokens."""
    for idx in range(w.lo // CHUNK_TOKENS, num_chunks(w.hi)):
        r, need = have.get(idx), min(CHUNK_TOKENS, w.hi - idx * CHUNK_TOKENS)
        if r is None or r.ntokens < need:
            return ChunkError(owner, w.layer, idx, "missing" if r is None else f"holds {r.ntokens} < {need} tokens")
    raise AssertionError("no bad chunk")


class OwnerReader:
    """Fetches parts of one owner's stored layers; `get(layer, kind)` blocks until that part is whole."""

    def __init__(self, store: ChunkStore, owner: str, wants: list[Want], window: int):
        self.store, self.owner = store, owner
        self.window = max(1, window)
        self.slots: dict[tuple[int, Kind], LayerSlot] = {}
        self.bytes_read = 0
        self._lock = threading.Lock()
        self._cursor = min((w.layer for w in wants), default=0)
        index = store.chunk_index(owner)
        rows: list[ChunkRow] = []
        for w in wants:
            if w.lo % CHUNK_TOKENS or not 0 <= w.lo <= w.hi:
                raise ValueError(f"bad token range {w.lo}:{w.hi}")
            width = store.shapes[w.kind].width
            n = w.hi - w.lo
            first, last = w.lo // CHUNK_TOKENS, num_chunks(w.hi)
            slot = self.slots[(w.layer, w.kind)] = LayerSlot(
                w, (n, width) if w.kind == Kind.HIDDEN else (n, 2, width), last - first
            )
            have = index.get((w.layer, w.kind.value), {})
            wanted = range(first, last)
            # C-level checks for the usual case (every chunk there, all full but the last):
            # this runs before the restore's first read
            got = list(map(have.__getitem__, wanted)) if set(wanted) <= have.keys() else None
            if got and (
                min(map(_NTOKENS, got[:-1]), default=CHUNK_TOKENS) < CHUNK_TOKENS
                or got[-1].ntokens < w.hi - (last - 1) * CHUNK_TOKENS
            ):
                got = None
            if got is not None:
                rows.extend(got)
            else:
                slot.error = _first_bad(owner, w, have)
            if slot.error is not None or slot.remaining == 0:
                slot.ready.set()
        self._slot_of = {(layer, k.value): slot for (layer, k), slot in self.slots.items()}
        # bytes wanted per layer: the read-ahead covers at least `prefetch_bytes` past the
        # consumer, so small layers are not held back while it is busy (say, recomputing)
        self._layer_bytes: dict[int, int] = defaultdict(int)
        for slot in self.slots.values():
            self._layer_bytes[slot.want.layer] += math.prod(slot.shape) * store.shapes[slot.want.kind].dtype.itemsize
        self._last_layer = max(self._layer_bytes, default=0)
        sizes = self._slot_bytes = {s.slab: s.slot_bytes for s in store.shapes.values()}
        self._plan = plan_requests(
            rows,
            sizes,
            store.cfg.max_request_bytes,
            first_bytes=store.cfg.first_request_bytes,
            ahead=store.cfg.request_layers,
        )
        self._planning, self._fresh = threading.Lock(), True
        self._next = next(self._plan, None)
        self._issue()

    def _issue(self) -> None:
        """Submit requests whose first layer is inside the window: `window` layers past the
        consumer, or more while those hold less than `prefetch_bytes`. Requests come in layer
        order over all directories, so a read cap is booked in that order here (booked by the
        reader threads, requests for later layers could take the bandwidth first)."""
        with self._lock:
            horizon = self._cursor + self.window
            ahead = sum(self._layer_bytes.get(i, 0) for i in range(self._cursor, horizon))
            while horizon <= self._last_layer and ahead < self.store.cfg.prefetch_bytes:
                ahead += self._layer_bytes.get(horizon, 0)
                horizon += 1
        # the plan is made on the way, outside `_lock`, which reader threads take to start
        with self._planning:
            while (q := self._next) is not None and q.min_layer < horizon:
                q.not_before = self.store.throttle.reserve(q.count * self._slot_bytes[q.slab])
                self.store.submit_read(q.dir, self._run, q)
                if self._fresh:  # let the first reader have the GIL: the rest is planned meanwhile
                    self._fresh = False
                    time.sleep(0)
                self._next = next(self._plan, None)

    def _run(self, q: Request) -> None:
        """On a reader thread: read the request's slots, then hand the checks to the verifier
        so that this thread's next read starts at once (a thread busy checksumming is one
        request fewer in flight)."""
        shape = self.store.shapes[Kind(q.chunks[0].kind)]
        pool = self.store.reads
        buf = None
        try:
            slab = self.store.slab(q.dir, q.slab)
            sb = slab.slot_bytes
            targets, parts = self._scatter_plan(q, shape, sb)
            bounce = None
            if None in parts:
                buf = pool.take()
                bounce = memoryview(buf)
                targets = [bounce[t[0] : t[0] + t[1]] if isinstance(t, tuple) else t for t in targets]
            n = slab.scatter(q.first, targets)
        except Exception as e:  # any failure is this request's chunks' failure, never a hang
            if buf is not None:
                pool.give(buf)
            for r in q.chunks:
                self._fail(r, f"read error: {e}")
            return
        pool.verify(self._verify, (q, shape, sb, parts, bounce, n, buf))

    def _verify(
        self, q: Request, shape: ChunkShape, sb: int, parts: list, bounce: memoryview | None, n: int, buf: object
    ) -> None:
        try:
            self._check(q, shape, sb, parts, bounce, n)
        except Exception as e:  # never a hang: the request's unfinished chunks fail
            for r in q.chunks:
                self._fail(r, f"read error: {e}")
        finally:
            if buf is not None:
                self.store.reads.give(buf)

    def _check(
        self,
        q: Request,
        shape: ChunkShape,
        sb: int,
        parts: list[list[memoryview] | None],
        bounce: memoryview | None,
        n: int,
    ) -> None:
        """Verify every chunk of a finished read; those read in place are done, the rest are
        copied out of the bounce buffer."""
        with self._lock:
            self.bytes_read += n
        self.store.count_read(n, q.dir, sum(p is not None for p in parts))
        landed: dict[LayerSlot, int] = {}  # chunks verified in place, per layer
        good: list[ChunkRow] = []
        for r, p in zip(q.chunks, parts, strict=True):
            off = (r.slot - q.first) * sb
            if off + shape.nbytes > n:
                self._fail(r, "slot beyond the end of its slab")
            elif (checksum_parts(p) if p is not None else checksum(bounce[off : off + shape.nbytes])) != r.checksum:
                self.store.count_checksum_failure()
                self._fail(r, "checksum mismatch")
            elif p is not None:
                slot = self._slot_of[(r.layer, r.kind)]
                landed[slot] = landed.get(slot, 0) + 1
            else:
                good.append(r)
        for slot, k in landed.items():
            self._done(slot, k)
        if not good:
            return
        # chunks of one layer in consecutive slots, with evenly spaced indices (chunk c of a
        # layer lives in directory (layer + c) mod N), take one strided copy
        whole = torch.frombuffer(bounce[:n], dtype=torch.uint8)
        i = 0
        while i < len(good):
            j = self._run_end(good, i)
            self._place_run(q, sb, whole, good[i:j], shape)
            i = j

    def _scatter_plan(
        self, q: Request, shape: ChunkShape, sb: int
    ) -> tuple[list[memoryview | tuple[int, int]], list[list[memoryview] | None]]:
        """The request's slots as read targets, in file order. A full chunk lands in place in
        its layer's buffer, so no copy follows the read; unwanted slots between wanted ones go
        to a shared discard area; tails (and chunks that cannot land in place) go to the bounce
        buffer, as `(offset, length)` of their slot until one is taken. Returns the targets
        and, per chunk of `q.chunks`, its bytes in place for the checksum (None: in the bounce
        buffer). Built a run at a time (a layer's chunks in consecutive slots) because it runs
        on a reader thread between two reads."""
        piece = shape.nbytes  # a chunk's 64 token rows (H, or each token's K and V)
        step = piece // CHUNK_TOKENS  # bytes per token row
        # chunks land in place only when their rows are whole pages, so their slots have no padding
        targets: list[memoryview | tuple[int, int]] = []
        parts: list[list[memoryview] | None] = []
        chunks, n = q.chunks, len(q.chunks)
        nxt, i = q.first, 0  # the next slot not yet targeted; the run's first chunk
        while i < n:
            r = chunks[i]
            if r.slot > nxt:
                self._skip(targets, (r.slot - nxt) * sb)
            slot = self._slot_of[(r.layer, r.kind)]
            mem = self._in_place(slot, piece)
            if mem is None or self._is_tail(r):  # a tail: its valid rows only
                targets.append(((r.slot - q.first) * sb, sb))
                parts.append(None)
                nxt, i = r.slot + 1, i + 1
                continue
            j = self._run_end(chunks, i)
            k = j - i
            gap = chunks[i + 1].idx - r.idx if k > 1 else 1
            o = (r.idx * CHUNK_TOKENS - slot.want.lo) * step
            stride = gap * piece
            pieces = [mem[x : x + piece] for x in range(o, o + k * stride, stride)]
            # consecutive chunks are consecutive token rows: one target, one segment of the request
            targets.extend([mem[o : o + k * piece]] if gap == 1 else pieces)
            parts.extend([[p] for p in pieces])
            nxt, i = r.slot + k, j
        return targets, parts

    def _skip(self, targets: list, n: int) -> None:
        """Bytes nobody reads: any number of them share the discard area."""
        discard = self.store.reads.discard
        while n > 0:
            k = min(n, len(discard))
            targets.append(discard[:k])
            n -= k

    def _in_place(self, slot: LayerSlot, piece: int) -> memoryview | None:
        """The bytes of the slot's layer buffer, if O_DIRECT can read chunks straight into it."""
        with self._lock:
            self._take(slot)
            assert slot.out is not None
            root = slot.out if slot.out._base is None else slot.out._base
            if piece % ALIGN or root.data_ptr() % ALIGN or not root.is_contiguous():
                return None
            if slot.mem is None:
                slot.mem = memoryview(root.view(-1).view(torch.uint8).numpy())
            return slot.mem

    def _take(self, slot: LayerSlot) -> None:
        """Give the slot its layer buffer (under the lock)."""
        if slot.out is None:
            slot.out = self.store.take_buffer(slot.shape)

    def _run_end(self, chunks: list[ChunkRow], i: int) -> int:
        """End of the run from `chunks[i]`: the same layer's next chunks in the next slots,
        with evenly spaced indices (chunk c of a layer lives in directory (layer + c) mod N),
        none a tail. A run lands in place, or is copied out of the bounce buffer, in one go."""
        r, n = chunks[i], len(chunks)
        full = self._slot_of[(r.layer, r.kind)].want.hi // CHUNK_TOKENS  # chunks from here are tails
        nxt = chunks[i + 1] if i + 1 < n else r
        gap = nxt.idx - r.idx
        j = i + 1
        while j < n and gap > 0:
            c = chunks[j]
            if c.slot != r.slot + j - i or c.layer != r.layer or c.kind != r.kind:
                break
            if c.idx != r.idx + (j - i) * gap or c.idx >= full:
                break
            j += 1
        return j

    def _is_tail(self, r: ChunkRow) -> bool:
        return (r.idx + 1) * CHUNK_TOKENS > self._slot_of[(r.layer, r.kind)].want.hi

    def _place_run(self, q: Request, slot_bytes: int, whole: torch.Tensor, run: list[ChunkRow], shape) -> None:  # noqa: ANN001
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
        if self._is_tail(first):  # the partial last chunk: only its valid rows
            slot.out[start:] = chunks[0, : hi - first.idx * CHUNK_TOKENS]
        else:
            full = (hi - lo) // CHUNK_TOKENS
            c0 = start // CHUNK_TOKENS
            sel = slice(c0, c0 + step * (k - 1) + 1, step)
            slot.out[: full * CHUNK_TOKENS].view(full, *shape.shape)[sel] = chunks
        self._done(slot, k)

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
        with self._lock:
            self._cursor = max(self._cursor, layer)
        self._issue()
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
        with self._lock:
            self._cursor = max(self._cursor, layer)
        self._issue()
        return slot.ready.is_set()

    def wait(self, layer: int, kind: Kind | None, timeout: float) -> bool:
        return self._slot(layer, kind).ready.wait(timeout)

    def release(self, layer: int, kind: Kind | None = None) -> None:
        """The caller is done with `get`'s tensor: its memory serves the next read."""
        for (lay, k), slot in self.slots.items():
            if lay == layer and (kind is None or k == kind) and slot.out is not None and slot.ready.is_set():
                self.store.give_buffer(slot.out)
                slot.out, slot.mem = None, None


def one_core_copies() -> None:
    """Storage threads copy with torch, whose larger copies would each start an OpenMP team
    of every core: dozens of such threads oversubscribe the cores and starve the restore's
    compute thread. The setting is per thread: the compute thread keeps its own."""
    torch.set_num_threads(1)


class ReadPool:
    """Per-directory reader threads and one verifier thread. Readers only read; each
    finished request goes to the verifier, which checks and places it. Reads land in place
    in layer buffers; the pool's aligned bounce buffers (bounded: bytes in flight stay
    bounded however many directories) serve only requests holding tails, or chunks that
    cannot land in place, so they do not cap how many requests are in flight. Unwanted
    slots inside a request all go to one shared discard area."""

    def __init__(self, n_dirs: int, depth: int, buf_bytes: int, make_buffer, discard_bytes: int):  # noqa: ANN001
        self.queues = [queue.Queue() for _ in range(n_dirs)]
        self.buffers: queue.Queue = queue.Queue()
        self._make, self._buf_bytes, self._made, self._max = make_buffer, buf_bytes, 0, depth + n_dirs
        self._lock = threading.Lock()
        self.discard = memoryview(make_buffer(discard_bytes))
        self.checks: queue.Queue = queue.Queue()
        self.threads = [threading.Thread(target=self._verifier, name="hcache-verify", daemon=True)] + [
            threading.Thread(target=self._loop, args=(q,), name=f"hcache-reader-{d}", daemon=True)
            for d, q in enumerate(self.queues)
            for _ in range(depth)
        ]
        self._readers = len(self.threads) - 1
        for t in self.threads:
            t.start()

    def submit(self, d: int, fn, req: Request) -> None:  # noqa: ANN001
        self.queues[d].put((fn, req))

    def verify(self, fn, args: tuple) -> None:  # noqa: ANN001
        self.checks.put((fn, args))

    def take(self):  # noqa: ANN201 - whatever make_buffer makes
        """A bounce buffer: made on first need, then reused; waits while all are in use."""
        with self._lock:
            if self.buffers.empty() and self._made < self._max:
                self._made += 1
                return self._make(self._buf_bytes)
        return self.buffers.get()

    def give(self, buf) -> None:  # noqa: ANN001
        self.buffers.put(buf)

    def _loop(self, q: queue.Queue) -> None:
        one_core_copies()
        while (item := q.get()) is not None:
            fn, req = item
            # a capped request waits for its turn here, holding no buffer
            wait_until(req.not_before)
            fn(req)
        with self._lock:  # the last reader out stops the verifier, after every read it handed over
            self._readers -= 1
            if self._readers == 0:
                self.checks.put(None)

    def _verifier(self) -> None:
        """One thread checks every finished read (checksums, copies out of bounce buffers)."""
        one_core_copies()
        while (item := self.checks.get()) is not None:
            fn, args = item
            fn(*args)

    def close(self) -> None:
        for q in self.queues:
            for _ in range(len(self.threads)):
                q.put(None)
