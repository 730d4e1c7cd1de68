"""Sessions on several stored contexts (RAG): exact compositions equal a prefill in that
order and lead the next composition with the same first documents; blends place the
contexts' stored KV and recompute a fraction of it; faults name the context."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import tload
from engine_helpers import make_engine, reference, turn, word_tokenizer

from hcache.engine.compose import Composition
from hcache.engine.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from hcache.engine.sampler import SamplingParams
from hcache.model.cache import KVCache
from hcache.restore.plan import Method

P = SamplingParams(max_new_tokens=6)


def docs(rng: random.Random, *lengths: int) -> list[list[int]]:
    return [[rng.randrange(300) for _ in range(n)] for n in lengths]


@pytest.fixture(params=["llama_gqa", "opt"])
def tiny(request, tiny_folder):
    return tload(tiny_folder(request.param))


def test_an_exact_composition_is_a_prefill_and_leads_the_next(tiny, tmp_path):
    tok = word_tokenizer(tiny.cfg.vocab_size)
    eng, store = make_engine(tiny, tok, [tmp_path / "s"])
    try:
        rng = random.Random(1)
        a, b, c, d = docs(rng, 90, 70, 50, 40)
        ctx = [eng.precompute_context(token_ids=x) for x in (a, b, c, d)]
        q = docs(rng, 12)[0]
        s = eng.create_session(context_ids=[x.id for x in ctx[:3]], composition=Composition("exact"))
        assert len(s.tokens) == 90  # the first context, shared
        got, stats = turn(eng, s.id, token_ids=q, params=P)
        assert got == reference(tiny, a + b + c + q, P, set())
        assert stats["cached_tokens"] == 90 and stats["placed_tokens"] == 0
        # the same first two documents, then another: they come from the stored composition
        s2 = eng.create_session(context_ids=[ctx[0].id, ctx[1].id, ctx[3].id])
        assert len(s2.tokens) == 160 and eng.counters.prefix_tokens == 160
        got2, stats2 = turn(eng, s2.id, token_ids=q, params=P)
        assert got2 == reference(tiny, a + b + d + q, P, set())
        assert stats2["cached_tokens"] == 160
        # the stored composition is its own state: deleting the contexts leaves it whole
        eng.delete(s2.id)
        for x in ctx[1:]:
            eng.delete(x.id)
        eng.evict(s.id)
        more = docs(rng, 5)[0]
        got3, _ = turn(eng, s.id, token_ids=more, params=P)
        assert got3 == reference(tiny, a + b + c + q + got + more, P, set())
        with pytest.raises(NotFound, match=ctx[1].id):
            eng.create_session(context_ids=[ctx[0].id, ctx[1].id])
    finally:
        eng.close()
        store.close()


def _kv(model, ids: list[int]) -> KVCache:
    cache = KVCache(model.cfg, model.dtype, model.device)
    with torch.no_grad():
        model(torch.tensor(ids, device=model.device), torch.arange(len(ids), device=model.device), cache)
    return cache


def _kv_error(eng, sid: str, want: KVCache, n: int) -> float:
    """The largest relative K/V error of the session's resident first `n` tokens."""
    cache = eng.registry.sessions[sid].cache
    worst = 0.0
    for layer in range(eng.model.cfg.num_layers):
        for got, ref in zip(cache.layer_kv(layer, n), want.layer_kv(layer, n), strict=True):
            worst = max(worst, ((got.float() - ref.float()).norm() / ref.float().norm()).item())
    return worst


def test_a_blend_recomputing_everything_is_a_prefill_and_concat_is_not(tiny, tmp_path):
    tok = word_tokenizer(tiny.cfg.vocab_size)
    eng, store = make_engine(tiny, tok, [tmp_path / "s"])
    try:
        rng = random.Random(2)
        a, b, c = docs(rng, 80, 60, 70)
        ctx = [eng.precompute_context(token_ids=x) for x in (a, b, c)]
        ids = [x.id for x in ctx]
        q = docs(rng, 10)[0]
        want = _kv(tiny, a + b + c + q)
        err = {}
        for mode, frac in (("concat", 0.0), ("blend", 0.3), ("blend", 1.0)):
            s = eng.create_session(context_ids=ids, composition=Composition(mode, frac))
            _, stats = turn(eng, s.id, token_ids=q, params=SamplingParams(max_new_tokens=1))
            assert stats["placed_tokens"] == 210 and stats["cached_tokens"] == 0
            assert stats["recomputed_tokens"] == round(frac * 210)
            err[mode, frac] = _kv_error(eng, s.id, want, 210 + len(q))
        assert err["blend", 1.0] < 1e-4  # float32 attention, another order of sums
        assert err["concat", 0.0] > 1e-2  # later documents never saw the earlier ones
        if tiny.cfg.arch != "opt":  # without RoPE, keys carry no position to move
            assert err["blend", 0.3] < err["concat", 0.0]
    finally:
        eng.close()
        store.close()


def test_a_blend_restores_its_own_state_by_kv_only(tmp_path, tiny_folder):
    model = tload(tiny_folder("llama_gqa"))
    tok = word_tokenizer(model.cfg.vocab_size)
    eng, store = make_engine(model, tok, [tmp_path / "s"], store_kinds="hidden")
    try:
        rng = random.Random(3)
        ctx = [eng.precompute_context(token_ids=x) for x in docs(rng, 70, 90)]
        how = Composition("blend", 0.2)
        q, more = docs(rng, 9, 6)
        runs = []
        for evict in (False, True):
            s = eng.create_session(context_ids=[x.id for x in ctx], composition=how)
            first, _ = turn(eng, s.id, token_ids=q, params=P)
            if evict:
                eng.evict(s.id)
                with pytest.raises(FailedPrecondition, match="blended"):
                    eng.restore(s.id, Method.RECOMPUTE)
            second, stats = turn(eng, s.id, token_ids=more, params=P)
            runs.append((first, second))
            assert stats["plan"]["kv"] == (model.cfg.num_layers if evict else 0)
        assert runs[0] == runs[1]  # restored: the blend's state, not a prefill's
    finally:
        eng.close()
        store.close()


def test_compositions_refuse_what_they_cannot_place(tmp_path, tiny_folder):
    model = tload(tiny_folder("llama_gqa"))
    tok = word_tokenizer(model.cfg.vocab_size)
    per_block = 64 * model.cfg.num_layers * 2 * model.cfg.kv_dim * 4
    eng, store = make_engine(model, tok, [tmp_path / "s"], kv_budget_bytes=2 * per_block)
    try:
        rng = random.Random(4)
        a, b, c = (eng.precompute_context(token_ids=x) for x in docs(rng, 60, 60, 60))
        own, theirs = (eng.precompute_context(token_ids=docs(rng, 30)[0], tenant=t) for t in ("t2", "t1"))
        with pytest.raises(NotFound, match=theirs.id):
            eng.create_session(context_ids=[own.id, theirs.id], tenant="t2")
        with pytest.raises(ResourceExhausted, match="180 tokens"):
            eng.create_session(context_ids=[a.id, b.id, c.id], composition=Composition("blend"))
        with pytest.raises(InvalidArgument, match="context mode"):
            Composition("mix")
        with pytest.raises(InvalidArgument, match="fraction"):
            Composition("blend", float("nan"))
        s = eng.create_session(context_ids=[a.id, b.id], composition=Composition("blend"))
        with pytest.raises(FailedPrecondition, match="shared by 1"):
            eng.delete(b.id)  # the blend's first turn reads it
        assert len(eng.list()) == 1 and eng.get(s.id).meta.compose == "blend"  # nothing else was kept
    finally:
        eng.close()
        store.close()


def test_an_unreadable_document_is_recomputed_alone_and_named(tmp_path, tiny_folder):
    model = tload(tiny_folder("llama_gqa"))
    tok = word_tokenizer(model.cfg.vocab_size)
    eng, store = make_engine(model, tok, [tmp_path / "s"], store_kinds="kv", restore_method="kv")
    try:
        rng = random.Random(5)
        a, b = docs(rng, 70, 80)
        ca, cb = (eng.precompute_context(token_ids=x) for x in (a, b))
        row = next(r for r in store.manifest.chunks(cb.id) if r.layer == 1 and r.idx == 0)
        slab = store.placement.slab(row.dir, row.slab)
        with open(slab.path, "r+b") as f:
            f.seek(row.slot * slab.slot_bytes + 10)
            byte = f.read(1)
            f.seek(row.slot * slab.slot_bytes + 10)
            f.write(bytes([byte[0] ^ 0xFF]))
        q = docs(rng, 8)[0]
        s = eng.create_session(context_ids=[ca.id, cb.id], composition=Composition("blend", 1.0))
        _, stats = turn(eng, s.id, token_ids=q, params=SamplingParams(max_new_tokens=1))
        assert stats["context_fallbacks"] == [cb.id] and stats["fallback_layers"] == 2
        assert _kv_error(eng, s.id, _kv(model, a + b + q), 158) < 1e-4  # recomputed right
    finally:
        eng.close()
        store.close()
