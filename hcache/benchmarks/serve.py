"""Serving benchmark: a multi-turn chat trace against `hcache serve` over gRPC.

ShareGPT-like and seeded: sessions arrive as a Poisson process; each opens with a
document-sized first message, then takes a few shorter turns with exponential think
time in between; message and reply lengths are drawn from log-normal distributions.
The resident KV budget holds only a few sessions, so most turns find their session
evicted and restore it. The same trace runs once per restore method (auto, forced KV,
forced RE), each against a fresh server on fresh storage. Reported: TTFT and TBT
p50/p99 (client-side), the server's restore time, sessions/s. JSON and a plot in
bench/results/."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field, fields
from pathlib import Path

import grpc

from hcache.benchmarks import report
from hcache.benchmarks.plots import serve_cdfs
from hcache.benchmarks.trace import SessionPlan, make_trace, play
from hcache.client import Client, wait_for_server
from hcache.storage.dirs import ensure_dirs


@dataclass
class Result:
    ttft_ms: list[float] = field(default_factory=list)
    tbt_ms: list[float] = field(default_factory=list)
    restore_ms: list[float] = field(default_factory=list)
    turns: int = 0
    restored_turns: int = 0
    restored_local: int = 0  # restores that read stored chunks (any H or KV layer)
    restored_recompute: int = 0  # restores that recomputed every layer
    errors: list[str] = field(default_factory=list)
    sessions_done: int = 0
    wall_s: float = 0.0
    prompt_tokens: int = 0  # after each session's first turn (OpenAI runs)
    cached_tokens: int = 0
    client_cpu_s: float = 0.0  # this process's CPU time: the clients share the server's cores

    def turn(self, start: float, stamps: list[float]) -> None:
        """A finished turn: time to its first token and between the rest (under the lock)."""
        self.turns += 1
        self.ttft_ms.append((stamps[0] - start) * 1e3)
        self.tbt_ms += [(b - a) * 1e3 for a, b in itertools.pairwise(stamps)]

    def add(self, other: Result) -> None:
        """Pool another run of the same trace into this one."""
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


def wait_until_compiled(http: int, timeout: float = 900) -> None:
    """Until the server's decode step is compiled (it serves eager steps while it compiles
    in the background): what a benchmark measures is the compiled one."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http}/readyz", timeout=30) as r:
                problems = json.load(r)["problems"]
        except urllib.error.HTTPError as e:
            problems = json.load(e)["problems"]
        if "compiling the decode step" not in problems:
            return
        if time.monotonic() > deadline:
            raise RuntimeError("the server's decode step did not compile in time")
        time.sleep(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    args: argparse.Namespace, method: str, root: Path, store_bytes: int = 0
) -> tuple[subprocess.Popen, str, int]:
    """A server on fresh storage, its gRPC target and its HTTP port (OpenAI API, metrics);
    `store_bytes` caps its store (0: unlimited)."""
    port, http = _free_port(), _free_port()
    dirs = [root / f"d{i}" for i in range(args.dirs)]
    cmd = [sys.executable, "-m", "hcache.cli", "serve", "--port", str(port), "--dtype", args.dtype]
    cmd += ["--dirs", *map(str, dirs), "--kv-budget-mb", str(args.budget_mb), "--restore-method", method]
    cmd += ["--store-kinds", "auto", "--http-port", str(http)] + (["--profile", args.profile] if args.profile else [])
    if store_bytes:
        cmd += ["--store-max-gb", f"{store_bytes / (1 << 30):.9f}"]
    log = open(root / "server.log", "w")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    target = f"127.0.0.1:{port}"
    try:  # the first start may profile the machine
        wait_for_server(target, timeout=600, alive=lambda: proc.poll() is None)
        wait_until_compiled(http)
    except RuntimeError:
        raise RuntimeError(f"server did not start; see {root / 'server.log'}") from None
    return proc, target, http


def store_totals(http: int) -> dict:
    """The server's dashboard totals: what its store holds, its capacity, what it released."""
    with urllib.request.urlopen(f"http://127.0.0.1:{http}/api/dashboard", timeout=30) as r:
        return json.load(r)["totals"]


def run_trace(target: str, trace: list[SessionPlan], seed: int) -> Result:
    res = Result()
    lock = threading.Lock()

    def one(plan: SessionPlan) -> None:
        with Client(target) as c:
            try:
                sid = c.create_session("You are a helpful assistant.").session_id
                for turn, think in zip(plan.turns, plan.think_s, strict=True):
                    start = time.perf_counter()
                    stamps, last = [], None
                    for r in c.generate(sid, turn.message, max_new_tokens=turn.max_new, seed=seed):
                        if r.finished:
                            last = r
                        else:
                            stamps.append(time.perf_counter())
                    assert last is not None and stamps
                    with lock:
                        res.turn(start, stamps)
                        if last.stats.restore_ms:
                            res.restored_turns += 1
                            res.restore_ms.append(last.stats.restore_ms)
                            plan = last.stats.plan
                            if plan.hidden or plan.kv:
                                res.restored_local += 1
                            else:
                                res.restored_recompute += 1
                    time.sleep(think)
                with lock:
                    res.sessions_done += 1
            except grpc.RpcError as e:
                with lock:
                    res.errors.append(f"{e.code().name}: {e.details()}")

    res.wall_s = play(trace, one)
    return res


def run_trace_openai(base_url: str, trace: list[SessionPlan], seed: int, pin: bool = False) -> Result:
    """The same trace through `/v1/chat/completions` with openai-python, streamed, each turn
    resending the whole conversation: as a stock client does (the server finds the stored
    conversation it extends), or naming the session the first reply named (`pin`)."""
    import openai

    res = Result()
    lock = threading.Lock()

    def one(plan: SessionPlan) -> None:
        c = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
        msgs: list[dict] = [{"role": "system", "content": "You are a helpful assistant."}]
        sid = None
        try:
            for i, (turn, think) in enumerate(zip(plan.turns, plan.think_s, strict=True)):
                msgs.append({"role": "user", "content": turn.message})
                start = time.perf_counter()
                stamps, parts, usage = [], [], None
                stream = c.chat.completions.create(
                    model="default",
                    messages=msgs,
                    max_tokens=turn.max_new,
                    temperature=0,
                    seed=seed,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"session_id": sid} if sid and pin else None,
                )
                for ch in stream:
                    sid = sid or ch.session_id
                    if ch.usage:
                        usage = ch.usage
                    if ch.choices and ch.choices[0].delta.content:
                        stamps.append(time.perf_counter())
                        parts.append(ch.choices[0].delta.content)
                assert usage is not None and stamps
                msgs.append({"role": "assistant", "content": "".join(parts)})
                with lock:
                    res.turn(start, stamps)
                    if i:
                        res.prompt_tokens += usage.prompt_tokens
                        res.cached_tokens += usage.prompt_tokens_details.cached_tokens
                time.sleep(think)
            with lock:
                res.sessions_done += 1
        except openai.APIError as e:
            with lock:
                res.errors.append(f"{type(e).__name__}: {e}")

    res.wall_s = play(trace, one)
    return res


def cpu_name() -> str:
    """`lscpu`'s model name, named beside every figure."""
    for ln in Path("/proc/cpuinfo").read_text().splitlines():
        if ln.startswith("model name"):
            return ln.split(":", 1)[1].strip()
    return "unknown CPU"


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def summarize(method: str, r: Result, api: str = "grpc") -> dict:
    return {
        "method": method,
        "api": api,
        "cached_ratio": r.cached_tokens / r.prompt_tokens if r.prompt_tokens else None,
        "turns": r.turns,
        "restored_turns": r.restored_turns,
        "restored_local": r.restored_local,
        "restored_recompute": r.restored_recompute,
        "errors": r.errors,
        "ttft_p50_ms": _pct(r.ttft_ms, 0.5),
        "ttft_p99_ms": _pct(r.ttft_ms, 0.99),
        "tbt_p50_ms": _pct(r.tbt_ms, 0.5),
        "tbt_p99_ms": _pct(r.tbt_ms, 0.99),
        "restore_median_ms": statistics.median(r.restore_ms) if r.restore_ms else None,
        "sessions_per_s": r.sessions_done / r.wall_s if r.wall_s else 0.0,
        "client_cpu_share": r.client_cpu_s / r.wall_s if r.wall_s else 0.0,
        "wall_s": r.wall_s,
        "ttft_ms": r.ttft_ms,
        "tbt_ms": r.tbt_ms,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hcache bench serve", description=__doc__)
    ap.add_argument("--methods", nargs="+", default=["auto", "kv", "recompute"])
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument("--rate", type=float, default=0.3, help="session arrivals per second")
    ap.add_argument("--min-turns", type=int, default=2)
    ap.add_argument("--max-turns", type=int, default=4)
    ap.add_argument("--doc-words", type=int, default=600, help="mean words of a session's first message")
    ap.add_argument("--msg-words", type=int, default=25, help="mean words of later messages")
    ap.add_argument("--reply", type=int, default=24, help="mean reply tokens")
    ap.add_argument("--max-reply", type=int, default=64)
    ap.add_argument("--think-s", type=float, default=3.0)
    ap.add_argument("--budget-mb", type=int, default=48, help="resident KV budget of the server")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--dirs", type=int, default=2, help="storage directories (under --root)")
    ap.add_argument("--root", default=None, help="where the stores go (default: a temp dir)")
    ap.add_argument("--profile", help="profile JSON for the server (default: measured once and cached)")
    ap.add_argument(
        "--store-fraction",
        type=float,
        default=0.0,
        help="also run auto on a store this fraction of what the first run stored (0: not)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="play the trace this many times per run, interleaved; percentiles pool every turn",
    )
    ap.add_argument(
        "--api",
        default="grpc",
        choices=["grpc", "openai"],
        help="openai: each method runs over gRPC and over /v1/chat/completions, full histories resent by a "
        "stock client (openai) and by one that names its session (openai-pinned)",
    )
    ap.add_argument("--out", default="bench/results/serve.json")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    trace = make_trace(args)
    apis = ["grpc", "openai", "openai-pinned"] if args.api == "openai" else ["grpc"]
    runs = [(m, m, 0.0, api) for m in args.methods for api in apis]
    if args.store_fraction:
        runs.append((f"auto@{args.store_fraction:g}", "auto", args.store_fraction, "grpc"))
    state_bytes = 0
    pooled: dict[tuple[str, str], Result] = {}
    p50s: dict[tuple[str, str], list[float]] = {}
    extra: dict[tuple[str, str], dict] = {}
    for _, (label, method, fraction, api) in itertools.product(range(args.repeat), runs):
        root = Path(
            tempfile.mkdtemp(prefix=f"hcache-serve-{method}-", dir=ensure_dirs([args.root])[0] if args.root else None)
        )
        store_bytes = int(state_bytes * fraction)
        proc, target, http = start_server(args, method, root, store_bytes)
        try:
            print(
                f"{label} over {api}: {len(trace)} sessions, {sum(len(p.turns) for p in trace)} turns ...", flush=True
            )
            cpu0 = _cpu_s()
            if api == "grpc":
                res = run_trace(target, trace, args.seed)
            else:
                res = run_trace_openai(f"http://127.0.0.1:{http}/v1", trace, args.seed, pin=api == "openai-pinned")
            res.client_cpu_s = _cpu_s() - cpu0
            totals = store_totals(http)
            state_bytes = state_bytes or totals["store_occupied_bytes"]  # the first run's, unlimited
            key = (label, api)
            pooled.setdefault(key, Result()).add(res)
            p50s.setdefault(key, []).append(_pct(res.ttft_ms, 0.5))
            extra[key] = {
                "store_max_bytes": store_bytes,
                "store_occupied_bytes": totals["store_occupied_bytes"],
                "bytes_released": totals["bytes_released"],
                "demotions": totals["demotions"],
            }
        finally:
            proc.terminate()
            proc.wait(timeout=120)
            shutil.rmtree(root, ignore_errors=True)
    rows = []
    for key, res in pooled.items():
        row = summarize(key[0], res, key[1])
        row["ttft_p50_runs_ms"] = p50s[key]
        rows.append(row | extra[key])
    base = next((r for r in rows if r["method"] == "auto" and r["api"] == "grpc"), rows[0])
    for r in rows:
        r["ttft_p50_vs_auto"] = r["ttft_p50_ms"] / base["ttft_p50_ms"]
        grpc_row = next(g for g in rows if g["method"] == r["method"] and g["api"] == "grpc")
        r["ttft_p50_vs_grpc"] = r["ttft_p50_ms"] / grpc_row["ttft_p50_ms"]
    png = Path(args.out).with_suffix(".png")
    png.parent.mkdir(parents=True, exist_ok=True)
    serve_cdfs(rows, png)
    data = {"args": vars(args), "cpu": cpu_name(), "rows": rows, "plot": str(png)}

    def table() -> None:
        hdr = f"{'method':10}{'api':>14}{'turns':>6}{'restored':>9}{'TTFT p50':>10}{'p99':>9}{'TBT p50':>9}{'p99':>8}"
        hdr += f"{'restore':>9}{'local':>6}{'RE':>4}{'store MB':>9}{'sess/s':>8}{'TTFT/auto':>10}{'/gRPC':>7}"
        print(hdr + f"{'cached':>8}{'errors':>7}{'client CPU':>11}")
        for r in rows:
            rest, cached = r["restore_median_ms"], r["cached_ratio"]
            grpc = r["api"] == "grpc"  # restores are counted from gRPC's turn stats
            restored, local, re_ = (
                r[k] if grpc else "-" for k in ("restored_turns", "restored_local", "restored_recompute")
            )
            cap = f"{r['store_max_bytes'] / 1e6:.0f}" if r["store_max_bytes"] else "-"
            print(
                f"{r['method']:10}{r['api']:>14}{r['turns']:>6}{restored:>9}{r['ttft_p50_ms']:>10.0f}"
                f"{r['ttft_p99_ms']:>9.0f}{r['tbt_p50_ms']:>9.0f}{r['tbt_p99_ms']:>8.0f}"
                f"{(f'{rest:.0f}' if rest else '-'):>9}{local:>6}{re_:>4}{cap:>9}"
                f"{r['sessions_per_s']:>8.3f}{r['ttft_p50_vs_auto']:>10.2f}{r['ttft_p50_vs_grpc']:>7.2f}"
                f"{(f'{cached:.1%}' if cached is not None else '-'):>8}{len(r['errors']):>7}"
                f"{r['client_cpu_share']:>11.0%}"
            )
        if args.repeat > 1:
            for r in rows:
                runs_ = ", ".join(f"{x:.0f}" for x in r["ttft_p50_runs_ms"])
                print(f"{r['method']} over {r['api']}: TTFT p50 of each run {runs_} ms")
        print(f"CPU: {data['cpu']}, {os.cpu_count()} cores")
        print(
            "(ms; restore = the server's median restore time of restored turns; local / RE = restores that"
            " read stored chunks / recomputed every layer; store MB = the capacity, - unlimited; cached ="
            f" prompt tokens served from stored state after each session's first turn (OpenAI usage); client CPU ="
            f" the clients' CPU time over the run's wall time, taken from the server's cores; plot {png})"
        )

    return report(data, args.out, args.json, table)
