"""Which sequence runs when: the queues by phase (waiting for blocks, prefilling, which
covers restoring, and decoding), admission against the block pool with LRU eviction of
idle resident sessions (their state is already stored, so eviction is free), and the
decode batch, round robin past `max_batch`. A sequence's phase changes here only, with the
queue it is in. The engine calls it under its lock."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator

from hcache.engine.block_pool import BLOCK_TOKENS, BlockPool, PagedCache
from hcache.engine.errors import ResourceExhausted
from hcache.engine.records import Counters, QueueDepth
from hcache.engine.sequence import Phase, Sequence
from hcache.engine.session import Session


class Scheduler:
    def __init__(self, pool: BlockPool, sessions: dict[str, Session], max_batch: int, counters: Counters):
        self.pool, self.sessions, self.max_batch, self.counters = pool, sessions, max_batch, counters
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []  # restoring, then prefilling
        self.decoding: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def queued(self, s: Session) -> bool:
        """Whether a turn of `s` waits for admission (nothing of it has started)."""
        return any(q.session is s for q in self.waiting)

    def idle(self) -> bool:
        return not (self.waiting or self.prefilling or self.decoding)

    def queue_depth(self) -> QueueDepth:
        restoring = sum(1 for q in self.prefilling if q.phase == Phase.RESTORING)
        return QueueDepth(len(self.waiting), restoring, len(self.prefilling) - restoring, len(self.decoding))

    # --- admission ---------------------------------------------------------------
    def blocks_for(self, seq: Sequence) -> int:
        """Blocks for everything the turn can hold: kept tokens, its prompt and its reply."""
        end = seq.keep + len(seq.new_tokens) + (seq.params.max_new_tokens if seq.sample else 0)
        return math.ceil(min(end, seq.max_tokens) / BLOCK_TOKENS)

    def admit(self) -> Iterator[tuple[Sequence, ResourceExhausted | None]]:
        """Waiting sequences in arrival order, each once its blocks are free, with the reason
        when it can never run; stops at the first that must wait for running ones. The caller
        takes each one's blocks (`allocate`) before asking for the next."""
        while self.waiting:
            seq = self.waiting[0]
            blocks = self.blocks_for(seq)
            if blocks > self.pool.num_blocks:
                self.waiting.popleft()
                yield (
                    seq,
                    ResourceExhausted(
                        f"this turn needs {blocks * BLOCK_TOKENS} tokens of KV memory; "
                        f"the budget holds {self.pool.num_blocks * BLOCK_TOKENS}"
                    ),
                )
                continue
            s = seq.session
            need = blocks - (len(s.cache.blocks) if s.cache else 0)
            if need > self.pool.num_free and not self._make_room(need, s):
                return  # running sequences free blocks when they finish
            self.waiting.popleft()
            yield seq, None

    def allocate(self, seq: Sequence) -> None:
        s = seq.session
        if s.cache is None:
            s.cache = PagedCache(self.pool)
        s.cache.reserve(self.blocks_for(seq) * BLOCK_TOKENS - s.cache.length)

    def _make_room(self, need: int, keep: Session) -> bool:
        idle = sorted(
            (s for s in self.sessions.values() if s.resident and not s.busy and s is not keep),
            key=lambda s: s.last_used,
        )
        for s in idle:
            if self.pool.num_free >= need:
                break
            self.evict(s)
        return self.pool.num_free >= need

    def evict(self, s: Session) -> None:
        if s.cache is not None:
            s.cache.free()
            s.cache = None
            self.counters.evictions += 1

    # --- running -----------------------------------------------------------------
    def decode_batch(self) -> list[Sequence]:
        return self.decoding[: self.max_batch]

    def rotate(self, batch: list[Sequence]) -> None:
        """Those that just decoded go behind those that waited (round robin past `max_batch`)."""
        ran = {id(q) for q in batch}
        self.decoding[:] = [q for q in self.decoding if id(q) not in ran] + [q for q in self.decoding if id(q) in ran]

    def to_prefill(self, seq: Sequence, restoring: bool) -> None:
        seq.phase = Phase.RESTORING if restoring else Phase.PREFILL
        self.prefilling.append(seq)

    def restored(self, seq: Sequence) -> None:
        """Its restore is done; its prompt's prefill runs on."""
        if seq.phase == Phase.RESTORING:
            seq.phase = Phase.PREFILL

    def to_decode(self, seq: Sequence) -> None:
        """After its first token: a sequence stays in a queue until it ends, so a failed step fails it."""
        self.prefilling.remove(seq)
        seq.phase = Phase.DECODE
        self.decoding.append(seq)

    def finished(self, seq: Sequence) -> None:
        """Done or failed: out of every queue."""
        for q in (self.prefilling, self.decoding):
            if seq in q:
                q.remove(seq)
        seq.phase = Phase.FINISHED
