"""A bfloat16 KV pool under float32 activations (`--kv-dtype bfloat16`): KV is stored as the
pool holds it (half the bytes), a KV restore puts back the very bits, H and recompute
restores round to them, the compiled decode step attends in bfloat16, and greedy turns
match a never-evicted run over a bfloat16 cache up to near-ties. A store of the other KV dtype is refused."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import tload
from engine_helpers import agrees_up_to_ties, make_engine, profile_for, reference, turn, word_tokenizer

from hcache.config import EngineConfig, StorageConfig
from hcache.engine.engine import Engine
from hcache.engine.errors import FailedPrecondition
from hcache.engine.sampler import SamplingParams
from hcache.model.attention import MATMUL_MIN_KEYS
from hcache.restore.plan import Method
from hcache.storage.layout import CHUNK_TOKENS, Kind, num_chunks
from hcache.storage.store import ChunkStore

BF16 = torch.bfloat16


def _resident(eng: Engine, sid: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    cache = eng.registry.sessions[sid].cache
    assert cache is not None
    return [tuple(t.clone() for t in cache.layer_kv(layer)) for layer in range(eng.model.cfg.num_layers)]


def test_a_bfloat16_pool_restores_what_it_held(tmp_path, tiny_folder):
    model = tload(tiny_folder("llama_gqa"))
    assert model.dtype == torch.float32
    tok = word_tokenizer(model.cfg.vocab_size)
    # eager decode: the compiled step over a bfloat16 pool is the serving default's test below
    eng, store = make_engine(model, tok, [tmp_path / "a", tmp_path / "b"], kv_dtype="bfloat16")
    try:
        assert eng.pool.dtype == BF16 and store.shapes[Kind.KV].dtype == BF16
        assert store.shapes[Kind.HIDDEN].dtype == torch.float32  # H stays the activations'
        rng = random.Random(3)
        s = eng.create_session()
        p = SamplingParams(max_new_tokens=6)
        history: list[int] = []
        for method in [None, Method.KV, Method.HIDDEN, Method.RECOMPUTE, None]:
            if method is not None:
                held = _resident(eng, s.id)
                eng.evict(s.id)
                r = eng.restore(s.id, method)
                n = len(history) - 1
                back = _resident(eng, s.id)
                for (k0, v0), (k1, v1) in zip(held, back, strict=True):
                    assert k1.dtype == BF16
                    if method == Method.KV:  # the stored bits are the pool's
                        assert torch.equal(k0, k1) and torch.equal(v0, v1)
                    elif method == Method.HIDDEN:  # projected in float32, rounded as the forward's were
                        torch.testing.assert_close(k1, k0, rtol=2**-7, atol=1e-6)
                        torch.testing.assert_close(v1, v0, rtol=2**-7, atol=1e-6)
                    else:  # attention rounds its output to bfloat16: one pass and the turns' pieces
                        # round differently, and later layers carry that (bfloat16-sized) difference
                        for a, b in ((k0, k1), (v0, v1)):
                            assert (a.float() - b.float()).abs().max() <= 2**-6 * a.float().abs().max()
                if method == Method.KV:  # whole chunks of two bytes per element
                    chunk = CHUNK_TOKENS * 2 * model.cfg.kv_dim * 2
                    assert r.bytes_read == model.cfg.num_layers * num_chunks(n) * chunk
            new = [rng.randrange(300) for _ in range(rng.randrange(20, 70))]
            got, _ = turn(eng, s.id, token_ids=new, params=p)
            # bfloat16 K/V a rounding step apart move this model's logits by a few hundredths
            agrees_up_to_ties(model, [*history, *new], got, p, BF16, tie=0.05)
            history += [*new, *got]
    finally:
        eng.close()
        store.close()


def test_a_store_of_the_other_kv_dtype_is_refused(tmp_path, tiny_folder):
    model = tload(tiny_folder("llama_gqa"))
    tok = word_tokenizer(model.cfg.vocab_size)
    eng, store = make_engine(model, tok, [tmp_path / "s"])  # float32 KV
    try:
        s = eng.create_session()
        turn(eng, s.id, token_ids=list(range(3, 40)), params=SamplingParams(max_new_tokens=2))
    finally:
        eng.close()
        store.close()
    store = ChunkStore(StorageConfig([str(tmp_path / "s")]), model.cfg, model.dtype)
    try:
        with pytest.raises(ValueError, match=r"store keeps KV in torch\.float32"):
            Engine(model, tok, store, profile_for(model), EngineConfig(kv_dtype="bfloat16"))
    finally:
        store.close()
    eng, store = make_engine(model, tok, [tmp_path / "s"], kv_dtype="bfloat16")
    try:
        with pytest.raises(FailedPrecondition, match="stored with another --kv-dtype"):
            eng.generate(s.id, token_ids=[5], params=SamplingParams(max_new_tokens=2))
    finally:
        eng.close()
        store.close()


def test_the_serving_default_matches_its_reference(served_default, tmp_path):
    """The default model as `hcache serve` serves it, cut to its first layers (conftest's
    `served_default`; `--weights auto`: int4 weights, fused projections, the packed int8 head;
    `--kv-dtype auto`: a bfloat16 KV pool; the compiled decode step): two sessions decoding
    together, then turns after KV, H and RE restores, give the greedy tokens of a never-evicted
    eager run over a bfloat16 cache (RE up to near-ties)."""
    model = served_default.model
    assert model.layers[0].wqkv is not None and model.lm_head.is_packed
    tok = word_tokenizer(model.cfg.vocab_size)
    eng, store = make_engine(model, tok, [tmp_path / "s"], decode="compiled")
    assert eng.pool.dtype == torch.bfloat16
    try:
        rng = random.Random(4)
        p = SamplingParams(max_new_tokens=8)
        prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (70, 23)]
        sessions = [eng.create_session() for _ in prompts]
        seqs = [eng.generate(s.id, token_ids=ids, params=p) for s, ids in zip(sessions, prompts, strict=True)]
        history = []
        for seq, ids in zip(seqs, prompts, strict=True):
            got = [t for ev in eng.stream(seq) for t in ev.token_ids]
            assert got == reference(model, ids, p, set(), BF16)
            history.append(ids + got)
        for method in (Method.KV, Method.HIDDEN, Method.RECOMPUTE):
            eng.evict(sessions[0].id)
            eng.restore(sessions[0].id, method)
            new = [rng.randrange(100, 40000) for _ in range(30)]
            got, _ = turn(eng, sessions[0].id, token_ids=new, params=p)
            if method == Method.RECOMPUTE:
                # RE rebuilds the history in one forward and the turn is a second; the reference
                # is one forward of both: the linears and norms round differently at other row
                # counts, so a near-tie may break either way (seen: 0.01 apart at 23)
                agrees_up_to_ties(model, history[0] + new, got, p, BF16, tie=0.05)
            else:
                assert got == reference(model, history[0] + new, p, set(), BF16), method
            history[0] += new + got
        assert eng.runner.graph.graphs() == served_default.warmed  # the engine's warm-up found them compiled
    finally:
        eng.close()
        store.close()


def test_a_turn_over_a_long_bfloat16_context_matches_its_reference(default_model, tmp_path):
    """Past `MATMUL_MIN_KEYS` cached tokens a turn attends through oneDNN's matmuls on a CPU
    without AMX (flash with AMX), while the one-pass reference attends with flash: after a
    KV restore of such a context, the turn's greedy tokens match the reference's."""
    model, tok = default_model.model, word_tokenizer(default_model.model.cfg.vocab_size)
    eng, store = make_engine(model, tok, [tmp_path / "s"], kv_dtype="bfloat16")
    try:
        rng = random.Random(7)
        p = SamplingParams(max_new_tokens=4)
        ctx = [rng.randrange(100, 40000) for _ in range(MATMUL_MIN_KEYS + 20)]
        s = eng.create_session()
        first, _ = turn(eng, s.id, token_ids=ctx, params=p)
        agrees_up_to_ties(model, ctx, first, p, BF16, tie=0.05)
        eng.evict(s.id)
        eng.restore(s.id, Method.KV)
        new = [rng.randrange(100, 40000) for _ in range(24)]
        got, _ = turn(eng, s.id, token_ids=new, params=p)
        agrees_up_to_ties(model, [*ctx, *first, *new], got, p, BF16, tie=0.05)
    finally:
        eng.close()
        store.close()
