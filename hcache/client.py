"""Python client for the hcache gRPC service.

with Client("localhost:50051") as c:
    sid = c.create_session("You are terse.").session_id
    for piece in c.generate(sid, "Hello!"):
        print(piece.text, end="")
"""

from __future__ import annotations

import time
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


@dataclass
class Reply:
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: pb.GenerateStats
    chunks: list[str] = field(default_factory=list)


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


class Client:
    def __init__(
        self,
        target: str = "localhost:50051",
        channel: grpc.Channel | None = None,
        timeout: float = 600,
        api_key: str | None = None,
        root_cert: bytes | None = None,
    ):
        """`api_key` goes with every call as `authorization: Bearer`; `root_cert` (PEM) turns TLS on."""
        if channel is None:
            if root_cert is not None:
                channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=root_cert))
            else:
                channel = grpc.insecure_channel(target)
        self.channel = channel
        if api_key:
            channel = grpc.intercept_channel(channel, _KeyInterceptor(api_key))
        self.stub = pb_grpc.HCacheStub(channel)
        self.timeout = timeout

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create_session(
        self, system_prompt: str = "", context_ids: list[str] | None = None, labels: dict[str, str] | None = None
    ) -> pb.Session:
        req = pb.CreateSessionRequest(system_prompt=system_prompt, context_ids=context_ids or [], labels=labels or {})
        return self.stub.CreateSession(req, timeout=self.timeout)

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
        sampling = pb.SamplingParams(
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, stop=stop or []
        )
        if seed is not None:
            sampling.seed = seed
        req = pb.GenerateRequest(session_id=session_id, message=message, token_ids=token_ids or [], sampling=sampling)
        return self.stub.Generate(req, timeout=self.timeout)

    def reply(self, session_id: str, message: str = "", **kw: object) -> Reply:
        """One whole turn."""
        chunks, ids = [], []
        last = None
        for r in self.generate(session_id, message, **kw):  # type: ignore[arg-type]
            if r.finished:
                last = r
            else:
                chunks.append(r.text)
                ids.extend(r.token_ids)
        if last is None:
            raise RuntimeError("the stream ended without a final message")
        return Reply("".join(chunks), ids, last.finish_reason, last.stats, chunks)

    def restore(self, session_id: str, method: str = "auto") -> pb.RestoreResponse:
        if method not in METHODS:
            raise ValueError(f"method must be one of {sorted(METHODS)}")
        return self.stub.RestoreSession(
            pb.RestoreRequest(session_id=session_id, method=METHODS[method]), timeout=self.timeout
        )

    def evict(self, session_id: str) -> pb.Session:
        return self.stub.EvictSession(pb.SessionRef(session_id=session_id), timeout=self.timeout)

    def delete(self, session_id: str) -> None:
        self.stub.DeleteSession(pb.SessionRef(session_id=session_id), timeout=self.timeout)

    def get(self, session_id: str) -> pb.Session:
        return self.stub.GetSession(pb.SessionRef(session_id=session_id), timeout=self.timeout)

    def list(self, page_size: int = 100) -> Iterator[pb.Session]:
        token = ""
        while True:
            r = self.stub.ListSessions(pb.ListSessionsRequest(page_size=page_size, page_token=token))
            yield from r.sessions
            if not r.next_page_token:
                return
            token = r.next_page_token

    def precompute_context(
        self, text: str = "", token_ids: list[int] | None = None, labels: dict[str, str] | None = None
    ) -> pb.Context:
        req = pb.PrecomputeContextRequest(text=text, token_ids=token_ids or [], labels=labels or {})
        return self.stub.PrecomputeContext(req, timeout=self.timeout)

    def stats(self) -> pb.Stats:
        return self.stub.GetStats(empty_pb2.Empty(), timeout=self.timeout)


def wait_for_server(target: str, timeout: float = 120, alive: Callable[[], bool] = lambda: True) -> None:
    """Block until the server at `target` reports SERVING on grpc.health.v1 (its start loads the
    model); raise if `alive()` turns false or `timeout` seconds pass first."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target) as ch:
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
