"""The int8 kernel benchmark: every kernel that runs here is timed on the model's int8
matrices, and the table names the ones that do not."""

from __future__ import annotations

from hcache.benchmarks.int8 import KERNELS, run, section, shapes
from hcache.kernels import native


def test_every_kernel_is_timed_or_named_as_skipped(tiny_folder):
    path = str(tiny_folder("llama_gqa"))
    dims = shapes(path)
    assert dims  # a float model packs its head as int8 rows
    res = run(path, [1, 3], repeats=1, int8pack_max=1)
    timed = {(r["kernel"], r["tokens"]) for r in res["rows"] if "ms" in r}
    skipped = {r["kernel"] for r in res["rows"] if "skipped" in r}
    assert ("int8pack", 1) in timed and ("int8pack", 3) not in timed
    assert ("ours", 3) in timed if native.int8_gemm() else "ours" in skipped
    assert all(r["ms"] > 0 and r["weights_gbps"] > 0 for r in res["rows"] if "ms" in r)
    table = "\n".join(section(res))
    assert all(k in table for k in KERNELS) and "| 3 |" in table
    assert res["step_mb"] == sum(n * k for n, k in dims) / 1e6
