"""`hcache` command line."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from hcache import config
from hcache.config import Config
from hcache.flags import add_config_flags, to_config
from hcache.malloc import tune_allocator
from hcache.storage.errors import StorageError

if TYPE_CHECKING:
    from hcache.restore.profile import Geometry, Profile


def _common(p: argparse.ArgumentParser, base: Config, only: tuple[str, ...] | None = ("model", "dtype")) -> None:
    """Model options (with `only=None`, every config flag) and torch's thread count."""
    add_config_flags(p, base, only)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")


def parser(base: Config | None = None) -> argparse.ArgumentParser:
    """The command line; the config flags' defaults come from `base` (default: Config())."""
    base = base or Config()
    ap = argparse.ArgumentParser(prog="hcache", description="stateful LLM serving with hidden-state KV restoration")
    sub = ap.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="3-turn chat; KV dropped and restored by every path after each turn")
    _common(demo, base, ("model", "dtype", "device"))
    demo.add_argument("--max-new-tokens", type=int, default=64)
    demo.add_argument("--json", action="store_true", help="print the table and replies as JSON on stdout")
    fsck = sub.add_parser("fsck", help="verify a store's chunks and manifest; --repair fixes what it can")
    fsck.add_argument("--dirs", nargs="+", required=True, help="the store's directories, in their original order")
    fsck.add_argument("--repair", action="store_true")
    prof = sub.add_parser("profile", help="measure this machine for the restore planner (cached)")
    _common(prof, base)
    prof.add_argument("--dirs", nargs="+", help="storage directories to measure (default: the store's)")
    prof.add_argument("--reprofile", action="store_true", help="measure again even if a profile is cached")
    plan = sub.add_parser("plan", help="what restore plan hcache would use for a model on a machine")
    plan.add_argument(
        "--model", help="'default', a .gguf file, an HF folder or a known geometry (llama-2-7b, opt-30b, ...)"
    )
    plan.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    for name in ("layers", "hidden", "heads", "kv-heads", "ffn", "head-dim"):
        plan.add_argument(f"--{name}", type=int)
    plan.add_argument("--tokens", type=int, required=True, help="context length to restore")
    plan.add_argument("--profile", help="a profile JSON from `hcache profile`")
    plan.add_argument("--device", help="hypothetical machine: a known accelerator (a100-40g, h100-sxm, l4, ...)")
    plan.add_argument("--tflops", type=float, help="hypothetical machine: peak compute (overrides --device's)")
    plan.add_argument("--mem-gbps", type=float, help="hypothetical machine: memory bandwidth (overrides --device's)")
    plan.add_argument("--io-gbps", type=float, help="hypothetical machine: storage read bandwidth, all drives")
    plan.add_argument("--tp", type=int, default=1, help="hypothetical machine: tensor-parallel devices")
    plan.add_argument("--efficiency", type=float, help="fraction of the peaks a restore reaches (default 0.75)")
    plan.add_argument("--cap-gbps", type=float, help="read bandwidth cap in GB/s")
    plan.add_argument("--json", action="store_true")
    serve = sub.add_parser(
        "serve",
        help="the gRPC service (default model, default store, port 50051)",
        description="Settings come from the flags given, then --config FILE, then the defaults shown.",
    )
    serve.add_argument(
        "--config",
        metavar="FILE",
        help="a TOML file: top-level model, dtype, ... and tables [storage], [engine], [server] (README)",
    )
    _common(serve, base, only=None)
    chat = sub.add_parser("chat", help="terminal chat client (/restore, /evict, /stats)")
    chat.add_argument(
        "--target",
        default="localhost:50051",
        help="HOST:PORT, or several replicas separated by commas (sessions routed by rendezvous hashing)",
    )
    chat.add_argument("--session", help="continue this session instead of creating one")
    chat.add_argument("--system", default="", help="system prompt of a new session")
    chat.add_argument("--max-new-tokens", type=int, default=256)
    chat.add_argument("--api-key", default=os.environ.get("HCACHE_API_KEY"), help="(default: $HCACHE_API_KEY)")
    chat.add_argument("--tls-ca", help="PEM root certificate: connect with TLS")
    pre = sub.add_parser(
        "precompute",
        help="store a corpus's documents as contexts through a running server (reruns skip what is stored)",
    )
    pre.add_argument("corpus", type=Path, help='a folder of .txt files, or a JSONL file of {"id": ..., "text": ...}')
    pre.add_argument("--label", action="append", default=[], metavar="KEY=VALUE", help="on every context")
    pre.add_argument("--quiet", action="store_true", help="no progress bar")
    ctxs = sub.add_parser("contexts", help="list the stored contexts, find one by its document id, or delete it")
    ctxs.add_argument("--id", help="the caller's document id (the `id` label precompute gave it)")
    ctxs.add_argument("--delete", action="store_true", help="delete the context of --id")
    for p in (pre, ctxs):
        p.add_argument("--target", default="localhost:50051", help="HOST:PORT of a running server")
        p.add_argument("--api-key", default=os.environ.get("HCACHE_API_KEY"), help="(default: $HCACHE_API_KEY)")
        p.add_argument("--tls-ca", help="PEM root certificate: connect with TLS")
    bench = sub.add_parser("bench", help="benchmarks (storage, restore, engine, serve, cluster, rag, int8)")
    kinds = ["storage", "restore", "engine", "serve", "soak", "peers", "cluster", "rag", "int8"]
    bench.add_argument("what", choices=kinds)
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="options of that benchmark (see --help after it)")
    return ap


def configure(argv: list[str] | None) -> tuple[argparse.Namespace, Config]:
    """The parsed flags and the Config they make: flags given win over the --config file,
    which wins over the defaults (the file's values become the flags' defaults)."""
    args = parser().parse_args(argv)
    if getattr(args, "config", None):
        args = parser(config.load(args.config)).parse_args(argv)
    return args, to_config(args)


def main(argv: list[str] | None = None) -> int:
    try:
        args, cfg = configure(argv)
        tune_allocator()  # before the model and its tensors exist
        if getattr(args, "threads", 0):
            import torch

            torch.set_num_threads(args.threads)
        if args.command == "demo":
            from hcache import demo

            if args.max_new_tokens < 1:
                raise ValueError("--max-new-tokens must be at least 1")
            return demo.run(cfg.model, cfg.dtype, args.max_new_tokens, as_json=args.json, device=cfg.device)
        if args.command == "serve":
            return _serve(cfg)
        if args.command == "chat":
            from hcache import chat

            root = Path(args.tls_ca).read_bytes() if args.tls_ca else None
            return chat.run(args.target, args.session, args.system, args.max_new_tokens, args.api_key, root)
        if args.command in ("precompute", "contexts"):
            return _contexts(args)
        if args.command == "profile":
            return _profile(cfg, args)
        if args.command == "plan":
            return _plan(args)
        if args.command == "fsck":
            from hcache.storage.fsck import fsck

            report = fsck(args.dirs, args.repair)
            print("\n".join(report.lines()))
            return 0 if report.clean or args.repair else 1
        if args.command == "bench":
            from importlib import import_module

            return import_module(f"hcache.benchmarks.{args.what}").main(args.rest)
    except (OSError, ValueError, StorageError) as e:
        print(f"hcache: error: {e}", file=sys.stderr)
        return 2
    return 0


def _contexts(args: argparse.Namespace) -> int:
    import grpc

    from hcache import precompute
    from hcache.client import Client

    root = Path(args.tls_ca).read_bytes() if args.tls_ca else None
    try:
        with Client(args.target, api_key=args.api_key, root_cert=root) as c:
            if args.command == "precompute":
                labels = dict(kv.split("=", 1) for kv in args.label if "=" in kv)
                if len(labels) != len(args.label):
                    raise ValueError("--label takes KEY=VALUE")
                t = precompute.precompute(c, args.corpus, labels, args.quiet)
                rate = f" ({t.tokens / t.seconds:,.0f} tokens/s)" if t.seconds and t.tokens else ""
                print(f"stored {t.stored} documents, {t.tokens} tokens{rate}; {t.reused} already stored")
                return 0
            if args.delete:
                if args.id is None:
                    raise ValueError("--delete needs --id")
                n = precompute.delete(c, args.id)
                print(f"deleted {n} context(s) of document {args.id!r}")
                return 0 if n else 1
            found = precompute.find(c, args.id)
            for ctx in found:
                doc = ctx.labels.get(precompute.ID_LABEL, "")
                print(f"{ctx.context_id}\t{ctx.num_tokens}\t{doc}")
            return 0 if found or args.id is None else 1
    except grpc.RpcError as e:
        print(f"hcache: error: {e.code().name}: {e.details()}", file=sys.stderr)  # type: ignore[attr-defined]
        return 2


def _serve(cfg: Config) -> int:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from hcache.server import app

    return app.serve(cfg)


def _profile(cfg: Config, args: argparse.Namespace) -> int:
    from pathlib import Path

    from hcache.model.loader import load
    from hcache.restore import profiler
    from hcache.storage.dirs import ensure_dirs

    dirs = ensure_dirs(args.dirs or cfg.storage.dirs)
    model = load(cfg.model, cfg.dtype, weights=cfg.weights).model
    path = profiler.profile_path(Path(cfg.profile_dir), model)
    prof = profiler.load_or_run(model, dirs, Path(cfg.profile_dir), args.reprofile)
    print(f"profile {path}{' (cached; --reprofile to measure again)' if not args.reprofile else ''}")
    print(f"  read {prof.read_gbps:.2f} GB/s ({', '.join(f'{g:.2f}' for g in prof.per_dir_gbps)} per directory)")
    print(
        f"  read latency {prof.read_latency_ms:.2f} ms; "
        f"H->KV {prof.h_ms_fixed:.2f} + {prof.h_ms_per_ktok:.2f} ms/1K tokens per layer"
    )
    print(f"  KV placement {prof.kv_ms_fixed:.3f} + {prof.kv_ms_per_ktok:.3f} ms/1K tokens per layer")
    print(f"  recompute per layer (ms): {prof.re_points}")
    print(f"  reading takes {prof.read_cpu_ms_per_mb:.2f} CPU ms per MB; a mix must win by {prof.mix_margin:.0%}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from hcache.config import hcache_home
    from hcache.model.geometry import ModelConfig
    from hcache.restore.partitioner import partition
    from hcache.restore.presets import MODELS
    from hcache.restore.profile import Geometry, Profile

    elem = 4 if args.dtype == "float32" else 2
    if args.model in MODELS:
        mcfg = MODELS[args.model]
    elif args.model:
        from hcache.model.loader import read_config

        mcfg = read_config(args.model)
    else:
        need = {"layers": args.layers, "hidden": args.hidden, "heads": args.heads, "ffn": args.ffn}
        missing = [f"--{k}" for k, v in need.items() if not v]
        if missing:
            raise ValueError(f"give --model or the geometry ({', '.join(missing)} missing)")
        kv_heads = args.kv_heads or args.heads
        head_dim = args.head_dim or args.hidden // args.heads
        mcfg = ModelConfig("llama", 0, args.hidden, args.ffn, args.layers, args.heads, kv_heads, head_dim, 0)
    geom = Geometry.of(mcfg, elem)
    hypothetical = args.device or args.tflops or args.mem_gbps or args.tp != 1 or args.efficiency is not None
    if args.profile:
        if hypothetical:
            raise ValueError("--profile describes a measured machine: drop --device/--tflops/--mem-gbps/--tp")
        prof = Profile.load(Path(args.profile))
    elif hypothetical or args.io_gbps:
        prof = _hypothetical(args, geom)
    else:
        cached = sorted((hcache_home() / "profiles").glob("*.json"))
        if not cached:
            raise ValueError("no profile: run `hcache profile`, or pass --profile FILE or --device D --io-gbps B")
        prof = Profile.load(cached[-1])
    res = partition(geom, prof, args.tokens, args.cap_gbps or None)
    if args.json:
        print(json.dumps(res.to_json(), indent=2))
    else:
        print(f"{prof.name}: {args.tokens} tokens -> {res.plan}")
        print(f"  predicted {res.makespan_ms:.1f} ms (storage {res.io_ms:.1f} ms, compute {res.compute_ms:.1f} ms)")
        print(f"  reads {res.bytes / 1e6:.1f} MB; counts {res.plan.counts()}")
    return 0


def _hypothetical(args: argparse.Namespace, geom: Geometry) -> Profile:
    from hcache.restore.presets import DEVICES, EFFICIENCY
    from hcache.restore.profile import Profile

    dev = None
    if args.device:
        if args.device not in DEVICES:
            raise ValueError(f"unknown --device {args.device!r}; known: {', '.join(DEVICES)}")
        dev = DEVICES[args.device]
    tflops = args.tflops or (dev and dev.tflops)
    if not tflops or not args.io_gbps:
        raise ValueError("a hypothetical machine needs --device or --tflops, and --io-gbps")
    # without a device, 100 GB/s: a server CPU's memory, where planning a GPU needs --device
    mem = args.mem_gbps or (dev.mem_gbps if dev else 100.0)
    eff = args.efficiency if args.efficiency is not None else EFFICIENCY
    label = args.device or f"{tflops:g} TFLOPS"
    name = f"{label}: {tflops:g} TFLOPS, {mem:g} GB/s memory"
    return Profile.hypothetical(geom, tflops, args.io_gbps, mem, tp=args.tp, efficiency=eff, name=name)


if __name__ == "__main__":
    raise SystemExit(main())
