"""How a request ends. A finished turn becomes durable off the loop thread (the
manifest commit waits for its chunks; then `Sharing.commit`, in cluster mode the cluster's
record under the turn's lease), then its stream's last event goes out and the session takes
requests again; a failed one takes the session back to its last durable turn, which is
what the store holds."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from hcache.engine.errors import EngineError, ResourceExhausted
from hcache.engine.parts import Parts
from hcache.engine.sequence import Event, Sequence
from hcache.engine.session import SessionMeta
from hcache.storage.catalogue import Lease
from hcache.storage.errors import StorageError, StorageFull

log = logging.getLogger(__name__)


DURABLE_THREADS = 4  # turns made durable at once (record commits wait on the cluster)


class Finisher:
    def __init__(self, parts: Parts, decode: Callable[[list[int]], str]):
        self.parts, self.decode = parts, decode
        self.store, self.scheduler, self.lock, self.sharing = parts.store, parts.scheduler, parts.lock, parts.sharing
        self._pool = ThreadPoolExecutor(max_workers=DURABLE_THREADS, thread_name_prefix="hcache-durable")

    def finish(self, seq: Sequence, reason: str) -> None:
        """Called under the lock when the request's work is done."""
        self.scheduler.finished(seq)
        seq.finish_reason = reason
        s = seq.session
        s.last_used = time.monotonic()
        if seq.restore_only:
            s.busy = False
            seq.done.set()
            return
        if seq.sample:
            seq.end_turn(self.decode)
        s.updated = time.time()
        self._pool.submit(self._make_durable, seq, list(s.own_tokens), s.meta.to_dict())

    def _make_durable(self, seq: Sequence, tokens: list[int], meta: dict) -> None:
        s = seq.session
        try:
            self.store.mark_durable(s.id, tokens, meta, s.index_as)
        except Exception as e:
            log.error("turn of %s not durable: %s", s.id, e)
            full = isinstance(e, StorageFull)
            self.fail(
                seq,
                ResourceExhausted(f"storage is full: {e}")
                if full
                else EngineError(f"the turn could not be saved: {e}"),
            )
            return
        try:
            self.sharing.commit(seq, tokens, meta)
        except StorageError as e:  # ABORTED (taken over) or UNAVAILABLE: not acknowledged
            log.error("turn of %s not committed to the cluster: %s", s.id, e)
            self.fail(seq, e)
            return
        with self.lock:
            s.history = None
            s.busy = False
            stats = seq.turn_stats()
            if not seq.sample and s.kind == "context":
                self.scheduler.evict(s)  # a context is read from storage by the sessions that use it
        seq.events.put(Event(finished=True, finish_reason=seq.finish_reason, stats=stats))
        seq.done.set()
        self.parts.turn_ended()

    def fail(self, seq: Sequence, err: Exception) -> None:
        with self.lock:
            self.scheduler.finished(seq)
            if seq.job is not None:
                self._rollback(seq)
            else:
                seq.session.meta.mode = seq.prev_mode
                seq.session.drop_fetched()  # (rows are staged only once the job runs)
            seq.session.busy = False
        lease, seq.lease = seq.lease, None
        if lease is None:
            self._report(seq, err)
        else:  # a network call, never under the lock (nor on the loop's thread)
            self._pool.submit(self._release_then_report, seq, lease, err)

    def _release_then_report(self, seq: Sequence, lease: Lease, err: Exception) -> None:
        """The lease goes before the error does: a client that retries at once must not find
        the session still leased to its failed turn."""
        try:
            self.sharing.release(lease)
        except Exception as e:  # the lease then expires on its own
            log.warning("lease of %s not released: %s", seq.session.id, e)
        finally:
            self._report(seq, err)

    @staticmethod
    def _report(seq: Sequence, err: Exception) -> None:
        seq.error = err
        seq.events.put(Event(error=err))
        seq.done.set()

    def _rollback(self, seq: Sequence) -> None:
        """The session becomes what its last durable turn left (the store's word)."""
        s = seq.session
        self.scheduler.evict(s)
        try:
            row = self.store.owner_row(s.id)
            self.store.truncate(s.id, row.num_tokens)  # drops staged rows of the failed turn
        except StorageError:
            log.exception("reloading %s after a failed turn", s.id)
            return
        s.tokens = s.tokens[: s.base] + row.tokens
        s.meta = SessionMeta.from_dict(row.meta)

    def close(self) -> None:
        """Waits for the turns being made durable."""
        self._pool.shutdown(wait=True)
