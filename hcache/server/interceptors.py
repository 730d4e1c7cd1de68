"""gRPC server interceptors: count every RPC by method and final status code, parse
requests inside the call, and map what a method raises to its status (`errors.py`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc

from hcache.server.errors import status_of


def _code(ctx: grpc.ServicerContext, failed: bool) -> str:
    code = ctx.code() if hasattr(ctx, "code") else None
    if code is None:
        return "UNKNOWN" if failed else "OK"
    return code.name if isinstance(code, grpc.StatusCode) else str(code)


class CountingInterceptor(grpc.ServerInterceptor):
    """Calls `count(rpc, code)` once per finished call (unary and server-streaming)."""

    def __init__(self, count: Callable[[str, str], None]):
        self.count = count

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        rpc = details.method.rsplit("/", 1)[-1]
        if handler.unary_unary:
            inner = handler.unary_unary

            def unary(req: Any, ctx: grpc.ServicerContext) -> Any:
                failed = True
                try:
                    out = inner(req, ctx)
                    failed = False
                    return out
                finally:
                    self.count(rpc, _code(ctx, failed))

            return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            inner_s = handler.unary_stream

            def stream(req: Any, ctx: grpc.ServicerContext) -> Iterator[Any]:
                failed = True
                try:
                    yield from inner_s(req, ctx)
                    failed = False
                except GeneratorExit:  # the client went away mid-stream
                    failed = False
                    raise
                finally:
                    self.count(rpc, "CANCELLED" if not ctx.is_active() and ctx.code() is None else _code(ctx, failed))

            return grpc.unary_stream_rpc_method_handler(
                stream, handler.request_deserializer, handler.response_serializer
            )
        return handler


class ParsingInterceptor(grpc.ServerInterceptor):
    """Parses requests inside the call, so a malformed one is INVALID_ARGUMENT with a reason
    (grpc's own deserialization failure would end the call as INTERNAL)."""

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer

        def parsed(raw: bytes, ctx: grpc.ServicerContext) -> Any:
            try:
                return parse(raw)
            except Exception as e:  # protobuf's DecodeError, or anything a parser raises
                ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {e}")

        if handler.unary_unary:
            inner = handler.unary_unary
            return grpc.unary_unary_rpc_method_handler(
                lambda raw, ctx: inner(parsed(raw, ctx), ctx), None, handler.response_serializer
            )
        if handler.unary_stream:
            inner_s = handler.unary_stream

            def stream(raw: bytes, ctx: grpc.ServicerContext) -> Iterator[Any]:
                yield from inner_s(parsed(raw, ctx), ctx)

            return grpc.unary_stream_rpc_method_handler(stream, None, handler.response_serializer)
        return handler


class ErrorsInterceptor(grpc.ServerInterceptor):
    """What a method raises ends its call with the error table's status and message
    (`errors.status_of`): the servicer's methods just raise. Innermost, so that a status a
    method or another interceptor already set (an abort) stands."""

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None:
            return None

        def abort(ctx: grpc.ServicerContext, e: Exception) -> None:
            if ctx.code() not in (None, grpc.StatusCode.OK):  # aborted already: `abort` raised this
                raise e
            st = status_of(e)
            ctx.abort(st.grpc, st.message)

        if handler.unary_unary:
            inner = handler.unary_unary

            def unary(req: Any, ctx: grpc.ServicerContext) -> Any:
                try:
                    return inner(req, ctx)
                except Exception as e:
                    abort(ctx, e)

            return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            inner_s = handler.unary_stream

            def stream(req: Any, ctx: grpc.ServicerContext) -> Iterator[Any]:
                try:
                    yield from inner_s(req, ctx)
                except Exception as e:
                    abort(ctx, e)

            return grpc.unary_stream_rpc_method_handler(
                stream, handler.request_deserializer, handler.response_serializer
            )
        return handler
