"""Where chunks live: every directory's slab files and slot allocators, and the in-memory
index of committed chunks with their write versions, kept in step under one lock. A slot
may be referenced by several owners' rows (a fork shares its parent's chunks): it is freed
when the last row referencing it goes."""

from __future__ import annotations

import threading
from collections import Counter, defaultdict
from pathlib import Path

import torch

from hcache.config import StorageConfig
from hcache.memory import aligned_buffer
from hcache.storage.errors import ChunkError, StorageFull, UnknownOwner
from hcache.storage.layout import CHUNK_TOKENS, ChunkShape, Kind, checksum, home_dir, parse_slab
from hcache.storage.manifest import ChunkRow, Manifest, OwnerRow
from hcache.storage.slab import SlabFile, SlotAllocator
from hcache.storage.stats import StoreStats

ChunkIndex = dict[tuple[int, str], dict[int, ChunkRow]]  # (layer, kind) -> chunk index -> row


class Placement:
    def __init__(
        self,
        dirs: list[Path],
        manifest: Manifest,
        shapes: dict[Kind, ChunkShape],
        cfg: StorageConfig,
        stats: StoreStats,
    ):
        self.dirs, self.manifest = dirs, manifest
        self.direct_io, self.quota_bytes = cfg.direct_io, cfg.quota_bytes
        self.lock = threading.RLock()
        self.slabs: dict[tuple[int, str], SlabFile] = {}
        self.allocs: dict[tuple[int, str], SlotAllocator] = {}
        self.index: dict[str, ChunkIndex] = {}
        # the version of each owner's index, from one counter: a plan made of an index stays
        # good while its owner's version does (an owner made again gets a new one)
        self._versions: dict[str, int] = {}
        self._version = 0
        self.seqs: dict[tuple[str, int, int, str], int] = {}  # the newest committed write of each chunk
        self.refs: Counter[tuple[int, str, int]] = Counter()  # (dir, slab, slot) -> rows referencing it
        self._recover({s.slab for s in shapes.values()}, stats)

    def _recover(self, names: set[str], stats: StoreStats) -> None:
        """Rebuild slot maps from the manifest: unreferenced slots are free, and slab
        tails past the last referenced slot are cut off; chunks wholly past an owner's
        durable tokens (a turn that never finished) are dropped."""
        owners = {o.owner: o for o in self.manifest.owners()}
        rows = self.manifest.chunks()
        stale = [r for r in rows if r.owner not in owners or r.idx * CHUNK_TOKENS >= owners[r.owner].num_tokens]
        if stale:
            self.manifest.delete_chunks(stale)
            stats.dropped_stale_chunks = len(stale)
        stale_set = set(stale)
        used: dict[tuple[int, str], set[int]] = defaultdict(set)
        for o in owners:
            self.index[o] = defaultdict(dict)
            self._changed(o)
        for r in rows:
            if r not in stale_set:
                used[(r.dir, r.slab)].add(r.slot)
                self.refs[(r.dir, r.slab, r.slot)] += 1
                self.index[r.owner][(r.layer, r.kind)][r.idx] = r
        names = names | {k[1] for k in used}
        for d, path in enumerate(self.dirs):
            names_here = names | {p.name[: -len(".slab")] for p in path.glob("*.slab")}
            for name in names_here:
                slab = self.slab(d, name)
                slots = used.get((d, name), set())
                keep = max(slots) + 1 if slots else 0
                high = slab.num_slots
                stats.recovered_orphan_slots += max(0, high - keep) + (keep - len(slots))
                if high > keep:
                    slab.truncate(keep)
                self.allocs[(d, name)] = SlotAllocator(slots, keep)

    def slab(self, d: int, name: str) -> SlabFile:
        key = (d, name)
        with self.lock:
            if key not in self.slabs:
                self.slabs[key] = SlabFile(self.dirs[d] / f"{name}.slab", parse_slab(name)[2], self.direct_io)
                self.allocs.setdefault(key, SlotAllocator(set(), self.slabs[key].num_slots))
            return self.slabs[key]

    # --- slots ------------------------------------------------------------------
    def place(self, shape: ChunkShape, owner: str, layer: int, idx: int, full: bool) -> tuple[int, int]:
        """A slot for chunk `idx` of `layer`: in its home directory, or the next one with room.
        Returns (directory, slot); full chunks come from the owner's layer's extent."""
        n = len(self.dirs)
        with self.lock:
            for _ in range(2):  # the second time after taking back the extents reserved ahead
                for step in range(n):
                    d = (home_dir(layer, idx, n) + step) % n
                    self.slab(d, shape.slab)
                    key = (owner, layer) if full else None
                    slot = self.allocs[(d, shape.slab)].allocate(key, self._room(d, shape))
                    if slot is not None:
                        return d, slot
                if not self._unreserve():
                    break
        raise StorageFull(f"all {n} storage directories are full (quota {self.quota_bytes} bytes each)")

    def _unreserve(self) -> bool:
        """Free every extent reserved ahead (a full store: they only keep chunks contiguous);
        whether there were any."""
        had = any(a.reserved for a in self.allocs.values())
        for alloc in self.allocs.values():
            alloc.drop_reservations()
        self._trim()
        return had

    def _room(self, d: int, shape: ChunkShape) -> int:
        """Slots the quota still allows to be added to directory `d`'s slab files."""
        if not self.quota_bytes:
            return 1 << 40
        # free slots inside slab files are charged nothing: released ones are punched out of the
        # file, and H and KV slabs would otherwise keep each other's holes from being used
        return max(0, (self.quota_bytes - self.occupied(d)) // shape.slot_bytes)

    def release(self, d: int, slab: str, slot: int) -> None:
        if slot < 0:
            return
        with self.lock:
            self.allocs[(d, slab)].release(slot)

    def occupied(self, d: int) -> int:
        """Bytes of directory `d` that new chunks cannot take: slots in use or reserved ahead
        for an owner's layer (free slots inside slab files are reused first)."""
        with self.lock:
            return sum((a.high - len(a.free)) * parse_slab(name)[2] for (dd, name), a in self.allocs.items() if dd == d)

    def in_use(self, d: int) -> int:
        """Bytes of directory `d` in slots in use: `occupied` less the extents reserved
        ahead, which a full store takes back."""
        with self.lock:
            return sum(a.num_used * parse_slab(name)[2] for (dd, name), a in self.allocs.items() if dd == d)

    def dir_usage(self, d: int) -> tuple[int, int, int]:
        """Directory `d`'s bytes in committed chunks' slots, bytes of slab files, and chunks."""
        used = slab_bytes = chunks = 0
        with self.lock:
            for (dd, name), a in self.allocs.items():
                if dd == d:
                    slot = parse_slab(name)[2]
                    used += a.num_used * slot
                    slab_bytes += a.high * slot
                    chunks += a.num_used
        return used, slab_bytes, chunks

    # --- the index ----------------------------------------------------------------
    def commit(self, rows: list[ChunkRow], seqs: list[int]) -> None:
        """Commit written chunks (`seqs`: their write versions) in one manifest transaction;
        a chunk whose owner is gone, or whose newer version is already committed, is dropped.
        Slots no row references any more are freed."""
        with self.lock:
            keep, drop = [], []
            for r, seq in zip(rows, seqs, strict=True):
                key = (r.owner, r.layer, r.idx, r.kind)
                if r.owner not in self.index or self.seqs.get(key, 0) > seq:
                    drop.append(r)
                else:
                    keep.append(r)
                    self.seqs[key] = seq
            replaced = self.manifest.commit_chunks(keep)
            for r in keep:
                self.index[r.owner][(r.layer, r.kind)][r.idx] = r
                self.refs[(r.dir, r.slab, r.slot)] += 1
            for owner in {r.owner for r in keep}:
                self._changed(owner)
            self._unref(replaced)
            for r in drop:  # written, never committed: no row references its slot
                self.release(r.dir, r.slab, r.slot)

    def _unref(self, rows: list[ChunkRow]) -> list[ChunkRow]:
        """Rows gone from the manifest; frees the slots no row references any more (returned)."""
        freed = []
        for r in rows:
            key = (r.dir, r.slab, r.slot)
            self.refs[key] -= 1
            if self.refs[key] <= 0:
                del self.refs[key]
                self.release(r.dir, r.slab, r.slot)
                freed.append(r)
        return freed

    def chunk_index(self, owner: str) -> ChunkIndex:
        """A copy of the owner's committed chunks."""
        return self.versioned_index(owner)[0]

    def versioned_index(self, owner: str) -> tuple[ChunkIndex, int]:
        """A copy of the owner's committed chunks, and the version it is a copy of."""
        with self.lock:
            if owner not in self.index:
                raise UnknownOwner(f"unknown owner {owner}")
            return {k: dict(v) for k, v in self.index[owner].items()}, self._versions[owner]

    def read_chunk(self, shape: ChunkShape, stats: StoreStats, owner: str, layer: int, idx: int) -> torch.Tensor:
        """One whole chunk (all 64 rows of its slot), checked."""
        with self.lock:
            if owner not in self.index:
                raise UnknownOwner(f"unknown owner {owner}")
            row = self.index[owner].get((layer, shape.kind.value), {}).get(idx)
        if row is None:
            raise ChunkError(owner, layer, idx, "missing")
        got = self.slab(row.dir, row.slab).read(row.slot, 1, aligned_buffer(shape.slot_bytes))
        if len(got) < shape.nbytes or checksum(got[: shape.nbytes]) != row.checksum:
            stats.count_checksum_failure()
            raise ChunkError(owner, layer, idx, "checksum mismatch")
        return torch.frombuffer(bytearray(got[: shape.nbytes]), dtype=shape.dtype).view(shape.shape)

    def version(self, owner: str) -> int | None:
        """The version of the owner's committed chunks (None: no such owner). It changes
        whenever they do."""
        with self.lock:
            return self._versions.get(owner)

    def _changed(self, owner: str) -> None:
        self._version += 1
        self._versions[owner] = self._version

    def add_owner(self, owner: str) -> None:
        with self.lock:
            self.index[owner] = defaultdict(dict)
            self._changed(owner)

    def fork(self, parent: str, child: str, meta: dict, n: int, prefixes: list[bytes] | None) -> OwnerRow:
        """A new owner sharing the parent's chunks of its first `n` tokens (see Manifest.fork_owner)."""
        with self.lock:
            row, rows = self.manifest.fork_owner(parent, child, meta, n, prefixes)
            self.index[child] = defaultdict(dict)
            self._changed(child)
            for r in rows:
                self.index[child][(r.layer, r.kind)][r.idx] = r
                self.refs[(r.dir, r.slab, r.slot)] += 1
            return row

    def forget_versions(self, owner: str) -> None:
        """The owner's next writes start a new history (after a truncation or a deletion)."""
        with self.lock:
            for key in [k for k in self.seqs if k[0] == owner]:
                del self.seqs[key]

    def drop_owner(self, owner: str, expired: bool = False) -> None:
        """Delete the owner and its chunk rows from the manifest and free its slots."""
        with self.lock:
            rows = self.manifest.delete_owner(owner, expired)
            self.index.pop(owner, None)
            self._versions.pop(owner, None)
            self._unref(rows)
            for alloc in self.allocs.values():
                alloc.drop_reservations(owner)
            self._trim()

    def release_layers(self, owner: str, drop: set[tuple[int, Kind]], layer_kinds: str) -> int:
        """The owner stops storing `drop` ((layer, kind) pairs) and stores `layer_kinds` from now
        on: one manifest transaction, then their slots and the extents reserved for them are
        freed. The caller keeps the owner quiet meanwhile, so the transaction (an fsync) runs
        outside the lock that placing chunks takes. Returns the bytes that became free."""
        with self.lock:
            idx = self.index[owner]
            rows = [r for layer, kind in drop for r in idx.get((layer, kind.value), {}).values()]
        self.manifest.release_layers(owner, layer_kinds, rows)
        with self.lock:
            before = sum(self.in_use(d) for d in range(len(self.dirs)))
            for layer, kind in drop:
                idx.pop((layer, kind.value), None)
            self._changed(owner)
            for r in self._unref(rows):
                self.slab(r.dir, r.slab).punch(r.slot)
            for r in rows:
                self.seqs.pop((r.owner, r.layer, r.idx, r.kind), None)
            for (_, name), alloc in self.allocs.items():
                for layer, kind in drop:
                    if parse_slab(name)[0] == kind:
                        alloc.drop_reservations(owner, layer)
            self._trim()
            return before - sum(self.in_use(d) for d in range(len(self.dirs)))

    def _trim(self) -> None:
        for key, alloc in self.allocs.items():
            high = alloc.trim()
            if high < self.slab(*key).num_slots:
                self.slab(*key).truncate(high)  # give trailing space back to the filesystem

    def close(self) -> None:
        for s in self.slabs.values():
            s.close()
        self.slabs = {}
