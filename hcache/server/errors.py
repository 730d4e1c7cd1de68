"""Every domain error's status, in one table for both front ends: a gRPC status code for
the servicer, an HTTP status and an OpenAI error code for the OpenAI API. Anything else is
internal: logged here with its traceback, and the caller learns only that it happened (or
the engine's own words, where the engine raised it)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

from hcache.engine.errors import EngineError
from hcache.storage.errors import ClusterUnavailable, LeaseHeld, LeaseLost, StorageError, StorageFull, UnknownOwner

log = logging.getLogger(__name__)
Code = grpc.StatusCode


@dataclass(frozen=True)
class Status:
    grpc: grpc.StatusCode
    http: int
    code: str  # the OpenAI error body's `code`
    message: str


# the engine's refusals name their gRPC code (engine/errors.py)
_ENGINE: dict[str, tuple[Code, int]] = {
    "INVALID_ARGUMENT": (Code.INVALID_ARGUMENT, 400),
    "NOT_FOUND": (Code.NOT_FOUND, 404),
    "FAILED_PRECONDITION": (Code.FAILED_PRECONDITION, 409),
    "RESOURCE_EXHAUSTED": (Code.RESOURCE_EXHAUSTED, 429),
    "UNAVAILABLE": (Code.UNAVAILABLE, 503),
}
# storage's, the most specific kind first
_STORAGE: tuple[tuple[type[Exception] | tuple[type[Exception], ...], Code, int, str], ...] = (
    (UnknownOwner, Code.NOT_FOUND, 404, "not_found"),
    (StorageFull, Code.RESOURCE_EXHAUSTED, 429, "storage_full"),
    ((LeaseHeld, LeaseLost), Code.ABORTED, 409, "session_leased"),  # another replica runs (or took) it
    (ClusterUnavailable, Code.UNAVAILABLE, 503, "cluster_unavailable"),
    (StorageError, Code.FAILED_PRECONDITION, 409, "storage"),
)
INTERNAL = Status(Code.INTERNAL, 500, "internal", "internal error; see the server log")


def status_of(e: BaseException) -> Status:
    """`e`'s status; an error of no known kind is logged, once, here."""
    if isinstance(e, EngineError):
        if e.code in _ENGINE:
            code, http = _ENGINE[e.code]
            return Status(code, http, e.code.lower(), str(e))
        log.error("internal error", exc_info=e)
        return Status(Code.INTERNAL, 500, "internal", str(e))  # the engine wrote it for the caller
    for kinds, code, http, name in _STORAGE:
        if isinstance(e, kinds):
            return Status(code, http, name, str(e))
    log.error("internal error", exc_info=e)
    return INTERNAL
