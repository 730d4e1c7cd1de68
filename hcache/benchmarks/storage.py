"""Storage benchmark: two-stage write and restore-shaped read throughput with O_DIRECT
for 1, 2 and 4 directories, the stage-1 copy cost per layer, and the device's
sequential read bandwidth measured in the same run."""

from __future__ import annotations

import os
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from hcache.benchmarks import report
from hcache.config import StorageConfig
from hcache.memory import aligned_buffer
from hcache.model.geometry import ModelConfig
from hcache.storage.dirs import ensure_dirs
from hcache.storage.layout import Kind
from hcache.storage.store import ChunkStore

RAW_FILE_BYTES = 1 << 30


@dataclass
class StorageRow:
    dirs: int
    tokens: int
    bytes: int
    write_gbps: float
    read_gbps: float
    read_ms: float
    raw_read_gbps: float
    ratio: float  # against the best of O_DIRECT and cold buffered sequential reads
    ratio_direct: float  # against large O_DIRECT sequential reads alone


class RawFile:
    """A 1 GB file for the device's sequential read bandwidth."""

    def __init__(self, folder: Path, size: int = RAW_FILE_BYTES):
        self.path, self.size, self.block = folder / "raw.bin", size, 64 << 20
        buf = aligned_buffer(self.block)
        buf.write(os.urandom(1 << 20) * (self.block >> 20))
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o644)
        for off in range(0, size, self.block):
            os.pwrite(fd, buf, off)
        os.fsync(fd)
        os.close(fd)

    def measure(self) -> dict[str, float]:
        """Large O_DIRECT reads (64 MB, one and two in flight) and a cold buffered read, GB/s."""
        out = {}
        direct = getattr(os, "O_DIRECT", 0)
        for name, flags, qd in (("direct_qd1", direct, 1), ("direct_qd2", direct, 2), ("buffered_cold", 0, 1)):
            fd = os.open(self.path, os.O_RDONLY | flags)
            if not flags:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # cold: none of it in the page cache
            out[name] = self.size / _read_all(fd, self.size, self.block, qd) / 1e9
            os.close(fd)
        return out


def _read_all(fd: int, size: int, block: int, qd: int) -> float:
    from concurrent.futures import ThreadPoolExecutor

    bufs = [aligned_buffer(block) for _ in range(qd)]
    offsets = list(range(0, size, block))

    def work(i: int) -> None:
        for off in offsets[i::qd]:
            os.preadv(fd, [bufs[i]], off)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(qd) as ex:
        list(ex.map(work, range(qd)))
    return time.perf_counter() - t0


def _layer_kinds(cfg: ModelConfig) -> list[Kind]:
    # both chunk kinds, as a mixed plan stores them
    return [Kind.HIDDEN if layer % 2 == 0 else Kind.KV for layer in range(cfg.num_layers)]


def stage1_copy_us(cfg: ModelConfig, dtype: torch.dtype, rows: int = 256, repeats: int = 201) -> float:
    """Median microseconds to copy one layer's hidden rows of a batch into a staging slot."""
    src = torch.randn(rows, cfg.hidden_size).to(dtype)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def write_owner(dirs: list[Path], cfg: ModelConfig, dtype: torch.dtype, tokens: int) -> float:
    """Save one owner of `tokens` tokens through the two-stage path; returns write GB/s."""
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    with ChunkStore(StorageConfig([str(d) for d in dirs], staging_bytes=256 << 20), cfg, dtype) as store:
        store.create_owner("bench", _layer_kinds(cfg), "bench")
        step = 512
        g = torch.Generator().manual_seed(0)
        h = torch.randn(step, cfg.hidden_size, generator=g).to(dtype)
        kv = torch.randn(step, 2, cfg.kv_dim, generator=g).to(dtype)
        t0 = time.perf_counter()
        for start in range(0, tokens, step):
            n = min(step, tokens - start)
            batch = store.acquire([("bench", start, n)])
            for t in batch.hidden.values():
                t.copy_(h[:n])
            for t in batch.kv.values():
                t.copy_(kv[:n])
            store.submit(batch)
        store.mark_durable("bench", [0] * tokens)
        seconds = time.perf_counter() - t0
        return sum(u.used_bytes for u in store.usage()) / seconds / 1e9


def read_owner(store: ChunkStore) -> tuple[float, int]:
    """Restore-shaped read: every chunk of every layer, in layer order. Returns (seconds, bytes)."""
    t0 = time.perf_counter()
    r = store.reader("bench")  # the restorer's prefetch window
    for layer in range(store.model.num_layers):
        r.get(layer)
        r.release(layer)
    return time.perf_counter() - t0, r.bytes_read


def run(cfg: ModelConfig, dtype: torch.dtype, dirs: list[str] | None, tokens: int = 8192, repeats: int = 5) -> dict:
    """Raw and restore-shaped reads alternate in every repeat, so device noise hits both alike."""
    given = ensure_dirs(dirs or [])  # like `hcache serve`: directories not there yet are created
    base = Path(tempfile.mkdtemp(prefix="hcache-bench-", dir=given[0] if given else None))
    roots = given or [base]
    try:
        layouts = {n: [roots[i % len(roots)] / f"hcache-bench-{n}-{i}" for i in range(n)] for n in (1, 2, 4)}
        writes = {n: write_owner(dd, cfg, dtype, tokens) for n, dd in layouts.items()}
        raw_file = RawFile(base)
        raw_runs: list[dict[str, float]] = []
        reads: dict[int, list[tuple[float, int]]] = {n: [] for n in layouts}
        # stores stay open, as in a server: their read and layer buffers are warm after the first read
        stores = {n: ChunkStore(StorageConfig([str(d) for d in dd]), cfg, dtype) for n, dd in layouts.items()}
        try:
            for st in stores.values():
                read_owner(st)
            rng = random.Random(0)
            for _ in range(repeats):
                # a fresh order each repeat: whatever the previous read left in flight hits all alike
                order: list[int | None] = [None, *stores]
                rng.shuffle(order)
                for n in order:
                    if n is None:
                        raw_runs.append(raw_file.measure())
                    else:
                        reads[n].append(read_owner(stores[n]))
        finally:
            for st in stores.values():
                st.close()
        raw = {k: statistics.median(r[k] for r in raw_runs) for k in raw_runs[0]}
        raw_best = max(raw.values())
        direct_best = max(v for k, v in raw.items() if k.startswith("direct"))
        rows = []
        for n in layouts:
            secs = statistics.median(s for s, _ in reads[n])
            nbytes = reads[n][0][1]
            gbps = nbytes / secs / 1e9
            rows.append(
                StorageRow(
                    n, tokens, nbytes, writes[n], gbps, secs * 1e3, raw_best, gbps / raw_best, gbps / direct_best
                )
            )
        return {
            "model": {"layers": cfg.num_layers, "hidden": cfg.hidden_size, "kv_dim": cfg.kv_dim, "dtype": str(dtype)},
            "repeats": repeats,
            "raw": raw,
            "raw_read_gbps": raw_best,
            "direct_read_gbps": direct_best,
            "read_gbps": statistics.median(r.read_gbps for r in rows),
            "write_gbps": statistics.median(r.write_gbps for r in rows),
            "stage1_copy_us_per_layer": stage1_copy_us(cfg, dtype),
            "rows": [asdict(r) for r in rows],
        }
    finally:
        shutil.rmtree(base, ignore_errors=True)
        for dd in layouts.values() if "layouts" in locals() else []:
            for d in dd:
                shutil.rmtree(d, ignore_errors=True)


def print_table(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"restore-shaped reads of one owner (all chunks, all layers), {res['model']}")
    cols = ("dirs", "tokens", "MB", "write GB/s", "read GB/s", "read ms", "device seq GB/s", "read / device")
    for col in (*cols, "read / O_DIRECT seq"):
        t.add_column(col, justify="right")
    for r in res["rows"]:
        t.add_row(
            str(r["dirs"]),
            str(r["tokens"]),
            f"{r['bytes'] / 1e6:.0f}",
            f"{r['write_gbps']:.2f}",
            f"{r['read_gbps']:.2f}",
            f"{r['read_ms']:.0f}",
            f"{r['raw_read_gbps']:.2f}",
            f"{r['ratio']:.2f}",
            f"{r['ratio_direct']:.2f}",
        )
    c = Console(width=140)
    c.print(t)
    c.print(
        f"device sequential reads, median of {res['repeats']} (GB/s): "
        + ", ".join(f"{k} {v:.2f}" for k, v in res["raw"].items())
    )
    c.print(f"stage-1 copy: {res['stage1_copy_us_per_layer']:.1f} us per layer for a 256-row batch")


def main(args: list[str] | None = None) -> int:
    import argparse

    from hcache.model.loader import DEFAULT_GEOMETRY, DTYPES, read_config

    ap = argparse.ArgumentParser(prog="hcache bench storage")
    ap.add_argument("--dirs", nargs="*", help="storage directories (one per device); default: a temp dir")
    ap.add_argument("--model", default="default", help="a model, or default-geometry (no GGUF needed)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    ap.add_argument("--out", default="bench/results/storage.json")
    a = ap.parse_args(args)
    cfg = DEFAULT_GEOMETRY if a.model == "default-geometry" else read_config(a.model)
    res = run(cfg, DTYPES[a.dtype], a.dirs, a.tokens, a.repeats)
    return report(res, a.out, a.json, lambda: print_table(res))
