"""The chunk store: where sessions' and contexts' state lives between turns and
across restarts. Several directories (one per device), slab files of fixed slots,
a SQLite manifest, two-stage saving (staging ring -> packer -> per-directory
writers) and coalesced, checksummed reads. The store is a front over its parts:
placement, buffer pools, the packer and writer threads, the read pool and the stats."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import torch

from hcache.config import StorageConfig
from hcache.memory import aligned_buffer
from hcache.model.geometry import ModelConfig
from hcache.storage.buffers import LayerBuffers, chunk_pools
from hcache.storage.capacity import Space, dir_quota, release_order, to_release
from hcache.storage.dir_writer import DirWriter
from hcache.storage.errors import FingerprintMismatch, StorageError, StoreLocked
from hcache.storage.layout import (
    CHUNK_TOKENS,
    ChunkShape,
    Kind,
    Stored,
    StoredSpec,
    chunk_shapes,
    decode_layer_kinds,
    encode_layer_kinds,
    num_chunks,
    union_of,
)
from hcache.storage.manifest import OwnerRow, open_manifest
from hcache.storage.outbox import Outbox
from hcache.storage.packer import FlushTail, Forget, Packer
from hcache.storage.placement import Placement
from hcache.storage.prefixes import prefix_hashes
from hcache.storage.reader import OwnerReader, ReadParts, Want
from hcache.storage.readplan import ReadPlans, stored_wants
from hcache.storage.readpool import ReadPool
from hcache.storage.staging import Segment, StagedBatch, StagingRing
from hcache.storage.stats import DirUsage, StoreStats
from hcache.storage.throttle import TokenBucket

log = logging.getLogger(__name__)
MANIFEST = "manifest.sqlite"
LOCK = "hcache.lock"


class ChunkStore:
    def __init__(
        self,
        cfg: StorageConfig,
        model: ModelConfig,
        dtype: torch.dtype,
        device: str = "cpu",
        kv_dtype: torch.dtype | None = None,
    ):
        """H is stored in `dtype` (the activations'), KV in `kv_dtype` (the resident KV's;
        default `dtype`)."""
        if not cfg.dirs:
            raise ValueError("at least one storage directory is needed")
        self.cfg, self.model, self.dtype = cfg, model, dtype
        self.kv_dtype = kv_dtype or dtype
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
        try:
            self.manifest = open_manifest(self.dirs[0] / MANIFEST, self.dirs)
        except BaseException:
            os.close(self._lock_fd)
            raise
        self.shapes: dict[Kind, ChunkShape] = chunk_shapes(model, dtype, self.kv_dtype)
        self.lock = threading.Lock()  # creating and deleting owners
        self.stats = StoreStats(read_bytes_by_dir=[0] * len(self.dirs))
        self.placement = Placement(self.dirs, self.manifest, self.shapes, cfg, self.stats)
        self.placement.quota_bytes = dir_quota(cfg.quota_bytes, cfg.max_bytes, len(self.dirs))
        self.chunk_buffers = chunk_pools(self.shapes)
        pinned = torch.device(device).type == "cuda" and torch.cuda.is_available()
        self.buffers = LayerBuffers(pinned, cfg.prefetch_bytes, cfg.prefetch_layers, self.stats)
        self.throttle = TokenBucket(cfg.read_cap_gbps * 1e9)
        self.ring = StagingRing(
            cfg.staging_bytes, model.hidden_size, model.kv_dim, dtype, torch.device(device), self.kv_dtype
        )
        self.writers = [
            DirWriter(i, path, self.placement, self.shapes, self.chunk_buffers, cfg.fsync_group_bytes)
            for i, path in enumerate(self.dirs)
        ]
        self.packer = Packer(
            self.manifest, self.placement, self.shapes, self.chunk_buffers, self.ring, self.writers, self.stats
        )
        # unwanted slots inside a request are at most two in a row (plan_requests' max_gap)
        discard = 2 * max(sh.slot_bytes for sh in self.shapes.values())
        self.reads = ReadPool(len(self.dirs), cfg.read_depth, cfg.max_request_bytes, aligned_buffer, discard)
        self._read_parts = ReadParts(
            self.shapes, self.placement, self.reads, self.buffers, self.throttle, self.stats, self.cfg
        )
        self._plans = ReadPlans(self.placement, {s.slab: s.slot_bytes for s in self.shapes.values()}, cfg)
        self.outbox = Outbox(self.packer.inbox)
        for t in (self.packer, *self.writers):
            t.start()
        self._closed = False

    @property
    def on_flush(self) -> Callable[[int, float], None] | None:
        """Called with (directory, seconds) after each group a writer wrote and committed."""
        return self.writers[0].on_flush

    @on_flush.setter
    def on_flush(self, fn: Callable[[int, float], None] | None) -> None:
        for w in self.writers:
            w.on_flush = fn

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
            self.placement.add_owner(owner)

    def owner_row(self, owner: str) -> OwnerRow:
        return self.manifest.owner(owner)

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
        Fill `batch.hidden[layer]` / `batch.kv[layer]`, or each kind's layers at once through
        `batch.hidden_all` / `batch.kv_all`, then `submit`."""
        need = union_of(frozenset(self.manifest.owner_layer_kinds(owner) for owner, *_ in segments))
        total = sum(n for *_, n in segments)
        batch = self.ring.acquire(total, need, before_wait=self.send_held)
        row = 0
        for owner, start, n in segments:
            batch.segments.append(Segment(owner, start, n, row))
            row += n
        self.stats.ring_waits, self.stats.ring_wait_seconds = self.ring.waits, self.ring.wait_seconds
        return batch

    def submit(self, batch: StagedBatch, hold: bool = False) -> None:
        """Stage 2 takes the batch; `hold`: a decode step's, sent with others (`Outbox`)."""
        self.outbox.submit(batch, hold)

    def send_held(self) -> None:
        """Held decode batches to the packer now (the engine idles, or the ring is full)."""
        self.outbox.send()

    def save_rows(self, owner: str, start: int, hidden: dict[int, torch.Tensor], kv: dict[int, torch.Tensor]) -> None:
        """Convenience for one owner: stage rows given per layer (H `[n, hidden]`, KV `[n, 2, kv_dim]`)."""
        n = next(iter(hidden.values() or kv.values())).shape[0]
        row_bytes = len(hidden) * self.shapes[Kind.HIDDEN].nbytes + len(kv) * self.shapes[Kind.KV].nbytes
        row_bytes //= CHUNK_TOKENS
        step = max(1, self.ring.capacity // (2 * max(1, row_bytes)))  # pieces the ring can hold
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            batch = self.acquire([(owner, start + lo, hi - lo)])
            for layer, t in batch.hidden.items():
                t.copy_(hidden[layer][lo:hi])
            for layer, t in batch.kv.items():
                t.copy_(kv[layer][lo:hi])
            self.submit(batch)

    def stage_rows(
        self,
        owner: str,
        start: int,
        hidden: dict[int, torch.Tensor],
        kv: dict[int, torch.Tensor],
        on_packed: Callable[[], None] | None = None,
    ) -> None:
        """Like `save_rows`, without the ring: the rows (every layer and kind the owner stores)
        are packed from the given tensors, which must stay unchanged until `on_packed` is
        called (from the packer's thread). Never waits for ring room, so a large batch goes
        behind the rows before it at once."""
        n = next(iter(hidden.values() or kv.values())).shape[0]
        batch = StagedBatch(-1, 0, n, hidden, kv, [Segment(owner, start, n, 0)], in_ring=False, on_packed=on_packed)
        self.outbox.send(batch)

    def mark_durable(
        self, owner: str, tokens: list[int], meta: dict | None = None, index_as: str | None = None
    ) -> None:
        """End of a turn: write the tail chunks, wait for every chunk of the owner to be
        committed, then record the token ids (and `meta`). Returns only when the turn is durable.
        `index_as`: a namespace (the tenant) under which later conversations that extend these
        tokens find them (`find_prefix`)."""
        self.owner_row(owner)
        done: Future = Future()
        self.outbox.send(FlushTail(owner, done))
        pending, staged = done.result()
        for f in pending:
            f.result()  # a failed write raises here: the turn is not durable
        err = self.packer.errors.pop(owner, None)
        if err is not None:
            raise StorageError(f"saving {owner} failed: {err}") from err
        if staged != len(tokens):
            raise ValueError(f"owner {owner}: {len(tokens)} token ids for {staged} staged rows")
        self.manifest.set_tokens(owner, tokens, meta, None if index_as is None else prefix_hashes(tokens, index_as))

    def find_prefix(self, tokens: list[int], namespace: str) -> list[tuple[str, int]]:
        """(owner, n) of the owners indexed under `namespace` whose durable tokens may start
        with `tokens[:n]` (whole chunks; a hash match: compare the tokens), longest first."""
        return self.manifest.find_prefixes(prefix_hashes(tokens, namespace))

    def fork(self, parent: str, child: str, n: int, meta: dict, index_as: str | None = None) -> OwnerRow:
        """A new session `child` whose first `n` tokens share the parent's stored chunks: nothing
        is copied, and what either writes later goes to fresh slots (a partly shared last chunk
        is refilled copy-on-write, as after a truncation). The caller keeps the parent quiet
        meanwhile (no turn, no release): its committed chunks are read."""
        with self.lock:
            if self.manifest.get_owner(child) is not None:
                raise ValueError(f"owner {child} already exists")
            tokens = self.owner_row(parent).tokens[:n]
            prefixes = None if index_as is None else prefix_hashes(tokens, index_as)
            return self.placement.fork(parent, child, meta, n, prefixes)

    def truncate(self, owner: str, n: int) -> None:
        """Forget tokens past `n` (a conversation rewritten from there). Durable at once."""
        row = self.owner_row(owner)
        if n > row.num_tokens:
            raise ValueError(f"owner {owner} has {row.num_tokens} durable tokens, cannot keep {n}")
        self._forget(owner)
        self.manifest.set_tokens(owner, row.tokens[:n])

    def delete(self, owner: str, expired: bool = False) -> None:
        """Delete the owner, records included; `expired` (idle too long) leaves a tombstone
        so that asking for it later says why it is gone."""
        self.owner_row(owner)
        self._forget(owner)
        with self.lock:
            self.placement.drop_owner(owner, expired)

    def expired(self, owner: str) -> tuple[str | None, float] | None:
        """(tenant, Unix time) when the owner was deleted for being idle, or None."""
        return self.manifest.expired(owner)

    def prune_expired(self, before: float) -> int:
        """Forget owners expired before `before` (Unix time): asked for, they are not found."""
        return self.manifest.prune_expired(before)

    # --- capacity ---------------------------------------------------------------
    def space(self) -> Space:
        """Capacity and use over every directory (a directory without a quota: what its
        filesystem still has free, plus what the store holds there). Extents reserved ahead
        count as free: a full store takes them back."""
        capacity = used = 0
        quota = self.placement.quota_bytes
        for d, path in enumerate(self.dirs):
            occupied = self.placement.occupied(d)
            used += self.placement.in_use(d)
            capacity += quota or occupied + shutil.disk_usage(path).free
        return Space(capacity, used)

    def bytes_for(self, owner: str, start: int, n: int) -> int:
        """At most what saving `n` more rows of the owner from `start` takes: the chunks they
        touch, and the copy-on-write tail's fresh slot, in every layer and kind it stores."""
        if n <= 0:
            return 0
        per_chunk = sum(self.shapes[k].slot_bytes for ks in self.layer_kinds(self.owner_row(owner)) for k in ks)
        return (num_chunks(start % CHUNK_TOKENS + n) + 1) * per_chunk

    def stored_bytes(self, owner: str) -> int:
        """The bytes of the owner's committed chunks (what releasing all of it would free,
        besides the extents reserved for it)."""
        index = self.placement.chunk_index(owner)
        return sum(len(rows) * self.shapes[Kind(kind)].slot_bytes for (_, kind), rows in index.items())

    def release(self, owner: str, nbytes: int) -> int:
        """Give up the owner's stored layers, in `release_order`, until at least `nbytes` are
        free (or it stores nothing). Token ids and records stay: what is given up is restored
        by recompute. The caller makes sure nothing reads or writes the owner meanwhile.
        Returns the bytes freed."""
        kinds = self.layer_kinds(self.owner_row(owner))
        index = self.placement.chunk_index(owner)
        held: dict[tuple[int, Kind], int] = {}
        for layer, kind in release_order(kinds):
            held[(layer, kind)] = len(index.get((layer, kind.value), {})) * self.shapes[kind].slot_bytes
        drop = to_release(held, nbytes)
        if not drop:
            return 0
        left = [ks - {k for la, k in drop if la == layer} for layer, ks in enumerate(kinds)]
        with self.lock:
            freed = self.placement.release_layers(owner, drop, encode_layer_kinds(left))
        self._forget(owner)  # the packer's state of the owner still lists what it gave up
        self.stats.count_release(freed, len(drop))
        return freed

    def _forget(self, owner: str) -> None:
        """Wait for the owner's queued writes, then drop its packing state and write versions."""
        drained: Future = Future()
        self.outbox.send(FlushTail(owner, drained, write_tail=False))
        pending, _ = drained.result()
        for f in pending:
            f.exception()  # wait; a failed write of state being dropped does not matter
        done: Future = Future()
        self.outbox.send(Forget(owner, done))
        done.result()
        self.placement.forget_versions(owner)

    # --- reading ----------------------------------------------------------------
    def reader(
        self,
        owner: str,
        layers: list[int] | None = None,
        window: int | None = None,
        wants: list[Want] | None = None,
        into: dict[tuple[int, Kind], torch.Tensor] | None = None,
    ) -> OwnerReader:
        """Read every stored kind of `layers` (default: all), or exactly `wants`, up to the
        durable tokens; `into` is where wants land in the caller's memory (`OwnerReader`)."""
        row = self.owner_row(owner)
        if wants is None:
            wants = stored_wants(self.layer_kinds(row), layers, row.num_tokens)
        elif any(w.hi > row.num_tokens for w in wants):
            raise ValueError(f"owner {owner} has {row.num_tokens} durable tokens")
        plan = self._plans.plan(owner, wants)
        return OwnerReader(owner, wants, window or self.cfg.prefetch_layers, plan, self._read_parts, into)

    def read_chunk(self, owner: str, layer: int, idx: int, kind: Kind) -> torch.Tensor:
        """One whole chunk (all 64 rows of its slot), checked."""
        return self.placement.read_chunk(self.shapes[kind], self.stats, owner, layer, idx)

    def set_read_cap(self, gbps: float) -> None:
        """Cap restore reads at `gbps` GB/s (0 lifts the cap)."""
        self.cfg.read_cap_gbps = gbps
        self.throttle.set_rate(gbps * 1e9)

    def set_quota(self, nbytes: int) -> None:
        """Each directory's quota from now on (0: the filesystem's free space is the limit)."""
        self.cfg.quota_bytes = nbytes
        self.placement.quota_bytes = dir_quota(nbytes, self.cfg.max_bytes, len(self.dirs))

    # --- accounting -------------------------------------------------------------
    def usage(self) -> list[DirUsage]:
        out = []
        for d, path in enumerate(self.dirs):
            used, slab_bytes, chunks = self.placement.dir_usage(d)
            free, written = shutil.disk_usage(path).free, self.writers[d].bytes_written
            out.append(DirUsage(str(path), used, slab_bytes, self.placement.quota_bytes, free, chunks, written))
        return out

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.send_held()
            self.packer.inbox.put(None)
            self.packer.join()
            for w in self.writers:
                w.inbox.put(None)
            for w in self.writers:
                w.join()
            self.reads.close()
            self.ring.close()
        self.placement.close()
        self.manifest.close()
        os.close(self._lock_fd)

    def __enter__(self) -> ChunkStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
