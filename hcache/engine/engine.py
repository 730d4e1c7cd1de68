"""The serving engine: the public calls, and one loop thread (loop.py) that runs
continuous batching. A finished turn becomes durable off the loop thread. Everything that
changes sessions, queues or the pool happens under `self.lock`. What happens beyond this
process (cluster mode's leases, adoptions and fetches) is `self.sharing`'s (sharing.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

from hcache.config import EngineConfig
from hcache.engine import checks, heap, snapshot
from hcache.engine.block_pool import BlockPool, resident_kv_dtype
from hcache.engine.compose import Composition, compose
from hcache.engine.detokenizer import TextStream
from hcache.engine.errors import FailedPrecondition, InvalidArgument, Unavailable
from hcache.engine.finisher import Finisher
from hcache.engine.forks import fork, longest_stored
from hcache.engine.loop import Loop
from hcache.engine.parts import Parts
from hcache.engine.reclaimer import Reclaimer
from hcache.engine.records import Counters, EngineSnapshot, RestoreResult, StorageState
from hcache.engine.registry import Registry, content_key
from hcache.engine.runner import Runner
from hcache.engine.sampler import SamplingParams
from hcache.engine.scheduler import Scheduler
from hcache.engine.sequence import Event, EventSink, Sequence
from hcache.engine.session import Session, SessionMeta
from hcache.engine.sharing import Sharing, Solo
from hcache.engine.telemetry import Telemetry
from hcache.model.base import DecoderModel
from hcache.model.decode import BLOCK_TOKENS
from hcache.model.tokenizer import Tokenizer
from hcache.restore.plan import Method
from hcache.restore.planning import RestorePlanner, layer_kinds_for
from hcache.restore.profile import Profile
from hcache.storage.layout import CHUNK_TOKENS
from hcache.storage.prefixes import common_prefix
from hcache.storage.store import ChunkStore

log = logging.getLogger(__name__)


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
        sharing: Sharing | None = None,
    ):
        """`sharing`: where sessions live besides here (`Solo`: nowhere; `sharing_for` makes
        the cluster's with `--cluster`, where the store caches them)."""
        self.model, self.tok, self.store, self.profile = model, tokenizer, store, profile
        self.sharing = sharing or Solo()
        self.cfg = cfg or EngineConfig()
        self.model_name = model_name
        self.telemetry = telemetry or Telemetry()
        if self.cfg.restore_method != "auto":
            Method(self.cfg.restore_method)  # fail at start, not at the first restore
        kv_dtype = resident_kv_dtype(self.cfg.kv_dtype, model)
        if store.kv_dtype != kv_dtype:  # KV restores place the stored bits as they are
            raise ValueError(f"the store keeps KV in {store.kv_dtype}, the engine's KV is {kv_dtype}")
        per_block = BlockPool.bytes_per_block(model.cfg, kv_dtype)
        blocks = max(1, self.cfg.kv_budget_bytes // per_block)
        self.pool = BlockPool(model.cfg, kv_dtype, model.device, blocks, self.cfg.prefault_pool)
        kinds = layer_kinds_for(self.cfg.store_kinds, model, profile, self.cfg.plan_tokens, store.kv_dtype)
        # read buffers for the longest session the KV budget can hold (any restore keeps that
        # many pooled after it), so that no restore pays for fresh memory
        mc = model.cfg
        longest = max(self.cfg.plan_tokens, min(mc.max_position, self.pool.num_blocks * BLOCK_TOKENS))
        store.buffers.warm(longest * max(s.nbytes for s in store.shapes.values()) // CHUNK_TOKENS, mc.num_layers)
        self.registry = Registry(store, model, kinds)
        self.counters = Counters()
        self.scheduler = Scheduler(self.pool, self.registry.sessions, self.cfg.max_batch, self.counters)
        parts = self._parts = Parts(self.cfg, store, self.registry, self.scheduler, self.sharing, self.telemetry)
        self.lock, self._wake = parts.lock, parts.work
        self.runner = Runner(model, store, self.cfg)
        self.runner.warm(self.pool)
        self.finisher = Finisher(parts, tokenizer.decode)
        self.reclaimer = Reclaimer(parts)
        self.draining = False
        self._precomputing: dict[tuple[str | None, int, bytes], Sequence] = {}  # content_key -> its run
        planner = RestorePlanner(store, model, self.registry.fingerprint, profile)
        self.loop = Loop(parts, planner, self.runner, self.finisher, self.reclaimer)
        self.sharing.attach(self)
        heap.freeze()  # the model, compiled kernels and this engine: no full collection walks them
        if not self.runner.compiled.is_set():  # and the compiled step, once compiled
            self.runner.after_compiled(heap.freeze)

    # --- public API (called from RPC threads) -------------------------------------
    def create_session(
        self,
        system_prompt: str = "",
        context_ids: list[str] | None = None,
        labels: dict[str, str] | None = None,
        tenant: str | None = None,
        history: list[dict[str, str]] | None = None,
        composition: Composition | None = None,
    ) -> Session:
        """A chat session; `history` is a conversation it starts from (system, user and
        assistant messages, as a client resends them), computed with its first turn.
        `context_ids` go before it in that order, placed as `composition` says (compose.py;
        default: the server's mode and fraction)."""
        self._check_open()
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages += checks.history(history or [])
        ids = list(context_ids or [])
        how = composition or Composition(self.cfg.context_mode, self.cfg.blend_fraction)
        self.sharing.before_create(ids, tenant)
        with self.lock:
            checks.session_limit(self.registry.sessions.values(), tenant, self.cfg.max_sessions_per_tenant)
            contexts = [self.registry.get(c, "context", tenant) for c in ids]
            checks.contexts_fit(contexts, self.model.cfg.max_position, self.pool.num_blocks * BLOCK_TOKENS)
            s, lead = compose(self.registry, contexts, how, messages, dict(labels or {}), tenant)
            if lead:
                self.counters.prefix_matches += 1
                self.counters.prefix_tokens += lead
        self.sharing.created(s)
        return s

    def continue_chat(self, messages: list[dict[str, str]], tenant: str | None = None) -> tuple[Session, int]:
        """A new session for a conversation resent in full, its last message the user's new
        turn: it shares the stored state of the tenant's longest stored conversation that this
        one extends (found by whole 64-token chunks, then matched token by token; shared
        copy-on-write), which stays as it was; with none,
        it starts empty. Returns the session and how many tokens it shares."""
        self._check_open()
        if not messages or messages[-1].get("role") != "user":
            raise InvalidArgument("the last message must be the user's")
        history = checks.history(messages[:-1])
        ids = self.tok.encode_chat([*history, messages[-1]])
        with self.lock:
            checks.session_limit(self.registry.sessions.values(), tenant, self.cfg.max_sessions_per_tenant)
            found = longest_stored(self.registry, ids, tenant)
            if found is None:
                s, shared = self.registry.create("session", {}, [], history, tenant), 0
            else:
                parent, shared = found
                s = fork(self.registry, parent, shared, SessionMeta(messages=history, mode="chat", tenant=tenant))
                self.counters.prefix_matches += 1
                self.counters.prefix_tokens += shared
                if parent.cache is not None and parent.cache.length >= shared:
                    # the parent is idle and durable: its memory goes to the fork, which a client
                    # resending histories continues, instead of the fork reading it back from disk
                    s.cache, parent.cache = parent.cache, None
                    s.cache.truncate(shared)
                    self.counters.kv_handovers += 1
        self.sharing.created(s)
        return s, shared

    def precompute_context(
        self,
        text: str = "",
        token_ids: list[int] | None = None,
        labels: dict[str, str] | None = None,
        tenant: str | None = None,
    ) -> Session:
        """Prefill a document once and store its state; returns when it is durable."""
        return self.precompute(text, token_ids, labels, tenant)[0]

    def precompute(
        self,
        text: str = "",
        token_ids: list[int] | None = None,
        labels: dict[str, str] | None = None,
        tenant: str | None = None,
    ) -> tuple[Session, bool]:
        """The document's context, and whether it was stored already: the same tokens
        precomputed again by the same tenant return the stored context (its labels as they
        were) and compute nothing; while they are being computed, they wait for it."""
        self._check_open()
        checks.exactly_one(text, token_ids, "give the context as text or as token_ids (exactly one)")
        ids = list(token_ids) if token_ids else self.tok.encode(text)
        checks.tokens(ids, self.model.cfg.vocab_size)
        if not ids:
            raise InvalidArgument("the context is empty")
        checks.within_context(ids, self.model.cfg.max_position, "context")
        key = content_key(ids, tenant)
        while True:
            with self.lock:
                found = self.registry.context_of(ids, tenant)
                if found is not None:
                    return found, True
                running = self._precomputing.get(key)
                if running is None:
                    self._check_storage(tenant, len(ids))
                    ctx = self.registry.create("context", dict(labels or {}), [], [], tenant)
                    ctx.busy = True
                    seq = self.sequence(ctx, ids, 0, SamplingParams(max_new_tokens=1), [], sample=False)
                    self._precomputing[key] = seq
                    break
            running.done.wait()  # then it is stored, or it failed and this call computes it
        try:
            try:
                seq.lease = self.sharing.lease_context(ctx)
            except BaseException:
                with self.lock:
                    ctx.busy = False
                raise
            self.compute(seq)
            with self.lock:
                self.registry.index_context(ctx)
        finally:
            with self.lock:
                del self._precomputing[key]
            seq.done.set()  # (set already unless the lease failed) wakes the calls that wait
        return ctx, False

    def generate(
        self,
        session_id: str,
        message: str = "",
        token_ids: list[int] | None = None,
        params: SamplingParams | None = None,
        stops: list[str] | None = None,
        tenant: str | None = None,
        events: EventSink | None = None,
    ) -> Sequence:
        """Queue a turn; read `seq.events` (or iterate `stream(seq)`) for the reply. `events`
        replaces that queue: anything with a thread-safe `put(event)`, called on the engine's
        threads."""
        self._check_open()
        params = params or SamplingParams(max_new_tokens=self.cfg.default_max_new_tokens)
        stops = list(stops or [])
        checks.sampling(params, stops, self.model.cfg.max_position)
        checks.exactly_one(message, token_ids, "a turn is a non-empty message or a list of token_ids (exactly one)")
        lease = self.sharing.lease_turn(session_id, tenant)
        try:
            seq = self._queue_turn(session_id, message, token_ids, params, stops, tenant, events)
        except BaseException:
            if lease is not None:
                self.sharing.turn_refused(session_id, lease)
            raise
        seq.lease = lease
        self._submit(seq)
        return seq

    def _queue_turn(
        self,
        session_id: str,
        message: str,
        token_ids: list[int] | None,
        params: SamplingParams,
        stops: list[str],
        tenant: str | None,
        events: EventSink | None,
    ) -> Sequence:
        """The turn's sequence, checked; the session is busy with it from here."""
        with self.lock:
            s = self.reclaimer.settle(session_id, tenant)
            if s.fetched is None:  # else busy since this request's lease fetched its rows
                checks.usable(s)
            m, mode = s.meta, "chat" if message else "tokens"
            if m.mode and m.mode != mode:
                raise InvalidArgument(f"session {session_id} takes {m.mode} turns, not {mode}")
            if message:
                ids = m.prefix + self.tok.encode_chat([*m.messages, {"role": "user", "content": message}])
            elif not m.mode and m.prefix:  # a first turn feeds every context before its tokens
                ids = m.prefix + list(token_ids or [])
            else:
                ids = s.acknowledged + ([m.pending] if m.pending is not None else []) + list(token_ids or [])
            checks.tokens(ids, self.model.cfg.vocab_size)
            checks.within_context(ids, self.model.cfg.max_position, "prompt")
            keep = min(common_prefix(s.tokens, ids), len(ids) - 1)
            if keep < s.base:
                raise FailedPrecondition(f"session {session_id} no longer starts with its context")
            self._check_storage(tenant, len(ids) - len(s.tokens) + params.max_new_tokens)
            seq = self.sequence(s, ids[keep:], keep, params, stops, sample=True)
            seq.user_message = message or None
            if events is not None:
                seq.events = events  # type: ignore[assignment]
            if self.cfg.restore_method != "auto":
                seq.restore_method = Method(self.cfg.restore_method)
            self.sharing.turn_queued(s, keep)
            m.mode = mode
            s.busy = True
        return seq

    def restore(self, session_id: str, method: Method | None = None, tenant: str | None = None) -> RestoreResult:
        """Make the session resident (again, from storage, when a method is forced)."""
        self._check_open()
        with self.lock:
            s = self.reclaimer.settle(session_id, tenant)
            checks.usable(s)
            if s.resident and method is None:
                return RestoreResult(already_resident=True, num_tokens=len(s.tokens))
            if not s.tokens:
                return RestoreResult(already_resident=s.resident)
            self.scheduler.evict(s)
            seq = self.sequence(s, [], len(s.tokens), SamplingParams(max_new_tokens=1), [], sample=False)
            seq.restore_method, seq.restore_only = method, True
            s.busy = True
        self.compute(seq)
        assert seq.restored is not None
        return seq.restored

    def evict(self, session_id: str, tenant: str | None = None) -> Session:
        with self.lock:
            s = self.reclaimer.settle(session_id, tenant)
            checks.not_busy(s)
            self.scheduler.evict(s)
            return s

    def delete(self, session_id: str, tenant: str | None = None) -> None:
        """Delete a session, or a context no session uses (here; in cluster mode, anywhere)."""
        self.sharing.before_delete(session_id, tenant)
        with self.lock:
            s = self.registry.sessions.get(session_id)
            kind = s.kind if s is not None else "session"
            s = self.reclaimer.settle(session_id, tenant, kind)  # NotFound for unknown ids and other tenants
            checks.not_busy(s)
            self.scheduler.evict(s)
            self.registry.delete(s)

    def get(self, session_id: str, tenant: str | None = None) -> Session:
        shared = self.sharing.get(session_id, tenant)
        if shared is not None:
            return shared
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
                if self.scheduler.idle() and not any(s.busy for s in self.registry.sessions.values()):
                    return True
            time.sleep(0.05)
        return False

    def close(self) -> None:
        self.reclaimer.close()
        self.loop.stop()
        self.finisher.close()
        self.sharing.close()
        heap.thaw()

    def snapshot(self) -> EngineSnapshot:
        """The state GetStats, /metrics and the dashboard show, read at once."""
        storage = StorageState.of(self.store)  # disk usage, read outside the engine's lock
        with self.lock:
            return snapshot.take(self.model_name, self.draining, self._parts, self.pool, storage)

    # --- helpers -------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.draining:
            raise Unavailable("the server is draining; retry on another instance")

    def _check_storage(self, tenant: str | None, more_tokens: int) -> None:
        owners, limit = self.registry.sessions.values(), self.cfg.max_storage_bytes_per_tenant
        checks.storage_quota(owners, tenant, more_tokens, self.registry.bytes_per_token(), limit)

    def sequence(
        self, s: Session, new: list[int], keep: int, params: SamplingParams, stops: list[str], sample: bool
    ) -> Sequence:
        stop_ids = set() if params.ignore_eos else set(self.tok.stop_ids)
        seq = Sequence(s, new, keep, params, stop_ids, self.model.cfg.max_position, sample=sample)
        seq.text = TextStream(self.tok.decode, stops)
        seq.prev_mode = s.meta.mode
        return seq

    def _submit(self, seq: Sequence) -> None:
        with self.lock:
            self.scheduler.add(seq)
        self._wake.set()

    def compute(self, seq: Sequence) -> None:
        """Run a sequence that samples nothing (a restore, a context) to its end."""
        self._submit(seq)
        seq.done.wait()
        if seq.error is not None:
            raise seq.error
