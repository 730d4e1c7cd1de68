"""The int8 kernels on a model's int8 matrices, as a decode step streams them: ours
(AVX512-VNNI, `kernels/int8_gemm.cpp`), oneDNN's u8s8 GEMM and `_weight_int8pack_mm`, each
through `Int8Linear.forward` (activation quantization included), at the tokens of a decode
step, a batch of 4 and of 32, and a prefill chunk; beside them the machine's streaming read,
the bound of a step. Every matrix lies in memory of its own, so each call streams it from
DRAM as a step of the model does."""

from __future__ import annotations

import argparse
import platform
from typing import Any

import torch

from hcache.benchmarks import measures, report
from hcache.kernels.cpu import cpu
from hcache.model.loader import load
from hcache.model.quant import Int8Linear
from hcache.restore.profiler import median_ms

KERNELS = ("ours", "onednn", "int8pack")


def shapes(model: str) -> list[tuple[int, int]]:
    """(rows, inputs) of every int8 matrix a decode step of `model` runs, in order."""
    m = load(model, "float32", weights="packed").model
    mods = [*m.layers, m.lm_head]
    return [(x.out_features, x.in_features) for mod in mods for x in mod.modules() if isinstance(x, Int8Linear)]


def _matrices(dims: list[tuple[int, int]], kernel: str) -> list[Int8Linear] | None:
    g = torch.Generator().manual_seed(0)
    out = []
    for n, k in dims:
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
        lin = Int8Linear(q, (torch.rand(n, generator=g) * 0.01).bfloat16())
        if kernel == "ours" and not lin.pack_native():
            return None
        if kernel == "onednn" and not lin.pack_for_onednn():
            return None
        out.append(lin)
    return out


def run(model: str, tokens: list[int], repeats: int, int8pack_max: int) -> dict[str, Any]:
    dims = shapes(model)
    step_bytes = sum(n * k for n, k in dims)
    res: dict[str, Any] = {
        "model": model,
        "cpu_kind": cpu().kind,
        "processor": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "matrices": len(dims),
        "step_mb": step_bytes / 1e6,
        "stream_read_gbps": measures.stream_read_gbps(),
        "rows": [],
    }
    for kernel in KERNELS:
        mats = _matrices(dims, kernel)
        if mats is None:
            res["rows"].append({"kernel": kernel, "skipped": f"does not run on {cpu().kind}"})
            continue
        for t in tokens:
            if kernel == "int8pack" and t > int8pack_max:
                continue
            xs = {k: torch.randn(t, k) for k in {k for _, k in dims}}

            def step(mats: list[Int8Linear] = mats, xs: dict = xs) -> None:
                with torch.inference_mode():
                    for lin in mats:
                        lin(xs[lin.in_features])

            ms = median_ms(step, repeats)
            res["rows"].append({"kernel": kernel, "tokens": t, "ms": ms, "weights_gbps": step_bytes / ms / 1e6})
            print(res["rows"][-1], flush=True)
        del mats
    return res


def section(res: dict[str, Any]) -> list[str]:
    """RESULTS.md's table: ms per step of the int8 matrices, and GB/s of weights streamed."""
    by = {(r["kernel"], r["tokens"]): r for r in res["rows"] if "ms" in r}
    tokens = sorted({t for _, t in by})
    lines = [
        f"## Int8 kernels on {res['model']} (`bench/results/int8.json`)",
        "",
        f"CPU kind {res['cpu_kind']}, {res['threads']} threads: the {res['matrices']} int8 matrices of a decode "
        f"step ({res['step_mb']:.1f} MB), each through `Int8Linear.forward` with its activation quantization; "
        f"median ms per pass over all of them, and weights streamed in GB/s. The machine's streaming read "
        f"(a float32 sum, median) is {res['stream_read_gbps']:.1f} GB/s.",
        "",
        "| tokens | " + " | ".join(f"{k} ms | {k} GB/s" for k in KERNELS) + " | oneDNN / ours |",
        "|---:|" + "---:|---:|" * len(KERNELS) + "---:|",
    ]
    for t in tokens:
        cells = []
        for k in KERNELS:
            r = by.get((k, t))
            cells += [f"{r['ms']:.2f}", f"{r['weights_gbps']:.1f}"] if r else ["-", "-"]
        ours, dnn = by.get(("ours", t)), by.get(("onednn", t))
        ratio = f"{dnn['ms'] / ours['ms']:.2f}x" if ours and dnn else "-"
        lines.append(f"| {t} | " + " | ".join(cells) + f" | {ratio} |")
    lines += [""] + [f"{r['kernel']}: {r['skipped']}." for r in res["rows"] if "skipped" in r]
    return [*lines, ""] if lines[-1] else lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hcache bench int8", description=__doc__)
    ap.add_argument("--model", default="qwen2.5-0.5b", help="a model whose GGUF has 5- to 8-bit matrices")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 32, 512])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--int8pack-max", type=int, default=32, help="tokens above which int8pack is not timed (slow)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default="bench/results/int8.json")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    res = run(a.model, a.tokens, a.repeats, a.int8pack_max)
    return report(res, a.out, a.json, lambda: print("\n".join(section(res))))
