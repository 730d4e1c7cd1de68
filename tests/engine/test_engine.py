"""The batching engine on tiny random models: exact multi-turn output across evictions and
every restore path, batched decode of sessions of different lengths, LRU eviction under a
small budget, fused vs sequential restore, shared contexts, and corrupt-chunk fallback."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import tload
from engine_helpers import make_engine, reference, turn, word_tokenizer

from hcache.engine.errors import EngineError, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from hcache.engine.sampler import SamplingParams
from hcache.restore.plan import Method


@pytest.fixture(params=["llama_gqa", "llama_mha", "opt"])
def tiny(request, tiny_folder):
    return tload(tiny_folder(request.param))


def rand_ids(rng: random.Random, n: int, vocab: int = 300) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def test_multi_turn_exact_across_evictions_and_methods(tiny, tmp_path):
    tok = word_tokenizer(tiny.cfg.vocab_size)
    eng, store = make_engine(tiny, tok, [tmp_path / "a", tmp_path / "b"])
    try:
        rng = random.Random(1)
        s = eng.create_session()
        history: list[int] = []
        p = SamplingParams(max_new_tokens=6)
        for method in [None, Method.KV, Method.HIDDEN, Method.RECOMPUTE, "auto", None]:
            if method is not None:
                eng.evict(s.id)
                r = eng.restore(s.id, None if method == "auto" else method)
                assert r.num_tokens == len(history) - 1 and not r.fallback_layers
            new = rand_ids(rng, rng.randrange(3, 70))
            got, stats = turn(eng, s.id, token_ids=new, params=p)
            want = reference(tiny, [*history, *new], p, set())
            assert got == want
            history += [*new, *got]
            assert stats["completion_tokens"] == len(got)
        # stored state matches: tokens fed so far (the last sampled token is not fed)
        assert store.owner_row(s.id).tokens == history[:-1]
    finally:
        eng.close()
        store.close()


def test_batched_decode_of_different_lengths_matches_singles(tiny, tmp_path):
    tok = word_tokenizer(tiny.cfg.vocab_size)
    eng, store = make_engine(tiny, tok, [tmp_path / "s"], max_batch=3)
    try:
        rng = random.Random(2)
        p = SamplingParams(max_new_tokens=12)
        prompts = [rand_ids(rng, n) for n in (5, 40, 90, 17, 64)]
        sessions = [eng.create_session() for _ in prompts]
        seqs = [eng.generate(s.id, token_ids=ids, params=p) for s, ids in zip(sessions, prompts, strict=True)]
        for seq, ids in zip(seqs, prompts, strict=True):
            got = [t for ev in eng.stream(seq) for t in ev.token_ids]
            assert got == reference(tiny, ids, p, set())
    finally:
        eng.close()
        store.close()


def test_sessions_that_store_nothing_continue_exactly_by_recompute(tmp_path, tiny_folder):
    """`store_kinds="none"` turns the saver off: no chunk is written, and an evicted session
    comes back by recomputing every layer, exactly."""
    tiny = tload(tiny_folder("llama_gqa"))
    eng, store = make_engine(tiny, word_tokenizer(tiny.cfg.vocab_size), [tmp_path / "s"], store_kinds="none")
    try:
        rng = random.Random(4)
        p = SamplingParams(max_new_tokens=6)
        s = eng.create_session()
        first = rand_ids(rng, 90)
        got, _ = turn(eng, s.id, token_ids=first, params=p)
        history = first + got
        assert not any(store.layer_kinds(store.owner_row(s.id)))
        eng.evict(s.id)
        r = eng.restore(s.id)
        assert r.plan.recompute == tiny.cfg.num_layers and r.bytes_read == 0
        new = rand_ids(rng, 12)
        got, _ = turn(eng, s.id, token_ids=new, params=p)
        assert got == reference(tiny, history + new, p, set())
    finally:
        eng.close()
        store.close()


def test_lru_eviction_under_small_budget_is_transparent(tiny, tmp_path):
    tok = word_tokenizer(tiny.cfg.vocab_size)
    block = 2 * tiny.cfg.num_layers * 64 * tiny.cfg.kv_dim * 4
    eng, store = make_engine(tiny, tok, [tmp_path / "s"], kv_budget_bytes=3 * block)  # 192 tokens
    try:
        rng = random.Random(3)
        p = SamplingParams(max_new_tokens=5)
        hist = {}
        for _ in range(3):
            s = eng.create_session()
            ids = rand_ids(rng, 80)
            got, _ = turn(eng, s.id, token_ids=ids, params=p)
            hist[s.id] = ids + got
        assert eng.counters.evictions >= 1
        for sid, h in hist.items():  # every session continues exactly, restored when it was evicted
            new = rand_ids(rng, 10)
            got, _ = turn(eng, sid, token_ids=new, params=p)
            assert got == reference(tiny, h + new, p, set())
        with pytest.raises(ResourceExhausted):
            s = eng.create_session()
            turn(eng, s.id, token_ids=rand_ids(rng, 200), params=SamplingParams(max_new_tokens=5))
    finally:
        eng.close()
        store.close()


@pytest.mark.parametrize("fused", [True, False])
def test_fused_and_sequential_restore_prefill_agree(tmp_path, tiny_folder, fused):
    model = tload(tiny_folder("llama_gqa"))
    tok = word_tokenizer(model.cfg.vocab_size)
    eng, store = make_engine(model, tok, [tmp_path / "s"], fused=fused, piece_tokens=16)
    try:
        rng = random.Random(4)
        p = SamplingParams(max_new_tokens=4)
        s = eng.create_session()
        first = rand_ids(rng, 100)
        got1, _ = turn(eng, s.id, token_ids=first, params=p)
        eng.evict(s.id)
        second = rand_ids(rng, 40)  # three pieces, the first fused with the restore
        got2, stats = turn(eng, s.id, token_ids=second, params=p)
        assert got2 == reference(model, first + got1 + second, p, set())
        assert stats["restore_ms"] > 0 and stats["cached_tokens"] == len(first) + len(got1) - 1
    finally:
        eng.close()
        store.close()


def test_shared_context_is_not_copied(tmp_path, tiny_folder):
    model = tload(tiny_folder("llama_mha"))
    tok = word_tokenizer(model.cfg.vocab_size)
    eng, store = make_engine(model, tok, [tmp_path / "s"])
    try:
        rng = random.Random(5)
        doc = rand_ids(rng, 100)
        ctx = eng.precompute_context(token_ids=doc)
        assert len(ctx.tokens) == 100 and not ctx.resident
        p = SamplingParams(max_new_tokens=5)
        for _ in range(2):
            s = eng.create_session(context_ids=[ctx.id])
            assert len(s.tokens) == 100
            q = rand_ids(rng, 20)
            got, stats = turn(eng, s.id, token_ids=q, params=p)
            assert got == reference(model, doc + q, p, set())
            assert stats["restore_ms"] > 0  # the document came from storage
            # the session's own chunks cover only its own tokens
            own = {(r.layer, r.idx) for r in store.manifest.chunks(s.id)}
            assert max(idx for _, idx in own) == 0
        with pytest.raises(FailedPrecondition):
            eng.delete(ctx.id)
    finally:
        eng.close()
        store.close()


def test_a_document_precomputed_again_is_the_stored_context(tmp_path, tiny_folder):
    """Bulk precompute reruns skip what is stored: the same tokens for the same tenant are
    one context, found by content after a restart too; another tenant, other tokens or a
    deleted context compute anew."""
    model = tload(tiny_folder("llama_mha"))
    tok = word_tokenizer(model.cfg.vocab_size)
    doc = rand_ids(random.Random(9), 100)
    eng, store = make_engine(model, tok, [tmp_path / "s"])
    try:
        a = eng.precompute_context(token_ids=doc, labels={"id": "d1"})
        written = sum(u.bytes_written for u in store.usage())
        again = eng.precompute_context(token_ids=doc, labels={"id": "d2"})
        assert again is a and a.meta.labels == {"id": "d1"}
        assert [c.id for c in eng.list("context")] == [a.id]
        assert sum(u.bytes_written for u in store.usage()) == written  # nothing computed or stored
        assert eng.precompute_context(token_ids=doc, tenant="t2").id != a.id
        assert eng.precompute_context(token_ids=doc[:-1]).id != a.id
        text = eng.precompute_context(text="w1 w2 w3")
        assert eng.precompute_context(text="w1 w2 w3") is text
        # the same document sent twice at once: the second waits for the first's context
        twice = rand_ids(random.Random(10), 200)
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda _: eng.precompute_context(token_ids=twice), range(2)))
        assert got[0] is got[1]
        assert sum(c.tokens == twice for c in eng.list("context")) == 1
    finally:
        eng.close()
        store.close()
    eng, store = make_engine(model, tok, [tmp_path / "s"])
    try:
        assert eng.precompute_context(token_ids=doc).id == a.id  # found after a restart
        eng.delete(a.id)
        assert eng.precompute_context(token_ids=doc).id != a.id
    finally:
        eng.close()
        store.close()


def test_corrupt_chunk_falls_back_to_recompute(tmp_path, tiny_folder):
    model = tload(tiny_folder("llama_gqa"))
    tok = word_tokenizer(model.cfg.vocab_size)
    eng, store = make_engine(model, tok, [tmp_path / "s"], store_kinds="kv")
    try:
        rng = random.Random(6)
        p = SamplingParams(max_new_tokens=4)
        s = eng.create_session()
        ids = rand_ids(rng, 150)
        got, _ = turn(eng, s.id, token_ids=ids, params=p)
        eng.evict(s.id)
        row = next(r for r in store.manifest.chunks(s.id) if r.layer == 1 and r.idx == 1)
        slab = store.placement.slab(row.dir, row.slab)
        with open(slab.path, "r+b") as f:
            f.seek(row.slot * slab.slot_bytes + 100)
            b = f.read(1)
            f.seek(row.slot * slab.slot_bytes + 100)
            f.write(bytes([b[0] ^ 0xFF]))
        r = eng.restore(s.id, Method.KV)  # layers 0 and 1 recomputed from tokens
        assert r.fallback_layers == 2 and store.stats.checksum_failures >= 1
        new = rand_ids(rng, 8)
        got2, _ = turn(eng, s.id, token_ids=new, params=p)
        assert got2 == reference(model, ids + got + new, p, set())
        assert eng.counters.fallback_layers == 2
    finally:
        eng.close()
        store.close()


def test_bad_input_changes_nothing(tmp_path, tiny_folder):
    model = tload(tiny_folder("llama_gqa"))
    tok = word_tokenizer(model.cfg.vocab_size)
    eng, store = make_engine(model, tok, [tmp_path / "s"])
    try:
        s = eng.create_session()
        turn(eng, s.id, token_ids=[1, 2, 3], params=SamplingParams(max_new_tokens=3))
        before = store.owner_row(s.id)
        bad = [
            dict(token_ids=[]),
            dict(token_ids=[1], message="x"),
            dict(token_ids=[300]),
            dict(token_ids=[-1]),
            dict(token_ids=[1] * 300),
            dict(token_ids=[1], params=SamplingParams(temperature=-1)),
            dict(token_ids=[1], params=SamplingParams(top_p=1.5)),
            dict(token_ids=[1], params=SamplingParams(max_new_tokens=0)),
            dict(token_ids=[1], params=SamplingParams(max_new_tokens=10**6)),
            dict(token_ids=[1], stops=["x"] * 100),
            dict(message="hello"),  # a token session takes token turns
        ]
        for kw in bad:
            with pytest.raises(InvalidArgument):
                eng.generate(s.id, **kw)
        with pytest.raises(NotFound):
            eng.generate("nope", token_ids=[1])
        with pytest.raises(NotFound):
            eng.restore("nope")
        after = store.owner_row(s.id)
        assert (after.tokens, after.meta) == (before.tokens, before.meta) and not eng.get(s.id).busy
    finally:
        eng.close()
        store.close()


def test_a_failing_step_fails_its_turn_instead_of_hanging(tmp_path, tiny_folder, monkeypatch):
    model = tload(tiny_folder("llama_gqa"))
    tok = word_tokenizer(model.cfg.vocab_size)
    eng, store = make_engine(model, tok, [tmp_path / "s"])

    def boom(*args, **kwargs):
        raise RuntimeError("a bug")

    try:
        s = eng.create_session()
        p = SamplingParams(max_new_tokens=3)
        got, _ = turn(eng, s.id, token_ids=[1, 2, 3], params=p)
        for step in ("start", "first_token"):  # while the turn is admitted, and once it is prefilled
            with monkeypatch.context() as m:
                m.setattr(eng.runner, step, boom)
                seq = eng.generate(s.id, token_ids=[4], params=p)
                assert seq.done.wait(60), step
                with pytest.raises(EngineError):
                    list(eng.stream(seq))
        got2, _ = turn(eng, s.id, token_ids=[4], params=p)  # the session goes on from its last durable turn
        assert got2 == reference(model, [1, 2, 3, *got, 4], p, set())
    finally:
        eng.close()
        store.close()


def test_a_turn_ends_with_the_text_it_held_back(tmp_path, tiny_folder):
    """The stream holds back a tail that could start a stop string; when the turn ends
    without one, the tail is the reply's and comes in the last token's event: the text a
    client joins is the reply the session keeps (an API client sends it back next turn)."""
    model = tload(tiny_folder("llama_gqa"))
    tok = word_tokenizer(model.cfg.vocab_size)
    eng, store = make_engine(model, tok, [tmp_path / "s"])
    try:
        s = eng.create_session()
        stops = [f"{d}#" for d in "0123456789"]  # every word ends in a digit: its tail is held back
        seq = eng.generate(s.id, token_ids=[1, 2, 3], params=SamplingParams(max_new_tokens=2), stops=stops)
        events = list(eng.stream(seq))
        ids = [t for ev in events for t in ev.token_ids]
        assert events[-1].finish_reason == "length" and len(ids) == 2
        assert "".join(ev.text for ev in events) == tok.decode(ids)
    finally:
        eng.close()
        store.close()
