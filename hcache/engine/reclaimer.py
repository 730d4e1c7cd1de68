"""The store's capacity, kept in the background: when free space falls below the low
watermark, the chunks of the least recently used idle sessions are given up (the store's
`release`, cheapest layers first) until it is back at the high watermark; with a TTL,
sessions idle longer than that are deleted, records included. Nothing here runs on a
turn's path: a session is picked under the engine's lock, marked `releasing` (a request
for it waits, briefly, in `settle`) and released outside the lock.

A session with a turn running (restoring, computing, or not yet durable) is never
touched. An idle resident session is evicted from memory first, as the scheduler's LRU
eviction does (its state is durable, so that is free), and released only once nothing idle
and not resident is left: resident sessions can hold far more state than a small store, and
would otherwise pin it. For a turn waiting for room, sessions whose turn is only queued
come after those (else they could pin the room it waits for): nothing of their turn has
run yet, and it plans its restore from what is left. Admission promises each turn the
space it may write, so turns running together never count the same free space twice."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

from hcache.engine.errors import ResourceExhausted
from hcache.engine.parts import Parts
from hcache.engine.sequence import Sequence
from hcache.engine.session import Session

log = logging.getLogger(__name__)
POLL_S = 0.5  # between checks when nothing wakes the reclaimer
ROOM_WAIT_S = 5.0  # a turn waits this long for released space, then tries anyway
# an expired session says so this long (a client back from a week away learns why), then
# its tombstone goes and it is simply not found: tombstones must not grow without bound
TOMBSTONE_KEEP_S = 7 * 86400.0
PRUNE_EVERY_S = 60.0


class Reclaimer:
    def __init__(self, parts: Parts):
        self.parts = parts
        self.store, self.registry, self.lock, self.settled = parts.store, parts.registry, parts.lock, parts.settled
        self.cfg, self.counters, self.scheduler = parts.cfg, parts.counters, parts.scheduler
        self.wake = parts.reclaim
        self._wanted = 0  # free bytes a waiting turn asked for
        self._promised: dict[int, tuple[Sequence, int, int]] = {}  # turn -> (bytes, its owner's bytes then)
        self._next_prune = 0.0  # monotonic time of the next tombstone pruning
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="hcache-reclaimer", daemon=True)
        self._thread.start()

    def want(self, nbytes: int) -> None:
        """A turn waits for `nbytes` of free space: release for it even above the low watermark."""
        self._wanted = max(self._wanted, nbytes)
        self.wake.set()

    def settle(self, session_id: str, tenant: str | None, kind: str = "session") -> Session:
        """The session, once no release holds it or its context (a release takes a few
        milliseconds). Called under the engine's lock; it may be gone afterwards (expired)."""
        while True:
            s = self.registry.get(session_id, kind, tenant)
            if not (s.releasing or self._reads_released(s)):
                return s
            self.settled.wait()

    def _reads_released(self, s: Session) -> bool:
        """Whether a context `s` reads is giving up chunks (a release takes milliseconds)."""
        return any((c := self.registry.sessions.get(cid)) is not None and c.releasing for cid in s.reads)

    def has_room(self, seq: Sequence) -> bool:
        """Whether the store has room for what the turn will save, beside what turns already
        admitted may still write; the turn's share is then promised to it until it ends.
        When there is no room, releases are asked for and the turn waits: for turns in
        flight to end (their sessions then become idle, so releasable), or ROOM_WAIT_S when
        none is (then it runs, and a full store refuses it as before). A turn bigger than the
        whole store is refused at once. Called under the engine's lock."""
        s = seq.session
        if s.releasing or self._reads_released(s):
            return False  # queued, its chunks are being given up for room: it reads what is left
        n = len(seq.new_tokens) + (seq.params.max_new_tokens if seq.sample else 0)
        need = self.store.bytes_for(s.id, seq.keep - s.base, n)
        if need == 0:
            return True
        space = self.store.space()
        if space.capacity and need > space.capacity:
            raise ResourceExhausted(
                f"this turn would store {need / 1e6:.1f} MB; the store's capacity is {space.capacity / 1e6:.1f} MB"
            )
        promised = self._promised_bytes()
        if space.free - promised >= need:
            self._promised[id(seq)] = (seq, need, self.store.stored_bytes(s.id))
            return True
        now = time.monotonic()
        seq.t_room = seq.t_room or now
        if not promised and now - seq.t_room > ROOM_WAIT_S:
            return True
        self.want(need + promised)
        return False

    def _promised_bytes(self) -> int:
        """What admitted turns not yet durable may still write: each one's promise, less
        what its session stored since."""
        total = 0
        for key, (seq, need, before) in list(self._promised.items()):
            if seq.done.is_set():
                del self._promised[key]
            else:
                total += max(0, need - (self.store.stored_bytes(seq.session.id) - before))
        return total

    def close(self) -> None:
        self._stop = True
        self.wake.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop:
            try:
                self.step()
            except Exception:  # a failed pass is retried at the next; serving goes on
                log.exception("reclaiming storage failed")
            self.wake.wait(POLL_S)
            self.wake.clear()

    def step(self) -> None:
        """One pass: expire, then release down to the high watermark."""
        if self.cfg.session_ttl_s > 0:
            self._expire()
        self._prune()  # with no TTL too: an earlier run's tombstones
        cfg = self.store.cfg
        space = self.store.space()
        wanted, self._wanted = self._wanted, 0
        need = max(space.to_release(cfg.low_watermark, cfg.high_watermark), wanted - space.free)
        for s in self._victims() if need > 0 else ():
            need -= self._release(s, need, queued_too=wanted > 0)
            if need <= 0:
                break
        if wanted:
            self.parts.work.set()  # the turn that waited for room looks again

    # --- retention ------------------------------------------------------------------
    def _expire(self) -> None:
        cutoff = time.time() - self.cfg.session_ttl_s
        with self.lock:
            old = [s for s in self.registry.sessions.values() if s.kind == "session" and s.updated < cutoff]
        for s in old:
            if not self._take(s, expiring=True):
                continue
            try:
                self.store.delete(s.id, expired=True)
                with self.lock:
                    del self.registry.sessions[s.id]
                    self.counters.expiries += 1
                log.info("session %s expired (idle over %gs)", s.id, self.cfg.session_ttl_s)
            finally:
                self._give_back(s)

    def _prune(self) -> None:
        now = time.monotonic()
        if now < self._next_prune:
            return
        self._next_prune = now + PRUNE_EVERY_S
        n = self.store.prune_expired(time.time() - TOMBSTONE_KEEP_S)
        if n:
            log.info("forgot %d expired sessions (expired over %gs ago)", n, TOMBSTONE_KEEP_S)

    # --- capacity ---------------------------------------------------------------------
    def _victims(self) -> Iterator[Session]:
        """Least recently used first: idle sessions not resident, then resident ones (evicted
        to be released), then those whose turn is queued, then contexts that sessions use."""
        with self.lock:
            owners = list(self.registry.sessions.values())
            used = {c for s in owners for c in s.reads}
            order = sorted(owners, key=lambda s: (s.id in used, s.busy, s.resident, s.last_used))
        yield from order

    def _release(self, s: Session, need: int, queued_too: bool) -> int:
        if not self._take(s, queued_too=queued_too):
            return 0
        try:
            return self.store.release(s.id, need)
        finally:
            self._give_back(s)

    def _take(self, s: Session, expiring: bool = False, queued_too: bool = False) -> bool:
        """Mark `s` as being worked on, if nothing uses it: no turn of it in flight, and for
        a context, no session on it busy or being released. With `queued_too` (a turn waits
        for room), a turn that is only queued does not count: nothing of it has run, and it
        waits while `releasing`. A resident one is evicted from memory first; one that
        stores nothing is left alone (evicting it would free nothing)."""

        def in_use(o: Session) -> bool:
            return o.releasing or (o.busy and not (queued_too and self.scheduler.queued(o)))

        with self.lock:
            if self.registry.sessions.get(s.id) is not s or in_use(s):
                return False
            if expiring and s.updated >= time.time() - self.cfg.session_ttl_s:
                return False  # a turn ended since it was listed
            if any(s.id in o.reads and in_use(o) for o in self.registry.sessions.values()):
                return False
            if not expiring and self.store.stored_bytes(s.id) == 0:
                return False
            self.scheduler.evict(s)  # idle, its state durable: dropping its memory loses nothing
            s.releasing = True
            return True

    def _give_back(self, s: Session) -> None:
        with self.lock:
            s.releasing = False
            self.settled.notify_all()
