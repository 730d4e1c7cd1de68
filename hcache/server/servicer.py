"""The gRPC servicer: a thin translation between protobuf messages and the engine. Its
methods just raise: `ErrorsInterceptor` ends the call with the error table's status."""

from __future__ import annotations

import math
from collections.abc import Iterator

import grpc
from google.protobuf import empty_pb2

from hcache.engine.compose import Composition
from hcache.engine.engine import Engine
from hcache.engine.errors import InvalidArgument
from hcache.engine.records import EngineSnapshot, PlanSummary, RestoreResult, TurnStats
from hcache.engine.sampler import SamplingParams
from hcache.engine.sequence import Event
from hcache.engine.session import Session
from hcache.restore.plan import Method
from hcache.server.auth import tenant_var
from hcache.v1 import hcache_pb2 as pb
from hcache.v1 import hcache_pb2_grpc as pb_grpc

METHODS = {
    pb.RESTORE_METHOD_AUTO: None,
    pb.RESTORE_METHOD_HIDDEN: Method.HIDDEN,
    pb.RESTORE_METHOD_KV: Method.KV,
    pb.RESTORE_METHOD_RECOMPUTE: Method.RECOMPUTE,
}
CONTEXT_MODES = {
    pb.CONTEXT_MODE_EXACT: "exact",
    pb.CONTEXT_MODE_BLEND: "blend",
    pb.CONTEXT_MODE_CONCAT: "concat",
}
MAX_PAGE = 1000


# --- engine records -> protos, in one place ----------------------------------------
def plan_pb(p: PlanSummary) -> pb.Plan:
    return pb.Plan(recompute=p.recompute, hidden=p.hidden, kv=p.kv, layers=p.layers)


def session_pb(s: Session) -> pb.Session:
    return pb.Session(
        session_id=s.id,
        num_tokens=len(s.acknowledged),
        resident=s.resident,
        labels=s.meta.labels,
        context_ids=s.meta.context_ids,
        turns=s.meta.turns,
        busy=s.busy,
        last_plan=plan_pb(PlanSummary.of(s.last_plan)),
        last_restore_ms=s.last_restore_ms,
        created_unix=s.created,
        updated_unix=s.updated,
    )


def context_pb(c: Session, reused: bool = False) -> pb.Context:
    return pb.Context(context_id=c.id, num_tokens=len(c.tokens), labels=c.meta.labels, reused=reused)


def event_pb(ev: Event, session_id: str) -> pb.GenerateResponse:
    if not ev.finished:
        return pb.GenerateResponse(text=ev.text, token_ids=ev.token_ids)
    stats = turn_stats_pb(ev.stats or TurnStats())
    return pb.GenerateResponse(finished=True, finish_reason=ev.finish_reason, stats=stats, session_id=session_id)


def turn_stats_pb(st: TurnStats) -> pb.GenerateStats:
    return pb.GenerateStats(
        restore_ms=st.restore_ms,
        prefill_ms=st.prefill_ms,
        ttft_ms=st.ttft_ms,
        plan=plan_pb(st.plan),
        prompt_tokens=st.prompt_tokens,
        cached_tokens=st.cached_tokens,
        completion_tokens=st.completion_tokens,
        queue_ms=st.queue_ms,
        decode_ms=st.decode_ms,
        bytes_read=st.bytes_read,
        fallback_layers=st.fallback_layers,
        placed_tokens=st.placed_tokens,
        recomputed_tokens=st.recomputed_tokens,
        context_fallbacks=st.context_fallbacks,
    )


def restore_pb(r: RestoreResult) -> pb.RestoreResponse:
    return pb.RestoreResponse(
        restore_ms=r.restore_ms,
        plan=plan_pb(r.plan),
        bytes_read=r.bytes_read,
        predicted_ms=r.predicted_ms,
        num_tokens=r.num_tokens,
        fallback_layers=r.fallback_layers,
        already_resident=r.already_resident,
    )


def stats_pb(snap: EngineSnapshot) -> pb.Stats:
    c, st = snap.counters, snap.storage
    return pb.Stats(
        sessions=snap.sessions,
        resident_sessions=snap.resident_sessions,
        resident_bytes=snap.resident_bytes,
        budget_bytes=snap.budget_bytes,
        contexts=snap.contexts,
        queue_depth=snap.queue.by_phase(),
        evictions=c.evictions,
        restores=c.restores,
        fallback_layers=c.fallback_layers,
        checksum_failures=st.checksum_failures,
        bytes_read=st.bytes_read,
        dirs=[
            pb.DirStats(
                path=u.path,
                used_bytes=u.used_bytes,
                free_bytes=u.fs_free_bytes,
                bytes_written=u.bytes_written,
                chunks=u.chunks,
            )
            for u in st.dirs
        ],
        generated_tokens=c.generated_tokens,
        model=snap.model,
        draining=snap.draining,
    )


def sampling_of(req: pb.GenerateRequest, default_max: int) -> tuple[SamplingParams, list[str]]:
    s = req.sampling
    for name in ("temperature", "top_p"):
        v = getattr(s, name)
        if not math.isfinite(v):
            raise InvalidArgument(f"sampling.{name} must be a finite number")
    params = SamplingParams(
        max_new_tokens=s.max_new_tokens or default_max,
        temperature=s.temperature,
        top_p=s.top_p or 1.0,
        top_k=s.top_k,
        seed=s.seed if s.HasField("seed") else None,
    )
    return params, list(s.stop)


def composition_of(req: pb.CreateSessionRequest | pb.GenerateRequest, mode: str, fraction: float) -> Composition:
    """The request's context mode and blend fraction, the server's (`mode`, `fraction`) where unset."""
    if req.context_mode not in (pb.CONTEXT_MODE_DEFAULT, *CONTEXT_MODES):
        raise InvalidArgument(f"unknown context mode {req.context_mode}")
    return Composition(
        CONTEXT_MODES.get(req.context_mode, mode), req.blend_fraction if req.HasField("blend_fraction") else fraction
    )


class Servicer(pb_grpc.HCacheServicer):
    def __init__(self, engine: Engine):
        self.engine = engine

    def _composition(self, request: pb.CreateSessionRequest | pb.GenerateRequest) -> Composition:
        return composition_of(request, self.engine.cfg.context_mode, self.engine.cfg.blend_fraction)

    def CreateSession(self, request: pb.CreateSessionRequest, context: grpc.ServicerContext) -> pb.Session:
        how = self._composition(request)
        ids, labels = list(request.context_ids), dict(request.labels)
        s = self.engine.create_session(request.system_prompt, ids, labels, tenant_var.get(), composition=how)
        return session_pb(s)

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        params, stops = sampling_of(request, self.engine.cfg.default_max_new_tokens)
        ids, sid, tenant = list(request.token_ids), request.session_id, tenant_var.get()
        if request.context_ids:
            if sid:
                raise InvalidArgument("a session's contexts are given when it is created, not with its turns")
            how = self._composition(request)
            sid = self.engine.create_session(context_ids=list(request.context_ids), tenant=tenant, composition=how).id
            try:
                seq = self.engine.generate(sid, request.message, ids, params, stops, tenant)
            except Exception:
                self.engine.delete(sid, tenant)  # refused before it ran: nothing of it is kept
                raise
        else:
            seq = self.engine.generate(sid, request.message, ids, params, stops, tenant)
        context.add_callback(lambda: self.engine.cancel(seq))  # runs when the client goes away, too
        for ev in self.engine.stream(seq):
            yield event_pb(ev, sid)

    def RestoreSession(self, request: pb.RestoreRequest, context: grpc.ServicerContext) -> pb.RestoreResponse:
        if request.method not in METHODS:
            raise InvalidArgument(f"unknown restore method {request.method}")
        return restore_pb(self.engine.restore(request.session_id, METHODS[request.method], tenant_var.get()))

    def EvictSession(self, request: pb.SessionRef, context: grpc.ServicerContext) -> pb.Session:
        return session_pb(self.engine.evict(request.session_id, tenant_var.get()))

    def DeleteSession(self, request: pb.SessionRef, context: grpc.ServicerContext) -> empty_pb2.Empty:
        self.engine.delete(request.session_id, tenant_var.get())
        return empty_pb2.Empty()

    def GetSession(self, request: pb.SessionRef, context: grpc.ServicerContext) -> pb.Session:
        return session_pb(self.engine.get(request.session_id, tenant_var.get()))

    def ListSessions(self, request: pb.ListSessionsRequest, context: grpc.ServicerContext) -> pb.ListSessionsResponse:
        size = min(request.page_size or 100, MAX_PAGE)
        sessions = self.engine.list(tenant=tenant_var.get())
        # the page token is the last id of the previous page: stable while sessions come and go
        rest = [s for s in sessions if s.id > request.page_token] if request.page_token else sessions
        page = rest[:size]
        more = len(rest) > size
        return pb.ListSessionsResponse(
            sessions=[session_pb(s) for s in page], next_page_token=page[-1].id if more else ""
        )

    def PrecomputeContext(self, request: pb.PrecomputeContextRequest, context: grpc.ServicerContext) -> pb.Context:
        c, reused = self.engine.precompute(
            request.text, list(request.token_ids), dict(request.labels), tenant_var.get()
        )
        return context_pb(c, reused)

    def ListContexts(self, request: pb.ListContextsRequest, context: grpc.ServicerContext) -> pb.ListContextsResponse:
        size = min(request.page_size or 100, MAX_PAGE)
        want = dict(request.labels).items()
        contexts = [c for c in self.engine.list("context", tenant_var.get()) if want <= c.meta.labels.items()]
        rest = [c for c in contexts if c.id > request.page_token] if request.page_token else contexts
        page = rest[:size]
        more = len(rest) > size
        return pb.ListContextsResponse(
            contexts=[context_pb(c) for c in page], next_page_token=page[-1].id if more else ""
        )

    def GetStats(self, request: empty_pb2.Empty, context: grpc.ServicerContext) -> pb.Stats:
        return stats_pb(self.engine.snapshot())
