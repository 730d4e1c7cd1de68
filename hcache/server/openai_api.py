"""OpenAI's chat API over hcache sessions: `/v1/chat/completions` (streamed as server-sent
events or not) and `/v1/models`.

A request names its session (`session_id` in the body, which openai-python sends through
`extra_body`, or an `x-session-id` header) and then resends the conversation: the session's
stored messages plus one new user message. Without a session, the turn runs in a new session
that shares the stored state of the longest conversation under the same API key that the
request extends (found by whole 64-token chunks, matched token by token, shared copy-on-write;
the stored one stays as it was). A new session may instead start on precomputed contexts
(`extra_body={"contexts": [ids], "context_mode": "exact" | "blend" | "concat",
"blend_fraction": 0.15}`), placed in that order before the conversation. Every
response names its session (`session_id`, and the `x-session-id` header).
API keys arrive as `Authorization: Bearer` and are the gRPC side's tenants."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from sse_starlette import EventSourceResponse
from starlette.concurrency import run_in_threadpool

from hcache.engine.compose import Composition
from hcache.engine.engine import Engine
from hcache.engine.errors import InvalidArgument, Unavailable
from hcache.engine.records import TurnStats
from hcache.engine.sampler import SamplingParams
from hcache.engine.sequence import Event, Sequence
from hcache.engine.session import Session
from hcache.server.auth import digest
from hcache.server.errors import status_of

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1")
MAX_MESSAGES = 4096
MAX_STOPS = 4  # OpenAI's limit
MAX_CONTEXTS = 256
TYPE_OF = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
}
FINISH = {"stop": "stop", "length": "length", "cancelled": "stop"}


# --- errors: OpenAI's shape, mapped here for every route ---------------------------------
def error_response(status: int, message: str, code: str | None = None, param: str | None = None) -> JSONResponse:
    kind = TYPE_OF.get(status, "server_error" if status >= 500 else "invalid_request_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def error_of(e: Exception) -> JSONResponse:
    if isinstance(e, ApiError):
        return error_response(e.status, str(e), e.code, e.param)
    st = status_of(e)
    return error_response(st.http, st.message, st.code)


def validation_error(exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    msg = first.get("msg", "invalid request")
    return error_response(400, f"{where}: {msg}" if where else msg, "invalid_request", where or None)


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


# --- the request ---------------------------------------------------------------------------
class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def as_dict(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # clients send fields we do not use (user, metadata, ...)
    model: str
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)
    session_id: str | None = Field(None, min_length=1, max_length=200)
    # hcache's extension: precomputed contexts (RAG documents) placed before the conversation
    # of a new session, in order, as `context_mode` says (the server's by default)
    contexts: list[Annotated[str, Field(min_length=1, max_length=200)]] | None = Field(None, max_length=MAX_CONTEXTS)
    context_mode: Literal["exact", "blend", "concat"] | None = None
    blend_fraction: float | None = Field(None, ge=0, le=1)

    def sampling(self, default_max: int) -> tuple[SamplingParams, list[str]]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS:
            raise ApiError(400, f"stop: at most {MAX_STOPS} sequences", "invalid_request", "stop")
        most = self.max_completion_tokens or self.max_tokens or default_max
        seed = None if self.seed is None else self.seed % 2**63
        return SamplingParams(max_new_tokens=most, temperature=self.temperature, top_p=self.top_p, seed=seed), stops


# --- auth ----------------------------------------------------------------------------------
def tenant(request: Request, authorization: Annotated[str | None, Header()] = None) -> str | None:
    """The API key's tenant, or None where the server has no keys file."""
    keys: dict[str, str] | None = request.app.state.keys
    if not keys:
        return None
    if not authorization or not authorization.lower().startswith("bearer "):
        raise ApiError(401, "missing API key (Authorization: Bearer ...)", "invalid_api_key")
    d = digest(authorization[7:].strip())
    for known, name in keys.items():
        if hmac.compare_digest(d, known):
            return name
    raise ApiError(401, "invalid API key", "invalid_api_key")


def engine_of(request: Request) -> Engine:
    e = request.app.state.metrics.engine
    if e is None:
        raise Unavailable("the model is not loaded yet")
    return e


Tenant = Annotated[str | None, Depends(tenant)]
Eng = Annotated[Engine, Depends(engine_of)]


# --- routes ----------------------------------------------------------------------------------
@router.get("/models")
def models(engine: Eng, who: Tenant) -> dict:
    return {"object": "list", "data": [_model_card(engine)]}


@router.get("/models/{model_id}")
def model(model_id: str, engine: Eng, who: Tenant) -> dict:
    _check_model(engine, model_id)
    return _model_card(engine)


@router.post("/chat/completions", response_model=None)
async def chat_completions(
    body: ChatRequest,
    engine: Eng,
    who: Tenant,
    x_session_id: Annotated[str | None, Header()] = None,
) -> JSONResponse | EventSourceResponse:
    _check_model(engine, body.model)
    params, stops = body.sampling(engine.cfg.default_max_new_tokens)
    sink = _LoopSink(asyncio.get_running_loop()) if body.stream else None
    sid = body.session_id or x_session_id
    session, seq = await run_in_threadpool(_start, engine, body, sid, who, params, stops, sink)
    head = _Head(engine.model_name, session.id)
    if sink is not None:
        usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventSourceResponse(
            _stream(engine, seq, sink, head, usage), headers={"x-session-id": session.id}, ping=15, sep="\n"
        )
    text, reason, stats = await run_in_threadpool(_collect, engine, seq)
    return JSONResponse(head.completion(text, reason, stats), headers={"x-session-id": session.id})


# --- the turn ---------------------------------------------------------------------------------
def _start(
    engine: Engine,
    body: ChatRequest,
    sid: str | None,
    who: str | None,
    params: SamplingParams,
    stops: list[str],
    sink: _LoopSink | None,
) -> tuple[Session, Sequence]:
    """The session this conversation continues (or a new one) and its queued turn."""
    msgs = [m.as_dict() for m in body.messages]
    if msgs[-1]["role"] != "user":
        raise ApiError(400, "the last message must be the user's", "invalid_request", "messages")
    if sid and body.contexts:
        raise ApiError(400, "contexts are given when a session starts, not to a session", "invalid_request", "contexts")
    if sid:
        s = engine.get(sid, who)
        stored = s.meta.messages
        if len(msgs) != len(stored) + 1 or msgs[: len(stored)] != stored:
            raise ApiError(
                400,
                f"messages must be session {sid}'s conversation ({len(stored)} messages, as the API returned them) "
                "followed by one user message",
                "conversation_mismatch",
                "messages",
            )
        return s, engine.generate(s.id, msgs[-1]["content"], None, params, stops, who, sink)
    if body.contexts:
        cfg = engine.cfg
        frac = cfg.blend_fraction if body.blend_fraction is None else body.blend_fraction
        how = Composition(body.context_mode or cfg.context_mode, frac)
        s = engine.create_session(context_ids=body.contexts, tenant=who, history=msgs[:-1], composition=how)
    else:
        s, _ = engine.continue_chat(msgs, who)
    try:
        return s, engine.generate(s.id, msgs[-1]["content"], None, params, stops, who, sink)
    except Exception:
        engine.delete(s.id, who)  # a refused first turn leaves no empty session behind
        raise


def _collect(engine: Engine, seq: Sequence) -> tuple[str, str, TurnStats]:
    parts: list[str] = []
    try:
        for ev in engine.stream(seq):
            if ev.finished:
                return "".join(parts), ev.finish_reason, ev.stats or TurnStats()
            parts.append(ev.text)
    finally:
        engine.cancel(seq)  # a no-op once finished; keeps the partial turn if this thread was interrupted
    raise InvalidArgument("the turn ended without a final event")


class _LoopSink:
    """A turn's events handed to the event loop as the engine makes them: one thread hop per
    event, where iterating the engine's queue on a threadpool thread took two and kept a
    thread per stream taking the GIL beside the engine."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()

    def put(self, item: Event) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server is stopping
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


async def _stream(engine: Engine, seq: Sequence, sink: _LoopSink, head: _Head, usage: bool) -> AsyncIterator[dict]:
    """Chunks as OpenAI sends them: the role, the text as it comes, the finish reason, usage
    (when asked), then [DONE]. A client that goes away cancels the turn, which keeps what
    was generated, as a cancelled gRPC stream does."""
    try:
        yield {"data": json.dumps(head.chunk({"role": "assistant", "content": ""}))}
        while True:
            ev: Event = await sink.queue.get()
            if ev.error is not None:
                raise ev.error
            if not ev.finished:
                if ev.text:
                    yield {"data": json.dumps(head.chunk({"content": ev.text}))}
                continue
            yield {"data": json.dumps(head.chunk({}, FINISH.get(ev.finish_reason, ev.finish_reason)))}
            if usage:
                yield {"data": json.dumps(head.usage_chunk(ev.stats or TurnStats()))}
            yield {"data": "[DONE]"}
            return
    finally:
        engine.cancel(seq)


class _Head:
    """What every response and chunk of one completion shares."""

    def __init__(self, model: str, session_id: str):
        self.id, self.created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        self.model, self.session_id = model, session_id

    def _base(self, kind: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "session_id": self.session_id,
        }

    def completion(self, text: str, reason: str, st: TurnStats) -> dict:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": FINISH.get(reason, reason),
            "logprobs": None,
        }
        return {
            **self._base("chat.completion"),
            "choices": [choice],
            "usage": _usage(st),
            "session_id": self.session_id,
        }

    def chunk(self, delta: dict, reason: str | None = None) -> dict:
        choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
        return {**self._base("chat.completion.chunk"), "choices": [choice]}

    def usage_chunk(self, st: TurnStats) -> dict:
        return {
            **self._base("chat.completion.chunk"),
            "choices": [],
            "usage": _usage(st),
            "session_id": self.session_id,
        }


def _usage(st: TurnStats) -> dict:
    prompt = st.prompt_tokens + st.cached_tokens  # OpenAI's prompt counts the cached part too
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": st.completion_tokens,
        "total_tokens": prompt + st.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": st.cached_tokens},
    }
    if st.placed_tokens:  # hcache's: what a blend placed from storage and recomputed
        usage["context_details"] = {
            "placed_tokens": st.placed_tokens,
            "recomputed_tokens": st.recomputed_tokens,
            "fallbacks": st.context_fallbacks,
        }
    return usage


def _model_card(engine: Engine) -> dict:
    return {"id": engine.model_name, "object": "model", "created": 0, "owned_by": "hcache"}


def _check_model(engine: Engine, name: str) -> None:
    if name not in (engine.model_name, "default"):
        raise ApiError(404, f"model {name!r} not found; this server serves {engine.model_name!r}", "model_not_found")
