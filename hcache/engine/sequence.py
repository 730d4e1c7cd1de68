"""A Sequence is one Generate (or restore) on a session, moving through the phases
WAITING -> RESTORING -> PREFILL -> DECODE -> FINISHED (the scheduler moves it), and the
events its stream sends."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from hcache.engine.detokenizer import TextStream
from hcache.engine.prefill import Job
from hcache.engine.records import PlanSummary, RestoreResult, TurnStats
from hcache.engine.sampler import Sampler, SamplingParams
from hcache.engine.session import Session
from hcache.restore.plan import Method, Plan
from hcache.storage.catalogue import Lease


class Phase(str, Enum):
    WAITING = "waiting"
    RESTORING = "restoring"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


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
    job: Job | None = None
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
        m = self.session.meta
        assert self.text is not None
        if m.mode == "chat":
            reply = self.text.text if self.text.stopped else decode(self.generated)
            user = {"role": "user", "content": self.user_message or ""}
            m.messages = [*m.messages, user, {"role": "assistant", "content": reply}]
        else:
            m.pending = self.generated[-1]
        m.turns += 1

    def turn_stats(self) -> TurnStats:
        rep = self.job.report if self.job else None
        end = self.t_last or time.perf_counter()
        return TurnStats(
            restore_ms=rep.restore_ms if rep else 0.0,
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
            placed_tokens=rep.placed_tokens if rep else 0,
            recomputed_tokens=rep.recomputed_tokens if rep else 0,
            context_fallbacks=list(rep.context_fallbacks) if rep else [],
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
