"""The RAG benchmark's pipeline figure: a corpus precomputed once, then queries from
`concurrency` clients at once, each over `per_query` documents drawn by a Zipf law of their
popularity (a few documents are retrieved often, most rarely), in every context mode and
against a full prefill of the same prompt: queries/s and TTFT percentiles."""

from __future__ import annotations

import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from hcache.benchmarks.engine import run_turn
from hcache.engine.compose import Composition
from hcache.engine.engine import Engine

REPLY_TOKENS = 8  # a short answer: decode steps share the cores with the other clients' prefills
Query = tuple[list[int], list[int]]  # documents in order, question tokens


def zipf_queries(
    n: int, n_docs: int, per_query: int, questions: dict[int, list[list[int]]], s: float, rng: random.Random
) -> list[Query]:
    """`n` queries of `per_query` distinct documents, document r (0-based popularity rank)
    drawn with weight 1 / (r + 1)^s, in the order drawn, and a question about one of them
    (`questions`: by document)."""
    weights = [1 / (r + 1) ** s for r in range(n_docs)]
    out = []
    for _ in range(n):
        order: list[int] = []
        while len(order) < per_query:
            d = rng.choices(range(n_docs), weights)[0]
            if d not in order:
                order.append(d)
        asked = rng.choice([d for d in order if questions.get(d)] or [-1])
        out.append((order, rng.choice(questions.get(asked) or [q for qs in questions.values() for q in qs])))
    return out


def pipeline(
    engine: Engine, ctx: list[str], docs: list[list[int]], queries: list[Query], fraction: float, concurrency: int
) -> dict[str, dict[str, float]]:
    """Per mode (full prefill, exact, blend at `fraction`, concat): the queries run by
    `concurrency` clients at once, each a new session and a reply of REPLY_TOKENS tokens."""

    def one(mode: str, q: Query) -> float:
        order, question = q
        if mode == "full":
            s = engine.create_session()
            ids = [t for d in order for t in docs[d]] + question
        else:
            how = Composition(mode, fraction)
            s = engine.create_session(context_ids=[ctx[d] for d in order], composition=how)
            ids = question
        try:
            return run_turn(engine, s.id, ids, REPLY_TOKENS).ttft_ms
        finally:
            engine.delete(s.id)

    out = {}
    for mode in ("full", "exact", "blend", "concat"):
        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            ttfts = sorted(pool.map(lambda q, m=mode: one(m, q), queries))
        wall = time.perf_counter() - t0
        out[mode] = {
            "qps": len(queries) / wall,
            "ttft_p50_ms": statistics.median(ttfts),
            "ttft_p95_ms": ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))],
        }
        print(f"pipeline {mode}: {out[mode]}", flush=True)
    for r in out.values():
        r["qps_over_full"] = r["qps"] / out["full"]["qps"]
    return out


def section(p: dict) -> list[str]:
    """RESULTS.md's lines (and the console table) for a run's pipeline figure."""
    out = [
        f"Pipeline: {p['queries']} queries from {p['concurrency']} clients at once over a corpus of {p['docs']} "
        f"precomputed documents, each query's documents drawn by a Zipf law of popularity (s = {p['zipf_s']:g}), "
        f"a reply of {p['reply_tokens']} tokens each:",
        "",
        "| mode | queries/s | / full prefill | TTFT p50 ms | TTFT p95 ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for mode, r in p["modes"].items():
        out.append(
            f"| {mode} | {r['qps']:.3f} | {r['qps_over_full']:.2f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p95_ms']:.0f} |"
        )
    return [*out, ""]
