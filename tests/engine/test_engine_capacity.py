"""The engine under a small store: cold sessions give back their chunks in the background
and stay exact (restored by recompute or a mix), idle sessions expire with a TTL and say
so, and a context a turn is using is never released."""

from __future__ import annotations

import random
import time

import pytest
from conftest import tload
from engine_helpers import make_engine, reference, turn, word_tokenizer

from hcache.engine import reclaimer
from hcache.engine.errors import NotFound, ResourceExhausted
from hcache.engine.sampler import SamplingParams
from hcache.storage.fsck import fsck
from hcache.storage.layout import CHUNK_TOKENS, num_chunks


def rand_ids(rng: random.Random, n: int, vocab: int = 300) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


@pytest.fixture
def model(tiny_folder):
    return tload(tiny_folder("llama_gqa"))


# a KV budget of ~3 sessions (the rest are evicted, and cold ones lose their chunks), or one
# that keeps every session resident: their state on disk is then 10x the store, and the
# reclaimer must evict idle resident sessions from memory to release their chunks
@pytest.mark.parametrize("kv_budget", [20 * 24576, 64 << 20], ids=["evicted", "resident"])
def test_small_store_serves_ten_times_its_capacity_exactly(model, tmp_path, kv_budget):
    tok = word_tokenizer(model.cfg.vocab_size)
    dirs = [tmp_path / "a", tmp_path / "b"]
    storage = {"max_bytes": 768 << 10, "low_watermark": 0.3, "high_watermark": 0.5}
    eng, store = make_engine(model, tok, dirs, storage, kv_budget_bytes=kv_budget)
    capacity = store.space().capacity
    try:
        rng = random.Random(7)
        p = SamplingParams(max_new_tokens=8)
        sessions = [eng.create_session() for _ in range(36)]
        history: dict[str, list[int]] = {s.id: [] for s in sessions}
        plans = []
        for _ in range(5):
            for s in rng.sample(sessions, len(sessions)):
                new = rand_ids(rng, rng.randrange(20, 36))
                got, stats = turn(eng, s.id, token_ids=new, params=p)  # never refused
                assert got == reference(model, [*history[s.id], *new], p, set())
                history[s.id] += [*new, *got]
                plans.append(stats["plan"])
        # what the sessions would store had nothing been released (both kinds, every layer)
        per_chunk = sum(sh.slot_bytes for sh in store.shapes.values()) * model.cfg.num_layers
        total = sum(num_chunks(len(h) - 1) * per_chunk for h in history.values())
        assert total >= 10 * capacity
        assert store.stats.bytes_released > 0 and store.stats.demotions > 0
        assert eng.counters.evictions > 0  # with the large budget, only by the reclaimer
        assert any(pl["recompute"] for pl in plans)  # released sessions came back by recompute
        assert store.space().used <= capacity
    finally:
        eng.close()
        store.close()
    report = fsck([str(d) for d in dirs])
    assert report.clean, report.lines()


def test_a_turn_bigger_than_the_store_is_refused_at_once(model, tmp_path):
    tok = word_tokenizer(model.cfg.vocab_size)
    eng, store = make_engine(model, tok, [tmp_path / "s"])
    try:
        per_chunk = sum(sh.slot_bytes for sh in store.shapes.values()) * model.cfg.num_layers
        store.set_quota(3 * per_chunk)  # three chunks of every layer and kind
        rng = random.Random(5)
        p = SamplingParams(max_new_tokens=8)
        s = eng.create_session()
        t0 = time.monotonic()
        with pytest.raises(ResourceExhausted, match="capacity"):  # 3 chunks, and a fresh tail: 4
            turn(eng, s.id, token_ids=rand_ids(rng, 150), params=p)
        assert time.monotonic() - t0 < reclaimer.ROOM_WAIT_S  # refused, not left waiting for room
        first = rand_ids(rng, 20)
        got, _ = turn(eng, s.id, token_ids=first, params=p)  # the refusal changed nothing
        assert got == reference(model, first, p, set())
        # 3 chunks fit the store only without the one the session holds: its turn is queued, so
        # the session gives it up (evicted, then released) and is restored by recompute
        more = rand_ids(rng, 60)
        got2, stats = turn(eng, s.id, token_ids=more, params=p)
        assert got2 == reference(model, [*first, *got, *more], p, set())
        assert stats["plan"]["recompute"] == model.cfg.num_layers
    finally:
        eng.close()
        store.close()


def test_turns_running_together_do_not_count_the_same_room_twice(model, tmp_path):
    tok = word_tokenizer(model.cfg.vocab_size)
    eng, store = make_engine(model, tok, [tmp_path / "s"])
    try:
        per_chunk = sum(sh.slot_bytes for sh in store.shapes.values()) * model.cfg.num_layers
        store.set_quota(3 * per_chunk)
        rng = random.Random(11)
        p = SamplingParams(max_new_tokens=8)
        a, b = eng.create_session(), eng.create_session()
        # each turn writes 2 chunks (3 with a fresh tail, as admission counts): both fit the
        # empty store alone, not together; the second waits for the first, then for its release
        qa, qb = rand_ids(rng, 100), rand_ids(rng, 100)
        seqs = [eng.generate(a.id, token_ids=qa, params=p), eng.generate(b.id, token_ids=qb, params=p)]
        got = [[t for ev in eng.stream(seq) for t in ev.token_ids] for seq in seqs]
        assert got == [reference(model, q, p, set()) for q in (qa, qb)]
        assert store.stats.bytes_released > 0
    finally:
        eng.close()
        store.close()


def test_ttl_deletes_idle_sessions_which_then_say_they_expired(model, tmp_path, monkeypatch):
    tok = word_tokenizer(model.cfg.vocab_size)
    dirs = [tmp_path / "s"]
    eng, store = make_engine(model, tok, dirs, session_ttl_s=1.0)
    p = SamplingParams(max_new_tokens=4)
    try:
        old, kept = eng.create_session(), eng.create_session()
        turn(eng, old.id, token_ids=[1, 2, 3], params=p)
        deadline = time.monotonic() + 10
        while old.id in eng.registry.sessions and time.monotonic() < deadline:
            turn(eng, kept.id, token_ids=[4, 5], params=p)  # used within the TTL: kept
            time.sleep(0.2)
        assert old.id not in eng.registry.sessions and kept.id in eng.registry.sessions
        for call in (lambda: eng.generate(old.id, token_ids=[1]), lambda: eng.get(old.id)):
            with pytest.raises(NotFound, match="expired"):
                call()
        with pytest.raises(NotFound, match="not found"):
            eng.get("0" * 32)  # never existed: no claim that it expired
        assert old.id not in {r.owner for r in store.owners()}  # records included
        assert eng.counters.expiries == 1
    finally:
        eng.close()
        store.close()
    assert fsck([str(d) for d in dirs]).clean
    eng, store = make_engine(model, tok, dirs)  # after a restart too
    try:
        with pytest.raises(NotFound, match="expired"):
            eng.get(old.id)
        # after TOMBSTONE_KEEP_S the tombstone goes (without a TTL too): plainly not found
        monkeypatch.setattr(reclaimer, "TOMBSTONE_KEEP_S", 0.0)
        eng.reclaimer._next_prune = 0.0
        eng.reclaimer.step()
        assert store.expired(old.id) is None
        with pytest.raises(NotFound, match="not found"):
            eng.get(old.id)
    finally:
        eng.close()
        store.close()


def test_context_in_use_is_never_released(model, tmp_path):
    tok = word_tokenizer(model.cfg.vocab_size)
    eng, store = make_engine(model, tok, [tmp_path / "s"], {"low_watermark": 0.0, "high_watermark": 0.0})
    try:
        rng = random.Random(3)
        doc = rand_ids(rng, 3 * CHUNK_TOKENS)
        ctx = eng.precompute_context(token_ids=doc)
        s = eng.create_session(context_ids=[ctx.id])
        other = eng.create_session()
        p = SamplingParams(max_new_tokens=6)
        turn(eng, other.id, token_ids=rand_ids(rng, 70), params=p)
        eng.evict(other.id)
        kinds = store.owner_row(ctx.id).layer_kinds
        # the store is now "full": every pass wants everything released
        store.cfg.low_watermark = store.cfg.high_watermark = 1.0
        q = rand_ids(rng, 20)
        seq = eng.generate(s.id, token_ids=q, params=p)  # the session reads the context's chunks
        eng.reclaimer.step()
        assert store.owner_row(ctx.id).layer_kinds == kinds  # in use: kept
        # an idle one was not (the reclaimer's own thread may hold it mid-release: this pass
        # then skips it, and that thread finishes it)
        deadline = time.monotonic() + 10
        while store.owner_row(other.id).layer_kinds.strip("-") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.owner_row(other.id).layer_kinds.strip("-") == ""
        got = [t for ev in eng.stream(seq) for t in ev.token_ids]
        assert got == reference(model, doc + q, p, set())
        assert [v.id for v in eng.reclaimer._victims()][-1] == ctx.id  # shared: released last
        eng.evict(s.id)
        deadline = time.monotonic() + 10
        while store.owner_row(ctx.id).layer_kinds.strip("-") and time.monotonic() < deadline:
            eng.reclaimer.wake.set()
            time.sleep(0.05)
        assert store.owner_row(ctx.id).layer_kinds.strip("-") == ""  # nothing uses it now: released
        q2 = rand_ids(rng, 15)
        got2, stats = turn(eng, s.id, token_ids=q2, params=p)
        assert got2 == reference(model, [*doc, *q, *got, *q2], p, set())
        assert stats["plan"]["recompute"] == model.cfg.num_layers
    finally:
        eng.close()
        store.close()
