"""RAG benchmark: questions over several precomputed documents, by every context mode.

A synthetic corpus ships with it (`corpus`): documents of about `--doc-tokens` tokens, each
holding facts (a number of an invented person) among distractor sentences. A query
puts `--per-query` documents in a random order before a question whose answer is in one.

- Quality, in the model alone (the engine runs the same `Blend`): for a full prefill,
  exact (the first document restored, the rest prefilled), concat and blends at each
  `--fractions`: answer accuracy (the code in the greedy reply), agreement of the greedy
  reply with full prefill's, and the KL divergence of the first reply token's distribution
  from full prefill's.
- Speed, through the engine with the documents precomputed in its store and none resident:
  TTFT of a full prefill of the same tokens, exact the first time, exact on a prefix hit
  (the same composition again), blend at `--blend-fraction` and concat, and llama.cpp's
  prefill of the same prompt on the same GGUF (in a process of its own, where
  llama-cpp-python is installed: `make bench-peers`), interleaved per query; with
  `--pipeline-queries`, the pipeline figure (`rag_pipeline`). Medians; JSON in bench/results."""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import statistics
import tempfile
from pathlib import Path

import torch

from hcache import omp
from hcache.benchmarks import report
from hcache.benchmarks.engine import run_turn
from hcache.benchmarks.llamacpp import Peer
from hcache.benchmarks.peers import machine
from hcache.benchmarks.rag_pipeline import REPLY_TOKENS, pipeline, zipf_queries
from hcache.benchmarks.rag_pipeline import section as pipeline_section
from hcache.config import EngineConfig, StorageConfig
from hcache.engine.block_pool import resident_kv_dtype
from hcache.engine.compose import Composition
from hcache.engine.engine import Engine
from hcache.engine.generate import generate
from hcache.engine.sampler import SamplingParams
from hcache.kernels.cpu import cpu
from hcache.model.base import DecoderModel
from hcache.model.cache import KVCache
from hcache.model.loader import load, resolve_model_path
from hcache.model.tokenizer import Tokenizer
from hcache.restore import profiler
from hcache.restore.blend import Blend, Document
from hcache.restore.executor import restore
from hcache.restore.plan import Method, Plan
from hcache.restore.projection import serve_compiled_only, warm_up
from hcache.restore.state import MemoryState
from hcache.storage.dirs import ensure_dirs
from hcache.storage.store import ChunkStore

ANSWER_TOKENS = 6  # the answer's four digits, and a little after
SYLLABLES = ["mar", "lo", "ven", "tis", "ka", "dor", "bel", "qu", "sen", "ra", "th", "wyn", "ost", "pel", "gar"]
THINGS = ["gate code", "locker number", "badge number", "room number", "account number", "permit number"]
FILLER = [
    "The weather there was mild for most of the year, with rain in the autumn months.",
    "Visitors often mention the old market square and the narrow streets around it.",
    "A local committee meets every second Tuesday to discuss repairs and budgets.",
    "Several families have lived in the area for generations and keep detailed records.",
    "The nearest train station is a short walk away and trains run every half hour.",
    "In the evenings the main road is quiet, and most shops close before seven.",
    "The annual report lists many numbers, but most of them change from year to year.",
    "An archive in the town hall keeps copies of every official letter since 1950.",
]


def _name(rng: random.Random) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(3)).capitalize()


Fact = tuple[int, str, str, str]  # document index, question, the reply's start, answer


def corpus(n_docs: int, doc_tokens: int, tok: Tokenizer, seed: int = 0) -> tuple[list[str], list[Fact]]:
    """`n_docs` documents of about `doc_tokens` tokens, and their facts. The reply's start is
    in the prompt (after the chat template's assistant turn), so the reply begins with the
    answer: the first token's distribution is the answer's."""
    rng = random.Random(seed)
    docs, facts = [], []
    for i in range(n_docs):
        place = _name(rng)
        lines = [f"Notes on {place}."]
        mine = []
        while len(tok.encode(" ".join(lines))) < doc_tokens:
            if rng.random() < 0.35:
                who, what, code = _name(rng), rng.choice(THINGS), str(rng.randrange(1000, 10000))
                lines.append(f"The {what} of {who} of {place} is {code}.")
                mine.append((i, f"What is the {what} of {who} of {place}?", f"The {what} of {who} of {place} is", code))
            else:
                lines.append(rng.choice(FILLER))
        docs.append(" ".join(lines))
        facts += mine[:3]
    return docs, facts


def _reply(model: DecoderModel, cache: KVCache, last: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """The first reply token's log-probabilities and the greedy reply, from the prompt's
    final hidden state `last` with its KV in `cache`."""
    logp = torch.log_softmax(model.logits(last[0]).float(), -1)
    first = int(logp.argmax())
    rest = generate(model, cache, [first], SamplingParams(max_new_tokens=ANSWER_TOKENS - 1), set())
    return logp, [first, *rest]


def quality(
    model: DecoderModel,
    tok: Tokenizer,
    docs: list[list[int]],
    queries: list[tuple[list[int], list[int], str]],
    fractions: list[float],
    kv_dtype: torch.dtype,
) -> dict:
    """Accuracy, agreement and KL per mode over `queries` (document order, question ids, answer)."""
    states = []
    for ids in docs:
        st = MemoryState(model.cfg, model.dtype, model.device, capacity=len(ids))
        for _ in generate(model, KVCache(model.cfg, model.dtype), ids, SamplingParams(max_new_tokens=1), set(), st):
            pass
        states.append(st)
    kv = Plan.uniform(model.cfg.num_layers, Method.KV)
    modes = ["full", "exact", "concat", *(f"blend {f:g}" for f in fractions)]
    rows: dict[str, dict[str, list[float]]] = {m: {"correct": [], "agree": [], "kl": []} for m in modes}
    with torch.inference_mode():
        for order, question, answer in queries:
            prompt = [t for d in order for t in docs[d]] + question
            n_lead = len(docs[order[0]])
            out = {}
            for mode in modes:
                cache = KVCache(model.cfg, kv_dtype, model.device, capacity=len(prompt) + ANSWER_TOKENS)
                if mode == "full":
                    h = model(torch.tensor(prompt), torch.arange(len(prompt)), cache)[-1:]
                elif mode == "exact":
                    cache, _ = restore(model, kv, states[order[0]], cache)
                    rest = prompt[n_lead:]
                    h = model(torch.tensor(rest), torch.arange(n_lead, len(prompt)), cache)[-1:]
                else:
                    frac = 0.0 if mode == "concat" else float(mode.split()[1])
                    placed = [Document(str(d), docs[d], kv, states[d]) for d in order]
                    cache.reserve(len(prompt))
                    b = Blend(model, cache, placed, question, frac)
                    for _ in b.run():
                        pass
                    assert b.last_hidden is not None
                    h = b.last_hidden
                out[mode] = _reply(model, cache, h)
            ref_logp, ref_reply = out["full"]
            for mode, (logp, reply) in out.items():
                r = rows[mode]
                r["correct"].append(float(tok.decode(reply).strip().startswith(answer)))
                r["agree"].append(float(reply == ref_reply))
                r["kl"].append(float((ref_logp.exp() * (ref_logp - logp)).sum()))
    return {
        m: {
            "accuracy": statistics.mean(r["correct"]),
            "agreement": statistics.mean(r["agree"]),
            "kl_mean": statistics.mean(r["kl"]),
            "kl_median": statistics.median(r["kl"]),
        }
        for m, r in rows.items()
    }


def speed(
    engine: Engine, ctx: list[str], docs: list[list[int]], queries: list, fraction: float, peer: Peer | None
) -> dict:
    """TTFT per mode, the modes (and llama.cpp, with `peer`) interleaved within each query."""
    modes = ("full", "exact", "exact_prefix_hit", "blend", "concat", *(("llama.cpp",) if peer else ()))
    runs: dict[str, list[float]] = {m: [] for m in modes}
    plans: dict[str, int] = {}
    for order, question, _ in queries:
        ids = [ctx[d] for d in order]
        prompt = [t for d in order for t in docs[d]] + question
        s = engine.create_session()
        runs["full"].append(run_turn(engine, s.id, prompt).ttft_ms)
        if peer:
            runs["llama.cpp"].append(peer.call("ttft", prompt))
        for mode, how in (
            ("exact", Composition("exact")),
            ("exact_prefix_hit", Composition("exact")),
            ("blend", Composition("blend", fraction)),
            ("concat", Composition("concat")),
        ):
            s = engine.create_session(context_ids=ids, composition=how)
            st = run_turn(engine, s.id, question)
            runs[mode].append(st.ttft_ms)
            plans[mode] = st.cached_tokens + st.placed_tokens
    full = statistics.median(runs["full"])
    return {
        m: {"p50_ms": statistics.median(v), "runs_ms": v, "over_full": statistics.median(v) / full}
        for m, v in runs.items()
    } | {"tokens_from_storage": plans}


def run(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    rng = random.Random(0)
    omp.isolate_main()
    lm = omp.on_worker(lambda: load(args.model, args.dtype, "cpu", args.weights))
    model, tok = lm.model, lm.tokenizer
    assert tok is not None, "the model has no tokenizer"
    kv_dtype = resident_kv_dtype(args.kv_dtype, model)
    texts, facts = corpus(args.docs, args.doc_tokens, tok)
    docs = [tok.encode(t) for t in texts]

    def query(i: int) -> tuple[list[int], list[int], str]:
        d, q, start, a = facts[rng.randrange(len(facts))]
        others = rng.sample([j for j in range(len(docs)) if j != d], args.per_query - 1)
        order = [*others, d]
        rng.shuffle(order)
        return order, tok.encode_chat([{"role": "user", "content": q}]) + tok.encode(start), a

    out: dict = {
        "cpu": f"{machine()['cpu']}, {os.cpu_count()} CPUs; {cpu().describe()}",
        "model": args.model,
        "weights": model.weights,
        "kv_dtype": str(kv_dtype).removeprefix("torch."),
        "per_query": args.per_query,
        "doc_tokens": statistics.mean(len(d) for d in docs),
        "blend_fraction": args.blend_fraction,
    }
    if args.quality_queries:
        qs = [query(i) for i in range(args.quality_queries)]
        out["quality"] = omp.on_worker(lambda: quality(model, tok, docs, qs, args.fractions, kv_dtype))
        out["quality_queries"] = len(qs)
    if args.speed_queries:
        dirs = ensure_dirs(args.dirs) if args.dirs else [Path(tempfile.mkdtemp(prefix="hcache-bench-"))]
        root = [Path(tempfile.mkdtemp(dir=d)) for d in dirs]
        omp.on_worker(lambda: warm_up(model))
        prof = omp.on_worker(lambda: profiler.load_or_run(model, dirs, Path(args.profile_dir)))
        store = ChunkStore(StorageConfig([str(d) for d in root]), model.cfg, model.dtype, "cpu", kv_dtype)
        cfg = EngineConfig(
            kv_budget_bytes=args.budget_mb << 20,
            store_kinds="auto",
            kv_dtype=args.kv_dtype,
            compile_in_background=False,
            decode="eager",
        )
        engine = Engine(model, tok, store, prof, cfg)
        serve_compiled_only()
        try:
            ctx = [engine.precompute_context(token_ids=d).id for d in docs]
            qs = [query(i) for i in range(args.speed_queries)]
            run_turn(engine, engine.create_session().id, docs[0][:64])  # the engine's first turn, not timed
            longest = max(sum(len(docs[d]) for d in order) + len(q) for order, q, _ in qs)
            peer = Peer(longest + 8, os.cpu_count() or 2, root[0], args.model) if _with_llama_cpp(args) else None
            try:
                out["speed"] = speed(engine, ctx, docs, qs, args.blend_fraction, peer)
            finally:
                if peer:
                    peer.close()
            out["speed_queries"] = len(qs)
            if args.pipeline_queries:
                out["pipeline"] = _pipeline(engine, tok, args, rng)
        finally:
            engine.close()
            store.close()
    return out


def _pipeline(engine: Engine, tok: Tokenizer, args: argparse.Namespace, rng: random.Random) -> dict:
    """The pipeline figure (`rag_pipeline`) over a corpus of its own, precomputed here."""
    texts, facts = corpus(args.pipeline_docs, args.doc_tokens, tok, seed=1)
    docs = [tok.encode(t) for t in texts]
    ctx = [engine.precompute_context(token_ids=d).id for d in docs]
    questions: dict[int, list[list[int]]] = {}
    for d, q, start, _ in facts:
        questions.setdefault(d, []).append(tok.encode_chat([{"role": "user", "content": q}]) + tok.encode(start))
    queries = zipf_queries(args.pipeline_queries, len(docs), args.per_query, questions, args.zipf, rng)
    return {
        "docs": len(docs),
        "queries": len(queries),
        "concurrency": args.concurrency,
        "zipf_s": args.zipf,
        "reply_tokens": REPLY_TOKENS,
        "modes": pipeline(engine, ctx, docs, queries, args.blend_fraction, args.concurrency),
    }


def _with_llama_cpp(args: argparse.Namespace) -> bool:
    """llama.cpp's row where it is asked for, installed, and the model is a GGUF file."""
    if not args.llama_cpp or importlib.util.find_spec("llama_cpp") is None:
        return False
    return resolve_model_path(args.model).suffix == ".gguf"


def section(data: dict, stem: str = "rag") -> list[str]:
    """RESULTS.md's section for bench/results/`stem`.json (`rag_MODEL.json`: another model's)."""
    model = "" if data["model"] == "default" else f" ({data['model']})"
    out = [
        f"## RAG: questions over several stored documents{model}",
        "",
        f"`bench/rag.py`: {data['model']} with {data['weights']} weights and a {data['kv_dtype']} KV cache; "
        f"{data['per_query']} documents of about {data['doc_tokens']:.0f} tokens in a random order before a "
        "question whose answer is in one of them (a synthetic corpus of facts among distractors). "
        f"CPU: {data.get('cpu', 'not recorded')}.",
        "",
    ]
    if s := data.get("speed"):
        read = s["tokens_from_storage"]
        out += [
            f"TTFT, documents precomputed and none resident, median of {data['speed_queries']} queries, the modes "
            "interleaved:",
            "",
            "| mode | TTFT p50 ms | / full prefill | tokens from storage |",
            "|---|---:|---:|---:|",
        ]
        names = {
            "full": "full prefill",
            "exact": "exact, first time (the first document restored)",
            "exact_prefix_hit": "exact, the same documents again",
            "blend": f"blend at {data['blend_fraction']:g}",
            "concat": "concat",
            "llama.cpp": "llama.cpp, a prefill of the same prompt (same GGUF)",
        }
        for m, name in names.items():
            if m not in s:
                continue
            r = s[m]
            out.append(f"| {name} | {r['p50_ms']:.0f} | {r['over_full']:.2f} | {read.get(m, 0)} |")
        out.append("")
    if p := data.get("pipeline"):
        out += pipeline_section(p)
    if q := data.get("quality"):
        out += [
            f"Quality over {data['quality_queries']} queries, against full prefill (accuracy: the reply starts with "
            "the answer; agreement: the same greedy reply; KL: of the first reply token's distribution):",
            "",
            "| mode | accuracy | agreement | KL mean | KL median |",
            "|---|---:|---:|---:|---:|",
        ]
        for m, r in q.items():
            out.append(
                f"| {m} | {r['accuracy']:.2f} | {r['agreement']:.2f} | {r['kl_mean']:.4f} | {r['kl_median']:.4f} |"
            )
        out.append("")
    notes = [f"Note: {data[k]}" for k in ("quality_note", "speed_note", "pipeline_note") if k in data]  # merged
    return [*out, *notes, f"Raw results: `bench/results/{stem}.json`.", ""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hcache bench rag", description=__doc__)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--kv-dtype", default="auto", choices=["auto", "model", "bfloat16"])
    ap.add_argument("--dirs", nargs="+", help="storage directories (default: a temp dir)")
    ap.add_argument("--docs", type=int, default=40, help="documents in the corpus")
    ap.add_argument("--doc-tokens", type=int, default=512)
    ap.add_argument("--per-query", type=int, default=5)
    ap.add_argument("--quality-queries", type=int, default=40)
    ap.add_argument("--speed-queries", type=int, default=5)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.05, 0.15, 0.3])
    ap.add_argument("--blend-fraction", type=float, default=0.15)
    ap.add_argument("--budget-mb", type=int, default=2048)
    ap.add_argument("--pipeline-queries", type=int, default=0, help="queries of the pipeline figure (0: none)")
    ap.add_argument("--pipeline-docs", type=int, default=200, help="documents of the pipeline's corpus")
    ap.add_argument("--concurrency", type=int, default=4, help="the pipeline's clients at once")
    ap.add_argument("--zipf", type=float, default=1.0, help="the pipeline's Zipf exponent of document popularity")
    ap.add_argument(
        "--no-llama-cpp", dest="llama_cpp", action="store_false", help="leave llama.cpp's prefill out of the speed rows"
    )
    ap.add_argument("--profile-dir", default=str(Path.home() / ".cache/hcache/profiles"))
    ap.add_argument("--out", default="bench/results/rag.json")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    data = run(args)

    def table() -> None:
        print(
            f"\n{data['model']}, {data['weights']} weights, {data['kv_dtype']} KV: {data['per_query']} documents "
            f"of ~{data['doc_tokens']:.0f} tokens + a question"
        )
        if q := data.get("quality"):
            print(f"\nquality over {data['quality_queries']} queries (vs full prefill)")
            print(f"{'mode':14}{'accuracy':>10}{'agreement':>11}{'KL mean':>10}{'KL median':>11}")
            for m, r in q.items():
                print(
                    f"{m:14}{r['accuracy']:>10.2f}{r['agreement']:>11.2f}{r['kl_mean']:>10.4f}{r['kl_median']:>11.4f}"
                )
        if p := data.get("pipeline"):
            print("", *pipeline_section(p), sep="\n")
        if s := data.get("speed"):
            print(f"\nTTFT over {data['speed_queries']} queries, documents from storage")
            print(f"{'mode':18}{'p50 ms':>10}{'/ full':>9}{'tokens read':>13}")
            for m, r in s.items():
                if m == "tokens_from_storage":
                    continue
                print(f"{m:18}{r['p50_ms']:>10.1f}{r['over_full']:>9.2f}{s['tokens_from_storage'].get(m, 0):>13}")

    return report(data, args.out, args.json, table)


if __name__ == "__main__":
    raise SystemExit(main())
