"""`hcache profile`: measure this machine for the partitioner. Storage read bandwidth
per directory (O_DIRECT, restore-shaped reads of a scratch owner), H -> KV projection,
KV placement, and one layer's recompute at several context lengths. The result is
cached as JSON per model fingerprint, dtype and device, and reused until re-profiled."""

from __future__ import annotations

import platform
import resource
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.progress import Progress

from hcache.model.attention import KVCache
from hcache.model.base import DecoderModel
from hcache.restore.plan import Method, Plan
from hcache.restore.profile import Profile
from hcache.restore.restorer import restore
from hcache.storage.layout import Kind
from hcache.storage.reader import Want
from hcache.storage.source import StoreSource
from hcache.storage.store import ChunkStore, StorageConfig

SCRATCH = ".hcache-profile"
RE_CONTEXTS = (256, 1024, 2048, 4096)
IO_TOKENS = 4096
PROFILE_VERSION = 2  # bumped when the profile gains a measurement: older files are re-measured
# restores on this 2-core VM come within about +-10% of their predictions, and single
# methods err less than mixes; a mix must win by more than that to be chosen
CPU_MIX_MARGIN = 0.05


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device).replace(" ", "-")
    return f"cpu-{platform.machine()}-{torch.get_num_threads()}t"


def profile_path(cache_dir: Path, model: DecoderModel) -> Path:
    dtype = str(model.dtype).removeprefix("torch.")
    return cache_dir / f"{model.fingerprint()[:16]}-{dtype}-{device_name(model.device)}-v{PROFILE_VERSION}.json"


def _median_ms(fn: Callable[[], object], repeats: int = 5) -> float:
    fn()  # warm-up
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
    read_gbps: float
    latency_ms: float
    h_ms_per_ktok: float  # H -> KV inside a real H-only restore: reads in flight compete for the CPU
    kv_ms_per_ktok: float
    cpu_ms_per_mb: float  # every thread's CPU per MB of restore-shaped reads


def _io(model: DecoderModel, dirs: list[Path], tokens: int, pipeline: bool = False) -> IOResult:
    """Restore-shaped reads of a scratch owner over `dirs`; with `pipeline`, also the per-layer
    compute of real H-only and KV-only restores (on a small machine reads and compute share cores)."""
    scratch = [d / SCRATCH for d in dirs]
    for d in scratch:
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    try:
        cfg = model.cfg
        with ChunkStore(StorageConfig([str(d) for d in scratch]), cfg, model.dtype, str(model.device)) as st:
            both = [{Kind.HIDDEN, Kind.KV}] * cfg.num_layers
            st.create_owner("profile", both, model.fingerprint())
            h = torch.randn(tokens, cfg.hidden_size).to(model.dtype)
            kv = torch.randn(tokens, 2, cfg.kv_dim).to(model.dtype)
            st.save_rows(
                "profile", 0, dict.fromkeys(range(cfg.num_layers), h), dict.fromkeys(range(cfg.num_layers), kv)
            )
            st.mark_durable("profile", [0] * tokens)
            half = [Want(i, Kind.KV if i % 2 else Kind.HIDDEN, 0, tokens) for i in range(cfg.num_layers)]

            def read_all() -> int:
                r = st.reader("profile", wants=half)
                for w in half:
                    r.get(w.layer, w.kind)
                    r.release(w.layer)
                return r.bytes_read

            nbytes = read_all()
            secs = _median_ms(read_all) / 1e3
            cpu = []
            for _ in range(3):  # every thread's CPU (the consumer here only waits)
                before = resource.getrusage(resource.RUSAGE_SELF)
                read_all()
                after = resource.getrusage(resource.RUSAGE_SELF)
                used = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
                cpu.append(used * 1e3 / (nbytes / 1e6))
            latency = _median_ms(lambda: st.read_chunk("profile", 0, 0, Kind.HIDDEN))
            rates = {}
            for m in (Method.HIDDEN, Method.KV) if pipeline else ():
                runs = []
                for _ in range(3):
                    _, rep = restore(
                        model, Plan.uniform(cfg.num_layers, m), StoreSource(st, "profile", model.fingerprint())
                    )
                    runs.append(rep.ms_by_method[m.value] / cfg.num_layers * 1000 / tokens)
                rates[m] = statistics.median(runs)
            h_rate, kv_rate = rates.get(Method.HIDDEN, 0.0), rates.get(Method.KV, 0.0)
            return IOResult(nbytes / secs / 1e9, latency, h_rate, kv_rate, statistics.median(cpu))
    finally:
        for d in scratch:
            shutil.rmtree(d, ignore_errors=True)


def run(
    model: DecoderModel,
    dirs: list[Path],
    io_tokens: int = IO_TOKENS,
    show: bool = True,
    re_contexts: tuple[int, ...] = RE_CONTEXTS,
) -> Profile:
    cfg, dev, dt = model.cfg, model.device, model.dtype
    steps = len(dirs) + 1 + 2 + len(re_contexts)
    with Progress(disable=not show, transient=True) as bar:
        task = bar.add_task("profiling", total=steps)
        per_dir = []
        for d in dirs:
            bar.update(task, description=f"read bandwidth {d}")
            per_dir.append(_io(model, [d], io_tokens).read_gbps)
            bar.advance(task)
        bar.update(task, description="read bandwidth and restore compute, all directories")
        io = _io(model, dirs, io_tokens, pipeline=True)
        read_gbps, latency = io.read_gbps, io.latency_ms
        bar.advance(task)

        n = 1024
        h = torch.randn(n, cfg.hidden_size, device=dev).to(dt)
        pos = torch.arange(n, device=dev)
        cache = KVCache(cfg, dt, dev, capacity=n)
        bar.update(task, description="H -> KV projection")

        # every layer with its own weights, as a restore runs them (one layer re-run stays cache-hot)
        def project() -> None:
            for layer in range(cfg.num_layers):
                k, v = model.kv_from_hidden(layer, h, pos)
                cache.write(layer, k, v, start=0)

        h_ms = max(_median_ms(project) / cfg.num_layers, io.h_ms_per_ktok * n / 1000)
        bar.advance(task)
        k = torch.randn(n, cfg.num_kv_heads, cfg.head_dim, device=dev).to(dt)
        bar.update(task, description="KV placement")
        kv_ms = max(
            _median_ms(lambda: [cache.write(i, k, k, start=0) for i in range(cfg.num_layers)]) / cfg.num_layers,
            io.kv_ms_per_ktok * n / 1000,
        )
        bar.advance(task)

        re_points = {}
        for ctx in re_contexts:
            if ctx > cfg.max_position:
                continue
            bar.update(task, description=f"recompute, {ctx} tokens")
            ids = torch.randint(0, cfg.vocab_size, (ctx,), device=dev)

            depth = min(cfg.num_layers, 4)

            def some_layers(ids: torch.Tensor = ids, ctx: int = ctx, depth: int = depth) -> None:
                model(ids, torch.arange(ctx, device=dev), KVCache(cfg, dt, dev, capacity=ctx), num_layers=depth)

            re_points[ctx] = _median_ms(some_layers, repeats=3) / depth
            bar.advance(task)
    return Profile(
        name=device_name(dev),
        read_gbps=read_gbps,
        read_latency_ms=latency,
        h_ms_per_ktok=h_ms * 1000 / n,
        kv_ms_per_ktok=kv_ms * 1000 / n,
        re_points=re_points,
        per_dir_gbps=per_dir,
        # on a GPU the readers' CPU does not slow compute, and the model has fewer shared parts
        read_cpu_ms_per_mb=io.cpu_ms_per_mb if dev.type == "cpu" else 0.0,
        mix_margin=CPU_MIX_MARGIN if dev.type == "cpu" else 0.0,
        meta={"dtype": str(dt), "dirs": [str(d) for d in dirs], "io_tokens": io_tokens, "time": time.time()},
    )


def load_or_run(model: DecoderModel, dirs: list[Path], cache_dir: Path, reprofile: bool = False) -> Profile:
    path = profile_path(cache_dir, model)
    if path.exists() and not reprofile:
        return Profile.load(path)
    prof = run(model, dirs)
    prof.save(path)
    return prof
