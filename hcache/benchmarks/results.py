"""bench/RESULTS.md from the JSON the benchmarks wrote: tables with ratios measured in
the same run, the plots (benchmarks/plots.py), the machine, versions and the commands."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from hcache.benchmarks.engine import section as engine_section
from hcache.benchmarks.plots import peers_plots
from hcache.benchmarks.results_gpu import gpu_section

COMMANDS = """\
make bench-peers          # builds llama-cpp-python into .venv (once, ~12 min), runs bench/peers.py
make bench                # bench-peers + the storage, restore, engine and serve benchmarks, then this page
.venv/bin/python bench/peers.py --dirs /path/on/nvme    # one benchmark alone; --help for options
.venv/bin/python bench/peers.py --device cuda --dtype bfloat16 --skip llama.cpp transformers \\
    --out bench/results/peers_gpu_bfloat16.json          # hcache alone on a GPU
.venv/bin/python bench/results.py                        # this page from bench/results/*.json
"""


def _load(d: Path, name: str) -> Any:
    p = d / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def _fmt(v: float | None, nd: int = 0) -> str:
    return "-" if v is None else f"{v:,.{nd}f}"


def _targets(peers: dict) -> list[str]:
    """The issue's targets at the largest context, each with its measured ratio."""
    rows, dec = peers["rows"], peers["decode"]
    n = max(r["tokens"] for r in rows)

    def at(system: str) -> dict:
        return next((r for r in rows if r["system"] == system and r["tokens"] == n), {})

    h, ll, tf = at("hcache"), at("llama.cpp"), at("transformers")
    out = [f"### Targets at {n} tokens", "", "| target | measured | met |", "|---|---:|:---:|"]

    def add(name: str, value: float | None, ok: bool | None) -> None:
        out.append(f"| {name} | {_fmt(value, 3)} | {'-' if ok is None else ('yes' if ok else 'no')} |")

    if h and ll:
        r = h["ttft_after_eviction_ms"] / ll["ttft_after_eviction_ms"]
        add("TTFT after eviction <= 0.4x llama.cpp load + turn", r, r <= 0.4)
        rec = min(v for v in (ll.get("prefill_ms"), tf.get("prefill_ms")) if v)
        r = h["ttft_after_eviction_ms"] / rec
        add("TTFT after eviction <= 0.1x the faster peer recompute", r, r <= 0.1)
        r = ll["prefill_ms"] / h["prefill_ms"]
        add("prefill speed >= 2x llama.cpp's (ratio of speeds)", r, r >= 2)
    if "hcache" in dec and "llama.cpp" in dec:
        a, b = dec["hcache"], dec["llama.cpp"]
        r = a["tbt_b1_ms"] / b["tbt_b1_ms"]
        add("batch-1 TBT <= 1.0x llama.cpp's", r, r <= 1.0)
        big = max(peers["args"]["batches"])
        r = a.get(f"tokens_per_s_b{big}", 0) / max(1e-9, b.get(f"tokens_per_s_b{big}", 0))
        add(f"batch-{big} throughput >= 2x llama.cpp's (ratio)", r, r >= 2)
        if a.get("weights_mb"):
            r = a["weights_mb"] / a["gguf_mb"]
            add("resident weights <= 1.3x the GGUF file", r, r <= 1.3)
    resident = [h[f"turn_after_{m}_ms"] for m in ("auto", "kv", "hidden", "re") if h.get(f"turn_after_{m}_ms")]
    if resident and ll:
        turn, both = statistics.median(resident), ll["ttft_after_eviction_ms"]
        llama_turn = ll.get("turn_ms")
        out += [
            "",
            f"The same run's floor for the first target: hcache's turn with the context already resident "
            f"(a turn after each of the {len(resident)} restores above, so no read or placing overlaps it; "
            f"median) took {_fmt(turn)} ms = {turn / both:.2f}x of llama.cpp's load + turn"
            + (f" ({turn / llama_turn:.2f}x of llama.cpp's turn alone)" if llama_turn else "")
            + ". A restore, however fast, only adds to it.",
        ]
    return out


def _quality(peers: dict) -> list[str]:
    q = peers.get("quality")
    if not q:
        return []
    modes = [k for k in q if k.startswith("hcache ")]
    float_ppl = q.get("hcache float")
    out = [
        "### Perplexity",
        "",
        f"Over the {q['tokens']} tokens of `{q['text']}` (the text the tests ship), the same token ids for every "
        f"system; hcache in {peers['args']['dtype']}. Target: the serving mode within 1% of the float oracle.",
        "",
        "Max logit error: the largest |logit - the float oracle's| over that text (logits span about 60). "
        "Demo chat: greedy tokens of `hcache demo`'s 3-turn chat that differ from the oracle's, position by "
        "position, of all its replies' tokens.",
        "",
        "| system | perplexity | vs hcache float | max logit error | demo chat tokens differing |",
        "|---|---:|---:|---:|---:|",
    ]
    for k in [*modes, "llama.cpp"]:
        ratio = q[k] / float_ppl if float_ppl else None
        err = q.get("max_logit_err", {}).get(k)
        chat = q.get("demo_chat", {}).get(k)
        diff = f"{sum(t['differ'] for t in chat)} of {sum(t['tokens'] for t in chat)}" if chat else "-"
        out.append(f"| {k} | {q[k]:.3f} | {_fmt(ratio, 4)} | {_fmt(err, 2)} | {diff} |")
    return [*out, ""]


def _attention(peers: dict) -> list[str]:
    a = peers.get("attention")
    if not a:
        return []
    contexts = sorted({int(k.rsplit("_", 1)[1]) for k in a if k.startswith("attn_ms_")})
    out = [
        "### Attention of a 32-token turn over a long context",
        "",
        "One layer's attention (`model/attention.causal_attention`, query heads grouped over their KV head, no "
        "T x S mask: the flash kernel on the prefix and on the causal block, merged by log-sum-exp; for a bfloat16 "
        "cache on a CPU with AVX512-BF16 and no AMX, one pass of our kernel, `kernels/attention_bf16.cpp`, over "
        "both), as GFLOP/s of 4 T S H D, against `torch.mm` on 2048-square matrices in the same dtype, same run.",
        "",
        "| dtype | mm GFLOP/s | " + " | ".join(f"{s} tokens: ms / GFLOP/s / of mm" for s in contexts) + " |",
        "|---|---:|" + "---:|" * len(contexts),
    ]
    for dt in ("float32", "bfloat16"):
        peak = a[f"mm_gflops_{dt}"]
        cells = [
            f"{a[f'attn_ms_{dt}_{s}']:.2f} / {a[f'attn_gflops_{dt}_{s}']:.0f} / {a[f'attn_gflops_{dt}_{s}'] / peak:.0%}"
            for s in contexts
        ]
        out.append(f"| {dt} | {peak:.0f} | " + " | ".join(cells) + " |")
    return [*out, ""]


def _attention_kernels(peers: dict) -> list[str]:
    a, rates = peers.get("attention_kernels"), peers.get("attention", {})
    if not a:
        return []
    peak = rates.get("mm_gflops_bfloat16")
    out = [
        f"The same layer at {a['context']} tokens (bfloat16 cache, {a['turn']}-token turn) through every fused "
        "attention torch offers on this CPU, next to ours (`hcache`: our AVX512-BF16 kernel where the CPU has "
        "AVX512-BF16 and no AMX) and the library path it replaced; the error is the largest "
        "|output - float64 reference| over the largest |output|.",
        "",
        "| kernel | ms | GFLOP/s | of bf16 mm | max relative error |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in a.items():
        if not isinstance(r, dict):
            continue
        if "error" in r:
            out.append(f"| {name} | failed: {r['error']} | | | |")
            continue
        share = f"{r['gflops'] / peak:.0%}" if peak else "-"
        out.append(f"| {name} | {r['ms']:.2f} | {r['gflops']:.0f} | {share} | {r['max_rel_err']:.1e} |")
    return [*out, ""]


def render(results: Path, bench_dir: Path) -> str:
    peers = _load(results, "peers")
    lines = ["# hcache benchmark results", "", "Generated by `bench/results.py` from `bench/results/*.json`.", ""]
    if peers:
        m, hc = peers["machine"], peers["decode"].get("hcache", {})
        lines += [
            "## Machine and versions",
            "",
            f"{m['cpu']}, {m['cores']} cores, {m['memory_gb']:.0f} GB; Python {m['python']}, torch {m['torch']}, "
            f"llama-cpp-python {m['llama-cpp-python']}, transformers {m['transformers']}; run {m['date']}. "
            f"hcache ran in {peers['args']['dtype']} with {hc.get('weights', peers['args'].get('weights'))} weights "
            f"and a {hc.get('kv_dtype', peers['args'].get('kv_dtype'))} KV cache on "
            f"{peers['args']['threads']} threads, its decode step compiled; "
            "llama.cpp the same GGUF "
            "(Q4_1 weights, f16 KV) on the same threads; transformers in float32.",
            "",
            "Storage reads: hcache reads with O_DIRECT. llama.cpp's state file is fsync'ed and dropped from the page "
            "cache with `posix_fadvise(POSIX_FADV_DONTNEED)` before its load.",
            "",
            "## Restoring a context, and the first token of a new 32-token turn",
            "",
            "| tokens | llama.cpp recompute | transformers recompute | hcache prefill | llama.cpp save / load | "
            "llama.cpp load+turn | hcache auto / KV / H / RE restore | hcache TTFT after eviction (fused) | "
            "vs llama.cpp load+turn | vs best recompute |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        rows = peers["rows"]
        for n in sorted({r["tokens"] for r in rows}):
            h = next((r for r in rows if r["system"] == "hcache" and r["tokens"] == n), {})
            ll = next((r for r in rows if r["system"] == "llama.cpp" and r["tokens"] == n), {})
            tf = next((r for r in rows if r["system"] == "transformers" and r["tokens"] == n), {})
            ttft = h.get("ttft_after_eviction_ms")
            recomputes = [v for v in (ll.get("prefill_ms"), tf.get("prefill_ms")) if v]
            r_ll = ttft / ll["ttft_after_eviction_ms"] if ttft and ll else None
            r_re = ttft / min(recomputes) if ttft and recomputes else None
            restore = " / ".join(_fmt(h.get(f"restore_{k}_ms")) for k in ("auto", "kv", "hidden", "re"))
            lines.append(
                f"| {n} | {_fmt(ll.get('prefill_ms'))} | {_fmt(tf.get('prefill_ms'))} | {_fmt(h.get('prefill_ms'))} | "
                f"{_fmt(ll.get('save_ms'))} / {_fmt(ll.get('load_ms'))} | {_fmt(ll.get('ttft_after_eviction_ms'))} | "
                f"{restore} | {_fmt(ttft)} | {_fmt(r_ll, 2)}x | {_fmt(r_re, 3)}x |"
            )
        lines += [
            "",
            "All times in ms, from one run: the TTFT columns (llama.cpp's load and turn, hcache's fused "
            "restore and turn) are medians of three evictions each, the rest single measurements. "
            "hcache's auto plans: "
            + ", ".join(f"{r['tokens']}: `{r.get('auto_plan', '')}`" for r in rows if r["system"] == "hcache")
            + ".",
            "",
        ]
        dec = peers["decode"]
        lines += [
            "## Decode",
            "",
            "Both systems prefill every prompt first and then time decode steps of the whole batch "
            "(llama.cpp: the median step; hcache: the median gap between tokens over the middle half "
            "of each sequence's turn). Batch-1 TBT and the TTFT columns above are medians of rounds "
            "in which the two systems take turns (llama.cpp in a process of its own): this VM's "
            "speed drifts by up to 15% over minutes.",
            "",
            "| | batch 1 TBT (ms) | "
            + " | ".join(f"batch {b} tokens/s" for b in peers["args"]["batches"] if b > 1)
            + " |",
            "|---|---:|" + "---:|" * sum(1 for b in peers["args"]["batches"] if b > 1),
        ]
        for system, d in sorted(dec.items()):
            lines.append(
                f"| {system} | {_fmt(d.get('tbt_b1_ms'), 1)} | "
                + " | ".join(_fmt(d.get(f"tokens_per_s_b{b}"), 1) for b in peers["args"]["batches"] if b > 1)
                + " |"
            )
        if "hcache" in dec and "llama.cpp" in dec:
            a, b = dec["hcache"], dec["llama.cpp"]
            big = max(x for x in peers["args"]["batches"])
            lines += [
                "",
                f"hcache / llama.cpp: batch-1 TBT {a['tbt_b1_ms'] / b['tbt_b1_ms']:.2f}x; batch-{big} "
                f"throughput {a.get(f'tokens_per_s_b{big}', 0) / max(1e-9, b.get(f'tokens_per_s_b{big}', 0)):.2f}x.",
            ]
            if a.get("tbt_b1_rounds_ms") and b.get("tbt_b1_rounds_ms"):
                pairs = zip(a["tbt_b1_rounds_ms"], b["tbt_b1_rounds_ms"], strict=False)
                lines[-1] += (
                    " Batch-1 rounds (hcache / llama.cpp, ms): "
                    + ", ".join(f"{x:.2f} / {y:.2f}" for x, y in pairs)
                    + "."
                )
            if a.get("weights_mb"):
                lines += [
                    "",
                    f"hcache: host (Python) time around the compiled decode graph {_fmt(a.get('host_ms_b1'), 2)} ms "
                    f"per batch-1 step; resident weights {a['weights_mb']:.1f} MB for a {a['gguf_mb']:.1f} MB GGUF; "
                    f"peak RSS before llama.cpp loaded {a['peak_rss_mb']:.0f} MB.",
                ]
        if saver_off := dec.get("hcache", {}).get("tbt_b1_saver_off_ms"):
            lines += [
                "",
                f"hcache batch-1 TBT with the two-stage saver on (sessions store what the planner chose) "
                f"{_fmt(dec['hcache']['tbt_b1_ms'], 2)} ms, off (`--store-kinds none`) {_fmt(saver_off, 2)} ms: "
                f"{(dec['hcache']['tbt_b1_ms'] / saver_off - 1):+.1%}.",
            ]
        lines += ["", *_targets(peers), "", *_quality(peers), *_attention(peers), *_attention_kernels(peers)]
        for name in peers_plots(peers, bench_dir):
            lines += [f"![{name}]({name})", ""]
    lines += gpu_section(results)
    eng = _load(results, "engine")
    if eng is not None:
        lines += engine_section(eng)
    for name, title in (
        ("serve", "Serving trace"),
        ("storage", "Storage"),
        ("restore", "Restore methods"),
    ):
        if (results / f"{name}.json").exists():
            lines += [f"## {title}", "", f"Raw results: `bench/results/{name}.json`.", ""]
    cap = _load(results, "serve_capacity")
    if cap is not None:
        lines += _capacity(cap)
    api = _load(results, "serve_openai")
    if api is not None:
        lines += _openai(api)
    cluster = _load(results, "cluster")
    if cluster is not None:
        lines += _cluster(cluster)
    lines += ["## Commands", "", "```", COMMANDS.rstrip(), "```", ""]
    return "\n".join(lines)


def _capacity(data: dict) -> list[str]:
    """The serving trace on an unlimited store and on one a fraction of its state."""
    rows = data["rows"]
    base = rows[0]
    out = [
        "## Serving trace under a store quota",
        "",
        f"`{data.get('command', 'hcache bench serve')}` on {data.get('cpu', 'an unnamed CPU')}: the trace once on an "
        "unlimited store, then on a store whose capacity is the fraction shown of what the first run stored. "
        "TTFT is client-side, medians and p99 of every turn; restores by kind count restored turns that read "
        "stored chunks (local) or recomputed every layer (RE). Ratios are against the first row, same run.",
        "",
        "| run | store capacity | turns | errors | TTFT p50 ms | TTFT p99 ms | p50 ratio | restores local | "
        "restores RE | released MB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cap = f"{r['store_max_bytes'] / 1e6:.0f} MB" if r.get("store_max_bytes") else "unlimited"
        out.append(
            f"| {r['method']} | {cap} | {r['turns']} | {len(r['errors'])} | {_fmt(r['ttft_p50_ms'])} | "
            f"{_fmt(r['ttft_p99_ms'])} | {r['ttft_p50_ms'] / base['ttft_p50_ms']:.2f} | {r['restored_local']} | "
            f"{r['restored_recompute']} | {_fmt(r.get('bytes_released', 0) / 1e6, 1)} |"
        )
    return [*out, "", "Raw results: `bench/results/serve_capacity.json`.", ""]


def _cluster(data: dict) -> list[str]:
    """Two replicas on a Redis Cluster: the trace by routing, and one long session's restore."""
    a = data["args"]
    out = [
        "## Two replicas on a Redis Cluster",
        "",
        f"`hcache bench cluster` on {data.get('cpu', 'an unnamed CPU')}: two replicas and a 3-master Redis Cluster "
        f"on loopback, {a['dtype']}, all on the same cores.",
    ]
    if data.get("phases"):
        out += [
            "",
            f"A Poisson trace of {a['sessions']} multi-turn sessions, routed by rendezvous affinity, then at random "
            "(fresh replicas each). TTFT is client-side over every turn; restores by where the state came from.",
            "",
            "| routing | turns | errors | TTFT p50 ms | TTFT p99 ms | p50 / affinity | restores local | cluster "
            "| recompute | chunk MB fetched | chunk MB uploaded |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        base = data["phases"][0]["ttft_p50_ms"]
        for p in data["phases"]:
            out.append(
                f"| {p['routing']} | {p['turns']} | {len(p['errors'])} | {_fmt(p['ttft_p50_ms'])} | "
                f"{_fmt(p['ttft_p99_ms'])} | {p['ttft_p50_ms'] / base:.2f} | {p['restores_local']:.0f} | "
                f"{p['restores_cluster']:.0f} | {p['restores_recompute']:.0f} | "
                f"{_fmt(p['chunk_bytes_fetched'] / 1e6)} | {_fmt(p['chunk_bytes_uploaded'] / 1e6)} |"
            )
    long = data.get("long_session")
    if long and "cluster_vs_local" in long:
        out += [
            "",
            f"One session of {long['tokens']:,} tokens made on replica a, then a one-token turn after eviction: "
            "restored from a's own disks (local), on another replica from the cluster's chunks (cluster), on a "
            f"fresh replica without them (recompute); {a['long_repeat']} turns each, medians. A cluster replica "
            "is fresh but has continued another long session first, as a serving replica has; that first turn "
            "is `cold` (its fetch meets fresh memory). Targets: cluster <= 2x local and <= 0.1x recompute.",
            "",
            "| path | TTFT ms | each turn ms | server restore ms | vs local | vs recompute |",
            "|---|---|---|---|---|---|",
        ]
        for k in ("local", "cluster", "cold", "recompute"):
            r = long.get(k)
            if r is None:
                continue
            out.append(
                f"| {k} | {_fmt(r['ttft_ms'])} | {', '.join(_fmt(x) for x in r['ttft_runs_ms'])} | "
                f"{_fmt(r['restore_ms'])} | {r['ttft_ms'] / long['local']['ttft_ms']:.2f} | "
                f"{r['ttft_ms'] / long['recompute']['ttft_ms']:.3f} |"
            )
    return [*out, "", "Raw results: `bench/results/cluster.json`.", ""]


def _runs(data: dict) -> str:
    n = data["args"].get("repeat", 1)
    return "one run each" if n == 1 else f"{n} runs each, interleaved, every turn pooled"


def _openai(data: dict) -> list[str]:
    """The serving trace over gRPC and over OpenAI's chat completions, full histories resent."""
    out = [
        "## Serving trace over gRPC and the OpenAI API",
        "",
        f"`hcache bench serve --api openai` on {data.get('cpu', 'an unnamed CPU')}: the trace over gRPC, then "
        "through openai-python (streamed, each turn resending the whole conversation: `openai` as a stock client does, "
        "the server finding the stored conversation it extends; `openai-pinned` naming the session), each "
        f"on a fresh server, {_runs(data)}. TTFT is client-side, medians and p99 of every turn; cached is "
        "cached_tokens over prompt_tokens after each session's first turn; client CPU is the benchmark's own "
        "CPU time (the clients, on the server's cores) over the run's wall time. Targets: OpenAI TTFT p50 "
        "within 1.2x of gRPC; cached >= 90%.",
        "",
        "| method | API | turns | errors | TTFT p50 ms | TTFT p99 ms | TBT p50 ms | TTFT p50 / gRPC | cached "
        "| TTFT p50 of each run ms | client CPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        cached = "-" if r.get("cached_ratio") is None else f"{r['cached_ratio']:.1%}"
        each = ", ".join(_fmt(x) for x in r.get("ttft_p50_runs_ms", [r["ttft_p50_ms"]]))
        out.append(
            f"| {r['method']} | {r['api']} | {r['turns']} | {len(r['errors'])} | {_fmt(r['ttft_p50_ms'])} | "
            f"{_fmt(r['ttft_p99_ms'])} | {_fmt(r['tbt_p50_ms'])} | {r['ttft_p50_vs_grpc']:.2f} | {cached} | {each} | "
            f"{r.get('client_cpu_share', 0):.0%} |"
        )
    return [*out, "", "Raw results: `bench/results/serve_openai.json`.", ""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/results.py", description=__doc__)
    ap.add_argument("--results", default="bench/results")
    ap.add_argument("--out", default="bench/RESULTS.md")
    args = ap.parse_args(argv)
    out = Path(args.out)
    text = render(Path(args.results), out.parent)
    out.write_text(text)
    print(f"wrote {out}")
    return 0
