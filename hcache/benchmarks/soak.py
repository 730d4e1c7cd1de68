"""Load and soak: many concurrent multi-turn sessions against a server on loopback.

Each session's messages and sampling seeds are fixed by its index, so a run can be
compared reply by reply with a one-session-at-a-time reference run on the same server.
`bench/soak.py` repeats rounds for `--minutes` and reports errors, throughput and the
server's resident memory per round (it must stay flat)."""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from hcache.benchmarks import report
from hcache.client import Client
from hcache.storage.dirs import ensure_dirs

TOPICS = ["owls", "rivers", "bread", "chess", "volcanoes", "jazz", "tides", "bees", "glass", "maps", "tea", "kites"]


def messages(i: int, turns: int) -> list[str]:
    topic = TOPICS[i % len(TOPICS)]
    first = f"Session {i}. Tell me one fact about {topic}."
    return [first] + [f"Another fact about {topic}, number {t + 2}?" for t in range(turns - 1)]


def run_session(target: str, i: int, turns: int, max_new: int, seed: int) -> list[list[int]]:
    """Token ids of each reply of session `i` (temperature 0.7 with per-turn seeds)."""
    with Client(target, timeout=600) as c:
        sid = c.create_session("Answer in one sentence.").session_id
        out = []
        for t, msg in enumerate(messages(i, turns)):
            r = c.reply(sid, msg, max_new_tokens=max_new, temperature=0.7, top_p=0.9, seed=seed + 1000 * i + t)
            out.append(r.token_ids)
        c.delete(sid)
        return out


def run_load(target: str, sessions: int, turns: int, max_new: int, seed: int, concurrency: int) -> dict:
    replies: dict[int, list[list[int]]] = {}
    errors: list[str] = []
    t0 = time.perf_counter()

    def one(i: int) -> None:
        try:
            replies[i] = run_session(target, i, turns, max_new, seed)
        except grpc.RpcError as e:
            errors.append(f"session {i}: {e.code().name}: {e.details()}")

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        list(pool.map(one, range(sessions)))
    wall = time.perf_counter() - t0
    tokens = sum(len(r) for rs in replies.values() for r in rs)
    return {"replies": replies, "errors": errors, "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall}


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def main(argv: list[str] | None = None) -> int:
    from hcache.benchmarks.serve import start_server

    ap = argparse.ArgumentParser(prog="hcache bench soak", description=__doc__)
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-new", type=int, default=16)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--budget-mb", type=int, default=256)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--dirs", type=int, default=2)
    ap.add_argument("--root", default=None)
    ap.add_argument("--profile")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/soak.json")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="hcache-soak-", dir=ensure_dirs([args.root])[0] if args.root else None))
    proc, target = start_server(args, "auto", root)
    rounds = []
    try:
        ref = run_load(target, args.sessions, args.turns, args.max_new, args.seed, 1)
        deadline = time.monotonic() + args.minutes * 60
        while time.monotonic() < deadline:
            r = run_load(target, args.sessions, args.turns, args.max_new, args.seed, args.sessions)
            mismatches = sum(r["replies"].get(i) != ref["replies"].get(i) for i in range(args.sessions))
            rounds.append(
                {
                    "errors": r["errors"],
                    "mismatches": mismatches,
                    "wall_s": r["wall_s"],
                    "tokens_per_s": r["tokens_per_s"],
                    "rss_mb": rss_bytes(proc.pid) / 1e6,
                }
            )
            print(f"round {len(rounds)}: {rounds[-1]}", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    data = {"args": vars(args), "reference_tokens_per_s": ref["tokens_per_s"], "rounds": rounds}

    def table() -> None:
        print(f"{'round':>5}{'errors':>8}{'mismatch':>10}{'tok/s':>8}{'RSS MB':>9}")
        for i, r in enumerate(rounds, 1):
            print(f"{i:>5}{len(r['errors']):>8}{r['mismatches']:>10}{r['tokens_per_s']:>8.1f}{r['rss_mb']:>9.0f}")
        print(f"one session at a time: {ref['tokens_per_s']:.1f} tok/s")

    return report(data, args.out, args.json, table)
