"""The gRPC service on loopback with the default model: multi-turn exactness across
evictions, forced restore methods and a restart; shared contexts; every bad input's
status; busy sessions, cancellation, pagination, health and reflection."""

from __future__ import annotations

import threading
from pathlib import Path

import grpc
import pytest
from engine_helpers import profile_for, reference
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from hcache.client import Client
from hcache.config import Config, EngineConfig, ServerConfig, StorageConfig
from hcache.engine.generate import ChatSession
from hcache.engine.sampler import SamplingParams
from hcache.server.app import Running, start

pytestmark = pytest.mark.model
SYSTEM = "You are a helpful assistant. Answer briefly."
TURNS = ["What is the capital of France?", "And of Italy?", "Which of the two is larger?", "Thanks! Bye."]
MAX_NEW = 24


def serve(loaded, dirs: list[Path], **engine: object) -> Running:
    cfg = Config(
        storage=StorageConfig([str(d) for d in dirs]),
        engine=EngineConfig(**{"store_kinds": "both", "kv_budget_bytes": 256 << 20, **engine}),  # type: ignore[arg-type]
        server=ServerConfig(port=0, http_port=-1, drain_seconds=10),
    )
    return start(cfg, profile_for(loaded.model), loaded)


@pytest.fixture(scope="module")
def server(default_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("store")
    run = serve(default_model, [d / "a", d / "b"])
    yield run
    run.stop(1)


@pytest.fixture(scope="module")
def client(server):
    with Client(f"127.0.0.1:{server.port}") as c:
        yield c


@pytest.fixture(scope="module")
def ref_replies(default_model):
    chat = ChatSession(default_model.model, default_model.tokenizer, SYSTEM)
    return [chat.reply(m, SamplingParams(max_new_tokens=MAX_NEW))[0] for m in TURNS]


def code_of(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        r = fn()
        if hasattr(r, "__iter__") and not isinstance(r, (str, bytes)):
            list(r)
    return e.value.code()


def test_multi_turn_exact_across_evictions_and_forced_methods(client, ref_replies):
    sid = client.create_session(SYSTEM).session_id
    assert len(bytes.fromhex(sid)) == 16  # 128 random bits
    for msg, want, method in zip(TURNS, ref_replies, [None, "kv", "hidden", "recompute"], strict=True):
        if method:
            client.evict(sid)
            assert not client.get(sid).resident
            r = client.restore(sid, method)
            n = {"kv": r.plan.kv, "hidden": r.plan.hidden, "recompute": r.plan.recompute}[method]
            assert n == 30 and r.num_tokens == client.get(sid).num_tokens and client.get(sid).resident
        got = client.reply(sid, msg, max_new_tokens=MAX_NEW)
        assert got.text == want
        assert got.finish_reason in ("stop", "length")
    # auto restore inside Generate, fused with the new turn's prefill
    client.evict(sid)
    r = client.reply(sid, "One more word?", max_new_tokens=4)
    assert r.stats.restore_ms > 0 and r.stats.plan.recompute + r.stats.plan.hidden + r.stats.plan.kv == 30


def test_restart_continues_identically(default_model, tmp_path, ref_replies):
    dirs = [tmp_path / "x", tmp_path / "y", tmp_path / "z"]
    run = serve(default_model, dirs)
    with Client(f"127.0.0.1:{run.port}") as c:
        sid = c.create_session(SYSTEM, labels={"user": "u1"}).session_id
        for msg, want in zip(TURNS[:2], ref_replies[:2], strict=True):
            assert c.reply(sid, msg, max_new_tokens=MAX_NEW).text == want
        n = c.get(sid).num_tokens
    run.stop()
    run = serve(default_model, dirs)
    try:
        with Client(f"127.0.0.1:{run.port}") as c:
            s = c.get(sid)
            assert (s.num_tokens, s.resident, dict(s.labels), s.turns) == (n, False, {"user": "u1"}, 2)
            for msg, want in zip(TURNS[2:], ref_replies[2:], strict=True):
                assert c.reply(sid, msg, max_new_tokens=MAX_NEW).text == want
    finally:
        run.stop()


def test_shared_context_sessions(client, default_model):
    m, tok = default_model.model, default_model.tokenizer
    doc = "The Zorblat river flows through the city of Quenth. Quenth is famous for blue bridges. " * 4
    ctx = client.precompute_context(doc, labels={"doc": "zorblat"})
    assert ctx.context_id and ctx.num_tokens == len(tok.encode(doc))
    p = SamplingParams(max_new_tokens=16)
    for q in ["Which river flows through Quenth?", "What is Quenth famous for?"]:
        s = client.create_session(context_ids=[ctx.context_id])
        assert s.num_tokens == ctx.num_tokens
        got = client.reply(s.session_id, q, max_new_tokens=16)
        ids = tok.encode(doc) + tok.encode_chat([{"role": "user", "content": q}])
        assert got.token_ids == reference(m, ids, p, tok.stop_ids)
        assert got.stats.cached_tokens == ctx.num_tokens and got.stats.restore_ms > 0
    assert code_of(lambda: client.create_session(context_ids=["ctx-nope"])) == grpc.StatusCode.NOT_FOUND


def test_bad_inputs_get_status_codes_and_change_nothing(client, server):
    sid = client.create_session(SYSTEM).session_id
    client.reply(sid, "Hi", max_new_tokens=3)
    before = server.store.owner_row(sid)
    INVALID = grpc.StatusCode.INVALID_ARGUMENT
    cases = [
        dict(message=""),
        dict(message="x", token_ids=[1]),
        dict(message="x", temperature=-1.0),
        dict(message="x", temperature=float("nan")),
        dict(message="x", top_p=1.5),
        dict(message="x", max_new_tokens=10**7),
        dict(message="x", stop=["s" * 1000]),
        dict(token_ids=[49152]),  # vocabulary is 0..49151
        dict(message="word " * 9000),  # beyond the 8192-token context
    ]
    for kw in cases:
        assert code_of(lambda kw=kw: client.generate(sid, **kw)) == INVALID, kw
    assert code_of(lambda: client.generate("0" * 32, message="x")) == grpc.StatusCode.NOT_FOUND
    assert code_of(lambda: client.get("nope")) == grpc.StatusCode.NOT_FOUND
    assert code_of(lambda: client.evict("nope")) == grpc.StatusCode.NOT_FOUND
    assert code_of(lambda: client.delete("nope")) == grpc.StatusCode.NOT_FOUND
    assert code_of(lambda: client.restore("nope")) == grpc.StatusCode.NOT_FOUND
    assert code_of(lambda: client.precompute_context("")) == INVALID
    assert code_of(lambda: client.precompute_context(token_ids=[10**6])) == INVALID
    after = server.store.owner_row(sid)
    assert (after.tokens, after.meta) == (before.tokens, before.meta)
    assert client.reply(sid, "Hi again", max_new_tokens=3).finish_reason in ("stop", "length")


def test_over_budget_is_resource_exhausted(default_model, tmp_path):
    run = serve(default_model, [tmp_path / "s"], kv_budget_bytes=8 << 20)  # 2 blocks: 128 tokens
    try:
        with Client(f"127.0.0.1:{run.port}") as c:
            sid = c.create_session().session_id
            code = code_of(lambda: list(c.generate(sid, "word " * 200, max_new_tokens=4)))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert c.get(sid).num_tokens == 0 and not c.get(sid).busy
    finally:
        run.stop()


def test_busy_session_and_cancel_mid_stream(client, server):
    sid = client.create_session(SYSTEM).session_id
    stream = client.generate(sid, "Write a long story about a dragon.", max_new_tokens=200)
    first = next(stream)
    assert first.text or first.token_ids
    assert code_of(lambda: client.generate(sid, "again")) == grpc.StatusCode.FAILED_PRECONDITION
    assert code_of(lambda: client.evict(sid)) == grpc.StatusCode.FAILED_PRECONDITION
    stream.cancel()
    for _ in range(200):  # the engine notices at its next step, then makes the partial turn durable
        s = client.get(sid)
        if not s.busy:
            break
        threading.Event().wait(0.05)
    assert not s.busy and s.turns == 1
    # the partial turn is kept and stored: the session continues from storage
    assert server.store.owner_row(sid).num_tokens == s.num_tokens
    client.evict(sid)
    assert client.reply(sid, "Summarize it.", max_new_tokens=4).finish_reason in ("stop", "length")


def test_list_delete_stats_health_reflection(client, server):
    ids = {client.create_session(labels={"n": str(i)}).session_id for i in range(5)}
    seen, pages = [], 0
    token = ""
    while True:
        r = client.stub.ListSessions(
            __import__("hcache.v1.hcache_pb2", fromlist=["x"]).ListSessionsRequest(page_size=2, page_token=token)
        )
        seen += [s.session_id for s in r.sessions]
        pages += 1
        token = r.next_page_token
        if not token:
            break
    assert ids <= set(seen) and len(seen) == len(set(seen)) and pages >= 3
    victim = ids.pop()
    client.delete(victim)
    assert code_of(lambda: client.get(victim)) == grpc.StatusCode.NOT_FOUND
    st = client.stats()
    assert st.sessions >= len(ids) and st.dirs and st.model
    ch = client.channel
    hs = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="hcache.v1.HCache"))
    assert hs.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(ch)
    resp = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in resp.list_services_response.service}
    assert {"hcache.v1.HCache", "grpc.health.v1.Health"} <= names
