"""hcache against the systems a user would otherwise pick, on one GGUF model (`--model`, the
default model's unless told), in one run on this machine.

- llama.cpp (llama-cpp-python, loaded with use_extra_bufts=False): prefill (token
  recompute); per-sequence state saved to a file and loaded back; the TTFT of a new
  32-token turn after the load. The state file is fsync'ed and then dropped from the
  page cache with posix_fadvise(DONTNEED) before it is loaded, so its load reads the disk.
- transformers: prefill.
- hcache: restore by auto, KV, H and RE from O_DIRECT storage, then the same new turn;
  and the fused TTFT after eviction (restore + turn in one layer-wise pipeline), each
  round beside one of the turn over the context restored before it (the floor).
- Decode: time between tokens at batch 1, aggregate tokens/s at batch 8 and 32.
llama.cpp runs in a process of its own (`llamacpp.Peer`); the TTFT evictions and batch-1
TBT alternate between the two systems round by round, so the VM's drift over minutes
stays out of their ratios.
JSON in bench/results/peers.json (plots and RESULTS.md by bench/report.py)."""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import os
import platform
import random
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from hcache import omp
from hcache.benchmarks import measures, report
from hcache.benchmarks.llamacpp import (
    EVICTION_ROUNDS,
    REPEATS,
    TURN,
    Peer,
    eviction_row,
    llama,
    llama_cpp_decode,
    llama_cpp_rows,
)
from hcache.config import EngineConfig, StorageConfig
from hcache.engine.block_pool import resident_kv_dtype
from hcache.engine.engine import Engine
from hcache.engine.records import TurnStats
from hcache.engine.sampler import SamplingParams
from hcache.engine.sequence import Sequence
from hcache.kernels.cpu import cpu as kernels_cpu
from hcache.model.loader import load, read_config, resolve_model_path
from hcache.restore import profiler
from hcache.restore.plan import Method
from hcache.restore.projection import serve_compiled_only, warm_up
from hcache.storage.dirs import ensure_dirs
from hcache.storage.store import ChunkStore


def transformers_rows(doc: list[int], contexts: list[int], max_tokens: int, model: str) -> list[dict]:
    from transformers import AutoModelForCausalLM

    p = resolve_model_path(model)
    model = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32).eval()
    rows = []
    for n in contexts:
        if n > max_tokens:
            continue
        with torch.inference_mode():
            t = time.perf_counter()
            model(torch.tensor([doc[:n]]), use_cache=True)
            rows.append({"system": "transformers", "tokens": n, "prefill_ms": (time.perf_counter() - t) * 1e3})
        print(f"transformers {n}: {rows[-1]}", flush=True)
    return rows


def hcache_rows(
    args: argparse.Namespace, doc: list[int], turn: list[int], peer: Peer | None
) -> tuple[list[dict], dict[str, Any]]:
    """hcache's rows and decode figures; with `peer`, llama.cpp's too, each measure's rounds
    alternating between the two systems."""
    omp.isolate_main()  # the engine's loop computes (see hcache/omp.py)
    lm = omp.on_worker(lambda: load(args.model, args.dtype, args.device, args.weights))
    dirs = ensure_dirs(args.dirs) if args.dirs else [Path(tempfile.mkdtemp(prefix="hcache-peers-"))]
    omp.on_worker(lambda: warm_up(lm.model))  # as `hcache serve` starts: no restore pays for compiling
    prof = omp.on_worker(lambda: profiler.load_or_run(lm.model, dirs, Path(args.profile_dir)))
    engine, store = _engine(lm, prof, dirs, args, kv_budget_bytes=4 << 30, store_kinds="both")
    serve_compiled_only()
    rows: list[dict] = []
    one = SamplingParams(max_new_tokens=1, ignore_eos=True)
    try:
        for n in args.contexts:
            t = time.perf_counter()
            ctx = engine.precompute_context(token_ids=doc[:n])
            row: dict[str, Any] = {"system": "hcache", "tokens": n, "prefill_ms": (time.perf_counter() - t) * 1e3}
            for name, method in (
                ("auto", None),
                ("kv", Method.KV),
                ("hidden", Method.HIDDEN),
                ("re", Method.RECOMPUTE),
            ):
                s = engine.create_session(context_ids=[ctx.id])
                r = engine.restore(s.id, method)
                seq = engine.generate(s.id, token_ids=turn, params=one)
                st = _last_stats(engine, seq)
                row[f"restore_{name}_ms"] = r.restore_ms
                row[f"turn_after_{name}_ms"] = st.ttft_ms
                row[f"bytes_{name}"] = r.bytes_read
                if name == "auto":
                    row["auto_plan"] = r.plan.layers
                engine.delete(s.id)
            peer_row = {"system": "llama.cpp", "tokens": n} | (peer.call("prepare", doc[:n]) if peer else {})
            ttfts, resident, loads, turns = [], [], [], []
            for _ in range(EVICTION_ROUNDS):
                s = engine.create_session(context_ids=[ctx.id])  # evicted session, new turn: restore fused
                seq = engine.generate(s.id, token_ids=turn, params=one)
                ttfts.append(_last_stats(engine, seq).ttft_ms)
                engine.delete(s.id)
                # the floor in the same phase of the VM: the turn with the context restored before it
                s = engine.create_session(context_ids=[ctx.id])
                engine.restore(s.id)
                seq = engine.generate(s.id, token_ids=turn, params=one)
                resident.append(_last_stats(engine, seq).ttft_ms)
                engine.delete(s.id)
                if peer:
                    load_ms, turn_ms = peer.call("load_turn", doc[:n], turn)
                    loads.append(load_ms)
                    turns.append(turn_ms)
            row["ttft_after_eviction_ms"] = statistics.median(ttfts)
            row["ttft_rounds_ms"] = ttfts
            row["resident_turn_ms"] = statistics.median(resident)
            row["resident_turn_rounds_ms"] = resident
            rows.append(row)
            print(f"hcache {n}: {row}", flush=True)
            if peer:
                peer.call("forget", n)
                rows.append(peer_row | eviction_row(loads, turns))
                print(f"llama.cpp {n}: {rows[-1]}", flush=True)
    finally:
        engine.close()
        store.close()
    # decode on engines as served: what sessions store is the planner's choice (the restore
    # rows above store both kinds, to have every path), or nothing with the saver off.
    # Batch 1, the closest ratio, in rounds: saver on, saver off, llama.cpp
    b1: dict[str, list[float]] = {"on": [], "off": [], "llama.cpp": [], "host": []}
    for _ in range(REPEATS):
        on = _decode_variant(lm, prof, dirs, doc, [1], args)
        b1["on"].append(on["tbt_b1_ms"])
        b1["host"].append(on.get("host_ms_b1", math.nan))
        b1["off"].append(_decode_variant(lm, prof, dirs, doc, [1], args, store_kinds="none")["tbt_b1_ms"])
        if peer:
            b1["llama.cpp"].append(peer.call("decode", doc, [1], args.decode_prompt, args.decode_steps)["tbt_b1_ms"])
    more = [b for b in args.batches if b > 1]
    decode = _decode_variant(lm, prof, dirs, doc, more, args) if more else {}
    decode |= {"tbt_b1_ms": statistics.median(b1["on"]), "tbt_b1_saver_off_ms": statistics.median(b1["off"])}
    decode |= {"tbt_b1_rounds_ms": b1["on"], "tbt_b1_saver_off_rounds_ms": b1["off"]} | _memory(lm, args.device)
    decode["host_ms_b1"] = statistics.median(b1["host"])
    decode["weights"] = lm.model.weights  # what `auto` resolved to
    decode["kv_dtype"] = str(resident_kv_dtype(args.kv_dtype, lm.model)).removeprefix("torch.")
    peer_decode: dict[str, Any] = {}
    if peer:
        peer_decode = peer.call("decode", doc, more, args.decode_prompt, args.decode_steps) if more else {}
        peer_decode |= {"tbt_b1_ms": statistics.median(b1["llama.cpp"]), "tbt_b1_rounds_ms": b1["llama.cpp"]}
    return rows, {"hcache": decode} | ({"llama.cpp": peer_decode} if peer else {})


def _engine(lm: Any, prof: Any, dirs: list[Path], args: argparse.Namespace, **cfg: Any) -> tuple[Engine, ChunkStore]:
    """An engine configured by `cfg` (and `--kv-dtype`) on a fresh store in each of `dirs`."""
    roots = [tempfile.mkdtemp(dir=d) for d in dirs]
    kv_dtype = resident_kv_dtype(args.kv_dtype, lm.model)
    store = ChunkStore(StorageConfig(roots), lm.model.cfg, lm.model.dtype, args.device, kv_dtype)
    return Engine(
        lm.model, lm.tokenizer, store, prof, EngineConfig(kv_dtype=args.kv_dtype, compile_in_background=False, **cfg)
    ), store


def _decode_variant(
    lm: Any, prof: Any, dirs: list[Path], doc: list[int], batches: list[int], args: argparse.Namespace, **cfg: Any
) -> dict[str, float]:
    """Decode on a fresh engine (and store) configured by `cfg`."""
    engine, store = _engine(lm, prof, dirs, args, kv_budget_bytes=1 << 30, **cfg)
    try:
        return _hcache_decode(engine, doc, batches, args.decode_prompt, args.decode_steps)
    finally:
        engine.close()
        store.close()
        del engine, store
        gc.collect()  # its block pool (reference cycles hold it): the next engine's must not add to the peak RSS


def _memory(lm: Any, device: str) -> dict[str, float]:
    """Resident weights (`DecoderModel.weight_bytes`) against the GGUF file, the bytes a
    decode step streams with the machine's streaming read rate (its bound), and the
    process's peak RSS so far (before llama.cpp loads)."""
    return {
        "weights_mb": lm.model.weight_bytes() / 1e6,
        "step_weights_mb": lm.model.step_bytes() / 1e6,
        "stream_read_gbps": measures.stream_read_gbps(device),
        "gguf_mb": lm.source.stat().st_size / 1e6,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3,
    }


def _last_stats(engine: Engine, seq: Sequence) -> TurnStats:
    return next(ev.stats for ev in engine.stream(seq) if ev.finished) or TurnStats()


def _hcache_decode(engine: Engine, doc: list[int], batches: list[int], prompt: int, steps: int) -> dict[str, float]:
    """Per batch size b: b sessions prefill their prompts first (a turn of one token each,
    as llama.cpp's rows prefill before they time), then all take a turn of one new token and
    `steps` more, and the gaps between tokens are timed while all b decode together: after
    the last sequence's first token (their one-token prefills share the first steps) and
    before the first one's last (the batch then shrinks). At batch 1, the middle half of
    the gaps."""
    out = {}
    first = SamplingParams(max_new_tokens=1, ignore_eos=True)
    params = SamplingParams(max_new_tokens=steps, ignore_eos=True)
    for b in batches:
        sessions = [engine.create_session() for _ in range(b)]
        prompts = [[doc[(i * 7 + j) % len(doc)] for j in range(prompt + 1)] for i in range(b)]
        pairs = list(zip(sessions, prompts, strict=True))
        for q in [engine.generate(s.id, token_ids=p[:prompt], params=first) for s, p in pairs]:
            _last_stats(engine, q)
        submitted, seqs = [], []
        for s, p in pairs:
            submitted.append(time.perf_counter() * 1e3)
            seqs.append(engine.generate(s.id, token_ids=p[prompt:], params=params))
        engine.runner.step_ms.clear()
        stats = [_last_stats(engine, q) for q in seqs]
        if b == 1 and engine.runner.graph is not None:  # Python around the compiled graph
            steps_ms = list(engine.runner.step_ms)[len(engine.runner.step_ms) // 2 :]
            out["host_ms_b1"] = statistics.median(step - graph for step, graph in steps_ms)
        if b == 1:
            gaps = stats[0].tbt_ms[len(stats[0].tbt_ms) // 4 : 3 * len(stats[0].tbt_ms) // 4]
        else:
            gaps = _together(submitted, stats)
        med = statistics.median(gaps)
        out["tbt_b1_ms" if b == 1 else f"tokens_per_s_b{b}"] = med if b == 1 else b / (med / 1e3)
        for s in sessions:
            engine.delete(s.id)
    return out


def _together(submitted_ms: list[float], stats: list[TurnStats]) -> list[float]:
    """The gaps that ended while every sequence decoded: each token's time is its turn's
    submission plus its TTFT and the gaps before it."""
    pairs = list(zip(submitted_ms, stats, strict=True))
    ends = [[t + st.ttft_ms + s for s in itertools.accumulate(st.tbt_ms)] for t, st in pairs]
    joined = max(t + st.ttft_ms for t, st in pairs)
    left = min(e[-1] for e in ends)
    gaps = [
        g for st, e in zip(stats, ends, strict=True) for g, end in zip(st.tbt_ms, e, strict=True) if joined < end < left
    ]
    if len(gaps) < 4 * len(stats):
        raise SystemExit(f"fewer than 4 steps of the whole batch of {len(stats)}: raise --decode-steps")
    return gaps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hcache bench peers", description=__doc__)
    ap.add_argument("--model", default="default", help="a model by name or a GGUF file's path (both systems)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8000])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu", help="hcache's torch device (llama.cpp runs on the CPU)")
    ap.add_argument("--weights", default="auto", choices=["auto", "float", "packed"], help="hcache's weight mode")
    ap.add_argument("--kv-dtype", default="auto", choices=["auto", "model", "bfloat16"], help="hcache's resident KV")
    ap.add_argument("--dirs", nargs="+", help="storage directories (default: a temp dir)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--decode-prompt", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=96)
    ap.add_argument("--transformers-max", type=int, default=8192, help="skip transformers above this context")
    ap.add_argument("--skip", nargs="*", default=[], choices=["llama.cpp", "transformers", "hcache"])
    ap.add_argument("--merge", action="store_true", help="keep the skipped systems' rows from --out")
    ap.add_argument("--profile-dir", default=str(Path.home() / ".cache/hcache/profiles"))
    ap.add_argument("--out", help="default: bench/results/peers.json, peers_MODEL.json for another model")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.out is None:
        name = "" if args.model == "default" else "_" + Path(args.model).name.removesuffix(".gguf")
        args.out = f"bench/results/peers{name}.json"
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    doc = [rng.randrange(100, 49000) for _ in range(max(args.contexts) + 64)]
    turn = [rng.randrange(100, 49000) for _ in range(TURN)]
    scratch = ensure_dirs(args.dirs)[0] if args.dirs else Path(tempfile.mkdtemp())
    data: dict[str, Any] = {"rows": [], "decode": {}, "machine": machine(), "args": vars(args)}
    if args.merge and Path(args.out).exists():  # keep the systems this run skips
        old = json.loads(Path(args.out).read_text())
        data["rows"] = [r for r in old["rows"] if r["system"] in args.skip]
        data["decode"] = {k: v for k, v in old["decode"].items() if k in args.skip}

    def save() -> None:  # after each system, so a failure later keeps what was measured
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(data, indent=2))

    if "hcache" not in args.skip:
        n_ctx = max(args.contexts) + 2 * TURN
        peer = None if "llama.cpp" in args.skip else Peer(n_ctx, args.threads, scratch, args.model)
        try:
            rows, dec = hcache_rows(args, doc, turn, peer)
        finally:
            if peer:
                peer.close()
        data["rows"] += rows
        data["decode"] |= dec
        save()
    # before llama.cpp: its OpenMP teams stay in this process, and with more team threads
    # than cores every parallel region of ours waits tens of microseconds for a sleeping one
    cfg = read_config(args.model)
    if torch.device(args.device).type == "cpu":  # the CPU's attention kernels, beside the rows
        data["attention"] = measures.attention_rates(
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, [c for c in args.contexts if c > TURN], TURN
        )
        data["attention_kernels"] = measures.attention_kernels(
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, max(args.contexts), TURN
        )
    if "hcache" in args.skip and "llama.cpp" not in args.skip:  # llama.cpp alone, in this process
        data["rows"] += llama_cpp_rows(doc, turn, args.contexts, scratch, args.threads, args.model)
        data["decode"]["llama.cpp"] = llama_cpp_decode(
            doc, args.batches, args.decode_prompt, args.decode_steps, args.threads, args.model
        )
        save()
    if "transformers" not in args.skip:
        data["rows"] += omp.on_worker(lambda: transformers_rows(doc, args.contexts, args.transformers_max, args.model))
    if "llama.cpp" not in args.skip:
        data["quality"] = measures.perplexities(
            args.dtype, lambda n: llama(n, args.threads, logits_all=True, model=args.model), args.model
        )
    save()

    def table() -> None:
        for r in data["rows"]:
            print({k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()})
        print(data["decode"])

    return report(data, args.out, args.json, table)


def machine() -> dict[str, Any]:
    import importlib.metadata as md

    def ver(p: str) -> str:
        try:
            return md.version(p)
        except md.PackageNotFoundError:
            return "-"

    info = _cpuinfo()
    # "AMD EPYC" alone names no generation: its family and model do
    family = f"family {info['cpu family']} model {info['model']}" if "cpu family" in info and "model" in info else None
    caps = {
        k: os.environ[k]
        # TORCHINDUCTOR_CPP_MARCH: inductor's C++ is built -march=native unless told, whatever the cap
        for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "TORCHINDUCTOR_CPP_MARCH")
        if k in os.environ
    }
    try:  # the instructions llama.cpp was built for (an AVX2-only build beside capped torch)
        import llama_cpp

        llama_isa = llama_cpp.llama_print_system_info().decode().strip()
    except Exception:
        llama_isa = "-"
    return {
        "cpu": info.get("model name", platform.processor()),
        "cpu_family": family,
        "cpu_kind": kernels_cpu().kind,  # as hcache's kernels see it (capped by `caps`)
        "kernels": kernels_cpu().paths(),
        "caps": caps,
        "llama_cpp_system": llama_isa,
        "cores": os.cpu_count(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "memory_gb": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "llama-cpp-python": ver("llama-cpp-python"),
        "transformers": ver("transformers"),
        "hcache": ver("hcache"),
        "date": time.strftime("%Y-%m-%d"),
    }


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (none where there is no such file)."""
    path = Path("/proc/cpuinfo")
    text = path.read_text().split("\n\n", 1)[0] if path.exists() else ""
    pairs = (ln.split(":", 1) for ln in text.splitlines() if ":" in ln)
    return {k.strip(): v.strip() for k, v in pairs}
