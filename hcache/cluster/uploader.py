"""Chunks follow the turn to the cluster: once a turn is durable here (and committed to the
record), its new chunks are read back from the local store, checked, and put in the
cluster by one background thread, pipelined. Nothing waits for it: a full queue drops the
turn's upload (counted), and a chunk the cluster lacks is recomputed by whoever needs it."""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field

import torch

from hcache.cluster.tier import ChunkTier, chunk_key, chunk_rows, pack, prefix_hash
from hcache.storage.errors import StorageError
from hcache.storage.layout import CHUNK_TOKENS, num_chunks
from hcache.storage.store import ChunkStore

log = logging.getLogger(__name__)
UNREACHABLE_HINT = "chunks stay local; other replicas recompute what they lack"


@dataclass
class UploadCounters:
    chunks: int = 0  # chunks put in the cluster
    bytes: int = 0
    dropped: int = 0  # turns whose upload was dropped: the queue was full (the cluster is slow)
    failed: int = 0  # turns whose upload failed (unreachable cluster, owner gone, bad chunk)
    pending: int = 0  # turns queued now


@dataclass(frozen=True)
class Upload:
    owner: str
    tokens: list[int] = field(repr=False)  # the owner's token ids as of the durable turn
    first: int  # the first token this turn wrote (earlier chunks are in the cluster already)


class ChunkUploader:
    def __init__(self, store: ChunkStore, tier: ChunkTier, max_pending: int = 64, batch_bytes: int = 8 << 20):
        self.store, self.tier, self.batch_bytes = store, tier, batch_bytes
        self.counters = UploadCounters()
        self._q: queue.Queue[Upload | None] = queue.Queue(max_pending)
        self._idle = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="hcache-chunk-upload", daemon=True)
        self._thread.start()

    def offer(self, owner: str, tokens: list[int], first: int) -> bool:
        """Queue the turn's chunks; False (and counted) when the queue is full."""
        with self._idle:
            self.counters.pending += 1
        try:
            self._q.put_nowait(Upload(owner, list(tokens), max(0, first)))
        except queue.Full:
            with self._idle:
                self.counters.pending -= 1
                self.counters.dropped += 1
            return False
        return True

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued upload is done (tests, benchmarks, shutdown)."""
        with self._idle:
            return self._idle.wait_for(lambda: self.counters.pending == 0, timeout)

    def _run(self) -> None:
        while (job := self._q.get()) is not None:
            try:
                if self._closing:
                    raise StorageError("the replica is shutting down")  # not a minute per job on a dead cluster
                self._upload(job)
            except Exception as e:  # the cluster or the owner: either way, nothing to retry
                self.counters.failed += 1
                if not self._closing:
                    log.warning("uploading chunks of %s to %s: %s (%s)", job.owner, self.tier.url, e, UNREACHABLE_HINT)
            with self._idle:
                self.counters.pending -= 1
                self._idle.notify_all()

    def _upload(self, job: Upload) -> None:
        n = len(job.tokens)
        kinds = self.store.layer_kinds(self.store.owner_row(job.owner))
        items: list[tuple[str, bytes]] = []
        size = 0
        for idx in range(job.first // CHUNK_TOKENS, num_chunks(n)):
            rows = chunk_rows(n, idx)
            end = idx * CHUNK_TOKENS + rows
            got = []
            for layer, ks in enumerate(kinds):
                for kind in sorted(ks):
                    whole = self.store.read_chunk(job.owner, layer, idx, kind)[:rows]
                    got.append((chunk_key(job.owner, layer, kind, idx), whole.view(torch.uint8).numpy().tobytes()))
            # read first, then check: a rewrite of these tokens truncates the record before it
            # writes new rows, so rows read before the check are this prefix's
            if self.store.owner_row(job.owner).tokens[:end] != job.tokens[:end]:
                raise StorageError(f"owner {job.owner} was rewritten while its chunks were read")
            pre = prefix_hash(job.tokens[:end])
            for key, raw in got:
                items.append((key, pack(raw, rows, pre)))
                size += len(raw)
            if size >= self.batch_bytes:
                self._put(items, size)
                items, size = [], 0
        if items:
            self._put(items, size)

    def _put(self, items: list[tuple[str, bytes]], size: int) -> None:
        self.tier.put(items)
        self.counters.chunks += len(items)
        self.counters.bytes += size

    def close(self) -> None:
        """What is still queued is dropped (counted as failed): other replicas recompute it."""
        self._closing = True
        self._q.put(None)
        self._thread.join()
