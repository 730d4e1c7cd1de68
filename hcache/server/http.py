"""The HTTP side: an ASGI app (FastAPI) under uvicorn, on the same engine as gRPC.
/metrics (Prometheus), /healthz (live), /readyz (model loaded, decode step compiled, every
storage directory writable, the session cluster reachable in cluster mode, not draining), /dashboard and its
JSON feed, and OpenAI's /v1 API (`openai_api.py`). Errors leave in OpenAI's JSON shape, mapped in one place."""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import threading
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from hcache.engine.errors import EngineError
from hcache.server import openai_api
from hcache.server.metrics import Metrics
from hcache.storage.errors import StorageError

log = logging.getLogger(__name__)
STATIC = Path(__file__).parent / "static"
MAX_BODY_BYTES = 8 << 20  # a chat request's JSON; larger ones get 413 before they are parsed
DRAIN_BYTES = 64 << 20  # an over-long body up to this is read and dropped before the 413

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]


def readiness(metrics: Metrics) -> tuple[bool, list[str]]:
    e = metrics.engine
    if e is None:
        return False, ["model not loaded"]
    problems = ["draining"] if e.draining else []
    if not e.runner.compiled.is_set():
        # eager steps serve meanwhile, their rounding not the compiled step's: a load
        # balancer sends sessions to replicas whose continuations match each other's
        problems.append("compiling the decode step")
    for d in e.store.dirs:
        try:
            fd, name = tempfile.mkstemp(dir=d, prefix=".ready-")
            os.close(fd)
            os.unlink(name)
        except OSError as err:
            problems.append(f"{d} not writable: {err.strerror}")
    problems += e.sharing.problems()
    return not problems, problems


class BodyLimit:
    """413 for a body over `limit` bytes, declared or streamed, before anything parses it."""

    def __init__(self, app: ASGIApp, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[dict]], send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            if int(declared) <= DRAIN_BYTES:  # read it first: a client still sending sees a reset otherwise
                while (await receive()).get("more_body"):
                    pass
            return await _too_large(self.limit)(scope, receive, send)
        seen = 0

        async def limited() -> dict:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise _BodyTooLarge
            return msg

        try:
            await self.app(scope, limited, send)
        except _BodyTooLarge:
            await _too_large(self.limit)(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


def _too_large(limit: int) -> JSONResponse:
    return openai_api.error_response(413, f"request body over {limit} bytes")


def build_app(metrics: Metrics, keys: dict[str, str] | None = None) -> FastAPI:
    app = FastAPI(title="hcache", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.metrics = metrics
    app.state.keys = keys

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return openai_api.validation_error(exc)

    async def known(request: Request, exc: Exception) -> JSONResponse:
        return openai_api.error_of(exc)

    for kind in (openai_api.ApiError, EngineError, StorageError):  # errors with a status of their own
        app.add_exception_handler(kind, known)

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        return openai_api.error_of(exc)  # logged there; starlette logs it again and re-raises

    @app.middleware("http")
    async def count(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        response = await call_next(request)
        route = request.scope.get("route")
        metrics.requests.labels(f"HTTP {getattr(route, 'path', 'unknown')}", str(response.status_code)).inc()
        response.headers.setdefault("Cache-Control", "no-store")
        return response

    @app.get("/metrics")
    def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz")
    def healthz() -> PlainTextResponse:
        return PlainTextResponse("ok\n")

    @app.get("/readyz")
    def readyz() -> JSONResponse:
        ok, problems = readiness(metrics)
        return JSONResponse({"ready": ok, "problems": problems}, status_code=200 if ok else 503)

    @app.get("/")
    @app.get("/dashboard")
    def dashboard() -> FileResponse:
        return FileResponse(STATIC / "dashboard.html")

    @app.get("/api/dashboard")
    def dashboard_feed() -> JSONResponse:
        return JSONResponse(metrics.dashboard.json())

    @app.get("/static/{path:path}")
    def static(path: str) -> Response:
        target = (STATIC / path).resolve()
        if STATIC.resolve() not in target.parents or not target.is_file():
            return PlainTextResponse("not found\n", status_code=404)
        return FileResponse(target)

    app.include_router(openai_api.router)
    return app


class SidePort:
    """uvicorn serving the app on its own thread and event loop."""

    def __init__(
        self,
        metrics: Metrics,
        host: str,
        port: int,
        keys: dict[str, str] | None = None,
        tls: tuple[str, str] | None = None,
    ):
        self.metrics = metrics
        app = BodyLimit(build_app(metrics, keys), MAX_BODY_BYTES)
        cert, key = tls or (None, None)
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
            ssl_certfile=cert,
            ssl_keyfile=key,
            timeout_graceful_shutdown=2,
        )
        self.server = uvicorn.Server(config)
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="hcache-http", daemon=True)
        self._thread.start()
        while not self.server.started and self._thread.is_alive():
            self._thread.join(0.01)
        if not self.server.started:
            err = self._failed
            raise OSError(getattr(err, "errno", None), getattr(err, "strerror", None) or str(err or "did not start"))
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, name="hcache-rates", daemon=True)
        self._sampler.start()

    def _run(self) -> None:
        try:
            asyncio.run(self.server.serve())
        except BaseException as e:  # a port in use ends serve() with SystemExit
            self._failed = e if isinstance(e, OSError) else OSError(str(e))

    def _sample(self) -> None:
        while not self._stop.wait(2.0):
            try:
                self.metrics.dashboard.sample_rates()
            except Exception:
                log.exception("sampling storage rates")

    def close(self) -> None:
        self._stop.set()
        self.server.should_exit = True
        self._thread.join(5)
