"""How much a restore's reads slow its compute thread: the same stored state restored as
all-recompute, all-KV and two recompute-prefix + KV mixes, per reader depth and GIL switch
interval. Prints one JSON line per setting: per plan [restore ms, recompute (+ read setup)
compute ms, KV compute ms, wait ms], medians of 5 after a warm-up. This is the probe behind
`bench/results/gpu_reads_vs_compute_*.txt` (run there on an H100 host with `--device cuda`).

    python bench/reads_vs_compute.py --base /path/on/nvme [--device cuda] [--depths 8 2] [--switch 0.005 0.0005]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from hcache.benchmarks.models import bench_model, save_state
from hcache.config import StorageConfig
from hcache.restore.executor import restore
from hcache.restore.plan import Method, Plan
from hcache.restore.sources import StoreSource
from hcache.storage.store import ChunkStore


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--depths", nargs="+", type=int, default=[8, 2], help="reader threads per directory")
    ap.add_argument("--switch", nargs="+", type=float, default=[0.005, 0.0005], help="sys.setswitchinterval")
    ap.add_argument("--tokens", nargs="+", type=int, default=[1024, 4096])
    a = ap.parse_args(argv)
    model = bench_model("default", torch.bfloat16, a.device, random_weights=True)
    L, fp = model.cfg.num_layers, model.fingerprint()
    base = Path(tempfile.mkdtemp(prefix="hcache-rvc-", dir=a.base))
    plans = {
        "RE": Plan.uniform(L, Method.RECOMPUTE),
        "KV": Plan.uniform(L, Method.KV),
        "RE7+KV": Plan.split(L, 7, 0),
        "RE22+KV": Plan.split(L, 22, 0),
    }
    for n in a.tokens:
        for nd in (1, 4):
            dirs = [base / f"{n}-{nd}-{i}" for i in range(nd)]
            for d in dirs:
                d.mkdir()
            cfg = StorageConfig([str(d) for d in dirs], staging_bytes=256 << 20)
            with ChunkStore(cfg, model.cfg, model.dtype, a.device) as st:
                save_state(model, st, "s", n, real=False)
            for depth in a.depths:
                cfg = StorageConfig([str(d) for d in dirs], read_depth=depth)
                with ChunkStore(cfg, model.cfg, model.dtype, a.device) as st:
                    for si in a.switch:
                        sys.setswitchinterval(si)
                        out: dict = {"n": n, "dirs": nd, "depth": depth, "si": si}
                        for name, plan in plans.items():
                            reps = [restore(model, plan, StoreSource(st, "s", fp))[1] for _ in range(6)][1:]

                            def med(values: list[float]) -> float:
                                return round(statistics.median(values), 1)

                            out[name] = [
                                med([r.ms for r in reps]),
                                med([r.ms_by_method["recompute"] for r in reps]),
                                med([r.ms_by_method["kv"] for r in reps]),
                                med([r.wait_ms for r in reps]),
                            ]
                        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
