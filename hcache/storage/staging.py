"""Stage 1 of saving: a bounded ring of preallocated memory (pinned on CUDA) that
takes a whole batch's rows, a kind's layers side by side (one copy per kind, or per
layer). A full ring blocks the producer (counted as a wait) and never drops data;
stage 2 releases entries as it packs them, possibly out of order."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hcache.storage.layout import Kind, LayerKinds, StoredSpec, canonical


@dataclass
class Segment:
    """Rows `row:row+n` of a staged batch are tokens `start:start+n` of `owner`."""

    owner: str
    start: int
    n: int
    row: int


class StagedBatch:
    """Rows to save. In the ring: each kind's layers, in order, as one strided view
    (`hidden_all` `[layers, rows, hidden]`, `kv_all` `[layers, rows, 2, kv_dim]`), so one
    copy fills them; `hidden` / `kv` are the same rows per layer. Not in the ring
    (`in_ring=False`): the caller's own per-layer tensors, held by the batch until packed,
    and `on_packed` told when they are no longer read."""

    def __init__(
        self,
        offset: int,
        nbytes: int,
        num_rows: int,
        hidden: dict[int, torch.Tensor] | None = None,
        kv: dict[int, torch.Tensor] | None = None,
        segments: list[Segment] | None = None,
        *,
        in_ring: bool = True,
        on_packed: Callable[[], None] | None = None,
        hidden_all: torch.Tensor | None = None,
        kv_all: torch.Tensor | None = None,
        layers: dict[Kind, tuple[int, ...]] | None = None,
    ):
        self.offset, self.nbytes, self.num_rows = offset, nbytes, num_rows
        self.segments = segments if segments is not None else []
        self.in_ring, self.on_packed = in_ring, on_packed
        self.hidden_all, self.kv_all = hidden_all, kv_all
        self._per_layer = {Kind.HIDDEN: hidden, Kind.KV: kv}
        self._layers = layers or {Kind.HIDDEN: tuple(hidden or ()), Kind.KV: tuple(kv or ())}

    def layers(self, kind: Kind) -> tuple[int, ...]:
        return self._layers[kind]

    def whole(self, kind: Kind) -> torch.Tensor | None:
        return self.hidden_all if kind == Kind.HIDDEN else self.kv_all

    def per_layer(self, kind: Kind) -> dict[int, torch.Tensor]:
        # made on first use: a decode step fills the whole views and never asks for these
        got = self._per_layer[kind]
        if got is None:
            whole = self.whole(kind)
            parts = whole.unbind() if whole is not None else ()
            got = self._per_layer[kind] = dict(zip(self._layers[kind], parts, strict=True))
        return got

    @property
    def hidden(self) -> dict[int, torch.Tensor]:  # layer -> [rows, hidden]
        return self.per_layer(Kind.HIDDEN)

    @property
    def kv(self) -> dict[int, torch.Tensor]:  # layer -> [rows, 2, kv_dim]
        return self.per_layer(Kind.KV)


@dataclass(frozen=True)
class _Layout:
    """Where a batch's rows go, relative to its start: per kind its layers, their byte
    offset and the per-layer slot size."""

    nbytes: int
    layers: dict[Kind, tuple[int, ...]]
    offsets: dict[Kind, int]
    slots: dict[Kind, int]


class StagingRing:
    def __init__(
        self,
        capacity_bytes: int,
        hidden_size: int,
        kv_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_dtype: torch.dtype | None = None,
    ):
        pin = device.type == "cuda" and torch.cuda.is_available()
        self.buf = torch.empty(capacity_bytes, dtype=torch.uint8, pin_memory=pin)
        self.capacity = capacity_bytes
        self.hidden_size, self.kv_dim = hidden_size, kv_dim
        self.dtypes = {Kind.HIDDEN: dtype, Kind.KV: kv_dtype or dtype}
        self.cond = threading.Condition()
        self.entries: deque[list] = deque()  # [offset, end, released], oldest first
        self.head = 0  # next free byte
        self.waits = 0
        self.wait_seconds = 0.0
        self.closed = False
        self._layouts: dict[tuple, _Layout] = {}
        # the ring's bytes as each kind's dtype (entries start 64-byte aligned)
        whole = {k: capacity_bytes - capacity_bytes % dt.itemsize for k, dt in self.dtypes.items()}
        self._typed = {k: self.buf[: whole[k]].view(self.dtypes[k]) for k in self.dtypes}

    def used_bytes(self) -> int:
        with self.cond:
            return sum(e[1] - e[0] for e in self.entries)

    def acquire(
        self,
        num_rows: int,
        layers: dict[int, StoredSpec] | LayerKinds,
        before_wait: Callable[[], None] | None = None,
    ) -> StagedBatch:
        """Room for `num_rows` rows of each (layer, kind) asked for (a dict, or `canonical`'s
        form of it); blocks while the ring is full (after `before_wait()`: batches the
        producer holds back free no room until sent)."""
        want = layers if isinstance(layers, tuple) else canonical(layers)
        lay = self._layouts.get((num_rows, want))
        if lay is None:
            if len(self._layouts) >= 1024:  # prefill pieces come in any size: a bound, not an LRU
                self._layouts.clear()
            lay = self._layouts[(num_rows, want)] = self._layout(num_rows, dict(want))
        if lay.nbytes > self.capacity:
            raise ValueError(f"a batch of {lay.nbytes} bytes does not fit a staging ring of {self.capacity}")
        with self.cond:
            start = self._fit(lay.nbytes)
            if start is None:
                if before_wait is not None:
                    before_wait()
                self.waits += 1
                t0 = time.perf_counter()
                while (start := self._fit(lay.nbytes)) is None:
                    if self.closed:
                        raise RuntimeError("staging ring closed")
                    self.cond.wait()
                self.wait_seconds += time.perf_counter() - t0
            self.entries.append([start, start + lay.nbytes, False])
            self.head = start + lay.nbytes
        views: dict[Kind, torch.Tensor] = {}
        for k, ls in lay.layers.items():
            if ls:  # one strided view straight over the ring's bytes as the kind's dtype
                size = self.dtypes[k].itemsize
                row = (self.hidden_size,) if k == Kind.HIDDEN else (2, self.kv_dim)
                stride = (lay.slots[k] // size, row[-1] * len(row), *((self.kv_dim,) if k == Kind.KV else ()), 1)
                at = (start + lay.offsets[k]) // size
                views[k] = self._typed[k].as_strided((len(ls), num_rows, *row), stride, at)
        return StagedBatch(
            start, lay.nbytes, num_rows, hidden_all=views.get(Kind.HIDDEN), kv_all=views.get(Kind.KV), layers=lay.layers
        )

    def _layout(self, num_rows: int, kinds: dict[int, frozenset[Kind]]) -> _Layout:  # once per shape
        row_bytes = {
            Kind.HIDDEN: self.hidden_size * self.dtypes[Kind.HIDDEN].itemsize,
            Kind.KV: 2 * self.kv_dim * self.dtypes[Kind.KV].itemsize,
        }
        # kind-major: a kind's slots are equal, so its layers form one strided view
        by_kind = {k: tuple(layer for layer in sorted(kinds) if k in kinds[layer]) for k in Kind}
        slot = {k: _align(num_rows * row_bytes[k]) for k in Kind}
        offsets, off = {}, 0
        for k, ls in by_kind.items():
            offsets[k] = off
            off += len(ls) * slot[k]
        return _Layout(off, by_kind, offsets, slot)

    def _fit(self, n: int) -> int | None:
        if not self.entries:
            self.head = 0
            return 0
        tail = self.entries[0][0]
        if self.head > tail or (self.head == tail and not self.entries):
            if self.capacity - self.head >= n:
                return self.head
            return 0 if tail >= n else None  # wrap to the front
        return self.head if tail - self.head >= n else None

    def release(self, batch: StagedBatch) -> None:
        if not batch.in_ring:
            if batch.on_packed is not None:
                batch.on_packed()
            return
        with self.cond:
            for e in self.entries:
                if e[0] == batch.offset and e[1] == batch.offset + batch.nbytes:
                    e[2] = True
                    break
            while self.entries and self.entries[0][2]:
                self.entries.popleft()
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


def _align(n: int, a: int = 64) -> int:
    return (n + a - 1) // a * a
