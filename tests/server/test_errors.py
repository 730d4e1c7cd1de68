"""The one error table: each domain error's gRPC status, HTTP status and OpenAI code, and
what an error of no known kind shows (nothing but that it happened)."""

from __future__ import annotations

import logging

import grpc
import pytest

from hcache.engine import errors as engine
from hcache.server.errors import INTERNAL, status_of
from hcache.server.openai_api import error_of
from hcache.storage import errors as storage

C = grpc.StatusCode


@pytest.mark.parametrize(
    ("error", "code", "http", "name"),
    [
        (engine.InvalidArgument("bad"), C.INVALID_ARGUMENT, 400, "invalid_argument"),
        (engine.NotFound("bad"), C.NOT_FOUND, 404, "not_found"),
        (engine.FailedPrecondition("bad"), C.FAILED_PRECONDITION, 409, "failed_precondition"),
        (engine.ResourceExhausted("bad"), C.RESOURCE_EXHAUSTED, 429, "resource_exhausted"),
        (engine.Unavailable("bad"), C.UNAVAILABLE, 503, "unavailable"),
        (storage.UnknownOwner("bad"), C.NOT_FOUND, 404, "not_found"),
        (storage.StorageFull("bad"), C.RESOURCE_EXHAUSTED, 429, "storage_full"),
        (storage.LeaseHeld("s", "replica-b", 3, 500), C.ABORTED, 409, "session_leased"),
        (storage.ClusterUnavailable("bad"), C.UNAVAILABLE, 503, "cluster_unavailable"),
        (storage.ChunkError("s", 0, 1, "bad"), C.FAILED_PRECONDITION, 409, "storage"),
    ],
)
def test_each_kind_has_one_status_for_both_front_ends(error: Exception, code, http: int, name: str):
    st = status_of(error)
    assert (st.grpc, st.http, st.code, st.message) == (code, http, name, str(error))
    body = error_of(error)
    assert body.status_code == http
    assert f'"code":"{name}"' in body.body.decode()


def test_an_unknown_error_is_logged_and_shows_nothing_of_itself(caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.ERROR, logger="hcache.server.errors"):
        st = status_of(RuntimeError("secret path /etc/x"))
    assert st == INTERNAL and "secret" not in st.message
    assert any(r.exc_info and "secret" in str(r.exc_info[1]) for r in caplog.records)


def test_an_engine_failure_keeps_the_engines_words():
    st = status_of(engine.EngineError("the turn could not be saved: disk full"))
    assert (st.grpc, st.http, st.message) == (C.INTERNAL, 500, "the turn could not be saved: disk full")
