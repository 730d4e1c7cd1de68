"""Engine benchmark: restoration as a phase of continuous batching.

A document of `--tokens` tokens is precomputed once as a context (its prefill is the
recompute baseline). Each measurement makes a fresh session on it, so its state comes
from storage (O_DIRECT):
- TTFT of a new turn of `--turn` tokens: fused (layer l of the turn prefilled as soon as
  layer l's KV is back) vs sequential (restore everything, then prefill), next to the
  restore alone and the turn's prefill alone (resident);
- the same resident turn while another process reads as many bytes of the store's files with
  O_DIRECT (`ioload`, on 8 threads and on 1): what the machine's I/O path alone costs the
  turn, with none of our reader's work (the fused TTFT pays it too);
- TBT of another session that is decoding, alone and while a session restores.
Medians over `--repeats`; JSON in bench/results/engine.json."""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from hcache import omp
from hcache.benchmarks import report
from hcache.config import EngineConfig, StorageConfig
from hcache.engine.block_pool import resident_kv_dtype
from hcache.engine.engine import Engine
from hcache.engine.records import TurnStats
from hcache.engine.sampler import SamplingParams
from hcache.model.loader import load
from hcache.restore import profiler
from hcache.restore.projection import serve_compiled_only, warm_up
from hcache.storage.dirs import ensure_dirs
from hcache.storage.store import ChunkStore


def run_turn(engine: Engine, sid: str, ids: list[int], max_new: int = 1) -> TurnStats:
    """A token turn run to its end; its stats."""
    seq = engine.generate(sid, token_ids=ids, params=SamplingParams(max_new_tokens=max_new, ignore_eos=True))
    stats = TurnStats()
    for ev in engine.stream(seq):
        if ev.finished and ev.stats is not None:
            stats = ev.stats
    return stats


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _turn_under_reads(
    engine: Engine, ctx: str, files: list[str], ids: list[int], threads: int
) -> tuple[float, float, int]:
    """A turn on a restored (resident) session while another process reads as many bytes
    as the restore did, with O_DIRECT, out of `files` (the store's). Returns (the turn's
    TTFT ms, the reads' ms, bytes read)."""
    s = engine.create_session(context_ids=[ctx])
    r = engine.restore(s.id)
    cmd = [sys.executable, "-m", "hcache.benchmarks.ioload", "--bytes", str(r.bytes_read), "--threads", str(threads)]
    reader = subprocess.Popen([*cmd, *files], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdin is not None and reader.stdout is not None
        if reader.stdout.readline().strip() != "ready":
            raise RuntimeError("the reader process did not start")
        reader.stdin.write("go\n")
        reader.stdin.flush()
        st = run_turn(engine, s.id, ids)
        nbytes, ms = reader.stdout.readline().split()
    finally:
        reader.wait()
        engine.delete(s.id)
    return st.ttft_ms, float(ms), int(nbytes)


def run(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    rng = random.Random(0)
    omp.isolate_main()  # the engine's loop computes (see hcache/omp.py)
    lm = omp.on_worker(lambda: load(args.model, args.dtype, "cpu", args.weights))
    model, tok = lm.model, lm.tokenizer
    dirs = ensure_dirs(args.dirs) if args.dirs else [Path(tempfile.mkdtemp(prefix="hcache-bench-"))]
    root = [Path(tempfile.mkdtemp(dir=d)) for d in dirs]
    omp.on_worker(lambda: warm_up(model))  # as `hcache serve` starts: no turn pays for compiling
    prof = omp.on_worker(lambda: profiler.load_or_run(model, dirs, Path(args.profile_dir)))
    kv_dtype = resident_kv_dtype(args.kv_dtype, model)
    store = ChunkStore(StorageConfig([str(d) for d in root]), model.cfg, model.dtype, "cpu", kv_dtype)
    cfg = EngineConfig(
        kv_budget_bytes=args.budget_mb << 20, store_kinds="auto", kv_dtype=args.kv_dtype, compile_in_background=False
    )
    engine = Engine(model, tok, store, prof, cfg)
    serve_compiled_only()
    vocab = model.cfg.vocab_size
    out: dict = {
        "model": args.model,
        "dtype": args.dtype,
        "weights": model.weights,
        "kv_dtype": str(kv_dtype).removeprefix("torch."),
        "tokens": args.tokens,
        "turn": args.turn,
        "dirs": len(dirs),
        "io_threads": args.io_threads,
    }
    try:
        doc = [rng.randrange(vocab) for _ in range(args.tokens)]
        t = time.perf_counter()
        ctx = engine.precompute_context(token_ids=doc)
        out["context_prefill_ms"] = (time.perf_counter() - t) * 1e3
        print(f"context of {args.tokens} tokens prefilled and stored in {out['context_prefill_ms']:.0f} ms")
        under = [f"turn_under_reads_{n}t" for n in args.io_threads]
        keys = ("fused", "sequential", "restore", "turn_prefill", "turn", *under)
        rows: dict[str, list[float]] = {k: [] for k in keys}
        reads: dict[str, list[float]] = {k: [] for k in under}
        plans = set()
        # the store's files, largest first: the context's slabs, written by now
        found = [f for d in root for f in d.rglob("*") if f.is_file()]
        files = [str(f) for f in sorted(found, key=lambda f: -f.stat().st_size)]
        for _ in range(args.repeats):
            for mode in ("fused", "sequential"):
                engine.cfg.fused = mode == "fused"
                s = engine.create_session(context_ids=[ctx.id])
                st = run_turn(engine, s.id, [rng.randrange(vocab) for _ in range(args.turn)])
                rows[mode].append(st.ttft_ms)
                plans.add(st.plan.layers)
                engine.delete(s.id)
            s = engine.create_session(context_ids=[ctx.id])
            r = engine.restore(s.id)
            rows["restore"].append(r.restore_ms)
            st = run_turn(engine, s.id, [rng.randrange(vocab) for _ in range(args.turn)])
            rows["turn_prefill"].append(st.prefill_ms)
            rows["turn"].append(st.ttft_ms)
            out["restore_bytes"] = r.bytes_read
            engine.delete(s.id)
            for n, key in zip(args.io_threads, under, strict=True):
                turn_ms, read_ms, _ = _turn_under_reads(
                    engine, ctx.id, files, [rng.randrange(vocab) for _ in range(args.turn)], n
                )
                rows[key].append(turn_ms)
                reads[key].append(read_ms)
        engine.cfg.fused = True
        med = {k: statistics.median(v) for k, v in rows.items()}
        out["ttft"] = {k: {"median_ms": med[k], "runs_ms": v} for k, v in rows.items()}
        out["reads_beside_the_turn_ms"] = {k: statistics.median(v) for k, v in reads.items()}
        out["plans"] = sorted(plans)
        out["ttft_fused_over_sequential"] = med["fused"] / med["sequential"]
        out["ttft_fused_over_max"] = med["fused"] / max(med["restore"], med["turn_prefill"])

        # TBT of a decoding session, alone and while other sessions restore the document
        d = engine.create_session()
        run_turn(engine, d.id, [rng.randrange(vocab) for _ in range(64)])
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
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--weights", default="auto", help="as `hcache serve --weights` (default: its default)")
    ap.add_argument("--kv-dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--dirs", nargs="+", help="storage directories (default: a temp dir)")
    ap.add_argument("--tokens", type=int, default=8000, help="the document restored")
    ap.add_argument("--turn", type=int, default=32, help="tokens of the new turn")
    ap.add_argument(
        "--io-threads", type=int, nargs="*", default=[8, 1], help="reader threads of the I/O-only process, per row"
    )
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
        print(
            f"\n{data['model']} {data['dtype']}, {data['weights']} weights, {data['kv_dtype']} KV: "
            f"{data['tokens']}-token context from storage + {data['turn']} new"
        )
        print(f"plans: {', '.join(data['plans'])}")
        print(f"{'':36}{'median ms':>12}")
        for k in t:
            print(f"{k:36}{t[k]['median_ms']:>12.1f}")
        base = t["turn"]["median_ms"]  # TTFT of the turn on a resident context
        for k, ms in data["reads_beside_the_turn_ms"].items():
            print(
                f"{k}: +{t[k]['median_ms'] - base:.1f} ms over the resident turn while another process read "
                f"{data['restore_bytes'] / 1e6:.0f} MB in {ms:.1f} ms"
            )
        print(f"fused: +{t['fused']['median_ms'] - base:.1f} ms over the resident turn")
        print(f"context prefill (recompute) {data['context_prefill_ms']:.0f} ms")
        print(f"TTFT fused / sequential = {data['ttft_fused_over_sequential']:.2f}")
        print(f"TTFT fused / max(restore, prefill) = {data['ttft_fused_over_max']:.2f}")
        a, d = data["tbt"]["alone"], data["tbt"]["during_restore"]
        print(f"TBT alone p50 {a['p50_ms']:.1f} p99 {a['p99_ms']:.1f} max {a['max_ms']:.1f} ms")
        print(
            f"TBT during {d['restores']} restores p50 {d['p50_ms']:.1f} p99 {d['p99_ms']:.1f} max {d['max_ms']:.1f} ms"
        )

    return report(data, args.out, args.json, table)


def section(data: dict) -> list[str]:
    """RESULTS.md's section for bench/results/engine.json."""
    t = data["ttft"]
    out = [
        "## Engine: a fused restore and turn, and what reading costs the turn",
        "",
        f"`bench/engine.py`: {data['model']} in {data['dtype']} with {data['weights']} weights and a "
        f"{data['kv_dtype']} KV cache; a {data['tokens']}-token context restored from storage (plans "
        f"{', '.join(data['plans'])}), then a {data['turn']}-token turn. Medians of {len(t['fused']['runs_ms'])} "
        "runs each, from one run of the benchmark.",
        "",
        "| measure | median ms | over the resident turn |",
        "|---|---:|---:|",
    ]
    base = t["turn"]["median_ms"]
    rows = [
        ("restore", "restore alone", False),
        ("turn_prefill", "the turn's prefill, context resident", False),
        ("turn", "TTFT, context resident", False),
        *(
            (f"turn_under_reads_{n}t", f"TTFT, context resident, another process reading on {n} thread(s)", True)
            for n in data["io_threads"]
        ),
        ("sequential", "TTFT: restore, then the turn", True),
        ("fused", "TTFT: restore and turn fused", True),
    ]
    for key, name, over in rows:
        ms = t[key]["median_ms"]
        out.append(f"| {name} | {ms:.1f} | {f'+{ms - base:.1f}' if over else ''} |")
    reads = data["reads_beside_the_turn_ms"]
    took = ", ".join(f"{reads[f'turn_under_reads_{n}t']:.0f} ms on {n} thread(s)" for n in data["io_threads"])
    out += [
        "",
        f"The other process read the restore's {data['restore_bytes'] / 1e6:.0f} MB out of the store's files with "
        f"O_DIRECT and did nothing else (no checksums, no placing, no GIL shared with the engine), in {took}: "
        "what that costs the turn is the machine's I/O path's own share, before any of our reader's work.",
    ]
    if tbt := data.get("tbt"):
        a, d = tbt["alone"], tbt["during_restore"]
        out += [
            "",
            f"A session decoding at batch 1: time between tokens p50 {a['p50_ms']:.1f} / p99 {a['p99_ms']:.1f} ms "
            f"alone, p50 {d['p50_ms']:.1f} / p99 {d['p99_ms']:.1f} ms while {d['restores']} restores of the "
            "context ran one after another (the loop gives each step's time left to the restore).",
        ]
    out += [
        "",
        "Raw results: `bench/results/engine.json`.",
        "",
    ]
    return out
