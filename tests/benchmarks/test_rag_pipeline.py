"""The RAG pipeline figure: Zipf retrievals, and every mode's queries run by concurrent
clients through one engine."""

from __future__ import annotations

import random
from collections import Counter

from conftest import tload
from engine_helpers import make_engine, word_tokenizer

from hcache.benchmarks.rag_pipeline import pipeline, section, zipf_queries


def test_zipf_queries_favour_popular_documents_and_ask_about_one():
    questions = {d: [[1000 + d]] for d in range(0, 50, 2)}  # odd documents hold no facts
    qs = zipf_queries(400, 50, 5, questions, 1.0, random.Random(0))
    assert all(len(set(order)) == 5 and all(0 <= d < 50 for d in order) for order, _ in qs)
    assert all(q[0] - 1000 in order for order, q in qs if any(d % 2 == 0 for d in order))
    drawn = Counter(d for order, _ in qs for d in order)
    assert drawn[0] > 3 * drawn[20] and drawn[0] == max(drawn.values())


def test_every_mode_runs_concurrent_queries(tiny_folder, tmp_path):
    model = tload(tiny_folder("llama_gqa"))
    tok = word_tokenizer(model.cfg.vocab_size)
    engine, store = make_engine(model, tok, [tmp_path / "s"])
    rng = random.Random(0)
    try:
        docs = [[rng.randrange(3, model.cfg.vocab_size) for _ in range(40)] for _ in range(8)]
        ctx = [engine.precompute_context(token_ids=d).id for d in docs]
        questions = {d: [[5, 6, 7]] for d in range(8)}
        out = pipeline(engine, ctx, docs, zipf_queries(6, 8, 3, questions, 1.0, rng), 0.3, 3)
    finally:
        engine.close()
        store.close()
    assert set(out) == {"full", "exact", "blend", "concat"}
    assert all(r["qps"] > 0 and r["ttft_p95_ms"] >= r["ttft_p50_ms"] > 0 for r in out.values())
    assert out["full"]["qps_over_full"] == 1.0
    p = {"docs": 8, "queries": 6, "concurrency": 3, "zipf_s": 1.0, "reply_tokens": 8, "modes": out}
    assert any("| blend |" in line for line in section(p))
