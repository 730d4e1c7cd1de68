"""Per-session and per-request state. A Session is a conversation (or a context)
whose state lives in the store; a Sequence is one Generate (or restore) moving
through the phases WAITING -> RESTORING -> PREFILL -> DECODE -> FINISHED."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from hcache.engine.block_pool import PagedCache
from hcache.engine.prefill import PrefillJob
from hcache.engine.records import PlanSummary, RestoreResult, SessionMeta, TurnStats
from hcache.engine.sampler import Sampler, SamplingParams
from hcache.restore.plan import Method, Plan
from hcache.storage.catalogue import Lease
from hcache.storage.fetched import Fetched


class Phase(str, Enum):
    WAITING = "waiting"
    RESTORING = "restoring"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


@dataclass
class Session:
    id: str
    kind: str  # "session" | "context"
    prefix: list[int]  # token ids of the contexts placed before the conversation
    parent: str | None  # the context whose stored state covers tokens[:base]
    base: int
    tokens: list[int]  # every token whose state exists (prefix included), as durable
    messages: list[dict[str, str]] = field(default_factory=list)
    mode: str = ""  # "" until the first turn, then "chat" or "tokens"
    pending: int | None = None  # the last sampled token (not fed yet), token mode
    labels: dict[str, str] = field(default_factory=dict)
    context_ids: list[str] = field(default_factory=list)
    turns: int = 0
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    cache: PagedCache | None = None  # resident KV
    busy: bool = False
    releasing: bool = False  # the reclaimer is giving up its chunks or expiring it
    last_used: float = field(default_factory=time.monotonic)
    last_plan: Plan | None = None
    last_restore_ms: float = 0.0
    error: str | None = None  # why this session cannot be restored (e.g. another model's state)
    tenant: str | None = None  # the API key's tenant that owns it (None: no keys configured)
    # the token ids of its last acknowledged turn when those run ahead of (or apart from) the
    # local state in `tokens`: another replica ran turns on it (cluster mode); None: `tokens`
    history: list[int] | None = None
    # rows of the tokens in `tokens` past the durable ones, fetched from the cluster for the
    # turn about to run (which restores from them and stages them); the session stays busy
    fetched: Fetched | None = None

    @property
    def resident(self) -> bool:
        return self.cache is not None

    def drop_fetched(self) -> None:
        """The turn that fetched rows did not start: back to the durable state, the record's
        tokens past it to be fetched or recomputed by the next turn."""
        f, self.fetched = self.fetched, None
        if f is not None:
            f.release()
            if self.history is None:
                self.history = list(self.tokens)
            del self.tokens[self.base + f.start :]

    @property
    def own_tokens(self) -> list[int]:
        return self.tokens[self.base :]

    @property
    def index_as(self) -> str | None:
        """The namespace (its tenant's) under which a chat session's stored prefixes are found
        by resent conversations; None for sessions on a context or fed token ids."""
        if self.kind != "session" or self.parent is not None or self.prefix or self.mode != "chat":
            return None
        return "tenant:" + self.tenant if self.tenant is not None else "-"

    @property
    def acknowledged(self) -> list[int]:
        """The token ids a new turn continues."""
        return self.history if self.history is not None else self.tokens

    def meta(self) -> SessionMeta:
        """What the manifest keeps next to the token ids (restored after a restart)."""
        return SessionMeta(
            prefix=self.prefix,
            parent=self.parent,
            base=self.base,
            messages=self.messages,
            mode=self.mode,
            pending=self.pending,
            labels=self.labels,
            context_ids=self.context_ids,
            turns=self.turns,
            tenant=self.tenant,
        )

    @classmethod
    def from_meta(
        cls, sid: str, kind: str, meta: SessionMeta, tokens: list[int], created: float, updated: float
    ) -> Session:
        m = meta
        return cls(
            id=sid,
            kind=kind,
            prefix=m.prefix,
            parent=m.parent,
            base=m.base,
            tokens=tokens,
            messages=m.messages,
            mode=m.mode,
            pending=m.pending,
            labels=m.labels,
            context_ids=m.context_ids,
            turns=m.turns,
            tenant=m.tenant,
            created=created,
            updated=updated,
        )

    def rewind(self, meta: SessionMeta) -> None:
        """Back to the conversation a stored meta describes (its last durable turn)."""
        self.messages, self.mode, self.pending, self.turns = meta.messages, meta.mode, meta.pending, meta.turns


class TextStream:
    """Incremental detokenization with stop strings: emits only text that is final (no
    half of a multi-byte character, nothing that could still turn into a stop string)."""

    def __init__(self, decode: Any, stops: list[str]):
        self.decode, self.stops = decode, [s for s in stops if s]
        self.ids: list[int] = []
        self.sent = 0  # characters of the full text already emitted
        self.text = ""
        self.stopped = False

    def push(self, token: int) -> str:
        self.ids.append(token)
        self.text = self.decode(self.ids)
        for s in self.stops:
            at = self.text.find(s)
            if at >= 0:
                self.text = self.text[:at]
                self.stopped = True
        if self.stopped:
            return self.flush()
        safe = len(self.text)
        if self.text.endswith("\ufffd"):
            safe = len(self.text.rstrip("\ufffd"))
        for s in self.stops:  # hold back a tail that is a prefix of a stop string
            for k in range(min(len(s) - 1, safe), 0, -1):
                if self.text[:safe].endswith(s[:k]):
                    safe -= k
                    break
        out = self.text[self.sent : max(self.sent, safe)]
        self.sent = max(self.sent, safe)
        return out

    def flush(self) -> str:
        out = self.text[self.sent :]
        self.sent = len(self.text)
        return out


@dataclass
class Event:
    """One message for the Generate stream."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str = ""
    stats: TurnStats | None = None
    error: Exception | None = None


class EventSink(Protocol):
    """Where a sequence's events go (a `queue.Queue` by default): `put` is called on engine threads."""

    def put(self, item: Event) -> None: ...


@dataclass(eq=False)
class Sequence:
    session: Session
    new_tokens: list[int]  # to prefill after what the session keeps
    keep: int  # tokens of the session's state this turn builds on
    params: SamplingParams
    stop_ids: set[int]
    max_tokens: int  # context limit: no token is fed at or past this position
    sample: bool = True  # False: prefill only (a context), no reply
    restore_method: Method | None = None  # forced method; None: the planner's choice
    restore_only: bool = False
    user_message: str | None = None
    phase: Phase = Phase.WAITING
    sampler: Sampler | None = None
    job: PrefillJob | None = None
    steps: Iterator[bool] | None = None  # the job's run()
    generated: list[int] = field(default_factory=list)
    text: TextStream | None = None
    events: queue.Queue = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    finish_reason: str = ""
    restored: RestoreResult | None = None  # what a restore-only request reports
    error: Exception | None = None  # why the request failed
    plan: Plan | None = None
    predicted_ms: float | None = None
    t_submit: float = field(default_factory=time.perf_counter)
    t_start: float = 0.0
    t_room: float = 0.0  # when it first waited for store space (0: never)
    t_first: float = 0.0
    t_last: float = 0.0
    tbt_ms: list[float] = field(default_factory=list)
    prev_mode: str = ""
    lease: Lease | None = None  # cluster mode: the turn commits under it

    @property
    def position(self) -> int:
        """Where the next fed token goes."""
        return len(self.session.tokens)

    def push(self, token: int) -> tuple[Event, str]:
        """Take a sampled token: its stream event, and why the turn ends here ("" when it goes on)."""
        self.generated.append(token)
        self.t_last = time.perf_counter()
        assert self.text is not None
        stop = token in self.stop_ids
        text = "" if stop else self.text.push(token)
        if stop or self.text.stopped:
            reason = "stop"
        elif len(self.generated) >= self.params.max_new_tokens or self.position + 1 >= self.max_tokens:
            reason = "length"
        else:
            reason = "cancelled" if self.cancelled.is_set() else ""
        if reason:  # what was held back (half a character, a stop string's start) is final now
            text += self.text.flush()
        return Event(text, [token]), reason

    def end_turn(self, decode: Callable[[list[int]], str]) -> None:
        """The reply joins the session's conversation (chat), or waits to be fed (token turns)."""
        s = self.session
        assert self.text is not None
        if s.mode == "chat":
            reply = self.text.text if self.text.stopped else decode(self.generated)
            user = {"role": "user", "content": self.user_message or ""}
            s.messages = [*s.messages, user, {"role": "assistant", "content": reply}]
        else:
            s.pending = self.generated[-1]
        s.turns += 1

    def turn_stats(self) -> TurnStats:
        rep = self.job.report if self.job else None
        end = self.t_last or time.perf_counter()
        return TurnStats(
            restore_ms=rep.restore_ms if rep and self.plan else 0.0,
            prefill_ms=rep.prefill_ms if rep else 0.0,
            ttft_ms=(self.t_first - self.t_submit) * 1e3 if self.t_first else 0.0,
            queue_ms=(self.t_start - self.t_submit) * 1e3 if self.t_start else 0.0,
            decode_ms=(end - self.t_first) * 1e3 if self.t_first else 0.0,
            plan=PlanSummary.of(self.plan),
            prompt_tokens=len(self.new_tokens),
            cached_tokens=self.keep,
            completion_tokens=len(self.generated),
            bytes_read=rep.bytes_read if rep else 0,
            fallback_layers=rep.fallback_layers if rep else 0,
            tbt_ms=list(self.tbt_ms),
        )

    def restore_result(self) -> RestoreResult:
        rep = self.job.report if self.job else None
        return RestoreResult(
            num_tokens=self.keep,
            restore_ms=rep.restore_ms if rep else 0.0,
            predicted_ms=self.predicted_ms or 0.0,
            bytes_read=rep.bytes_read if rep else 0,
            fallback_layers=rep.fallback_layers if rep else 0,
            plan=PlanSummary.of(self.plan),
        )
