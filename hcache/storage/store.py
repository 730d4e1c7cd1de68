"""The chunk store: where sessions' and contexts' state lives between turns and
across restarts. Several directories (one per device), slab files of fixed slots,
a SQLite manifest, two-stage saving (staging ring -> packer -> per-directory
writers) and coalesced, checksummed reads."""

from __future__ import annotations

import errno
import fcntl
import logging
import math
import os
import shutil
import threading
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hcache.config import ModelConfig, StorageConfig
from hcache.storage.errors import ChunkError, FingerprintMismatch, StorageError, StorageFull, StoreLocked, UnknownOwner
from hcache.storage.flusher import ChunkBuf, ChunkWrite, DirWriter, FlushTail, Forget, Packer
from hcache.storage.layout import (
    CHUNK_TOKENS,
    KV_LAYOUT,
    ChunkShape,
    Kind,
    Stored,
    StoredSpec,
    checksum,
    chunk_shapes,
    decode_layer_kinds,
    encode_layer_kinds,
    home_dir,
    parse_slab,
)
from hcache.storage.manifest import ChunkRow, Manifest, OwnerRow
from hcache.storage.reader import OwnerReader, ReadPool, Want
from hcache.storage.slab import HUGE_PAGE, ChunkBuffers, SlabFile, SlotAllocator, aligned_buffer
from hcache.storage.staging import Segment, StagedBatch, StagingRing
from hcache.storage.throttle import TokenBucket

log = logging.getLogger(__name__)
MANIFEST = "manifest.sqlite"
LOCK = "hcache.lock"


@dataclass
class DirUsage:
    path: str
    used_bytes: int  # slots referenced by committed chunks
    slab_bytes: int  # size of the slab files
    quota_bytes: int
    fs_free_bytes: int
    chunks: int
    bytes_written: int = 0


@dataclass
class StoreStats:
    checksum_failures: int = 0
    ring_waits: int = 0
    ring_wait_seconds: float = 0.0
    recovered_orphan_slots: int = 0
    dropped_stale_chunks: int = 0
    bytes_read: int = 0
    read_bytes_by_dir: list[int] = field(default_factory=list)
    read_buffers_allocated: int = 0  # fresh layer buffers (pinned on CUDA: slow to allocate)
    chunks_read_in_place: int = 0  # read straight into a layer buffer (the rest are copied from a bounce buffer)


class ChunkStore:
    def __init__(self, cfg: StorageConfig, model: ModelConfig, dtype: torch.dtype, device: str = "cpu"):
        if not cfg.dirs:
            raise ValueError("at least one storage directory is needed")
        self.cfg, self.model, self.dtype = cfg, model, dtype
        self.dirs = [Path(d).resolve() for d in cfg.dirs]
        for d in self.dirs:
            if not d.is_dir():
                raise FileNotFoundError(f"storage directory missing: {d}")
        self._lock_fd = os.open(self.dirs[0] / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise StoreLocked(f"{self.dirs[0]} is in use by another hcache process") from None
        self.manifest = Manifest(self.dirs[0] / MANIFEST)
        known = self.manifest.get_meta("dirs")
        listed = "\n".join(map(str, self.dirs))
        if known is not None and known != listed:
            self.close()
            raise StorageError(
                f"storage directories differ from the ones this store was created with:\n{known}\n"
                "chunks are placed by directory position; start with the same list, in the same order"
            )
        self.manifest.set_meta("dirs", listed)
        layout = self.manifest.get_meta("kv_layout")
        if layout != KV_LAYOUT and (layout is not None or self.manifest.has_chunks(Kind.KV.value)):
            self.close()
            raise StorageError(
                f"{self.dirs[0]}: its KV chunks are laid out as {layout or '[2, 64, kv_dim] (K rows, then V rows)'}; "
                f"this hcache reads [64, 2, kv_dim] ({KV_LAYOUT}). Serve them with the hcache that wrote them, "
                "or start this one on empty directories"
            )
        self.manifest.set_meta("kv_layout", KV_LAYOUT)
        self.shapes: dict[Kind, ChunkShape] = chunk_shapes(model, dtype)
        self.chunk_buffers = {k: ChunkBuffers(s.slot_bytes, self._chunk_view(s)) for k, s in self.shapes.items()}
        self.lock = threading.RLock()
        self.slabs: dict[tuple[int, str], SlabFile] = {}
        self.allocs: dict[tuple[int, str], SlotAllocator] = {}
        self.index: dict[str, dict[tuple[int, str], dict[int, ChunkRow]]] = {}
        self.seqs: dict[tuple[str, int, int, str], int] = {}
        self.errors: dict[str, Exception] = {}
        self._buffers: list[torch.Tensor] = []  # free layer buffers, least recently returned first
        self._pooled_bytes = 0
        self.pinned = torch.device(device).type == "cuda" and torch.cuda.is_available()
        self.stats = StoreStats(read_bytes_by_dir=[0] * len(self.dirs))
        self.on_flush: Callable[[int, float], None] | None = None  # (directory, seconds) per written group
        self.throttle = TokenBucket(cfg.read_cap_gbps * 1e9)
        self._recover()
        self.ring = StagingRing(cfg.staging_bytes, model.hidden_size, model.kv_dim, dtype, torch.device(device))
        self.packer = Packer(self)
        self.writers = [DirWriter(self, i, cfg.fsync_group_bytes) for i in range(len(self.dirs))]
        # unwanted slots inside a request are at most two in a row (plan_requests' max_gap)
        discard = 2 * max(sh.slot_bytes for sh in self.shapes.values())
        self.reads = ReadPool(len(self.dirs), cfg.read_depth, cfg.max_request_bytes, aligned_buffer, discard)
        for t in (self.packer, *self.writers):
            t.start()
        self._closed = False

    # --- startup ----------------------------------------------------------------
    def _recover(self) -> None:
        """Rebuild slot maps from the manifest: unreferenced slots are free, and slab
        tails past the last referenced slot are cut off; chunks wholly past an owner's
        durable tokens (a turn that never finished) are dropped."""
        owners = {o.owner: o for o in self.manifest.owners()}
        rows = self.manifest.chunks()
        stale = [r for r in rows if r.owner not in owners or r.idx * CHUNK_TOKENS >= owners[r.owner].num_tokens]
        if stale:
            self.manifest.delete_chunks(stale)
            self.stats.dropped_stale_chunks = len(stale)
        stale_set = set(stale)
        used: dict[tuple[int, str], set[int]] = defaultdict(set)
        for o in owners:
            self.index[o] = defaultdict(dict)
        for r in rows:
            if r not in stale_set:
                used[(r.dir, r.slab)].add(r.slot)
                self.index[r.owner][(r.layer, r.kind)][r.idx] = r
        names = {s.slab for s in self.shapes.values()} | {k[1] for k in used}
        for d, path in enumerate(self.dirs):
            names_here = names | {p.name[: -len(".slab")] for p in path.glob("*.slab")}
            for name in names_here:
                slab = self.slab(d, name)
                slots = used.get((d, name), set())
                keep = max(slots) + 1 if slots else 0
                high = slab.num_slots
                self.stats.recovered_orphan_slots += max(0, high - keep) + (keep - len(slots))
                if high > keep:
                    slab.truncate(keep)
                self.allocs[(d, name)] = SlotAllocator(slots, keep)

    def slab(self, d: int, name: str) -> SlabFile:
        key = (d, name)
        with self.lock:
            if key not in self.slabs:
                self.slabs[key] = SlabFile(self.dirs[d] / f"{name}.slab", parse_slab(name)[2], self.cfg.direct_io)
                self.allocs.setdefault(key, SlotAllocator(set(), self.slabs[key].num_slots))
            return self.slabs[key]

    # --- owners -----------------------------------------------------------------
    def create_owner(
        self,
        owner: str,
        layer_kinds: list[StoredSpec],
        fingerprint: str,
        kind: str = "session",
        meta: dict | None = None,
    ) -> None:
        if len(layer_kinds) != self.model.num_layers:
            raise ValueError(f"{len(layer_kinds)} layer kinds for a {self.model.num_layers}-layer model")
        with self.lock:
            if self.manifest.get_owner(owner) is not None:
                raise ValueError(f"owner {owner} already exists")
            self.manifest.create_owner(owner, kind, fingerprint, encode_layer_kinds(layer_kinds), meta)
            self.index[owner] = defaultdict(dict)

    def owner_row(self, owner: str) -> OwnerRow:
        row = self.manifest.get_owner(owner)
        if row is None:
            raise UnknownOwner(f"unknown owner {owner}")
        return row

    def check_fingerprint(self, owner: str, fingerprint: str) -> OwnerRow:
        row = self.owner_row(owner)
        if row.fingerprint != fingerprint:
            raise FingerprintMismatch(
                f"owner {owner} was saved by another model (fingerprint {row.fingerprint[:12]}, "
                f"this model {fingerprint[:12]}): its state cannot be restored with this model"
            )
        return row

    @staticmethod
    def layer_kinds(row: OwnerRow) -> list[Stored]:
        return decode_layer_kinds(row.layer_kinds)

    def owners(self) -> list[OwnerRow]:
        return self.manifest.owners()

    # --- saving -----------------------------------------------------------------
    def acquire(self, segments: list[tuple[str, int, int]]) -> StagedBatch:
        """Stage 1: ring room for a batch whose rows are, in order, `(owner, start_token, n)`.
        Fill `batch.hidden[layer]` / `batch.kv[layer]` (one copy per layer), then `submit`."""
        need: dict[int, set[Kind]] = defaultdict(set)
        for owner, *_ in segments:
            for layer, ks in enumerate(self.layer_kinds(self.owner_row(owner))):
                need[layer] |= ks
        total = sum(n for *_, n in segments)
        batch = self.ring.acquire(total, dict(need))
        row = 0
        for owner, start, n in segments:
            batch.segments.append(Segment(owner, start, n, row))
            row += n
        self.stats.ring_waits, self.stats.ring_wait_seconds = self.ring.waits, self.ring.wait_seconds
        return batch

    def submit(self, batch: StagedBatch) -> None:
        self.packer.inbox.put(batch)

    def save_rows(self, owner: str, start: int, hidden: dict[int, torch.Tensor], kv: dict[int, torch.Tensor]) -> None:
        """Convenience for one owner: stage rows given per layer (H `[n, hidden]`, KV `[n, 2, kv_dim]`)."""
        n = next(iter(hidden.values() or kv.values())).shape[0]
        elem = torch.finfo(self.dtype).bits // 8
        row_bytes = elem * (len(hidden) * self.model.hidden_size + len(kv) * 2 * self.model.kv_dim)
        step = max(1, self.ring.capacity // (2 * max(1, row_bytes)))  # pieces the ring can hold
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            batch = self.acquire([(owner, start + lo, hi - lo)])
            for layer, t in batch.hidden.items():
                t.copy_(hidden[layer][lo:hi])
            for layer, t in batch.kv.items():
                t.copy_(kv[layer][lo:hi])
            self.submit(batch)

    def mark_durable(self, owner: str, tokens: list[int], meta: dict | None = None) -> None:
        """End of a turn: write the tail chunks, wait for every chunk of the owner to be
        committed, then record the token ids (and `meta`). Returns only when the turn is durable."""
        self.owner_row(owner)
        done = _future()
        self.packer.inbox.put(FlushTail(owner, done))
        pending, staged = done.result()
        for f in pending:
            f.result()  # a failed write raises here: the turn is not durable
        err = self.errors.pop(owner, None)
        if err is not None:
            raise StorageError(f"saving {owner} failed: {err}") from err
        if staged != len(tokens):
            raise ValueError(f"owner {owner}: {len(tokens)} token ids for {staged} staged rows")
        self.manifest.set_tokens(owner, tokens, meta)

    def truncate(self, owner: str, n: int) -> None:
        """Forget tokens past `n` (a conversation rewritten from there). Durable at once."""
        row = self.owner_row(owner)
        if n > row.num_tokens:
            raise ValueError(f"owner {owner} has {row.num_tokens} durable tokens, cannot keep {n}")
        self._forget(owner)
        self.manifest.set_tokens(owner, row.tokens[:n])

    def delete(self, owner: str) -> None:
        self.owner_row(owner)
        self._forget(owner)
        with self.lock:
            rows = self.manifest.delete_owner(owner)
            self.index.pop(owner, None)
            for r in rows:
                self.release_slot(r.dir, r.slab, r.slot)
            for key, alloc in self.allocs.items():
                alloc.drop_reservations(owner)
                high = alloc.trim()
                if high < self.slab(*key).num_slots:
                    self.slab(*key).truncate(high)  # give trailing space back to the filesystem

    def _forget(self, owner: str) -> None:
        """Wait for the owner's queued writes, then drop its packing state and write versions."""
        drained = _future()
        self.packer.inbox.put(FlushTail(owner, drained, write_tail=False))
        pending, _ = drained.result()
        for f in pending:
            f.exception()  # wait; a failed write of state being dropped does not matter
        done = _future()
        self.packer.inbox.put(Forget(owner, done))
        done.result()
        with self.lock:
            for key in [k for k in self.seqs if k[0] == owner]:
                del self.seqs[key]

    # --- called by the packer and writers ---------------------------------------
    def new_chunk(self, kind: Kind) -> ChunkBuf:
        # rows past a tail's count are never read back; they need no zeroing
        return self.chunk_buffers[kind].take()

    def free_chunk(self, kind: Kind, buf: ChunkBuf) -> None:
        self.chunk_buffers[kind].give(buf)

    def _chunk_view(self, shape: ChunkShape) -> Callable[[memoryview], ChunkBuf]:
        def wrap(mem: memoryview) -> ChunkBuf:
            t = torch.frombuffer(mem, dtype=torch.uint8)[: shape.nbytes].view(self.dtype).view(shape.shape)
            return ChunkBuf(mem, t)

        return wrap

    def take_buffer(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A layer-sized read buffer, reused across restores (fresh memory costs page faults):
        the smallest free one that is large enough, whatever it last held. One pool serves H
        and KV layers of any length (with a pool per power-of-two size, a KV-only restore
        after an H-only one found none of its size and faulted in 24 fresh 16 MB buffers:
        4K tokens, multi-head model). New ones are rounded up to whole huge pages."""
        n = max(1, math.prod(shape))
        with self.lock:
            sizes = [f.numel() for f in self._buffers]
            best = min((i for i, k in enumerate(sizes) if k >= n), key=sizes.__getitem__, default=None)
            flat = self._buffers.pop(best) if best is not None else None
            if flat is not None:
                self._pooled_bytes -= flat.nbytes
            else:
                self.stats.read_buffers_allocated += 1
        if flat is None:  # pinned on CUDA: the restorer's host-to-device copies then run async
            item = self.dtype.itemsize
            size = -(-n * item // HUGE_PAGE) * HUGE_PAGE // item
            flat = (
                torch.empty(size, dtype=self.dtype, pin_memory=True)
                if self.pinned  # page-aligned too (cudaHostAlloc); the reader checks before reading in place
                else torch.frombuffer(aligned_buffer(size * item), dtype=self.dtype, count=size)
            )
        return flat[:n].view(shape)

    def give_buffer(self, t: torch.Tensor) -> None:
        """Keep what two restores' read-ahead holds (the layer window or `prefetch_bytes`, and
        a little more), so the next restore allocates nothing whichever kinds it reads; on
        CUDA a fresh pinned buffer costs milliseconds and stalls the device. Over that, the
        least recently returned go."""
        flat = t._base if t._base is not None else t
        with self.lock:
            self._buffers.append(flat)
            self._pooled_bytes += flat.nbytes
            largest = max(f.nbytes for f in self._buffers)  # a small tail must not empty the pool
            keep = 2 * max(self.cfg.prefetch_bytes, (self.cfg.prefetch_layers + 2) * largest)
            while self._pooled_bytes > keep:
                self._pooled_bytes -= self._buffers.pop(0).nbytes

    def dispatch(self, w: ChunkWrite) -> None:
        """Place a chunk: its home directory, or the next one with room; then queue its write."""
        shape = self.shapes[w.kind]
        full = w.ntokens == CHUNK_TOKENS
        n = len(self.dirs)
        with self.lock:
            for step in range(n):
                d = (home_dir(w.layer, w.idx, n) + step) % n
                self.slab(d, shape.slab)
                slot = self.allocs[(d, shape.slab)].allocate((w.owner, w.layer) if full else None, self._room(d, shape))
                if slot is not None:
                    w.dir, w.slab, w.slot = d, shape.slab, slot
                    self.writers[d].inbox.put(w)
                    return
        w.future.set_exception(
            StorageFull(f"all {n} storage directories are full (quota {self.cfg.quota_bytes} bytes each)")
        )

    def _room(self, d: int, shape: ChunkShape) -> int:
        """Slots the quota still allows to be added to directory `d`'s slab files."""
        if not self.cfg.quota_bytes:
            return 1 << 40
        allocated = sum(a.high * parse_slab(name)[2] for (dd, name), a in self.allocs.items() if dd == d)
        return max(0, (self.cfg.quota_bytes - allocated) // shape.slot_bytes)

    def commit(self, group: list[ChunkWrite], rows: list[ChunkRow]) -> None:
        with self.lock:
            keep, drop = [], []
            for w, r in zip(group, rows, strict=True):
                key = (w.owner, w.layer, w.idx, w.kind.value)
                if w.owner not in self.index or self.seqs.get(key, 0) > w.seq:
                    drop.append(r)  # owner deleted, or a newer version already committed
                else:
                    keep.append(r)
                    self.seqs[key] = w.seq
            replaced = self.manifest.commit_chunks(keep)
            for r in keep:
                self.index[r.owner][(r.layer, r.kind)][r.idx] = r
            for r in replaced + drop:
                self.release_slot(r.dir, r.slab, r.slot)

    def release_slot(self, d: int, slab: str, slot: int) -> None:
        if slot < 0:
            return
        with self.lock:
            self.allocs[(d, slab)].release(slot)

    def storage_error(self, e: Exception, d: int) -> Exception:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return StorageFull(f"storage directory {self.dirs[d]} is full: {e.strerror}")
        return e if isinstance(e, StorageError) else StorageError(f"write to {self.dirs[d]} failed: {e}")

    def poison(self, owner: str, e: Exception) -> None:
        self.errors[owner] = e

    # --- reading ----------------------------------------------------------------
    def chunk_index(self, owner: str) -> dict[tuple[int, str], dict[int, ChunkRow]]:
        with self.lock:
            if owner not in self.index:
                raise UnknownOwner(f"unknown owner {owner}")
            return {k: dict(v) for k, v in self.index[owner].items()}

    def reader(
        self, owner: str, layers: list[int] | None = None, window: int | None = None, wants: list[Want] | None = None
    ) -> OwnerReader:
        """Read every stored kind of `layers` (default: all), or exactly `wants`, up to the durable tokens."""
        row = self.owner_row(owner)
        if wants is None:
            kinds = self.layer_kinds(row)
            chosen = layers if layers is not None else [i for i, ks in enumerate(kinds) if ks]
            if any(not kinds[i] for i in chosen):
                raise ValueError("asked for a layer that stores nothing (it is restored by recompute)")
            wants = [Want(i, k, 0, row.num_tokens) for i in chosen for k in sorted(kinds[i])]
        elif any(w.hi > row.num_tokens for w in wants):
            raise ValueError(f"owner {owner} has {row.num_tokens} durable tokens")
        return OwnerReader(self, owner, wants, window or self.cfg.prefetch_layers)

    def read_chunk(self, owner: str, layer: int, idx: int, kind: Kind) -> torch.Tensor:
        """One whole chunk (all 64 rows of its slot), checked."""
        row = self.chunk_index(owner).get((layer, kind.value), {}).get(idx)
        if row is None:
            raise ChunkError(owner, layer, idx, "missing")
        shape = self.shapes[kind]
        got = self.slab(row.dir, row.slab).read(row.slot, 1, aligned_buffer(shape.slot_bytes))
        if len(got) < shape.nbytes or checksum(got[: shape.nbytes]) != row.checksum:
            self.count_checksum_failure()
            raise ChunkError(owner, layer, idx, "checksum mismatch")
        return torch.frombuffer(bytearray(got[: shape.nbytes]), dtype=self.dtype).view(shape.shape)

    def submit_read(self, d: int, fn, req) -> None:  # noqa: ANN001
        self.reads.submit(d, fn, req)

    def set_read_cap(self, mbps: float) -> None:
        """Cap restore reads at `mbps` MB/s (0 lifts the cap)."""
        self.throttle.set_rate(mbps * 1e6)

    def count_read(self, nbytes: int, d: int, in_place: int = 0) -> None:
        with self.lock:
            self.stats.bytes_read += nbytes
            self.stats.read_bytes_by_dir[d] += nbytes
            self.stats.chunks_read_in_place += in_place

    def count_checksum_failure(self) -> None:
        with self.lock:
            self.stats.checksum_failures += 1

    # --- accounting -------------------------------------------------------------
    def usage(self) -> list[DirUsage]:
        out = []
        with self.lock:
            for d, path in enumerate(self.dirs):
                used = slab_bytes = chunks = 0
                for (dd, name), a in self.allocs.items():
                    if dd == d:
                        slot = parse_slab(name)[2]
                        used += a.num_used * slot
                        slab_bytes += a.high * slot
                        chunks += a.num_used
                free = shutil.disk_usage(path).free
                written = self.writers[d].bytes_written
                out.append(DirUsage(str(path), used, slab_bytes, self.cfg.quota_bytes, free, chunks, written))
        return out

    def close(self) -> None:
        if getattr(self, "_closed", True) is False:
            self._closed = True
            self.packer.inbox.put(None)
            self.packer.join()
            for w in self.writers:
                w.inbox.put(None)
            for w in self.writers:
                w.join()
            self.reads.close()
            self.ring.close()
        for s in getattr(self, "slabs", {}).values():
            s.close()
        self.slabs = {}
        self.manifest.close()
        os.close(self._lock_fd)

    def __enter__(self) -> ChunkStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _future() -> Future:
    return Future()
