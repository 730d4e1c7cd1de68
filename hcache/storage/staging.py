"""Stage 1 of saving: a bounded ring of preallocated memory (pinned on CUDA) that
takes a whole batch's rows, a kind's layers side by side (one copy per kind, or per
layer). A full ring blocks the producer (counted as a wait) and never drops data;
stage 2 releases entries as it packs them, possibly out of order."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hcache.storage.layout import Kind


@dataclass
class Segment:
    """Rows `row:row+n` of a staged batch are tokens `start:start+n` of `owner`."""

    owner: str
    start: int
    n: int
    row: int


@dataclass
class StagedBatch:
    offset: int
    nbytes: int
    num_rows: int
    hidden: dict[int, torch.Tensor]  # layer -> [rows, hidden]
    kv: dict[int, torch.Tensor]  # layer -> [rows, 2, kv_dim]
    segments: list[Segment] = field(default_factory=list)
    # (in the ring) each kind's layers, in order, as one strided view: one copy fills them
    hidden_all: torch.Tensor | None = None  # [layers, rows, hidden]
    kv_all: torch.Tensor | None = None  # [layers, rows, 2, kv_dim]
    in_ring: bool = True  # False: rows in the caller's own tensors, held by the batch until packed
    on_packed: Callable[[], None] | None = None  # (not in the ring) told when they are no longer read


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

    def used_bytes(self) -> int:
        with self.cond:
            return sum(e[1] - e[0] for e in self.entries)

    def acquire(self, num_rows: int, layers: dict[int, Kind | set[Kind]]) -> StagedBatch:
        """Room for `num_rows` rows of each (layer, kind) asked for; blocks while the ring is full."""
        kinds = {layer: ({k} if isinstance(k, Kind) else set(k)) for layer, k in layers.items()}
        row_bytes = {
            Kind.HIDDEN: self.hidden_size * self.dtypes[Kind.HIDDEN].itemsize,
            Kind.KV: 2 * self.kv_dim * self.dtypes[Kind.KV].itemsize,
        }
        # kind-major: a kind's slots are equal, so its layers form one strided view
        by_kind = {k: [layer for layer in sorted(kinds) if k in kinds[layer]] for k in Kind}
        slot = {k: _align(num_rows * row_bytes[k]) for k in Kind}
        nbytes = sum(len(ls) * slot[k] for k, ls in by_kind.items())
        if nbytes > self.capacity:
            raise ValueError(f"a batch of {nbytes} bytes does not fit a staging ring of {self.capacity}")
        with self.cond:
            start = self._fit(nbytes)
            if start is None:
                self.waits += 1
                t0 = time.perf_counter()
                while (start := self._fit(nbytes)) is None:
                    if self.closed:
                        raise RuntimeError("staging ring closed")
                    self.cond.wait()
                self.wait_seconds += time.perf_counter() - t0
            self.entries.append([start, start + nbytes, False])
            self.head = start + nbytes
        batch = StagedBatch(start, nbytes, num_rows, {}, {})
        off = start
        for k, layers in by_kind.items():
            if not layers:
                continue
            slots = self.buf[off : off + len(layers) * slot[k]].view(len(layers), slot[k])
            rows = slots[:, : num_rows * row_bytes[k]].view(self.dtypes[k])
            if k == Kind.HIDDEN:
                batch.hidden_all = rows.view(len(layers), num_rows, self.hidden_size)
                batch.hidden = dict(zip(layers, batch.hidden_all.unbind(), strict=True))
            else:
                batch.kv_all = rows.view(len(layers), num_rows, 2, self.kv_dim)
                batch.kv = dict(zip(layers, batch.kv_all.unbind(), strict=True))
            off += len(layers) * slot[k]
        return batch

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
