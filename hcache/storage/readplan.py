"""Read planning: which chunks a restore wants, the requests that read them (in the order
layers are consumed), where each slot of a request lands, and the plans kept for reuse."""

from __future__ import annotations

import bisect
import heapq
import operator
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from hcache.config import StorageConfig
from hcache.storage.errors import ChunkError
from hcache.storage.layout import CHUNK_TOKENS, Kind, Stored, num_chunks
from hcache.storage.manifest import ChunkRow
from hcache.storage.placement import Placement

Target = memoryview | tuple[int, int]  # bytes to read into, or (offset, length) in the bounce buffer


@dataclass
class Request:
    dir: int
    slab: str
    first: int
    count: int
    chunks: list[ChunkRow]
    min_layer: int
    not_before: float = 0.0  # under a read cap: when its bytes may go (booked in layer order)
    gate: int = 0  # which opening layer's it is (those go alone, in order), or their count


class Landing(NamedTuple):
    """Where chunks `first:first + count` of a request's `chunks` land: in place, chunk m at
    `mem[at + m * stride]` (in consecutive slots, so checked as one run); or, with `mem`
    None, a single chunk in the bounce buffer at offset `at` (its slot's)."""

    first: int
    count: int
    mem: memoryview | None
    at: int
    stride: int


@dataclass(frozen=True)
class Want:
    """Tokens `lo:hi` of one layer's `kind` (`lo` on a chunk boundary)."""

    layer: int
    kind: Kind
    lo: int
    hi: int


def stored_wants(kinds: list[Stored], layers: list[int] | None, n: int) -> list[Want]:
    """Tokens `0:n` of every kind `layers` store (default: every layer that stores one)."""
    chosen = layers if layers is not None else [i for i, ks in enumerate(kinds) if ks]
    if any(not kinds[i] for i in chosen):
        raise ValueError("asked for a layer that stores nothing (it is restored by recompute)")
    return [Want(i, k, 0, n) for i in chosen for k in sorted(kinds[i])]


_SLOT, _LAYER, _IDX, _DIR, _SLAB = map(operator.attrgetter, ("slot", "layer", "idx", "dir", "slab"))
_NTOKENS = operator.attrgetter("ntokens")


def wanted_chunks(owner: str, w: Want, have: dict[int, ChunkRow]) -> list[ChunkRow] | ChunkError:
    """`w`'s chunks out of `have` (index -> row), or the error naming the first one that is
    missing or holds too few tokens. The usual case (every chunk there, all full but the
    last) is checked with C-level calls: this runs before a restore's first read."""
    first, last = w.lo // CHUNK_TOKENS, num_chunks(w.hi)
    wanted = range(first, last)
    got = list(map(have.__getitem__, wanted)) if set(wanted) <= have.keys() else None
    if got and (
        min(map(_NTOKENS, got[:-1]), default=CHUNK_TOKENS) < CHUNK_TOKENS
        or got[-1].ntokens < w.hi - (last - 1) * CHUNK_TOKENS
    ):
        got = None
    return got if got is not None else _first_bad(owner, w, have)


def _first_bad(owner: str, w: Want, have: dict[int, ChunkRow]) -> ChunkError:
    for idx in range(w.lo // CHUNK_TOKENS, num_chunks(w.hi)):
        r, need = have.get(idx), min(CHUNK_TOKENS, w.hi - idx * CHUNK_TOKENS)
        if r is None or r.ntokens < need:
            return ChunkError(owner, w.layer, idx, "missing" if r is None else f"holds {r.ntokens} < {need} tokens")
    raise AssertionError("no bad chunk")


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
    they are less than `ahead` layers later (needed soon anyway; but not into the first
    layer's requests, which the consumer waits on with nothing else to do), so a layer is whole after
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
    first_layer = int(layer.min())
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
        first, stop = s_[p], lo_layer + (1 if lo_layer == first_layer else ahead)
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


class ReadPlan:
    """What a reader of `wants` reads: each want's chunks (or the error naming its first bad
    one), and the requests that read them, made as the reader asks for them. Once all were
    made, a reader of the same wants of the same owner version (every session on a shared
    context) takes copies of them instead of a plan of its own."""

    def __init__(
        self,
        owner: str,
        wants: list[Want],
        index: dict[tuple[int, str], dict[int, ChunkRow]],
        slot_bytes: dict[str, int],
        max_bytes: int,
        first_bytes: int,
        ahead: int,
    ):
        self.chunks = [wanted_chunks(owner, w, index.get((w.layer, w.kind.value), {})) for w in wants]
        rows = [r for c in self.chunks if not isinstance(c, ChunkError) for r in c]
        self._making: Iterator[Request] | None = plan_requests(
            rows, slot_bytes, max_bytes, first_bytes=first_bytes, ahead=ahead
        )
        self._made: list[Request] = []
        self.whole = False  # every request made

    @property
    def reusable(self) -> bool:
        return self.whole and not any(isinstance(c, ChunkError) for c in self.chunks)

    def requests(self) -> Iterator[Request]:
        """The requests in order: made now, by the plan's one first reader, or copies of them."""
        if self.whole:
            for q in self._made:
                yield Request(q.dir, q.slab, q.first, q.count, q.chunks, q.min_layer)
            return
        making, self._making = self._making, None
        if making is None:
            raise RuntimeError("a plan is read by one reader until all its requests are made")
        for q in making:
            self._made.append(Request(q.dir, q.slab, q.first, q.count, q.chunks, q.min_layer))
            yield q
        self.whole = True


class ReadPlans:
    """The last `kept` plans of whole reads, by (owner, version of its chunks, wants): the
    readers of an owner that does not change (say a shared context's) take one plan."""

    def __init__(self, placement: Placement, slot_bytes: dict[str, int], cfg: StorageConfig, kept: int = 64):
        self.placement, self.slot_bytes, self.cfg, self.kept = placement, slot_bytes, cfg, kept
        self._plans: OrderedDict[tuple[str, int, tuple[Want, ...]], ReadPlan] = OrderedDict()
        self._lock = threading.Lock()

    def plan(self, owner: str, wants: list[Want]) -> ReadPlan:
        """A whole plan of the same wants of this version of the owner's chunks, else a new one."""
        key = (owner, self.placement.version(owner) or 0, tuple(wants))
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None and plan.reusable:
                self._plans.move_to_end(key)
                return plan
        index, version = self.placement.versioned_index(owner)
        cfg = self.cfg
        plan = ReadPlan(
            owner, wants, index, self.slot_bytes, cfg.max_request_bytes, cfg.first_request_bytes, cfg.request_layers
        )
        with self._lock:
            self._plans[(owner, version, tuple(wants))] = plan
            while len(self._plans) > self.kept:
                self._plans.popitem(last=False)
        return plan


def scatter_plan(
    q: Request,
    piece: int,
    sb: int,
    dest: Callable[[ChunkRow], tuple[memoryview | None, Want]],
    discard: memoryview,
) -> tuple[list[Target], list[Landing]]:
    """The request's slots (`sb` bytes each, holding `piece` bytes of chunk) as read targets,
    in file order. A full chunk lands in place in its layer's buffer, so no copy follows the
    read: `dest(r)` gives that buffer's bytes (None where chunks cannot land in place) and
    the rows it wants. Unwanted slots between wanted ones go to the shared `discard` area;
    tails and chunks that cannot land in place go to the bounce buffer, as `(offset, length)`
    of their slot until one is taken. Returns the targets and where the chunks landed, a run
    at a time (a layer's chunks in consecutive slots): this runs on a reader thread between
    two reads, beside a turn, so nothing in it is done per chunk that can be done per run."""
    step = piece // CHUNK_TOKENS  # bytes per token row
    # chunks land in place only when their rows are whole pages, so their slots have no padding
    targets: list[Target] = []
    landings: list[Landing] = []
    chunks, n = q.chunks, len(q.chunks)
    nxt, i = q.first, 0  # the next slot not yet targeted; the run's first chunk
    while i < n:
        r = chunks[i]
        if r.slot > nxt:
            skip(targets, (r.slot - nxt) * sb, discard)
        mem, want = dest(r)
        if mem is None or is_tail(r, want.hi):  # a tail: its valid rows only
            at = (r.slot - q.first) * sb
            targets.append((at, sb))
            landings.append(Landing(i, 1, None, at, sb))
            nxt, i = r.slot + 1, i + 1
            continue
        j = run_end(chunks, i, want.hi // CHUNK_TOKENS)
        k = j - i
        gap = chunks[i + 1].idx - r.idx if k > 1 else 1
        o = (r.idx * CHUNK_TOKENS - want.lo) * step
        stride = gap * piece
        # consecutive chunks are consecutive token rows: one target, one segment of the request
        if gap == 1:
            targets.append(mem[o : o + k * piece])
        else:
            targets.extend([mem[x : x + piece] for x in range(o, o + k * stride, stride)])
        landings.append(Landing(i, k, mem, o, stride))
        nxt, i = r.slot + k, j
    return targets, landings


def skip(targets: list[Target], n: int, discard: memoryview) -> None:
    """Bytes nobody reads: any number of them share the discard area."""
    while n > 0:
        k = min(n, len(discard))
        targets.append(discard[:k])
        n -= k


def run_end(chunks: list[ChunkRow], i: int, full: int) -> int:
    """End of the run from `chunks[i]`: the same layer's next chunks in the next slots, with
    evenly spaced indices (chunk c of a layer lives in directory (layer + c) mod N), none a
    tail (an index from `full` on). A run lands in place, or is copied out of the bounce
    buffer, in one go."""
    r, n = chunks[i], len(chunks)
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


def is_tail(r: ChunkRow, hi: int) -> bool:
    """Does chunk `r` reach past token `hi` (the end of the rows wanted)?"""
    return (r.idx + 1) * CHUNK_TOKENS > hi
