"""`hcache` command line."""

from __future__ import annotations

import argparse
import sys

from hcache.config import Config
from hcache.storage.errors import StorageError


def _common(p: argparse.ArgumentParser) -> None:
    """Model options."""
    p.add_argument(
        "--model", default="default", help="'default' (SmolLM2-135M-Instruct GGUF), a .gguf file or an HF folder"
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hcache", description="stateful LLM serving with hidden-state KV restoration")
    sub = ap.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="3-turn chat; KV dropped and restored by every path after each turn")
    _common(demo)
    demo.add_argument("--max-new-tokens", type=int, default=64)
    fsck = sub.add_parser("fsck", help="verify a store's chunks and manifest; --repair fixes what it can")
    fsck.add_argument("--dirs", nargs="+", required=True, help="the store's directories, in their original order")
    fsck.add_argument("--repair", action="store_true")
    bench = sub.add_parser("bench", help="benchmarks (storage)")
    bench.add_argument("what", choices=["storage"])
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="options of that benchmark (see --help after it)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    cfg = Config(model=getattr(args, "model", "default"), dtype=getattr(args, "dtype", "float32"))
    if getattr(args, "threads", 0):
        import torch

        torch.set_num_threads(args.threads)
    try:
        if args.command == "demo":
            from hcache import demo

            if args.max_new_tokens < 1:
                raise ValueError("--max-new-tokens must be at least 1")
            return demo.run(cfg.model, cfg.dtype, args.max_new_tokens)
        if args.command == "fsck":
            from hcache.storage.fsck import fsck

            report = fsck(args.dirs, args.repair)
            print("\n".join(report.lines()))
            return 0 if report.clean or args.repair else 1
        if args.command == "bench":
            from hcache.benchmarks import storage

            return storage.main(args.rest)
    except (FileNotFoundError, ValueError, StorageError) as e:
        print(f"hcache: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
