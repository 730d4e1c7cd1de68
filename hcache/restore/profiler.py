"""`hcache profile`: measure this machine for the partitioner. Storage read bandwidth
per directory (O_DIRECT, restore-shaped reads of a scratch owner), H -> KV projection,
KV placement, and one layer's recompute at several context lengths. The result is
cached as JSON per model fingerprint, dtype and device, and reused until re-profiled."""

from __future__ import annotations

import platform
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from rich.progress import Progress

from hcache.model.attention import KVCache
from hcache.model.base import DecoderModel
from hcache.restore.profile import Profile
from hcache.storage.layout import Kind
from hcache.storage.store import ChunkStore, StorageConfig

SCRATCH = ".hcache-profile"
RE_CONTEXTS = (256, 1024, 2048, 4096)
IO_TOKENS = 4096


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device).replace(" ", "-")
    return f"cpu-{platform.machine()}-{torch.get_num_threads()}t"


def profile_path(cache_dir: Path, model: DecoderModel) -> Path:
    dtype = str(model.dtype).removeprefix("torch.")
    return cache_dir / f"{model.fingerprint()[:16]}-{dtype}-{device_name(model.device)}.json"


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


def _io(model: DecoderModel, dirs: list[Path], tokens: int) -> tuple[float, float]:
    """(GB/s, ms of a one-chunk read) for restore-shaped reads of a scratch owner over `dirs`."""
    scratch = [d / SCRATCH for d in dirs]
    for d in scratch:
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    try:
        cfg = model.cfg
        with ChunkStore(StorageConfig([str(d) for d in scratch]), cfg, model.dtype, str(model.device)) as st:
            kinds = [Kind.KV if i % 2 else Kind.HIDDEN for i in range(cfg.num_layers)]
            st.create_owner("profile", kinds, "profile")
            h = torch.randn(tokens, cfg.hidden_size).to(model.dtype)
            kv = torch.randn(tokens, 2, cfg.kv_dim).to(model.dtype)
            st.save_rows(
                "profile",
                0,
                {i: h for i, k in enumerate(kinds) if k == Kind.HIDDEN},
                {i: kv for i, k in enumerate(kinds) if k == Kind.KV},
            )
            st.mark_durable("profile", [0] * tokens)

            def read_all() -> int:
                r = st.reader("profile")
                for layer in range(cfg.num_layers):
                    r.get(layer)
                    r.release(layer)
                return r.bytes_read

            nbytes = read_all()
            secs = _median_ms(read_all) / 1e3
            latency = _median_ms(lambda: st.read_chunk("profile", 0, 0, Kind.HIDDEN))
            return nbytes / secs / 1e9, latency
    finally:
        for d in scratch:
            shutil.rmtree(d, ignore_errors=True)


def run(model: DecoderModel, dirs: list[Path], io_tokens: int = IO_TOKENS, show: bool = True) -> Profile:
    cfg, dev, dt = model.cfg, model.device, model.dtype
    steps = len(dirs) + 1 + 2 + len(RE_CONTEXTS)
    with Progress(disable=not show, transient=True) as bar:
        task = bar.add_task("profiling", total=steps)
        per_dir = []
        for d in dirs:
            bar.update(task, description=f"read bandwidth {d}")
            per_dir.append(_io(model, [d], io_tokens)[0])
            bar.advance(task)
        bar.update(task, description="read bandwidth, all directories")
        read_gbps, latency = _io(model, dirs, io_tokens)
        bar.advance(task)

        n = 1024
        h = torch.randn(n, cfg.hidden_size, device=dev).to(dt)
        pos = torch.arange(n, device=dev)
        cache = KVCache(cfg, dt, dev, capacity=n)
        bar.update(task, description="H -> KV projection")

        def project() -> None:
            k, v = model.kv_from_hidden(0, h, pos)
            cache.write(0, k, v, start=0)

        h_ms = _median_ms(project)
        bar.advance(task)
        k = torch.randn(n, cfg.num_kv_heads, cfg.head_dim, device=dev).to(dt)
        bar.update(task, description="KV placement")
        kv_ms = _median_ms(lambda: cache.write(1, k, k, start=0))
        bar.advance(task)

        re_points = {}
        for ctx in RE_CONTEXTS:
            if ctx > cfg.max_position:
                continue
            bar.update(task, description=f"recompute, {ctx} tokens")
            ids = torch.randint(0, cfg.vocab_size, (ctx,), device=dev)

            def one_layer(ids: torch.Tensor = ids, ctx: int = ctx) -> None:
                model(ids, torch.arange(ctx, device=dev), KVCache(cfg, dt, dev, capacity=ctx), num_layers=1)

            re_points[ctx] = _median_ms(one_layer, repeats=3)
            bar.advance(task)
    return Profile(
        name=device_name(dev),
        read_gbps=read_gbps,
        read_latency_ms=latency,
        h_ms_per_ktok=h_ms * 1000 / n,
        kv_ms_per_ktok=kv_ms * 1000 / n,
        re_points=re_points,
        per_dir_gbps=per_dir,
        meta={"dtype": str(dt), "dirs": [str(d) for d in dirs], "io_tokens": io_tokens, "time": time.time()},
    )


def load_or_run(model: DecoderModel, dirs: list[Path], cache_dir: Path, reprofile: bool = False) -> Profile:
    path = profile_path(cache_dir, model)
    if path.exists() and not reprofile:
        return Profile.load(path)
    prof = run(model, dirs)
    prof.save(path)
    return prof
