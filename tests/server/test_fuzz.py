"""Fuzzing the RPC surface with hypothesis: random and malformed field values, huge strings,
wrong wire types as raw bytes. Every call ends with an expected status (never INTERNAL or
UNKNOWN, never a hang), the server stays healthy, and a session's stored state is unchanged."""

from __future__ import annotations

import grpc
import pytest
from engine_helpers import profile_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hcache.client import Client
from hcache.config import Config, EngineConfig, ServerConfig, StorageConfig
from hcache.server.app import start
from hcache.v1 import hcache_pb2 as pb

# one worker runs the file in order: the last test checks what the fuzzers before it saw
pytestmark = [pytest.mark.model, pytest.mark.xdist_group("fuzz")]
OK = grpc.StatusCode.OK
EXPECTED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
METHODS = [
    "CreateSession",
    "Generate",
    "RestoreSession",
    "EvictSession",
    "DeleteSession",
    "GetSession",
    "ListSessions",
    "PrecomputeContext",
    "GetStats",
]
SEEN: dict = {}
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@pytest.fixture(scope="module")
def fuzzed(default_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    cfg = Config(
        storage=StorageConfig([str(d / "s")]),
        engine=EngineConfig(store_kinds="kv", kv_budget_bytes=64 << 20, default_max_new_tokens=2),
        server=ServerConfig(port=0, http_port=-1, max_message_bytes=1 << 20),
    )
    run = start(cfg, profile_for(default_model.model), default_model)
    with Client(f"127.0.0.1:{run.port}", timeout=60) as c:
        keep = c.create_session("Be brief.").session_id
        c.reply(keep, "Hello!", max_new_tokens=3)
        before = run.store.owner_row(keep)
        victim = c.create_session().session_id  # takes valid turns from the fuzzer
        yield run, c, keep, victim
    after = run.store.owner_row(keep)
    assert (after.tokens, after.meta, after.num_tokens) == (before.tokens, before.meta, before.num_tokens)
    run.stop(1)


def outcome(call) -> grpc.StatusCode:
    try:
        r = call()
        if hasattr(r, "__iter__") and not isinstance(r, (bytes, str)):
            list(r)
        return OK
    except grpc.RpcError as e:
        return e.code()


ids = st.one_of(st.text(max_size=80), st.just(""), st.binary(max_size=40).map(bytes.hex), st.just("x" * 5000))
texts = st.one_of(st.text(max_size=200), st.just(""), st.just("\x00\ud7ff\ufffd" * 50))
u32 = st.integers(0, 2**32 - 1)
floats = st.floats(allow_nan=True, allow_infinity=True, width=32)


@given(
    sid=st.one_of(ids, st.just("VICTIM")),
    message=texts,
    token_ids=st.lists(u32, max_size=20),
    max_new=st.one_of(st.integers(1, 3), u32),
    temperature=floats,
    top_p=floats,
    top_k=u32,
    stop=st.lists(st.text(max_size=300), max_size=20),
)
@FUZZ
def test_generate_fields(fuzzed, sid, message, token_ids, max_new, temperature, top_p, top_k, stop):
    _, c, keep, victim = fuzzed
    sid = victim if sid == "VICTIM" else sid
    assert sid != keep
    code = outcome(
        lambda: c.generate(sid, message, token_ids, max_new, temperature, top_p, top_k, stop=stop)  # type: ignore[arg-type]
    )
    assert code in (EXPECTED | {OK} if sid == victim else EXPECTED), code
    SEEN[code] = SEEN.get(code, 0) + 1


@given(method=st.sampled_from(METHODS), raw=st.binary(max_size=300))
@FUZZ
def test_raw_bytes(fuzzed, method, raw):
    _, c, keep, _ = fuzzed
    if method in ("CreateSession", "PrecomputeContext", "GetStats", "ListSessions"):
        return  # random bytes are often valid requests for these; their fields are fuzzed below
    call = c.channel.unary_stream if method == "Generate" else c.channel.unary_unary
    rpc = call(f"/hcache.v1.HCache/{method}", request_serializer=None, response_deserializer=None)
    if keep.encode() in raw:
        return
    code = outcome(lambda: rpc(raw, timeout=60))
    assert code in EXPECTED, code


def test_wrong_wire_types_and_huge_strings(fuzzed):
    _, c, keep, _ = fuzzed
    gen = c.channel.unary_stream("/hcache.v1.HCache/Generate", request_serializer=None, response_deserializer=None)
    # field 1 (session_id, a string) sent as a varint; field 3 (packed uint32) as a 64-bit fixed
    for raw in (b"\x08\x96\x01", b"\x19" + b"\x00" * 8, b"\x0a\xff\xff\xff\xff\x0f", b"\xff" * 20):
        assert outcome(lambda raw=raw: gen(raw, timeout=60)) == grpc.StatusCode.INVALID_ARGUMENT
    assert outcome(lambda: c.generate(keep, "a" * (2 << 20))) == grpc.StatusCode.RESOURCE_EXHAUSTED  # over 1 MB
    assert outcome(lambda: c.generate(keep, "a b " * 60000)) == grpc.StatusCode.INVALID_ARGUMENT  # > 8192 tokens
    assert outcome(lambda: c.precompute_context("word " * 100000)) in EXPECTED


@given(
    system=texts,
    labels=st.dictionaries(st.text(max_size=20), st.text(max_size=50), max_size=5),
    contexts=st.lists(ids, max_size=3),
    page_size=u32,
    page_token=ids,
    method=st.integers(-5, 10),
)
@FUZZ
def test_other_rpcs(fuzzed, system, labels, contexts, page_size, page_token, method):
    _, c, keep, _ = fuzzed
    code = outcome(lambda: c.create_session(system, contexts, labels))
    assert code in EXPECTED | {OK}, code
    assert outcome(lambda: c.stub.ListSessions(pb.ListSessionsRequest(page_size=page_size, page_token=page_token)))
    req = pb.RestoreRequest(session_id=page_token)
    req.method = method  # open enums take any int on the wire
    assert outcome(lambda: c.stub.RestoreSession(req, timeout=60)) in EXPECTED
    assert outcome(lambda: c.get(keep)) == OK
    assert c.stats().sessions >= 1


@given(
    message=st.text(min_size=1, max_size=100),
    max_new=st.integers(1, 3),
    temperature=st.floats(0, 2),
    top_p=st.floats(0, 1),
    top_k=st.integers(0, 100),
    seed=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    stop=st.lists(st.text(max_size=5), max_size=3),
)
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_generate_valid_values(fuzzed, message, max_new, temperature, top_p, top_k, seed, stop):
    _, c, _, victim = fuzzed
    code = outcome(lambda: c.generate(victim, message, None, max_new, temperature, top_p, top_k, seed, stop))
    assert code in EXPECTED | {OK}, code
    SEEN[code] = SEEN.get(code, 0) + 1


def test_zz_fuzz_reached_both_outcomes():
    """The field fuzzer made valid turns as well as refused ones (it ran before this)."""
    assert SEEN.get(OK, 0) >= 1 and sum(v for k, v in SEEN.items() if k != OK) >= 10, SEEN
