"""Python client for the hcache gRPC service.

with Client("localhost:50051") as c:
    sid = c.create_session("You are terse.").session_id
    for piece in c.generate(sid, "Hello!"):
        print(piece.text, end="")

With several replicas (`Client("a:50051,b:50051")`, `hcache serve --cluster`), a session's
calls go to the replica its id ranks first by rendezvous hashing, and to the next one when
that one is UNAVAILABLE. Routing only keeps replicas' local caches warm: any replica
continues any session exactly."""

from __future__ import annotations

import hashlib
import time
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import empty_pb2

from hcache.v1 import hcache_pb2 as pb
from hcache.v1 import hcache_pb2_grpc as pb_grpc

METHODS = {
    "auto": pb.RESTORE_METHOD_AUTO,
    "hidden": pb.RESTORE_METHOD_HIDDEN,
    "kv": pb.RESTORE_METHOD_KV,
    "recompute": pb.RESTORE_METHOD_RECOMPUTE,
}

CONTEXT_MODES = {
    "": pb.CONTEXT_MODE_DEFAULT,
    "exact": pb.CONTEXT_MODE_EXACT,
    "blend": pb.CONTEXT_MODE_BLEND,
    "concat": pb.CONTEXT_MODE_CONCAT,
}


@dataclass
class Reply:
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: pb.GenerateStats
    chunks: list[str] = field(default_factory=list)
    session_id: str = ""


class _KeyInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, key: str):
        self.meta = ("authorization", f"Bearer {key}")

    def _with_key(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        meta = [*(details.metadata or ()), self.meta]
        return details._replace(metadata=meta)  # type: ignore[attr-defined]

    def intercept_unary_unary(self, continuation: Callable, details: grpc.ClientCallDetails, request: Any) -> Any:
        return continuation(self._with_key(details), request)

    def intercept_unary_stream(self, continuation: Callable, details: grpc.ClientCallDetails, request: Any) -> Any:
        return continuation(self._with_key(details), request)


def targets_of(target: str | list[str]) -> list[str]:
    """`"a:1,b:2"` or `["a:1", "b:2"]` -> the replicas, in the order given, without repeats."""
    parts = target.split(",") if isinstance(target, str) else list(target)
    out = list(dict.fromkeys(p.strip() for p in parts if p.strip()))
    if not out:
        raise ValueError("no target: give HOST:PORT, or several separated by commas")
    return out


def rendezvous(session_id: str, targets: list[str]) -> list[str]:
    """The replicas in the order a session tries them: highest random weight first, so a
    replica that leaves moves only its own sessions, each to its next choice."""

    def weight(t: str) -> int:
        return int.from_bytes(hashlib.blake2b(f"{t}\0{session_id}".encode(), digest_size=8).digest(), "big")

    return sorted(targets, key=weight, reverse=True)


class Client:
    def __init__(
        self,
        target: str | list[str] = "localhost:50051",
        channel: grpc.Channel | None = None,
        timeout: float = 600,
        api_key: str | None = None,
        root_cert: bytes | None = None,
    ):
        """`target`: one replica, or several (a list, or comma-separated). `api_key` goes with
        every call as `authorization: Bearer`; `root_cert` (PEM) turns TLS on."""
        self.targets = targets_of(target) if channel is None else ["channel"]
        self.channels: list[grpc.Channel] = []
        self.stubs: dict[str, pb_grpc.HCacheStub] = {}
        for t in self.targets:
            ch = channel
            if ch is None:
                if root_cert is not None:
                    ch = grpc.secure_channel(t, grpc.ssl_channel_credentials(root_certificates=root_cert))
                else:
                    ch = grpc.insecure_channel(t)
            self.channels.append(ch)
            if api_key:
                ch = grpc.intercept_channel(ch, _KeyInterceptor(api_key))
            self.stubs[t] = pb_grpc.HCacheStub(ch)
        self.channel = self.channels[0]
        self.stub = self.stubs[self.targets[0]]
        self.timeout = timeout
        self._next = 0  # calls without a session go round the replicas

    def close(self) -> None:
        for ch in self.channels:
            ch.close()

    def _order(self, session_id: str | None, spread: bool = False) -> list[str]:
        """A session's replicas by rendezvous; otherwise the order given (`spread`: round robin)."""
        if session_id:
            return rendezvous(session_id, self.targets)
        if not spread:
            return self.targets
        self._next = (self._next + 1) % len(self.targets)
        return self.targets[self._next :] + self.targets[: self._next]

    def _call(self, session_id: str | None, call: Callable[[pb_grpc.HCacheStub], Any], spread: bool = False) -> Any:
        """`call` on the session's replica, then on the next while they are UNAVAILABLE."""
        last: grpc.RpcError | None = None
        for t in self._order(session_id, spread):
            try:
                return call(self.stubs[t])
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                last = e
        assert last is not None
        raise last

    def _stream(self, session_id: str, req: Any) -> Iterator[pb.GenerateResponse]:
        """Generate on the session's replica; the next one only if it was UNAVAILABLE before
        any of the reply came (a turn is never run twice)."""
        last: grpc.RpcError | None = None
        for t in self._order(session_id):
            stream = self.stubs[t].Generate(req, timeout=self.timeout)
            try:
                first = next(stream)
            except StopIteration:
                return
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                last = e
                continue
            yield first
            yield from stream
            return
        assert last is not None
        raise last

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create_session(
        self,
        system_prompt: str = "",
        context_ids: list[str] | None = None,
        labels: dict[str, str] | None = None,
        context_mode: str = "",
        blend_fraction: float | None = None,
    ) -> pb.Session:
        """`context_mode`: exact, blend or concat ("": the server's); see the proto's ContextMode."""
        req = pb.CreateSessionRequest(
            system_prompt=system_prompt,
            context_ids=context_ids or [],
            labels=labels or {},
            context_mode=CONTEXT_MODES[context_mode],
        )
        if blend_fraction is not None:
            req.blend_fraction = blend_fraction
        return self._call(None, lambda s: s.CreateSession(req, timeout=self.timeout), spread=True)

    def ask(
        self,
        context_ids: list[str],
        message: str,
        context_mode: str = "",
        blend_fraction: float | None = None,
        **sampling: Any,
    ) -> Reply:
        """One turn over precomputed contexts, in this order, in a new session (the reply's
        `session_id`, which later turns may continue)."""
        req = pb.GenerateRequest(
            message=message,
            sampling=_sampling(**sampling),
            context_ids=context_ids,
            context_mode=CONTEXT_MODES[context_mode],
        )
        if blend_fraction is not None:
            req.blend_fraction = blend_fraction
        return _reply(self._stream("", req))

    def generate(
        self,
        session_id: str,
        message: str = "",
        token_ids: list[int] | None = None,
        max_new_tokens: int = 0,
        temperature: float = 0.0,
        top_p: float = 0.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: list[str] | None = None,
    ) -> Iterator[pb.GenerateResponse]:
        """The reply as it streams; the last message has `finished` and `stats`."""
        sampling = _sampling(max_new_tokens, temperature, top_p, top_k, seed, stop)
        req = pb.GenerateRequest(session_id=session_id, message=message, token_ids=token_ids or [], sampling=sampling)
        if len(self.targets) == 1:
            return self.stub.Generate(req, timeout=self.timeout)
        return self._stream(session_id, req)

    def reply(self, session_id: str, message: str = "", **kw: object) -> Reply:
        """One whole turn."""
        return _reply(self.generate(session_id, message, **kw))  # type: ignore[arg-type]

    def restore(self, session_id: str, method: str = "auto") -> pb.RestoreResponse:
        if method not in METHODS:
            raise ValueError(f"method must be one of {sorted(METHODS)}")
        req = pb.RestoreRequest(session_id=session_id, method=METHODS[method])
        return self._call(session_id, lambda s: s.RestoreSession(req, timeout=self.timeout))

    def evict(self, session_id: str) -> pb.Session:
        ref = pb.SessionRef(session_id=session_id)
        return self._call(session_id, lambda s: s.EvictSession(ref, timeout=self.timeout))

    def delete(self, session_id: str) -> None:
        ref = pb.SessionRef(session_id=session_id)
        self._call(session_id, lambda s: s.DeleteSession(ref, timeout=self.timeout))

    def get(self, session_id: str) -> pb.Session:
        ref = pb.SessionRef(session_id=session_id)
        return self._call(session_id, lambda s: s.GetSession(ref, timeout=self.timeout))

    def list(self, page_size: int = 100) -> Iterator[pb.Session]:
        """The sessions of one replica (the first that answers)."""
        token = ""
        while True:
            req = pb.ListSessionsRequest(page_size=page_size, page_token=token)
            r = self._call(None, lambda s, req=req: s.ListSessions(req))
            yield from r.sessions
            if not r.next_page_token:
                return
            token = r.next_page_token

    def precompute_context(
        self, text: str = "", token_ids: list[int] | None = None, labels: dict[str, str] | None = None
    ) -> pb.Context:
        """On the replica the document's content picks (rendezvous), which finds it stored when
        it is sent again; the next one if that is unavailable."""
        req = pb.PrecomputeContextRequest(text=text, token_ids=token_ids or [], labels=labels or {})
        content = text.encode() if text else b"ids:" + array("I", token_ids or []).tobytes()
        key = "context:" + hashlib.sha256(content).hexdigest()
        return self._call(key, lambda s: s.PrecomputeContext(req, timeout=self.timeout))

    def contexts(self, labels: dict[str, str] | None = None, page_size: int = 100) -> Iterator[pb.Context]:
        """One replica's contexts (the first that answers), those with every label in `labels`."""
        token = ""
        while True:
            req = pb.ListContextsRequest(page_size=page_size, page_token=token, labels=labels or {})
            r = self._call(None, lambda s, req=req: s.ListContexts(req))
            yield from r.contexts
            if not r.next_page_token:
                return
            token = r.next_page_token

    def stats(self) -> pb.Stats:
        """One replica's figures (the first that answers)."""
        return self._call(None, lambda s: s.GetStats(empty_pb2.Empty(), timeout=self.timeout))


def _sampling(
    max_new_tokens: int = 0,
    temperature: float = 0.0,
    top_p: float = 0.0,
    top_k: int = 0,
    seed: int | None = None,
    stop: list[str] | None = None,
) -> pb.SamplingParams:
    sampling = pb.SamplingParams(
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, stop=stop or []
    )
    if seed is not None:
        sampling.seed = seed
    return sampling


def _reply(stream: Iterator[pb.GenerateResponse]) -> Reply:
    chunks, ids = [], []
    last = None
    for r in stream:
        if r.finished:
            last = r
        else:
            chunks.append(r.text)
            ids.extend(r.token_ids)
    if last is None:
        raise RuntimeError("the stream ended without a final message")
    return Reply("".join(chunks), ids, last.finish_reason, last.stats, chunks, last.session_id)


def wait_for_server(target: str, timeout: float = 120, alive: Callable[[], bool] = lambda: True) -> None:
    """Block until the server at `target` reports SERVING on grpc.health.v1 (its start loads the
    model); raise if `alive()` turns false or `timeout` seconds pass first."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    # grpc backs off reconnecting up to seconds apart while nothing listens; poll at our own pace
    fast = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100)]
    fast.append(("grpc.max_reconnect_backoff_ms", 300))
    with grpc.insecure_channel(target, options=fast) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            try:
                if (
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return
            except grpc.RpcError:
                pass
            if not alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server at {target} did not become ready")
            time.sleep(0.3)
