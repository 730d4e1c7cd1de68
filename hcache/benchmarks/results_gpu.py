"""RESULTS.md's GPU section: hcache alone on a lent GPU (`bench/peers.py --device cuda --skip
llama.cpp transformers`), a table per activation dtype, from `bench/results/peers_gpu_*.json`."""

from __future__ import annotations

import json
from pathlib import Path


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:,.1f}"


def gpu_section(results: Path) -> list[str]:
    files = sorted(results.glob("peers_gpu_*.json"))
    if not files:
        return []
    lines = [
        "## On a GPU (hcache alone)",
        "",
        "The peers benchmark's hcache half with `--device cuda`: float weights (int4 runs on CPUs), the "
        "decode step compiled and recorded as CUDA graphs (one per power-of-two batch size and key "
        "blocks), storage on the machine's own disk. llama.cpp did not run there, so these are not ratios "
        "against it.",
        "",
    ]
    for f in files:
        d = json.loads(f.read_text())
        m, a, dec = d["machine"], d["args"], d["decode"]["hcache"]
        gpu = m.get("gpu") or "a CUDA GPU (its name was not recorded by this run)"
        lines += [
            f"### {a.get('model', 'default')} in {a['dtype']} on {gpu}",
            "",
            f"Host: {m['cpu']}, {m['cores']} cores; Python {m['python']}, torch {m['torch']}; run {m['date']}; "
            f"{dec['weights']} weights, a {dec['kv_dtype']} KV cache. Raw results: `bench/results/{f.name}`.",
            "",
            "| tokens | prefill | restore auto / KV / H / RE | turn after a KV restore | "
            "TTFT after eviction (fused) | auto plan |",
            "|---:|---:|---:|---:|---:|---|",
        ]
        for r in sorted((r for r in d["rows"] if r["system"] == "hcache"), key=lambda r: r["tokens"]):
            restore = " / ".join(_ms(r.get(f"restore_{k}_ms")) for k in ("auto", "kv", "hidden", "re"))
            lines.append(
                f"| {r['tokens']} | {_ms(r['prefill_ms'])} | {restore} | {_ms(r.get('turn_after_kv_ms'))} | "
                f"{_ms(r.get('ttft_after_eviction_ms'))} | `{r.get('auto_plan', '')}` |"
            )
        lines += [
            "",
            f"Decode: batch-1 TBT {dec['tbt_b1_ms']:.2f} ms (host time around the graph's replay, the "
            f"wait for the GPU included, {dec['host_ms_b1']:.2f} ms); "
            + ", ".join(f"batch {b} {dec[f'tokens_per_s_b{b}']:,.0f} tokens/s" for b in a["batches"] if b > 1)
            + f"; batch-1 TBT with the saver off {dec['tbt_b1_saver_off_ms']:.2f} ms. Times in ms; the "
            "prefill column includes storing the context's chunks.",
            "",
            *_stream(dec),
        ]
    return lines


def _stream(dec: dict) -> list[str]:
    """The batch-1 step's weight bytes over its time, against the GPU's streaming read."""
    if not dec.get("stream_read_gbps"):
        return []
    gbps = dec["step_weights_mb"] / dec["tbt_b1_ms"]
    return [
        f"Weight stream: a batch-1 step reads {dec['step_weights_mb']:.1f} MB of weights, {gbps:.0f} GB/s, "
        f"{gbps / dec['stream_read_gbps']:.2f} of the GPU's streaming read ({dec['stream_read_gbps']:.0f} GB/s, "
        "a float32 sum over 4 GB, median).",
        "",
    ]
