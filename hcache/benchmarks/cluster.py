"""Scale-out benchmark: two `hcache serve --cluster` replicas on a 3-master Redis Cluster
started here (loopback, temporary directories).

1. The serving trace of `bench serve` (Poisson arrivals, multi-turn chat) twice, each on
   fresh replicas and an emptied cluster: routed by session affinity (the client's
   rendezvous hashing), then every turn to a replica drawn at random. Reported: TTFT
   p50/p99, restores by source (local, cluster, recompute) and the bytes moved (records,
   chunks fetched, chunks uploaded), from the replicas' /metrics.
2. One long session (about `--long-tokens` tokens) made on replica A, then one short turn
   each: on A after evicting it (local restore), on B (fetches A's chunks from the
   cluster) and on C (`--cluster-chunks off`: recomputes it). Reported: TTFT of each.

Writes bench/results/cluster.json."""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from hcache.benchmarks import report
from hcache.benchmarks.serve import _free_port, cpu_name, wait_until_compiled
from hcache.benchmarks.trace import WORDS, SessionPlan, make_trace, play
from hcache.client import Client, wait_for_server

METRICS = {  # what a phase reports, summed over replicas: /metrics sample -> key
    'hcache_restores_by_source_total{source="local"}': "restores_local",
    'hcache_restores_by_source_total{source="cluster"}': "restores_cluster",
    'hcache_restores_by_source_total{source="recompute"}': "restores_recompute",
    "hcache_cluster_read_bytes_total": "record_bytes_read",
    "hcache_cluster_written_bytes_total": "record_bytes_written",
    "hcache_cluster_chunk_read_bytes_total": "chunk_bytes_fetched",
    "hcache_cluster_chunk_uploaded_bytes_total": "chunk_bytes_uploaded",
    "hcache_cluster_chunk_upload_drops_total": "chunk_upload_drops",
    "hcache_cluster_recomputed_tokens_total": "recomputed_tokens",
}


class Redis:
    """Three cluster-enabled masters, no persistence (a benchmark), volatile-lru."""

    def __init__(self, root: Path, base_port: int):
        self.ports = [base_port + i for i in range(3)]
        self.procs = []
        for p in self.ports:
            d = root / f"redis-{p}"
            d.mkdir(parents=True)
            args = ["--port", str(p), "--bind", "127.0.0.1", "--dir", str(d), "--cluster-enabled", "yes"]
            args += ["--cluster-config-file", "nodes.conf", "--save", "", "--maxmemory-policy", "volatile-lru"]
            log = open(d / "redis.log", "w")  # noqa: SIM115 - closed with the process
            self.procs.append(subprocess.Popen(["redis-server", *args], stdout=log, stderr=subprocess.STDOUT))
        for p in self.ports:
            while self.cli(p, "PING") != "PONG":
                time.sleep(0.1)
        nodes = [f"127.0.0.1:{p}" for p in self.ports]
        subprocess.run(
            ["redis-cli", "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
        )
        while not all("cluster_state:ok" in self.cli(p, "CLUSTER", "INFO") for p in self.ports):
            time.sleep(0.2)
        self.url = "redis://" + ",".join(nodes)

    @staticmethod
    def cli(port: int, *cmd: str) -> str:
        return subprocess.run(["redis-cli", "-p", str(port), *cmd], capture_output=True, text=True).stdout.strip()

    def flush(self) -> None:
        for p in self.ports:
            self.cli(p, "FLUSHALL")

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


class Replica:
    def __init__(
        self, args: argparse.Namespace, root: Path, url: str, name: str, policy: str, budget_mb: int | None = None
    ):
        self.port, self.http = _free_port(), _free_port()
        cmd = [sys.executable, "-m", "hcache.cli", "serve", "--port", str(self.port), "--http-port", str(self.http)]
        cmd += ["--dtype", args.dtype, "--dirs", str(root / name), "--kv-budget-mb", str(budget_mb or args.budget_mb)]
        cmd += ["--cluster", url, "--replica-name", name, "--cluster-chunks", policy]
        cmd += ["--profile", args.profile] if args.profile else []
        root.mkdir(parents=True, exist_ok=True)
        self.log = root / f"{name}.log"
        out = open(self.log, "w")  # noqa: SIM115 - closed with the process
        # replicas share the cores: each takes its part, or their thread teams spin against each other
        env = {**os.environ, "OMP_NUM_THREADS": str(args.replica_threads)}
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        self.target = f"127.0.0.1:{self.port}"
        try:
            wait_for_server(self.target, timeout=600, alive=lambda: self.proc.poll() is None)
            wait_until_compiled(self.http)
        except RuntimeError:
            raise RuntimeError(f"replica {name} did not start; see {self.log}") from None

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/metrics", timeout=30) as r:
            text = r.read().decode()
        out = dict.fromkeys(METRICS.values(), 0.0)
        for line in text.splitlines():
            name, _, value = line.rpartition(" ")
            if name in METRICS:
                out[METRICS[name]] = float(value)
        return out

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def pct(xs: list[float], q: float) -> float | None:
    return round(statistics.quantiles(xs, n=100, method="inclusive")[int(q * 100) - 1], 1) if len(xs) > 1 else None


def run_phase(args: argparse.Namespace, root: Path, redis: Redis, routing: str) -> dict:
    redis.flush()
    reps = [Replica(args, root / routing, redis.url, f"{routing}-{n}", args.policy) for n in "ab"]
    try:
        targets = [r.target for r in reps]
        rng = random.Random(args.seed)
        ttft: list[float] = []
        turn_ms: list[float] = []  # to the turn's last event: acknowledged after its commit
        errors: list[str] = []
        lock = threading.Lock()

        def session(plan: SessionPlan) -> None:
            with Client(targets) as routed, Client(targets[0]) as ca, Client(targets[1]) as cb:
                try:
                    sid = routed.create_session("You are a helpful assistant.").session_id
                    for turn, think in zip(plan.turns, plan.think_s, strict=True):
                        with lock:
                            c = routed if routing == "affinity" else rng.choice((ca, cb))
                        t0 = time.perf_counter()
                        first = None
                        for r in c.generate(sid, turn.message, max_new_tokens=turn.max_new, seed=args.seed):
                            if first is None and not r.finished:
                                first = time.perf_counter()
                        with lock:
                            ttft.append(((first or time.perf_counter()) - t0) * 1e3)
                            turn_ms.append((time.perf_counter() - t0) * 1e3)
                        time.sleep(think)
                except Exception as e:  # reported, not fatal: the rest of the trace runs
                    with lock:
                        errors.append(f"{type(e).__name__}: {e}")

        wall = play(make_trace(args), session)
        time.sleep(1.0)  # uploads behind the last turns
        totals = dict.fromkeys(METRICS.values(), 0.0)
        for r in reps:
            for k, v in r.metrics().items():
                totals[k] += v
        return {
            "routing": routing,
            "turns": len(ttft),
            "ttft_p50_ms": pct(ttft, 0.5),
            "ttft_p99_ms": pct(ttft, 0.99),
            "turn_p50_ms": pct(turn_ms, 0.5),
            "turn_p99_ms": pct(turn_ms, 0.99),
            "wall_s": round(wall, 1),
            "errors": errors[:10],
            **totals,
        }
    finally:
        for r in reps:
            r.stop()


def one_turn_ttft(c: Client, sid: str) -> tuple[float, float]:
    """TTFT of a one-token turn and the server's restore time."""
    t0 = time.perf_counter()
    first, restore = None, 0.0
    for r in c.generate(sid, "Go on.", max_new_tokens=1):
        if first is None and not r.finished:
            first = time.perf_counter()
        if r.finished:
            restore = r.stats.restore_ms
    return round(((first or time.perf_counter()) - t0) * 1e3, 1), round(restore, 1)


def wait_uploaded(rep: Replica, timeout: float = 120) -> float:
    """Until the replica's chunk uploads stop growing; returns the bytes it uploaded."""
    up, deadline = -1.0, time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = rep.metrics()["chunk_bytes_uploaded"]
        if now and now == up:
            break
        up = now
        time.sleep(1.0)
    return up


def run_long(args: argparse.Namespace, root: Path, redis: Redis) -> dict:
    """Long sessions made on replica a, then one-token turns of one of them: evicted and
    restored on a (local), on fresh replicas that fetch the cluster's chunks (cluster), and
    on fresh ones that recompute (recompute). Each `--long-repeat` times; medians. A cluster
    replica first continues the other long session (`cold`: its first fetch meets fresh
    memory), so the timed turn finds it as a replica that has served before; a always is.
    Every turn adds a few tokens, uploaded before the next turn starts."""
    redis.flush()
    runs: dict[str, list[tuple[float, float]]] = {"local": [], "cold": [], "cluster": [], "recompute": []}

    def fresh(name: str, policy: str) -> Replica:
        return Replica(args, root / "long", redis.url, f"long-{name}", policy, args.long_budget_mb)

    a = fresh("a", "always")
    try:
        rng = random.Random(args.seed)
        with Client(a.target) as ca:
            sids = []
            for _ in range(2):
                text = " ".join(rng.choice(WORDS) for _ in range(args.long_tokens))
                sids.append(ca.create_session("You are a helpful assistant.").session_id)
                ca.reply(sids[-1], f"Remember this: {text}", max_new_tokens=1)
            sid, other = sids
            tokens = ca.get(sid).num_tokens
            up = wait_uploaded(a)
            for _ in range(args.long_repeat):
                ca.evict(sid)
                runs["local"].append(one_turn_ttft(ca, sid))
                wait_uploaded(a)
        fetched = 0.0
        for i in range(args.long_repeat):
            for kind, policy in (("cluster", "always"), ("recompute", "off")):
                rep = fresh(f"{kind}-{i}", policy)
                try:
                    with Client(rep.target) as c:
                        if kind == "cluster":
                            runs["cold"].append(one_turn_ttft(c, other))
                            wait_uploaded(rep)
                            before = rep.metrics()["chunk_bytes_fetched"]
                        runs[kind].append(one_turn_ttft(c, sid))
                    if kind == "cluster":
                        fetched = rep.metrics()["chunk_bytes_fetched"] - before
                    wait_uploaded(rep)
                finally:
                    rep.stop()
    finally:
        a.stop()

    def med(xs: list[tuple[float, float]]) -> dict:
        return {
            "ttft_ms": statistics.median(x[0] for x in xs),
            "restore_ms": statistics.median(x[1] for x in xs),
            "ttft_runs_ms": [x[0] for x in xs],
        }

    out = {"tokens": tokens, "chunk_bytes_uploaded": up, "chunk_bytes_fetched": fetched}
    out |= {k: med(v) for k, v in runs.items()}
    out["cluster_vs_local"] = out["cluster"]["ttft_ms"] / out["local"]["ttft_ms"]
    out["cluster_vs_recompute"] = out["cluster"]["ttft_ms"] / out["recompute"]["ttft_ms"]
    out["cold_vs_local"] = out["cold"]["ttft_ms"] / out["local"]["ttft_ms"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hcache bench cluster", description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=16, help="sessions of the trace (0: skip it)")
    p.add_argument("--rate", type=float, default=0.1, help="session arrivals per second (unsaturated)")
    p.add_argument(
        "--replica-threads", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="torch threads per replica"
    )
    p.add_argument("--min-turns", type=int, default=2)
    p.add_argument("--max-turns", type=int, default=5)
    p.add_argument("--doc-words", type=int, default=400, help="mean words of a session's first message")
    p.add_argument("--msg-words", type=int, default=30)
    p.add_argument("--reply", type=int, default=32, help="mean reply tokens")
    p.add_argument("--max-reply", type=int, default=96)
    p.add_argument("--think-s", type=float, default=2.0, help="mean think time between turns")
    p.add_argument("--long-tokens", type=int, default=8192, help="words of the long session (0: skip it)")
    p.add_argument("--budget-mb", type=int, default=64, help="each replica's resident KV budget")
    p.add_argument("--long-repeat", type=int, default=3, help="turns per restore path of the long session")
    p.add_argument("--long-budget-mb", type=int, default=1024, help="the long session's replicas' KV budget")
    p.add_argument("--policy", default="auto", choices=("auto", "always", "off"), help="--cluster-chunks")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--profile", default="", help="a profile JSON for the replicas (default: theirs)")
    p.add_argument("--redis-port", type=int, default=27101, help="first of three ports (port + 10000 free too)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/cluster.json")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hcache-bench-cluster-") as tmp:
        root = Path(tmp)
        redis = Redis(root, args.redis_port)
        try:
            phases = [run_phase(args, root, redis, r) for r in ("affinity", "random")] if args.sessions else []
            long = run_long(args, root, redis) if args.long_tokens else None
        finally:
            redis.stop()
    data = {"args": vars(args), "cpu": cpu_name(), "phases": phases, "long_session": long}

    def table() -> None:
        cols = ["routing", "turns", "ttft_p50_ms", "ttft_p99_ms", "restores_local", "restores_cluster"]
        cols += ["restores_recompute", "chunk_bytes_fetched", "chunk_bytes_uploaded", "record_bytes_read"]
        print(" ".join(f"{c:>20}" for c in cols))
        for ph in phases:
            print(" ".join(f"{ph[c]!s:>20}" for c in cols))
        if long:
            print(f"long session ({long['tokens']} tokens), one-token turn TTFT ms (median):", end="")
            print(" ".join(f" {k} {long[k]['ttft_ms']}" for k in ("local", "cluster", "cold", "recompute")))
            vs_local, vs_re, cold = long["cluster_vs_local"], long["cluster_vs_recompute"], long["cold_vs_local"]
            print(f"cluster / local {vs_local:.2f}x, cluster / recompute {vs_re:.3f}x", end="")
            print(f" (cold replica / local {cold:.2f}x)")

    return report(data, args.out, args.json, table)
