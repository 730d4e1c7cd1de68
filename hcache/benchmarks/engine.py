"""Engine benchmark: restoration as a phase of continuous batching.

A document of `--tokens` tokens is precomputed once as a context (its prefill is the
recompute baseline). Each measurement makes a fresh session on it, so its state comes
from storage (O_DIRECT):
- TTFT of a new turn of `--turn` tokens: fused (layer l of the turn prefilled as soon as
  layer l's KV is back) vs sequential (restore everything, then prefill), next to the
  restore alone and the turn's prefill alone (resident);
- TBT of another session that is decoding, alone and while a session restores.
Medians over `--repeats`; JSON in bench/results/engine.json."""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from hcache.benchmarks import report
from hcache.config import EngineConfig, StorageConfig
from hcache.engine.engine import Engine
from hcache.engine.records import TurnStats
from hcache.engine.sampler import SamplingParams
from hcache.model.loader import load
from hcache.restore import profiler
from hcache.restore.projection import serve_compiled_only, warm_up
from hcache.storage.dirs import ensure_dirs
from hcache.storage.store import ChunkStore


def _turn(engine: Engine, sid: str, ids: list[int], max_new: int = 1) -> TurnStats:
    seq = engine.generate(sid, token_ids=ids, params=SamplingParams(max_new_tokens=max_new, ignore_eos=True))
    stats = TurnStats()
    for ev in engine.stream(seq):
        if ev.finished and ev.stats is not None:
            stats = ev.stats
    return stats


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def run(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    rng = random.Random(0)
    lm = load(args.model, args.dtype)
    model, tok = lm.model, lm.tokenizer
    dirs = ensure_dirs(args.dirs) if args.dirs else [Path(tempfile.mkdtemp(prefix="hcache-bench-"))]
    root = [Path(tempfile.mkdtemp(dir=d)) for d in dirs]
    warm_up(model)  # as `hcache serve` starts: no turn pays for compiling
    prof = profiler.load_or_run(model, dirs, Path(args.profile_dir))
    store = ChunkStore(StorageConfig([str(d) for d in root]), model.cfg, model.dtype)
    cfg = EngineConfig(kv_budget_bytes=args.budget_mb << 20, store_kinds="auto")
    engine = Engine(model, tok, store, prof, cfg)
    serve_compiled_only()
    vocab = model.cfg.vocab_size
    out: dict = {"model": args.model, "dtype": args.dtype, "tokens": args.tokens, "turn": args.turn, "dirs": len(dirs)}
    try:
        doc = [rng.randrange(vocab) for _ in range(args.tokens)]
        t = time.perf_counter()
        ctx = engine.precompute_context(token_ids=doc)
        out["context_prefill_ms"] = (time.perf_counter() - t) * 1e3
        print(f"context of {args.tokens} tokens prefilled and stored in {out['context_prefill_ms']:.0f} ms")
        rows: dict[str, list[float]] = {k: [] for k in ("fused", "sequential", "restore", "turn_prefill")}
        plans = set()
        for _ in range(args.repeats):
            for mode in ("fused", "sequential"):
                engine.cfg.fused = mode == "fused"
                s = engine.create_session(context_ids=[ctx.id])
                st = _turn(engine, s.id, [rng.randrange(vocab) for _ in range(args.turn)])
                rows[mode].append(st.ttft_ms)
                plans.add(st.plan.layers)
                engine.delete(s.id)
            s = engine.create_session(context_ids=[ctx.id])
            r = engine.restore(s.id)
            rows["restore"].append(r.restore_ms)
            st = _turn(engine, s.id, [rng.randrange(vocab) for _ in range(args.turn)])
            rows["turn_prefill"].append(st.prefill_ms)
            engine.delete(s.id)
        engine.cfg.fused = True
        med = {k: statistics.median(v) for k, v in rows.items()}
        out["ttft"] = {k: {"median_ms": med[k], "runs_ms": v} for k, v in rows.items()}
        out["plans"] = sorted(plans)
        out["ttft_fused_over_sequential"] = med["fused"] / med["sequential"]
        out["ttft_fused_over_max"] = med["fused"] / max(med["restore"], med["turn_prefill"])

        # TBT of a decoding session, alone and while other sessions restore the document
        d = engine.create_session()
        _turn(engine, d.id, [rng.randrange(vocab) for _ in range(64)])
        alone = _decode_tbt(engine, d.id, rng, vocab, args.decode_tokens, None)
        during = _decode_tbt(engine, d.id, rng, vocab, args.decode_tokens, ctx.id)
        out["tbt"] = {
            "alone": {"p50_ms": _pct(alone[0], 0.5), "p99_ms": _pct(alone[0], 0.99), "max_ms": max(alone[0])},
            "during_restore": {
                "p50_ms": _pct(during[0], 0.5),
                "p99_ms": _pct(during[0], 0.99),
                "max_ms": max(during[0]),
                "restores": during[1],
                "restore_ms": during[2],
            },
        }
    finally:
        engine.close()
        store.close()
    return out


def _decode_tbt(
    engine: Engine, sid: str, rng: random.Random, vocab: int, n: int, ctx: str | None
) -> tuple[list[float], int, list[float]]:
    """TBTs of `sid` decoding `n` tokens; with `ctx`, sessions on it restore back to back meanwhile.
    Returns (TBTs measured while restores ran, or all of them when alone; restores; their ms)."""
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    seq = engine.generate(sid, token_ids=[rng.randrange(vocab)], params=params)
    restoring = [False]
    restores: list[float] = []
    windows: list[tuple[float, float]] = []

    def restorer() -> None:
        while not seq.done.is_set() and len(restores) < 20:
            s = engine.create_session(context_ids=[ctx])
            t0 = time.perf_counter()
            restoring[0] = True
            r = engine.restore(s.id)
            restoring[0] = False
            windows.append((t0, time.perf_counter()))
            restores.append(r.restore_ms)
            engine.delete(s.id)

    th = threading.Thread(target=restorer) if ctx else None
    stamps: list[float] = []
    started = False
    for _ev in engine.stream(seq):
        stamps.append(time.perf_counter())
        if th is not None and not started and len(stamps) >= 3:
            th.start()
            started = True
    if th is not None and started:
        th.join()
    gaps = [(b - a) * 1e3 for a, b in itertools.pairwise(stamps[1:])]
    if ctx is None:
        return gaps, 0, []
    inside = [(b - a) * 1e3 for a, b in itertools.pairwise(stamps[1:]) if any(w0 <= b <= w1 for w0, w1 in windows)]
    return inside or gaps, len(restores), restores


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hcache bench engine", description=__doc__)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--dirs", nargs="+", help="storage directories (default: a temp dir)")
    ap.add_argument("--tokens", type=int, default=8000, help="the document restored")
    ap.add_argument("--turn", type=int, default=128, help="tokens of the new turn")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--decode-tokens", type=int, default=120)
    ap.add_argument("--budget-mb", type=int, default=4096)
    ap.add_argument("--profile-dir", default=str(Path.home() / ".cache/hcache/profiles"))
    ap.add_argument("--out", default="bench/results/engine.json")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    data = run(args)

    def table() -> None:
        t = data["ttft"]
        print(f"\n{data['model']} {data['dtype']}: {data['tokens']}-token context from storage + {data['turn']} new")
        print(f"plans: {', '.join(data['plans'])}")
        print(f"{'':24}{'median ms':>12}")
        for k in ("restore", "turn_prefill", "sequential", "fused"):
            print(f"{k:24}{t[k]['median_ms']:>12.1f}")
        print(f"context prefill (recompute) {data['context_prefill_ms']:.0f} ms")
        print(f"TTFT fused / sequential = {data['ttft_fused_over_sequential']:.2f}")
        print(f"TTFT fused / max(restore, prefill) = {data['ttft_fused_over_max']:.2f}")
        a, d = data["tbt"]["alone"], data["tbt"]["during_restore"]
        print(f"TBT alone p50 {a['p50_ms']:.1f} p99 {a['p99_ms']:.1f} max {a['max_ms']:.1f} ms")
        print(
            f"TBT during {d['restores']} restores p50 {d['p50_ms']:.1f} p99 {d['p99_ms']:.1f} max {d['max_ms']:.1f} ms"
        )

    return report(data, args.out, args.json, table)
