"""The compiled decode step (model/decode.py) in the engine: batches of different lengths,
fragmented block tables, and every restore path give the eager reference's greedy tokens,
and nothing compiles after the engine's warm-up."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import DEVICE, tload
from engine_helpers import make_engine, reference, turn, word_tokenizer

from hcache.engine.block_pool import BlockPool
from hcache.engine.sampler import SamplingParams
from hcache.restore.plan import Method


@pytest.fixture(params=["llama_gqa", "opt"])
def tiny(request, tiny_folder):
    return tload(tiny_folder(request.param))


def test_compiled_decode_matches_the_eager_reference(tiny, tmp_path):
    tok = word_tokenizer(tiny.cfg.vocab_size)
    block = 2 * tiny.cfg.num_layers * 64 * tiny.cfg.kv_dim * 4
    eng, store = make_engine(tiny, tok, [tmp_path / "s"], max_batch=3, decode="compiled", kv_budget_bytes=12 * block)
    try:
        assert eng.runner.graph is not None
        compiled = eng.runner.graph.graphs()
        rng = random.Random(5)
        p = SamplingParams(max_new_tokens=10)
        # five sessions, three per step: rotating batches of different lengths and sizes
        prompts = [[rng.randrange(300) for _ in range(n)] for n in (5, 70, 130, 17, 64)]
        sessions = [eng.create_session() for _ in prompts]
        seqs = [eng.generate(s.id, token_ids=ids, params=p) for s, ids in zip(sessions, prompts, strict=True)]
        history = {}
        for s, seq, ids in zip(sessions, seqs, prompts, strict=True):
            got = [t for ev in eng.stream(seq) for t in ev.token_ids]
            assert got == reference(tiny, ids, p, set())
            history[s.id] = ids + got
        # later turns, one at a time: a lone sequence, its blocks one run or not, after restores
        for i, method in enumerate([None, Method.KV, Method.HIDDEN, Method.RECOMPUTE, None]):
            sid = sessions[i].id
            if method is not None:
                eng.evict(sid)
                eng.restore(sid, method)
            new = [rng.randrange(300) for _ in range(rng.randrange(3, 40))]
            got, _ = turn(eng, sid, token_ids=new, params=p)
            assert got == reference(tiny, history[sid] + new, p, set()), method
            history[sid] += new + got
        assert eng.runner.graph.graphs() == compiled  # the warm-up compiled every graph the turns needed
        if DEVICE == "cuda":  # every step replayed a CUDA graph recorded at the start
            assert eng.runner.graph.replays == len(eng.runner.step_ms) > 0
    finally:
        eng.close()
        store.close()


def test_the_warm_graphs_serve_any_batch_over_any_width(served_default):
    """After `warm`, batches of any size over any number of key blocks run the compiled
    graphs: serving refuses to compile later (`serve_compiled_only`), and a graph that took
    a batch's size for its width (as the default model's did, warmed with 2 sequences over 2
    blocks) left every other batch to run eager. The session's warmed served model: a graph
    compiled since its warm-up, by this test's calls or another test's, fails it. The warm-up
    itself compiles one graph per step function: none specialized to a size, then again."""
    assert served_default.warmed == 2
    graph = served_default.graph
    pool = BlockPool(served_default.model.cfg, torch.bfloat16, "cpu", 40)
    with torch.compiler.set_stance("fail_on_recompile"):
        for n in (1, 2, 3, 4, 7):
            for length in (60, 150, 300):  # 2 (at least), 3 and 5 key blocks with the new token
                blocks = [list(range(5 * i, 5 * i + 5)) for i in range(n)]
                graph([0] * n, [length] * n, [length] * n, blocks, pool.kv)
        graph([0], [100], [100], [[3, 9]], pool.kv)  # a lone sequence's blocks apart
    assert graph.graphs() == served_default.warmed
