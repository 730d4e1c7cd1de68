"""API keys. With a keys file, every hcache RPC must carry a key in its metadata
(`authorization: Bearer <key>` or `x-api-key: <key>`); each key is a tenant that owns
the sessions and contexts it creates, and sees no one else's. Health checking and
reflection stay open. Keys are kept only as SHA-256 digests."""

from __future__ import annotations

import contextvars
import hashlib
import hmac
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc

tenant_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("hcache_tenant", default=None)
OPEN_PREFIXES = ("/grpc.health.", "/grpc.reflection.")


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def load_keys(path: str | Path) -> dict[str, str]:
    """A keys file: one key per line as `tenant key` (or just `key`; the tenant is then named
    after the key's digest). Blank lines and lines starting with # are skipped."""
    keys: dict[str, str] = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) > 2:
            raise ValueError(f"{path}:{n}: expected 'tenant key' or 'key'")
        key = parts[-1]
        if len(key) < 16:
            raise ValueError(f"{path}:{n}: keys must be at least 16 characters")
        tenant = parts[0] if len(parts) == 2 else "key-" + digest(key)[:12]
        keys[digest(key)] = tenant
    if not keys:
        raise ValueError(f"{path}: no keys")
    return keys


def _key_of(metadata: tuple[tuple[str, str | bytes], ...] | None) -> str | None:
    for k, v in metadata or ():
        value = v.decode() if isinstance(v, bytes) else v
        if k == "authorization" and value.lower().startswith("bearer "):
            return value[7:].strip()
        if k == "x-api-key":
            return value.strip()
    return None


class AuthInterceptor(grpc.ServerInterceptor):
    def __init__(self, keys: dict[str, str]):
        self.keys = keys  # digest -> tenant

    def _tenant(self, key: str | None) -> str | None:
        if key is None:
            return None
        d = digest(key)
        for known, tenant in self.keys.items():  # constant-time compare of digests
            if hmac.compare_digest(d, known):
                return tenant
        return None

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None or details.method.startswith(OPEN_PREFIXES):
            return handler
        key = _key_of(details.invocation_metadata)
        tenant = self._tenant(key)
        why = "missing API key" if key is None else "invalid API key"
        if handler.unary_unary:
            inner = handler.unary_unary

            def unary(req: Any, ctx: grpc.ServicerContext) -> Any:
                if tenant is None:
                    ctx.abort(grpc.StatusCode.UNAUTHENTICATED, why)
                tenant_var.set(tenant)
                return inner(req, ctx)

            return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            inner_s = handler.unary_stream

            def stream(req: Any, ctx: grpc.ServicerContext) -> Iterator[Any]:
                if tenant is None:
                    ctx.abort(grpc.StatusCode.UNAUTHENTICATED, why)
                tenant_var.set(tenant)  # this handler thread serves one call at a time; set for each
                yield from inner_s(req, ctx)

            return grpc.unary_stream_rpc_method_handler(
                stream, handler.request_deserializer, handler.response_serializer
            )
        return handler
