"""Conversations resent in full without a session (what stock OpenAI clients do): each turn
runs in a new session that shares the longest stored conversation it extends, copy-on-write.
Replies equal a never-evicted session's, the stored conversation stays as it was, the shared
state outlives its parent, and tenants never match each other's prefixes."""

from __future__ import annotations

import pytest
from engine_helpers import make_engine, turn

from hcache.engine.errors import InvalidArgument
from hcache.engine.sampler import SamplingParams
from hcache.storage.layout import CHUNK_TOKENS
from hcache.storage.prefixes import common_prefix

pytestmark = pytest.mark.model
SYSTEM = (
    "You are a helpful assistant for travellers in Europe. Answer every question in one short, plain "
    "sentence, without lists, headings or emphasis, and say so when you do not know the answer. "
    "Prefer well-known facts about capitals, rivers, food and history over opinions."
)  # longer than a chunk, so even the first resend shares state
TURNS = ["What is the capital of France?", "And of Italy?", "Which of the two is larger?", "Thanks!"]
PARAMS = SamplingParams(max_new_tokens=10)


def test_resent_chat_forks_the_longest_stored_one_and_stays_exact(default_model, tmp_path) -> None:
    eng, store = make_engine(default_model.model, default_model.tokenizer, [tmp_path / "a", tmp_path / "b"])
    tok = default_model.tokenizer
    try:
        ref = eng.create_session(SYSTEM, tenant="ref")  # never evicted: the reference
        msgs = [{"role": "system", "content": SYSTEM}]
        forks = []
        for i, t in enumerate(TURNS):
            want, _ = turn(eng, ref.id, message=t, params=PARAMS)
            msgs.append({"role": "user", "content": t})
            s, shared = eng.continue_chat(msgs, "alice")
            ids = tok.encode_chat(msgs)
            assert shared < len(ids)
            if i:  # the previous turn's session: every token it shares with this one
                parent = forks[-1]
                common = min(common_prefix(parent.tokens, ids), len(ids) - 1)
                assert shared == common >= CHUNK_TOKENS and shared % CHUNK_TOKENS
                assert shared >= len(parent.tokens) - 2  # at most the reply's end is retokenized
                before = (list(parent.tokens), [dict(m) for m in parent.meta.messages])
            got, stats = turn(eng, s.id, message=t, params=PARAMS)
            assert got == want, i
            assert stats["cached_tokens"] == shared
            if i:
                assert (parent.tokens, parent.meta.messages) == before  # the stored one stays as it was
            msgs.append({"role": "assistant", "content": tok.decode(got)})
            forks.append(s)
        assert eng.counters.prefix_matches == len(TURNS) - 1 and eng.counters.prefix_tokens > 0
        assert eng.counters.kv_handovers == len(TURNS) - 1  # each parent was resident: its KV moved over
        assert not any(f.resident for f in forks[:-1])
        # the shared state outlives its parent: delete every earlier session, evict the last
        for s in forks[:-1]:
            eng.delete(s.id, "alice")
        eng.evict(forks[-1].id, "alice")
        msgs.append({"role": "user", "content": "Goodbye."})
        s, shared = eng.continue_chat(msgs, "alice")
        assert shared > 0
        restores = eng.counters.restores
        got, _ = turn(eng, s.id, message="Goodbye.", params=PARAMS)
        assert eng.counters.restores == restores + 1  # read back from the shared chunks
        want, _ = turn(eng, ref.id, message="Goodbye.", params=PARAMS)
        assert got == want
        # another tenant never matches; neither does a conversation that differs early
        assert eng.continue_chat(msgs, "bob")[1] == 0
        other = [{"role": "system", "content": "Be terse."}, *msgs[1:]]
        assert eng.continue_chat(other, "alice")[1] == 0
        with pytest.raises(InvalidArgument, match="last message"):
            eng.continue_chat(msgs[:-1], "alice")
    finally:
        eng.close()
        store.close()
