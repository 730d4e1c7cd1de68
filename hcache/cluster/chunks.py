"""The engine's use of session chunks in the cluster (`--cluster` with `--cluster-chunks`):
after a turn is acknowledged its new chunks go up behind it; before a turn of a session
this replica lacks (or holds a stale turn of), the cluster's chunks come down into the
local store when fetching them beats recomputing them, priced with the cluster's read
bandwidth, measured once. Any chunk missing there is recomputed: exact either way."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from hcache.cluster.fetch import fetch, hydrate
from hcache.cluster.tier import ChunkTier
from hcache.cluster.uploader import ChunkUploader, UploadCounters
from hcache.engine.records import ChunkStats
from hcache.restore.profile import Profile
from hcache.storage.buffers import FetchBuffers
from hcache.storage.fetched import Fetched
from hcache.storage.store import ChunkStore

log = logging.getLogger(__name__)
POLICIES = ("auto", "always", "off")


@dataclass
class ChunkCounters:
    fetches: int = 0  # owners whose state (some of it) came from the cluster's chunks
    tokens: int = 0  # tokens whose state came from them
    bytes_read: int = 0
    misses: int = 0  # fetches cut short by a missing (evicted) or unusable chunk
    skipped: int = 0  # fetches priced slower than recomputing
    failed: int = 0  # fetches that could not complete (recomputed instead)
    read_gbps: float = 0.0  # the cluster's measured read bandwidth (0: not measured yet)


class ClusterChunks:
    def __init__(
        self, store: ChunkStore, tier: ChunkTier, profile: Profile, layers: int, bytes_per_token: int, policy: str
    ):
        if policy not in POLICIES:
            raise ValueError(f"cluster chunks: auto, always or off, not {policy!r}")
        self.store, self.tier, self.profile, self.policy = store, tier, profile, policy
        self.layers, self.bytes_per_token = layers, bytes_per_token
        self.counters = ChunkCounters()
        self.uploader = ChunkUploader(store, tier)
        self.buffers = FetchBuffers()
        self._measure = threading.Lock()

    @property
    def uploads(self) -> UploadCounters:
        return self.uploader.counters

    def after_turn(self, owner: str, tokens: list[int], first: int) -> None:
        """The acknowledged turn's chunks (own token index `first` on) go up in the background."""
        self.uploader.offer(owner, tokens, first)

    def read_gbps(self) -> float:
        """Measured on first use: the cluster's read bandwidth does not change per request."""
        with self._measure:
            if not self.counters.read_gbps:
                self.counters.read_gbps = self.tier.measure_gbps()
                log.info("cluster chunk reads: %.2f GB/s (%s)", self.counters.read_gbps, self.tier.url)
            return self.counters.read_gbps

    def worth_it(self, have: int, want: int) -> bool:
        """Fetch tokens `have:want` rather than recompute them? The fetch is priced at the
        cluster's bandwidth; the recompute as every layer's forward over those tokens."""
        if self.policy != "auto":
            return self.policy == "always"
        fetch_ms = (want - have) * self.bytes_per_token / (self.read_gbps() * 1e9) * 1e3
        recompute_ms = self.layers * (self.profile.re_ms(want) - self.profile.re_ms(have))
        return fetch_ms < recompute_ms

    def fetch(self, owner: str, own_tokens: list[int], meta: dict | None) -> int:
        """Bring the record's `own_tokens` past what the store holds into it, durable; returns
        how many came. Never raises: what does not come is recomputed."""
        got = self._fetch(owner, own_tokens, lambda: hydrate(self.store, self.tier, owner, own_tokens, meta))
        if got is None:
            return 0
        self.used(got)
        return got.tokens

    def fetch_rows(self, owner: str, own_tokens: list[int]) -> Fetched | None:
        """The record's `own_tokens` past what the store holds, as rows coming into memory in
        the background for the turn about to run to restore from as they come (it stages them
        into the store behind it); None when the cluster has none of them. Never raises: what
        does not come is recomputed. The turn calls `used`."""
        pool = self.buffers
        return self._fetch(owner, own_tokens, lambda: fetch(self.store, self.tier, owner, own_tokens, pool, True))

    def _fetch(self, owner: str, own_tokens: list[int], run: Callable[[], Fetched]) -> Fetched | None:
        have = self.store.owner_row(owner).num_tokens
        if self.policy == "off" or have >= len(own_tokens):
            return None
        try:
            if not self.worth_it(have, len(own_tokens)):
                self.counters.skipped += 1
                return None
            t0 = time.perf_counter()
            got = run()
            ms = (time.perf_counter() - t0) * 1e3
        except Exception as e:  # unreachable cluster, full disk: the turn recomputes instead
            self.counters.failed += 1
            log.warning("fetching chunks of %s from the cluster: %s; recomputing instead", owner, e)
            self._roll_back(owner, have)
            return None
        self.counters.misses += got.missing
        if not got.tokens:
            got.release()
            return None
        mb = got.bytes / 1e6
        log.info("fetching %d tokens of %s (%.1f MB) from the cluster (%.0f ms)", got.tokens, owner, mb, ms)
        self.counters.bytes_read += got.bytes
        return got

    def used(self, got: Fetched) -> None:
        """Fetched state went into a restore (a turn refused after its fetch drops it)."""
        self.counters.fetches += 1
        self.counters.tokens += got.tokens

    def _roll_back(self, owner: str, have: int) -> None:
        """Rows staged by a fetch that failed half-way are dropped: the store keeps its turn."""
        try:
            self.store.truncate(owner, have)
        except Exception:
            log.exception("dropping a failed fetch of %s", owner)

    def stats(self) -> ChunkStats:
        c, u = self.counters, self.uploads
        fetched = (c.fetches, c.tokens, c.bytes_read, c.misses, c.skipped, c.failed, c.read_gbps)
        return ChunkStats(*fetched, u.chunks, u.bytes, u.dropped, u.failed)

    def close(self) -> None:
        self.uploader.flush(10.0)
        self.uploader.close()
