"""`hcache` command line."""

from __future__ import annotations

import argparse
import sys

from hcache.config import Config


def _common(p: argparse.ArgumentParser) -> None:
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
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    cfg = Config(model=args.model, dtype=args.dtype, threads=args.threads)
    import torch

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        if args.command == "demo":
            from hcache import demo

            if args.max_new_tokens < 1:
                raise ValueError("--max-new-tokens must be at least 1")
            return demo.run(cfg.model, cfg.dtype, args.max_new_tokens)
    except (FileNotFoundError, ValueError) as e:
        print(f"hcache: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
