"""What the engine refuses, by kind; the servicer maps each to a gRPC status code."""

from __future__ import annotations


class EngineError(Exception):
    code = "INTERNAL"


class NotFound(EngineError):
    code = "NOT_FOUND"


class InvalidArgument(EngineError):
    code = "INVALID_ARGUMENT"


class FailedPrecondition(EngineError):
    code = "FAILED_PRECONDITION"


class ResourceExhausted(EngineError):
    code = "RESOURCE_EXHAUSTED"


class Unavailable(EngineError):
    code = "UNAVAILABLE"
