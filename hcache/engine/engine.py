"""The serving engine: sessions, a block pool of resident KV, and one loop thread
that runs continuous batching. Each loop step admits waiting sequences (evicting
idle sessions by LRU when blocks run short: their state is already stored),
runs one batched decode step for every decoding sequence, and advances one
restore+prefill job by a layer, so a restoring session never stalls the others.
Everything that changes sessions or the pool happens under `self.lock`."""

from __future__ import annotations

import heapq
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch

from hcache.config import EngineConfig
from hcache.engine.block_pool import BLOCK_TOKENS, BatchCache, BlockPool, PagedCache
from hcache.engine.errors import EngineError, FailedPrecondition, InvalidArgument, ResourceExhausted, Unavailable
from hcache.engine.generate import common_prefix
from hcache.engine.prefill import PrefillJob
from hcache.engine.records import (
    Counters,
    EngineSnapshot,
    QueueDepth,
    RestoreResult,
    SessionMeta,
    SessionRow,
    StorageState,
)
from hcache.engine.sampler import Sampler, SamplingParams
from hcache.engine.saver import Saver, finish_decode
from hcache.engine.sequence import Event, Phase, Sequence, Session, TextStream
from hcache.engine.sessions import Registry, check_tokens, layer_kinds_for
from hcache.engine.telemetry import Telemetry
from hcache.malloc import trim_when_idle
from hcache.model.base import DecoderModel
from hcache.model.tokenizer import Tokenizer
from hcache.restore.plan import Method
from hcache.restore.profile import Profile
from hcache.storage.errors import StorageError, StorageFull
from hcache.storage.store import ChunkStore

log = logging.getLogger(__name__)
MAX_STOPS, MAX_STOP_CHARS = 16, 256
RECENT_SESSIONS = 200  # rows of the dashboard's session table


class Engine:
    def __init__(
        self,
        model: DecoderModel,
        tokenizer: Tokenizer,
        store: ChunkStore,
        profile: Profile,
        cfg: EngineConfig | None = None,
        model_name: str = "",
        telemetry: Telemetry | None = None,
    ):
        self.model, self.tok, self.store, self.profile = model, tokenizer, store, profile
        self.cfg = cfg or EngineConfig()
        self.model_name = model_name
        self.telemetry = telemetry or Telemetry()
        if self.cfg.restore_method != "auto":
            Method(self.cfg.restore_method)  # fail at start, not at the first restore
        per_block = BlockPool.bytes_per_block(model.cfg, model.dtype)
        self.pool = BlockPool(model.cfg, model.dtype, model.device, max(1, self.cfg.kv_budget_bytes // per_block))
        kinds = layer_kinds_for(self.cfg.store_kinds, model, profile, self.cfg.plan_tokens)
        self.registry = Registry(store, model, kinds)
        if self.cfg.read_cap_mbps:
            store.set_read_cap(self.cfg.read_cap_mbps)
        self.lock = threading.RLock()
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []
        self.decoding: list[Sequence] = []
        self.counters = Counters()
        self.draining = False
        self._wake = threading.Event()
        self._stop = False
        self._finisher = ThreadPoolExecutor(max_workers=4, thread_name_prefix="hcache-durable")
        self._thread = threading.Thread(target=self._loop, name="hcache-engine", daemon=True)
        self._thread.start()

    # --- public API (called from RPC threads) -------------------------------------
    def create_session(
        self,
        system_prompt: str = "",
        context_ids: list[str] | None = None,
        labels: dict[str, str] | None = None,
        tenant: str | None = None,
    ) -> Session:
        self._check_open()
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        with self.lock:
            self._check_session_limit(tenant)
            return self.registry.create("session", dict(labels or {}), list(context_ids or []), messages, tenant)

    def precompute_context(
        self,
        text: str = "",
        token_ids: list[int] | None = None,
        labels: dict[str, str] | None = None,
        tenant: str | None = None,
    ) -> Session:
        """Prefill a document once and store its state; returns when it is durable."""
        self._check_open()
        if bool(text) == bool(token_ids):
            raise InvalidArgument("give the context as text or as token_ids (exactly one)")
        ids = list(token_ids) if token_ids else self.tok.encode(text)
        check_tokens(ids, self.model.cfg.vocab_size)
        if not ids:
            raise InvalidArgument("the context is empty")
        if len(ids) > self.model.cfg.max_position:
            raise InvalidArgument(f"context of {len(ids)} tokens exceeds the model's {self.model.cfg.max_position}")
        with self.lock:
            self._check_storage(tenant, len(ids))
            ctx = self.registry.create("context", dict(labels or {}), [], [], tenant)
            ctx.busy = True
        seq = self._sequence(ctx, ids, 0, SamplingParams(max_new_tokens=1), [], sample=False)
        self._submit(seq)
        self._wait(seq)
        return ctx

    def generate(
        self,
        session_id: str,
        message: str = "",
        token_ids: list[int] | None = None,
        params: SamplingParams | None = None,
        stops: list[str] | None = None,
        tenant: str | None = None,
    ) -> Sequence:
        """Queue a turn; read `seq.events` (or iterate `stream(seq)`) for the reply."""
        self._check_open()
        params = params or SamplingParams(max_new_tokens=self.cfg.default_max_new_tokens)
        try:
            params.validate()
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        cap = self.model.cfg.max_position
        if params.max_new_tokens > cap:
            raise InvalidArgument(f"max_new_tokens {params.max_new_tokens} exceeds the model's context of {cap}")
        stops = list(stops or [])
        if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
            raise InvalidArgument(f"at most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} characters")
        if bool(message) == bool(token_ids):
            raise InvalidArgument("a turn is a non-empty message or a list of token_ids (exactly one)")
        with self.lock:
            s = self.registry.get(session_id, tenant=tenant)
            if s.busy:
                raise FailedPrecondition(f"session {session_id} is busy with another request")
            if s.error:
                raise FailedPrecondition(s.error)
            mode = "chat" if message else "tokens"
            if s.mode and s.mode != mode:
                raise InvalidArgument(f"session {session_id} takes {s.mode} turns, not {mode}")
            if message:
                msgs = [*s.messages, {"role": "user", "content": message}]
                ids = s.prefix + self.tok.encode_chat(msgs)
            else:
                ids = s.tokens + ([s.pending] if s.pending is not None else []) + list(token_ids or [])
            check_tokens(ids, self.model.cfg.vocab_size)
            if len(ids) > cap:
                raise InvalidArgument(f"prompt of {len(ids)} tokens exceeds the model's context of {cap}")
            keep = min(common_prefix(s.tokens, ids), len(ids) - 1)
            if keep < s.base:
                raise FailedPrecondition(f"session {session_id} no longer starts with its context")
            self._check_storage(tenant, len(ids) - len(s.tokens) + params.max_new_tokens)
            seq = self._sequence(s, ids[keep:], keep, params, stops, sample=True)
            seq.user_message = message or None
            if self.cfg.restore_method != "auto":
                seq.restore_method = Method(self.cfg.restore_method)
            s.mode = mode
            s.busy = True
        self._submit(seq)
        return seq

    def restore(self, session_id: str, method: Method | None = None, tenant: str | None = None) -> RestoreResult:
        """Make the session resident (again, from storage, when a method is forced)."""
        self._check_open()
        with self.lock:
            s = self.registry.get(session_id, tenant=tenant)
            if s.busy:
                raise FailedPrecondition(f"session {session_id} is busy with another request")
            if s.error:
                raise FailedPrecondition(s.error)
            if s.resident and method is None:
                return RestoreResult(already_resident=True, num_tokens=len(s.tokens))
            if not s.tokens:
                return RestoreResult(already_resident=s.resident)
            self._evict(s)
            seq = self._sequence(s, [], len(s.tokens), SamplingParams(max_new_tokens=1), [], sample=False)
            seq.restore_method, seq.restore_only = method, True
            s.busy = True
        self._submit(seq)
        self._wait(seq)
        assert seq.restored is not None
        return seq.restored

    def evict(self, session_id: str, tenant: str | None = None) -> Session:
        with self.lock:
            s = self.registry.get(session_id, tenant=tenant)
            if s.busy:
                raise FailedPrecondition(f"session {session_id} is busy with another request")
            self._evict(s)
            return s

    def delete(self, session_id: str, tenant: str | None = None) -> None:
        """Delete a session, or a context no session uses."""
        with self.lock:
            s = self.registry.sessions.get(session_id)
            kind = s.kind if s is not None else "session"
            s = self.registry.get(session_id, kind, tenant)  # NotFound for unknown ids and other tenants
            if s.busy:
                raise FailedPrecondition(f"{s.kind} {session_id} is busy with another request")
            self._evict(s)
            self.registry.delete(s)

    def get(self, session_id: str, tenant: str | None = None) -> Session:
        with self.lock:
            return self.registry.get(session_id, tenant=tenant)

    def list(self, kind: str = "session", tenant: str | None = None) -> list[Session]:
        """Sessions (or contexts) by id; only the tenant's own when a tenant is given."""
        with self.lock:
            mine = (s for s in self.registry.sessions.values() if s.kind == kind)
            return sorted((s for s in mine if tenant is None or s.tenant == tenant), key=lambda s: s.id)

    def stream(self, seq: Sequence) -> Iterator[Event]:
        while True:
            ev: Event = seq.events.get()
            if ev.error is not None:
                raise ev.error
            yield ev
            if ev.finished:
                return

    def cancel(self, seq: Sequence) -> None:
        seq.cancelled.set()
        self._wake.set()

    def drain(self, timeout: float) -> bool:
        """Refuse new work; wait for running sequences. True when everything finished."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if not (self.waiting or self.prefilling or self.decoding) and not any(
                    s.busy for s in self.registry.sessions.values()
                ):
                    return True
            time.sleep(0.05)
        return False

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join()
        self._finisher.shutdown(wait=True)

    def snapshot(self) -> EngineSnapshot:
        """The state GetStats, /metrics and the dashboard show, read at once."""
        storage = StorageState.of(self.store)  # disk usage, read outside the engine's lock
        per_block = BlockPool.bytes_per_block(self.model.cfg, self.model.dtype)
        with self.lock:
            owners = list(self.registry.sessions.values())
            sessions = [s for s in owners if s.kind == "session"]
            recent = heapq.nlargest(RECENT_SESSIONS, owners, key=lambda s: s.last_used)
            restoring = sum(1 for q in self.prefilling if q.phase == Phase.RESTORING)
            return EngineSnapshot(
                time=time.time(),
                model=self.model_name,
                draining=self.draining,
                counters=replace(self.counters),
                queue=QueueDepth(len(self.waiting), restoring, len(self.prefilling) - restoring, len(self.decoding)),
                sessions=len(sessions),
                contexts=len(owners) - len(sessions),
                resident_sessions=sum(s.resident for s in sessions),
                resident_bytes=(self.pool.num_blocks - self.pool.num_free) * per_block,
                budget_bytes=self.pool.num_blocks * per_block,
                recent=[SessionRow.of(s) for s in recent],
                storage=storage,
            )

    # --- helpers -------------------------------------------------------------------
    def _check_session_limit(self, tenant: str | None) -> None:
        limit = self.cfg.max_sessions_per_tenant
        if tenant is not None and limit:
            n = sum(1 for s in self.registry.sessions.values() if s.tenant == tenant and s.kind == "session")
            if n >= limit:
                raise ResourceExhausted(f"this API key already has {n} sessions (the limit is {limit})")

    def _check_storage(self, tenant: str | None, more_tokens: int) -> None:
        """Refuse work that could take a tenant's stored state past its quota."""
        limit = self.cfg.max_storage_bytes_per_tenant
        if tenant is None or not limit:
            return
        used = sum(len(s.own_tokens) for s in self.registry.sessions.values() if s.tenant == tenant)
        per_token = self.registry.bytes_per_token()
        if (used + more_tokens) * per_token > limit:
            raise ResourceExhausted(
                f"this API key stores {used * per_token / 1e6:.1f} MB; this request could take it past "
                f"its {limit / 1e6:.1f} MB quota (delete sessions to make room)"
            )

    def _check_open(self) -> None:
        if self.draining:
            raise Unavailable("the server is draining; retry on another instance")

    def _sequence(
        self, s: Session, new: list[int], keep: int, params: SamplingParams, stops: list[str], sample: bool
    ) -> Sequence:
        stop_ids = set() if params.ignore_eos else set(self.tok.stop_ids)
        seq = Sequence(s, new, keep, params, stops, stop_ids, self.model.cfg.max_position, sample=sample)
        seq.text = TextStream(self.tok.decode, stops)
        seq.prev_mode = s.mode
        return seq

    def _submit(self, seq: Sequence) -> None:
        with self.lock:
            self.waiting.append(seq)
        self._wake.set()

    def _wait(self, seq: Sequence) -> None:
        seq.done.wait()
        if seq.error is not None:
            raise seq.error

    def _evict(self, s: Session) -> None:
        if s.cache is not None:
            s.cache.free()
            s.cache = None
            self.counters.evictions += 1

    # --- the loop ------------------------------------------------------------------
    def _loop(self) -> None:
        if self.model.device.type == "cpu":
            torch.set_grad_enabled(False)
        with torch.inference_mode():
            while not self._stop:
                try:
                    with self.lock:
                        worked = self._step()
                except Exception:  # a bug must not kill the loop silently: fail what was running
                    log.exception("engine step failed")
                    with self.lock:
                        for seq in [*self.prefilling, *self.decoding]:
                            self._fail(seq, EngineError("internal error in the engine; see the server log"))
                    worked = True
                if not worked:
                    trim_when_idle()
                    self._wake.wait(0.05)
                    self._wake.clear()

    def _step(self) -> bool:
        worked = self._admit()
        if self.decoding:
            self._decode()
            worked = True
        return self._advance_prefill() or worked

    def _blocks_for(self, seq: Sequence) -> int:
        end = seq.keep + len(seq.new_tokens) + (seq.params.max_new_tokens if seq.sample else 0)
        return math.ceil(min(end, seq.max_tokens) / BLOCK_TOKENS)

    def _admit(self) -> bool:
        worked = False
        while self.waiting:
            seq = self.waiting[0]
            s = seq.session
            blocks = self._blocks_for(seq)
            need = blocks - (len(s.cache.blocks) if s.cache else 0)
            if blocks > self.pool.num_blocks:
                self.waiting.popleft()
                self._fail(
                    seq,
                    ResourceExhausted(
                        f"this turn needs {blocks * BLOCK_TOKENS} tokens of KV memory; "
                        f"the budget holds {self.pool.num_blocks * BLOCK_TOKENS}"
                    ),
                )
                continue
            if need > self.pool.num_free and not self._make_room(need, s):
                break  # wait for running sequences to finish
            self.waiting.popleft()
            try:
                self._start(seq)
            except EngineError as e:
                self._fail(seq, e)
            except StorageError as e:
                self._fail(seq, FailedPrecondition(str(e)))
            worked = True
        return worked

    def _make_room(self, need: int, keep: Session) -> bool:
        idle = sorted(
            (s for s in self.registry.sessions.values() if s.resident and not s.busy and s is not keep),
            key=lambda s: s.last_used,
        )
        for s in idle:
            if self.pool.num_free >= need:
                break
            self._evict(s)
        return self.pool.num_free >= need

    def _start(self, seq: Sequence) -> None:
        s = seq.session
        seq.t_start = time.perf_counter()
        plan = source = None
        if s.cache is None and seq.keep:
            cap = self.cfg.read_cap_mbps / 1000 if self.cfg.read_cap_mbps else None
            plan, seq.predicted_ms = self.registry.plan(s, seq.keep, self.profile, seq.restore_method, cap)
        if seq.keep < len(s.tokens):  # the conversation was re-rendered differently: drop the rest
            if s.cache is not None:
                s.cache.truncate(seq.keep)
            self.store.truncate(s.id, seq.keep - s.base)
            del s.tokens[seq.keep :]
        if plan is not None:
            source = self.registry.source(s, seq.keep)
            seq.plan = plan
        if s.cache is None:
            s.cache = PagedCache(self.pool)
        s.cache.reserve(self._blocks_for(seq) * BLOCK_TOKENS - s.cache.length)
        saver = Saver(self.store, s.id, s.base) if seq.new_tokens else None
        seq.job = PrefillJob(
            self.model,
            s.cache,
            s.tokens[: seq.keep],
            seq.new_tokens,
            plan,
            source,
            saver,
            self.cfg.piece_tokens,
            self.cfg.fused,
        )
        if plan is not None:
            s.cache.length = 0
        seq.steps = seq.job.run()
        seq.sampler = Sampler(seq.params)
        seq.phase = Phase.RESTORING if plan is not None else Phase.PREFILL
        s.last_used = time.monotonic()
        self.prefilling.append(seq)

    def _advance_prefill(self) -> bool:
        """Restore+prefill work, a layer at a time. While others decode, a time slice per step
        (their TBT grows by at most about the slice plus one layer); otherwise until every
        job waits on storage."""
        worked = False
        deadline = time.perf_counter() + self.cfg.prefill_slice_ms / 1e3 if self.decoding else math.inf
        for seq in list(self.prefilling):
            while time.perf_counter() < deadline:
                try:
                    did = next(seq.steps)
                except StopIteration:
                    self.prefilling.remove(seq)
                    self._prefilled(seq)
                    worked = True
                    break
                except Exception as e:
                    self.prefilling.remove(seq)
                    log.exception("prefill of %s failed", seq.session.id)
                    self._fail(seq, e if isinstance(e, EngineError) else EngineError(f"prefill failed: {e}"))
                    worked = True
                    break
                if not did:  # storage is behind: let the next job or a decode step run
                    if not self.decoding and seq.job is not None:
                        seq.job.wait_storage(0.005)  # nothing else to run: block on the read a moment
                        worked = True
                    break
                worked = True
                if seq.phase == Phase.RESTORING and seq.job is not None and seq.job.report.restore_ms:
                    seq.phase = Phase.PREFILL
            if time.perf_counter() >= deadline:
                break
        return worked

    def _prefilled(self, seq: Sequence) -> None:
        s, job = seq.session, seq.job
        assert job is not None
        rep = job.report
        s.tokens[seq.keep :] = seq.new_tokens
        if seq.plan is not None:
            self.counters.restores += 1
            self.counters.fallback_layers += rep.fallback_layers
            s.last_plan, s.last_restore_ms = seq.plan, rep.restore_ms
            counts = seq.plan.counts()
            mix = "+".join(m.short for m in Method if counts[m.value])
            self.telemetry.on_restore(mix, seq.plan.mix(), rep.restore_ms)
        if seq.restore_only:
            seq.restored = seq.restore_result()
        if seq.restore_only or not seq.sample:
            self._finish(seq, "restored" if seq.restore_only else "stored")
            return
        assert job.last_hidden is not None and seq.sampler is not None
        token = seq.sampler(self.model.logits(job.last_hidden)[0])
        seq.t_first = time.perf_counter()
        self.telemetry.on_ttft((seq.t_first - seq.t_submit) * 1e3)
        seq.phase = Phase.DECODE
        self.decoding.append(seq)
        self._emit(seq, token)

    def _decode(self) -> None:
        batch = self.decoding[: self.cfg.max_batch]
        m = self.model
        caches = [q.session.cache for q in batch]
        positions = [q.position for q in batch]
        tokens = torch.tensor([q.generated[-1] for q in batch], device=m.device)
        staged = self.store.acquire([(q.session.id, q.position - q.session.base, 1) for q in batch])
        bc = BatchCache(caches, [1] * len(batch))  # type: ignore[arg-type]
        h = m(tokens, torch.tensor(positions, device=m.device), bc, hidden_out=staged.hidden)  # type: ignore[arg-type]
        finish_decode(self.store, staged, caches, positions)  # type: ignore[arg-type]
        logits = m.logits(h)
        now = time.perf_counter()
        for i, q in enumerate(batch):
            q.session.tokens.append(q.generated[-1])
            assert q.sampler is not None
            q.tbt_ms.append((now - q.t_last) * 1e3)
            self.telemetry.on_tbt(q.tbt_ms[-1])
            self._emit(q, q.sampler(logits[i]))
        self.decoding = self.decoding[len(batch) :] + self.decoding[: len(batch)]  # round robin past max_batch

    def _emit(self, seq: Sequence, token: int) -> None:
        seq.generated.append(token)
        seq.t_last = time.perf_counter()
        self.counters.generated_tokens += 1
        assert seq.text is not None
        text = "" if token in seq.stop_ids else seq.text.push(token)
        reason = ""
        if token in seq.stop_ids or seq.text.stopped:
            reason = "stop"
        elif len(seq.generated) >= seq.params.max_new_tokens or seq.position + 1 >= seq.max_tokens:
            reason = "length"
        elif seq.cancelled.is_set():
            reason = "cancelled"
        seq.events.put(Event(text, [token]))
        if reason:
            self.decoding.remove(seq)
            self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: str) -> None:
        """The turn ends: its state becomes durable off the loop thread, then the stream's
        last message goes out and the session takes requests again."""
        seq.phase, seq.finish_reason = Phase.FINISHED, reason
        s = seq.session
        s.last_used = time.monotonic()
        if seq.restore_only:
            s.busy = False
            seq.done.set()
            return
        if seq.sample:
            assert seq.text is not None
            if s.mode == "chat":
                reply = seq.text.text if seq.text.stopped else self.tok.decode(seq.generated)
                s.messages = [
                    *s.messages,
                    {"role": "user", "content": seq.user_message or ""},
                    {"role": "assistant", "content": reply},
                ]
            else:
                s.pending = seq.generated[-1]
            s.turns += 1
        s.updated = time.time()
        tokens, meta = list(s.own_tokens), s.meta().to_dict()
        self._finisher.submit(self._make_durable, seq, tokens, meta)

    def _make_durable(self, seq: Sequence, tokens: list[int], meta: dict) -> None:
        s = seq.session
        try:
            self.store.mark_durable(s.id, tokens, meta)
        except Exception as e:
            log.error("turn of %s not durable: %s", s.id, e)
            err = (
                ResourceExhausted(f"storage is full: {e}")
                if isinstance(e, StorageFull)
                else EngineError(f"the turn could not be saved: {e}")
            )
            self._fail(seq, err)
            return
        with self.lock:
            s.busy = False
            stats = seq.turn_stats()
            if not seq.sample and s.kind == "context":
                self._evict(s)  # a context is read from storage by the sessions that use it
        seq.events.put(Event(finished=True, finish_reason=seq.finish_reason, stats=stats))
        seq.done.set()
        self._wake.set()

    def _rollback(self, seq: Sequence) -> None:
        """The turn failed: the session is what its last durable turn left (the store's word)."""
        s = seq.session
        self._evict(s)
        try:
            row = self.store.owner_row(s.id)
            self.store.truncate(s.id, row.num_tokens)  # drops staged rows of the failed turn
        except StorageError:
            log.exception("reloading %s after a failed turn", s.id)
            return
        s.tokens = s.tokens[: s.base] + row.tokens
        s.rewind(SessionMeta.from_dict(row.meta))

    def _fail(self, seq: Sequence, err: Exception) -> None:
        with self.lock:
            for q in (self.prefilling, self.decoding):
                if seq in q:
                    q.remove(seq)
            if seq.job is not None:
                self._rollback(seq)
            else:
                seq.session.mode = seq.prev_mode
            seq.phase = Phase.FINISHED
            seq.session.busy = False
        seq.error = err
        seq.events.put(Event(error=err))
        seq.done.set()
