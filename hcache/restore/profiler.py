"""`hcache profile`: measure this machine for the partitioner. Storage read bandwidth
per directory (O_DIRECT, restore-shaped reads of a scratch owner), H -> KV projection,
KV placement, and one layer's recompute at several context lengths. The result is
cached as JSON per model fingerprint, dtype and device, and reused until re-profiled."""

from __future__ import annotations

import contextlib
import platform
import resource
import shutil
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.progress import Progress

from hcache.config import StorageConfig
from hcache.kernels.cpu import cpu
from hcache.model.base import DecoderModel
from hcache.model.cache import KVCache
from hcache.restore.executor import recompute_prefix, restore
from hcache.restore.plan import Method, Plan
from hcache.restore.profile import Profile
from hcache.restore.sources import StoreSource
from hcache.storage.layout import CHUNK_TOKENS, Kind
from hcache.storage.reader import Want
from hcache.storage.store import ChunkStore

SCRATCH = ".hcache-profile"
# up to 8K: the quadratic part fitted to shorter lengths under-predicts long contexts
RE_CONTEXTS = (256, 1024, 2048, 4096, 8192)
# a GPU recomputes long contexts in milliseconds: measure the quadratic part, don't extrapolate it
RE_CONTEXTS_GPU = (*RE_CONTEXTS, 16384)
IO_TOKENS = 4096
LONG_CONTEXT = 4096  # recompute at this many tokens or more is timed on fewer layers and runs
H_TOKENS = (1024, 4096)
# bumped when the profile gains a measurement, or a read or compute path changes: older files are re-measured
PROFILE_VERSION = 10
# on a CPU a mix's prediction errs more than a single method's (its recompute prefix shares
# the cores with the reads): a mix must win by more than that error to be chosen
# (the figures behind it: bench/RESULTS.md)
CPU_MIX_MARGIN = 0.15


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device).replace(" ", "-")
    return f"cpu-{platform.machine()}-{cpu().kind}-{torch.get_num_threads()}t"  # the kind picks the kernels


def profile_path(cache_dir: Path, model: DecoderModel) -> Path:
    dtype = str(model.dtype).removeprefix("torch.")
    return cache_dir / f"{model.fingerprint()[:16]}-{dtype}-{device_name(model.device)}-v{PROFILE_VERSION}.json"


def median_ms(fn: Callable[[], object], repeats: int = 5, warm: bool = True) -> float:
    if warm:
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


@dataclass
class IOResult:
    read_gbps: float  # the rate past the fixed part
    latency_ms: float  # a restore's fixed read cost, at least one chunk's latency
    cpu_ms_per_mb: float  # every thread's CPU per MB of restore-shaped reads
    re_reading: dict[int, float] = field(default_factory=dict)  # tokens -> recompute slowdown beside reads
    h_points: dict[int, float] = field(default_factory=dict)  # tokens -> ms per layer, reads' CPU taken out
    kv_points: dict[int, float] = field(default_factory=dict)


@contextlib.contextmanager
def _scratch_store(model: DecoderModel, dirs: list[Path]) -> Iterator[ChunkStore]:
    """A store in fresh scratch folders under `dirs`, removed afterwards whatever happens."""
    scratch = [d / SCRATCH for d in dirs]
    for d in scratch:
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    try:
        with ChunkStore(StorageConfig([str(d) for d in scratch]), model.cfg, model.dtype, str(model.device)) as st:
            yield st
    finally:
        for d in scratch:
            shutil.rmtree(d, ignore_errors=True)


def _io(model: DecoderModel, dirs: list[Path], tokens: int, compute: tuple[int, ...] = ()) -> IOResult:
    """Restore-shaped reads of a scratch owner over `dirs` (half the layers H, half KV); for
    each length in `compute`, the per-layer work of real H-only and KV-only restores. Those
    run on data fresh from storage, as restores do (a re-run on one cache-hot tensor is far
    faster on a CPU), and the CPU their reads took is taken out: the plan charges it apart."""
    cfg, fp = model.cfg, model.fingerprint()  # hashes samples of every weight: once, not per restore
    with _scratch_store(model, dirs) as st:
        both = [{Kind.HIDDEN, Kind.KV}] * cfg.num_layers
        st.create_owner("profile", both, fp)
        h = torch.randn(tokens, cfg.hidden_size).to(model.dtype)
        kv = torch.randn(tokens, 2, cfg.kv_dim).to(model.dtype)
        st.save_rows("profile", 0, dict.fromkeys(range(cfg.num_layers), h), dict.fromkeys(range(cfg.num_layers), kv))
        st.mark_durable("profile", [0] * tokens)
        half = [Want(i, Kind.KV if i % 2 else Kind.HIDDEN, 0, tokens) for i in range(cfg.num_layers)]

        def read_all(hi: int = tokens) -> int:
            wants = [Want(w.layer, w.kind, 0, hi) for w in half]
            r = st.reader("profile", wants=wants)
            for w in wants:
                r.get(w.layer, w.kind)
                r.release(w.layer)
            return r.bytes_read

        nbytes = read_all()
        secs = median_ms(read_all) / 1e3
        # and a quarter as much: a restore's reads cost a fixed part (planning, the first
        # request's latency, the ramp of request sizes) plus bytes over the rate
        rate, fixed = nbytes / secs / 1e9, 0.0
        short = tokens // 4 // CHUNK_TOKENS * CHUNK_TOKENS
        if short:
            short_bytes, short_ms = read_all(short), median_ms(lambda: read_all(short))
            fixed, ms_per_gb = affine({short_bytes / 1e6: short_ms, nbytes / 1e6: secs * 1e3})
            rate = 1000 / ms_per_gb if ms_per_gb > 0 else rate
        cpu = []
        for _ in range(3):  # every thread's CPU (the consumer here only waits)
            before = resource.getrusage(resource.RUSAGE_SELF)
            read_all()
            after = resource.getrusage(resource.RUSAGE_SELF)
            used = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
            cpu.append(used * 1e3 / (nbytes / 1e6))
        latency = max(fixed, median_ms(lambda: st.read_chunk("profile", 0, 0, Kind.HIDDEN)))
        res = IOResult(rate, latency, statistics.median(cpu))
        elem = torch.finfo(model.dtype).bits // 8
        # one cache for every restore, as the engine's block pool is: a fresh one per restore
        # would pay its first-touch page faults inside the KV placement
        cache = KVCache(cfg, model.dtype, model.device, capacity=max(compute, default=1))
        for n in sorted(compute):  # shortest first: it warms what a long one runs once
            owner = "profile" if n == tokens else f"profile-{n}"  # the read owner serves its own length
            if n != tokens:
                st.create_owner(owner, both, fp)
                layers = range(cfg.num_layers)
                st.save_rows(owner, 0, dict.fromkeys(layers, h[:n]), dict.fromkeys(layers, kv[:n]))
                st.mark_durable(owner, [0] * n)
            for m, width, points in (
                (Method.HIDDEN, cfg.hidden_size, res.h_points),
                (Method.KV, 2 * cfg.kv_dim, res.kv_points),
            ):
                runs = []
                for i in range(4):  # the first warms buffers
                    src = StoreSource(st, owner, fp)
                    _, rep = restore(model, Plan.uniform(cfg.num_layers, m), src, cache)
                    if i:
                        runs.append(rep.ms_by_method[m.value] / cfg.num_layers)
                ms = statistics.median(runs)
                points[n] = max(ms - res.cpu_ms_per_mb * n * width * elem / 1e6, ms / 2)
            if model.device.type == "cpu" and n <= cfg.max_position:
                res.re_reading[n] = _re_beside_reads(model, st, owner, fp, cache)
        return res


def _re_beside_reads(model: DecoderModel, st: ChunkStore, owner: str, fp: str, cache: KVCache) -> float:
    """A recompute prefix's time inside a restore that reads the other layers' H over its time
    alone (same tokens, turns taken, medians); at least 1. The restore's recompute time takes
    in its read setup too, which plans that read pay."""
    L = model.cfg.num_layers
    k = max(1, L // 5)
    plan = Plan((Method.RECOMPUTE,) * k + (Method.HIDDEN,) * (L - k))
    tokens = st.owner_row(owner).tokens
    # a long context's runs take seconds each: one, after a shorter one's warmed both paths
    long = len(tokens) >= LONG_CONTEXT
    alone, beside = [], []
    for i in range(1 if long else 3):  # else the first warms both
        cache.truncate(0)
        t0 = time.perf_counter()
        with torch.inference_mode():
            recompute_prefix(model, tokens, cache, k)
        a = (time.perf_counter() - t0) * 1e3
        _, rep = restore(model, plan, StoreSource(st, owner, fp), cache)
        if i or long:
            alone.append(a)
            beside.append(rep.ms_by_method[Method.RECOMPUTE.value])
    return max(1.0, statistics.median(beside) / statistics.median(alone))


def _reads_cost_to_compute(model: DecoderModel, dirs: list[Path], prof: Profile, tokens: int) -> dict[float, float]:
    """MB read -> compute-thread ms lost, from real RE-prefix + KV restores that read one layer
    and half the layers: the compute thread's busy time over what the prefix and the placement
    take alone. On a GPU that thread is bound by kernel launches, and planning the reads and the
    readers' Python (checksums, placement, the GIL) take from it."""
    cfg, L, fp = model.cfg, model.cfg.num_layers, model.fingerprint()
    points: dict[float, float] = {}
    with _scratch_store(model, dirs) as st:
        st.create_owner("mix", [{Kind.KV}] * L, fp)
        kv = torch.randn(tokens, 2, cfg.kv_dim).to(model.dtype)
        st.save_rows("mix", 0, {}, dict.fromkeys(range(L), kv))
        st.mark_durable("mix", [0] * tokens)
        cache = KVCache(cfg, model.dtype, model.device, capacity=tokens)
        for n_kv in sorted({1, min(L, max(2, L // 2))}):
            alone = (L - n_kv) * prof.re_ms(tokens) + n_kv * prof.kv_ms(tokens)
            runs = []
            for i in range(4):  # the first warms buffers
                _, rep = restore(model, Plan.split(L, L - n_kv, 0), StoreSource(st, "mix", fp), cache)
                if i:
                    runs.append(sum(rep.ms_by_method.values()) - alone)
            points[n_kv * kv.nbytes / 1e6] = statistics.median(runs)
    return points


def affine(points: dict[int, float]) -> tuple[float, float]:
    """(fixed ms, ms per 1K tokens) through two measurements; no negative fixed part."""
    (n1, t1), (n2, t2) = sorted(points.items())
    slope = max(0.0, (t2 - t1) / (n2 - n1))
    fixed = t1 - slope * n1
    if fixed < 0:
        return 0.0, t2 / n2 * 1000
    return fixed, slope * 1000


def run(
    model: DecoderModel,
    dirs: list[Path],
    io_tokens: int = IO_TOKENS,
    show: bool = True,
    re_contexts: tuple[int, ...] | None = None,
    reads_vs_compute: bool | None = None,
) -> Profile:
    """`reads_vs_compute`: measure what reads take from the compute thread in mixed restores
    (default: on accelerators; on a CPU the readers' own CPU time per MB is charged instead)."""
    cfg, dev, dt = model.cfg, model.device, model.dtype
    if re_contexts is None:
        re_contexts = RE_CONTEXTS if dev.type == "cpu" else RE_CONTEXTS_GPU
    if reads_vs_compute is None:
        reads_vs_compute = dev.type != "cpu"
    singly = dirs if len(dirs) > 1 else []  # one directory's own rate is the all-directory one
    steps = len(singly) + 1 + len(re_contexts)
    with Progress(disable=not show, transient=True) as bar:
        task = bar.add_task("profiling", total=steps)
        per_dir = []
        for d in singly:
            bar.update(task, description=f"read bandwidth {d}")
            per_dir.append(_io(model, [d], io_tokens).read_gbps)
            bar.advance(task)
        bar.update(task, description="read bandwidth and restore compute, all directories")
        io = _io(model, dirs, io_tokens, compute=H_TOKENS)
        read_gbps, latency = io.read_gbps, io.latency_ms
        per_dir = per_dir or [read_gbps]
        bar.advance(task)

        h_fixed, h_rate = affine(io.h_points)
        kv_fixed, kv_rate = affine(io.kv_points)

        re_points = {}
        for ctx in re_contexts:
            if ctx > cfg.max_position:
                continue
            bar.update(task, description=f"recompute, {ctx} tokens")
            ids = torch.randint(0, cfg.vocab_size, (ctx,), device=dev)

            # long contexts: fewer layers and runs (seconds each, and little noise)
            long = ctx >= LONG_CONTEXT
            depth = min(cfg.num_layers, 2 if long else 4)
            cache = KVCache(cfg, dt, dev, capacity=ctx)

            def some_layers(ids: torch.Tensor = ids, depth: int = depth, cache: KVCache = cache) -> None:
                cache.truncate(0)
                model(ids, torch.arange(len(ids), device=dev), cache, num_layers=depth)

            # no warm-up run for a long one: seconds, to fault in its buffers only
            re_points[ctx] = median_ms(some_layers, repeats=1 if long else 3, warm=not long) / depth
            bar.advance(task)
    prof = Profile(
        name=device_name(dev),
        read_gbps=read_gbps,
        read_latency_ms=latency,
        h_ms_per_ktok=h_rate,
        kv_ms_per_ktok=kv_rate,
        h_ms_fixed=h_fixed,
        kv_ms_fixed=kv_fixed,
        re_points=re_points,
        re_reading=io.re_reading,
        per_dir_gbps=per_dir,
        read_cpu_ms_per_mb=io.cpu_ms_per_mb,
        mix_margin=CPU_MIX_MARGIN if dev.type == "cpu" else 0.0,
        meta={"dtype": str(dt), "dirs": [str(d) for d in dirs], "io_tokens": io_tokens, "time": time.time()},
    )
    if reads_vs_compute:
        with Progress(disable=not show, transient=True) as bar:
            bar.add_task("reads against compute", total=None)
            # at a measured recompute length: the restores' excess is over the prefix's own time
            lost = _reads_cost_to_compute(model, dirs, prof, min(io_tokens, max(re_points)))
        setup, per_gb = affine(lost) if len(lost) > 1 else (max(0.0, *lost.values()), 0.0)  # slope per 1000 MB
        prof.read_setup_ms, prof.read_cpu_ms_per_mb = setup, per_gb / 1000
        prof.meta["reads_vs_compute"] = {f"{mb:.1f}": ms for mb, ms in lost.items()}
    return prof


def load_or_run(model: DecoderModel, dirs: list[Path], cache_dir: Path, reprofile: bool = False) -> Profile:
    path = profile_path(cache_dir, model)
    if path.exists() and not reprofile:
        return Profile.load(path)
    prof = run(model, dirs)
    prof.save(path)
    return prof
