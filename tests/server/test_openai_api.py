"""OpenAI's API, driven by the official `openai` package (plain HTTP for malformed bodies):
replies equal the gRPC path's, sessions continue and restore, keys stay apart, hostile
bodies get 4xx and change nothing, and a dropped stream keeps its partial turn."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from engine_helpers import profile_for

from hcache.client import Client
from hcache.config import Config, EngineConfig, ServerConfig, StorageConfig
from hcache.server.app import start

pytestmark = pytest.mark.model
KEY_A, KEY_B = "alice-key-0123456789abcdef", "bob-key-0123456789abcdef0"
SYSTEM = "You are a helpful assistant. Answer briefly."
TURNS = ["What is the capital of France?", "And of Italy?", "Which of the two is larger?", "Thanks! Say goodbye."]


@pytest.fixture(scope="module")
def live(default_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("openai")
    (d / "keys").write_text(f"alice {KEY_A}\nbob {KEY_B}\n")
    cfg = Config(
        storage=StorageConfig([str(d / "a"), str(d / "b")]),
        engine=EngineConfig(store_kinds="both", kv_budget_bytes=256 << 20),
        server=ServerConfig(port=0, http_port=0, api_keys_file=str(d / "keys")),
    )
    run = start(cfg, profile_for(default_model.model), default_model)
    yield run
    run.stop(1)


def oai(live, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{live.http_port}/v1", api_key=key, max_retries=0, timeout=120)


def grpc_client(live, key: str = KEY_A) -> Client:
    return Client(f"127.0.0.1:{live.port}", api_key=key, timeout=120)


def post(live, body: bytes | dict, key: str | None = KEY_A, headers: dict | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    h = {"Content-Type": "application/json", **(headers or {})}
    if key:
        h["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(f"http://127.0.0.1:{live.http_port}/v1/chat/completions", data, h)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_models_and_a_completion_equal_to_grpc(live):
    c = oai(live)
    assert [m.id for m in c.models.list().data] == [live.engine.model_name]
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURNS[0]}]
    r = c.chat.completions.create(model="default", messages=msgs, temperature=0, max_tokens=12)
    assert r.object == "chat.completion" and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.session_id  # every response names its session
    with grpc_client(live) as g:
        sid = g.create_session(SYSTEM).session_id
        assert r.choices[0].message.content == g.reply(sid, TURNS[0], max_new_tokens=12).text


def test_streaming_equals_non_streaming_and_reports_usage(live):
    c = oai(live)
    msgs = [{"role": "user", "content": "Name three colours."}]
    whole = c.chat.completions.create(model="default", messages=msgs, temperature=0, max_tokens=16)
    chunks = list(
        c.chat.completions.create(
            model="default",
            messages=msgs,
            temperature=0,
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert len({ch.id for ch in chunks}) == 1 and chunks[0].session_id


def test_four_turns_resent_in_full_with_a_session_id_match_grpc(live):
    c = oai(live)
    msgs: list[dict] = [{"role": "system", "content": SYSTEM}]
    sid = None
    with grpc_client(live) as g:
        gsid = g.create_session(SYSTEM).session_id
        for i, turn in enumerate(TURNS):
            msgs.append({"role": "user", "content": turn})
            extra = {"session_id": sid} if sid else {}
            r = c.chat.completions.create(
                model="default", messages=msgs, temperature=0, max_tokens=10, seed=7, extra_body=extra
            )
            want = g.reply(gsid, turn, max_new_tokens=10).text
            assert r.choices[0].message.content == want, i
            sid = sid or r.session_id
            assert r.session_id == sid
            if i:
                assert r.usage.prompt_tokens_details.cached_tokens > 0
                assert r.usage.prompt_tokens_details.cached_tokens < r.usage.prompt_tokens
            msgs.append({"role": "assistant", "content": r.choices[0].message.content})
        # the header names the session too
        msgs.append({"role": "user", "content": "One more?"})
        r = c.chat.completions.with_raw_response.create(
            model="default", messages=msgs, temperature=0, max_tokens=4, extra_headers={"x-session-id": sid}
        )
        assert r.headers["x-session-id"] == sid and r.parse().session_id == sid


LONG_SYSTEM = (
    "You are a helpful assistant for travellers in Europe. Answer every question in one short, plain "
    "sentence, without lists, headings or emphasis, and say so when you do not know the answer. "
    "Prefer well-known facts about capitals, rivers, food and history over opinions."
)  # over a chunk: stored prefixes are found by whole 64-token chunks


def test_four_turns_resent_in_full_without_a_session_id_match_grpc(live):
    c = oai(live)
    msgs: list[dict] = [{"role": "system", "content": LONG_SYSTEM}]
    seen: list[str] = []
    with grpc_client(live) as g:
        gsid = g.create_session(LONG_SYSTEM).session_id
        for i, turn in enumerate(TURNS):
            msgs.append({"role": "user", "content": turn})
            r = c.chat.completions.create(model="default", messages=msgs, temperature=0.8, max_tokens=10, seed=7)
            want = g.reply(gsid, turn, max_new_tokens=10, temperature=0.8, seed=7).text
            assert r.choices[0].message.content == want, i
            assert r.session_id not in seen  # a new session each turn; the stored one stays as it was
            if i:
                cached = r.usage.prompt_tokens_details.cached_tokens
                assert 64 < cached < r.usage.prompt_tokens, cached
                # the sessions it shares with keep their own conversations
                assert [live.engine.get(sid, "alice").meta.messages for sid in seen] == [
                    msgs[: 2 * k + 3] for k in range(len(seen))
                ]
            seen.append(r.session_id)
            msgs.append({"role": "assistant", "content": r.choices[0].message.content})
    # another key resending the same conversation shares nothing
    resent = [*msgs, {"role": "user", "content": "Hi"}]
    r = oai(live, KEY_B).chat.completions.create(model="default", messages=resent, max_tokens=2)
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_evicted_session_continues_from_storage(live):
    c = oai(live)
    msgs = [{"role": "user", "content": "Count to five."}]
    r = c.chat.completions.create(model="default", messages=msgs, temperature=0, max_tokens=12)
    msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "Again."}]
    with grpc_client(live) as g:
        ref = g.create_session().session_id  # never evicted
        g.reply(ref, "Count to five.", max_new_tokens=12)
        want = g.reply(ref, "Again.", max_new_tokens=12).text
        g.evict(r.session_id)
        restores = live.engine.counters.restores
        r2 = c.chat.completions.create(
            model="default", messages=msgs, temperature=0, max_tokens=12, extra_body={"session_id": r.session_id}
        )
        assert live.engine.counters.restores == restores + 1
        assert r2.choices[0].message.content == want
        assert r2.usage.prompt_tokens_details.cached_tokens > 0


def test_keys_never_see_each_others_sessions(live):
    a, b = oai(live, KEY_A), oai(live, KEY_B)
    msgs = [{"role": "user", "content": "Hi"}]
    r = a.chat.completions.create(model="default", messages=msgs, temperature=0, max_tokens=3)
    msgs.append({"role": "assistant", "content": r.choices[0].message.content})
    msgs.append({"role": "user", "content": "Hello again"})
    with pytest.raises(openai.NotFoundError):
        b.chat.completions.create(model="default", messages=msgs, max_tokens=3, extra_body={"session_id": r.session_id})
    with pytest.raises(openai.AuthenticationError):
        oai(live, "wrong-key-0123456789abcdef").chat.completions.create(model="default", messages=msgs)
    status, body = post(live, {"model": "default", "messages": msgs}, key=None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"


def test_hostile_bodies_get_4xx_and_change_nothing(live):
    c = oai(live)
    msgs = [{"role": "user", "content": "Hi"}]
    r = c.chat.completions.create(model="default", messages=msgs, temperature=0, max_tokens=3)
    sid = r.session_id
    before = live.engine.get(sid, "alice")
    snapshot = (list(before.tokens), [dict(m) for m in before.meta.messages], before.meta.turns)
    ok_history = [*msgs, {"role": "assistant", "content": r.choices[0].message.content}]
    sessions = {x.id for x in live.engine.list(tenant="alice")}
    bad = [
        (b"{not json", 400),
        ({"model": "default", "messages": "hello", "session_id": sid}, 400),
        ({"model": "default", "messages": [{"role": "wizard", "content": "x"}], "session_id": sid}, 400),
        ({"model": "default", "messages": [{"role": "user", "content": 5}], "session_id": sid}, 400),
        ({"model": "default", "messages": [*ok_history, {"role": "user", "content": "x"}], "max_tokens": -1}, 400),
        ({"model": "default", "messages": [{"role": "user", "content": "x"}] * 10_000, "session_id": sid}, 400),
        ({"model": "default", "messages": [{"role": "user", "content": "x" * (9 << 20)}], "session_id": sid}, 413),
        ({"model": "default", "messages": [*ok_history, {"role": "user", "content": "x" * 200_000}]}, 400),
        ({"model": "default", "messages": [{"role": "user", "content": "rewritten"}], "session_id": sid}, 400),
        ({"model": "default", "messages": [*ok_history, {"role": "user", "content": "x"}], "n": 2}, 400),
        ({"model": "gpt-4o", "messages": [*ok_history, {"role": "user", "content": "x"}], "session_id": sid}, 404),
        ({"model": "default", "messages": [{"role": "user", "content": "x"}], "session_id": "nope"}, 404),
    ]
    for body, want in bad:
        status, out = post(live, body)
        assert status == want, (status, out, str(body)[:200])
        err = out["error"]
        assert err["message"] and "Traceback" not in err["message"] and err["type"]
    assert {x.id for x in live.engine.list(tenant="alice")} == sessions  # refused new conversations left none
    after = live.engine.get(sid, "alice")
    assert (list(after.tokens), [dict(m) for m in after.meta.messages], after.meta.turns) == snapshot


def test_a_dropped_stream_keeps_its_partial_turn(live):
    c = oai(live)
    r = c.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    sid = r.session_id
    turns = live.engine.get(sid, "alice").meta.turns
    msgs = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": r.choices[0].message.content},
        {"role": "user", "content": "Write a long story about a fox who learns to fly."},
    ]
    stream = c.chat.completions.create(
        model="default", messages=msgs, max_tokens=200, stream=True, extra_body={"session_id": sid}
    )
    got = 0
    for ch in stream:
        got += bool(ch.choices and ch.choices[0].delta.content)
        if got >= 3:
            break
    stream.close()
    deadline = time.monotonic() + 30
    while live.engine.get(sid, "alice").busy and time.monotonic() < deadline:
        time.sleep(0.1)
    s = live.engine.get(sid, "alice")
    assert s.meta.turns == turns + 1 and not s.busy
    assert s.meta.messages[-1]["role"] == "assistant" and s.meta.messages[-1]["content"]
    assert len(live.engine.tok.encode(s.meta.messages[-1]["content"])) < 200  # cut short, kept


@pytest.fixture
def limited(default_model, tmp_path):
    (tmp_path / "keys").write_text(f"alice {KEY_A}\n")
    cfg = Config(
        storage=StorageConfig([str(tmp_path / "a")]),
        engine=EngineConfig(store_kinds="kv", kv_budget_bytes=64 << 20, max_sessions_per_tenant=2),
        server=ServerConfig(port=0, http_port=0, api_keys_file=str(tmp_path / "keys")),
    )
    run = start(cfg, profile_for(default_model.model), default_model)
    yield run
    run.stop(1)


def openai_error(e: openai.APIStatusError) -> dict:
    err = e.response.json()["error"]
    assert err["message"] and "Traceback" not in err["message"] and err["type"]
    return err


def test_busy_session_key_limit_and_draining_get_409_429_503(limited):
    c = oai(limited)
    hi = [{"role": "user", "content": "Hi"}]
    r = c.chat.completions.create(model="default", messages=hi, max_tokens=2)
    sid, stored = r.session_id, [*hi, {"role": "assistant", "content": r.choices[0].message.content}]
    s = limited.engine.get(sid, "alice")
    with limited.engine.lock:
        s.busy = True  # as while a turn of it runs (a real one may end first: the model picks when)
    try:
        with pytest.raises(openai.ConflictError) as busy:  # a second turn on it at once
            c.chat.completions.create(
                model="default", messages=[*stored, {"role": "user", "content": "x"}], extra_body={"session_id": sid}
            )
    finally:
        with limited.engine.lock:
            s.busy = False
    assert busy.value.status_code == 409 and "busy" in openai_error(busy.value)["message"]
    with pytest.raises(openai.RateLimitError) as full:  # a second conversation is this key's limit; a third
        for _ in range(2):
            c.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hello"}], max_tokens=2)
    assert full.value.status_code == 429 and openai_error(full.value)["type"]
    assert len(limited.engine.list(tenant="alice")) == 2
    limited.engine.draining = True  # as SIGTERM starts a drain
    with pytest.raises(openai.InternalServerError) as gone:
        c.chat.completions.create(model="default", messages=hi, max_tokens=2)
    assert gone.value.status_code == 503 and "draining" in openai_error(gone.value)["message"]


DOCS = [
    "The Zarnik bridge in Oslen was finished in 1931 and is 412 metres long.",
    "Oslen's largest library holds 2.1 million books and opened in 1968.",
    "The river under the Zarnik bridge is called the Vell; it freezes most winters.",
]


def test_contexts_over_grpc_and_openai(live):
    """One-shot questions over precomputed documents: exact equals a plain prefill of the same
    tokens; blend and concat place them; a deleted context is NOT_FOUND by name."""
    question = "How long is the Zarnik bridge?"
    tok = live.engine.tok
    with grpc_client(live) as g:
        ctx = [g.precompute_context(text=d) for d in DOCS]
        ids = [c.context_id for c in ctx]
        exact = g.ask(ids, question, "exact", max_new_tokens=12)
        plain = g.create_session().session_id
        prompt = [t for d in DOCS for t in tok.encode(d)] + tok.encode_chat([{"role": "user", "content": question}])
        assert exact.token_ids == g.reply(plain, token_ids=prompt, max_new_tokens=12).token_ids
        assert exact.session_id and exact.stats.cached_tokens == ctx[0].num_tokens
        blend = g.ask(ids, question, "blend", 0.5, max_new_tokens=12)
        placed = sum(c.num_tokens for c in ctx)
        assert blend.stats.placed_tokens == placed and blend.stats.recomputed_tokens == -(-placed // 2)
        assert g.get(blend.session_id).context_ids == ids
    c = oai(live)
    r = c.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": question}],
        temperature=0,
        max_tokens=12,
        extra_body={"contexts": ids, "context_mode": "exact"},
    )
    assert r.choices[0].message.content == exact.text
    r = c.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": question}],
        temperature=0,
        max_tokens=12,
        extra_body={"contexts": ids, "context_mode": "concat"},
    )
    assert r.usage.context_details == {"placed_tokens": placed, "recomputed_tokens": 0, "fallbacks": []}
    with grpc_client(live) as g:
        g.delete(ctx[2].context_id)
        with pytest.raises(grpc.RpcError) as e:
            g.ask(ids, question, max_new_tokens=4)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and ctx[2].context_id in e.value.details()
    st, body = post(live, {"model": "default", "messages": [{"role": "user", "content": "hi"}], "contexts": ids})
    assert st == 404 and ctx[2].context_id in body["error"]["message"]
    st, body = post(
        live,
        {"model": "default", "messages": [{"role": "user", "content": "hi"}], "contexts": ids[:2], "blend_fraction": 2},
    )
    assert st == 400 and body["error"]["param"] == "blend_fraction"
