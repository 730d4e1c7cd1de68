"""RESULTS.md's peers sections, from `bench/results/peers.json`: hcache against llama.cpp
and transformers on the default model in one run, and the issue's targets."""

from __future__ import annotations

import statistics
from pathlib import Path

from hcache.benchmarks.plots import peers_plots

REAL_MODEL_CONTEXT = 4096  # the context the real-model goals are set at


def fmt(v: float | None, nd: int = 0) -> str:
    return "-" if v is None else f"{v:,.{nd}f}"


def _targets(peers: dict, prefill_goal: float = 2.0, n: int | None = None) -> list[str]:
    """The targets at context `n` (default: the largest), each with its measured ratio
    (prefill: the default model's goal, or `prefill_goal` for the other models'); the decode
    ones only at the largest context."""
    rows, dec = peers["rows"], peers["decode"]
    largest = max(r["tokens"] for r in rows)
    n = n or largest

    def at(system: str) -> dict:
        return next((r for r in rows if r["system"] == system and r["tokens"] == n), {})

    h, ll, tf = at("hcache"), at("llama.cpp"), at("transformers")
    out = [f"### Targets at {n} tokens", "", "| target | measured | met |", "|---|---:|:---:|"]

    def add(name: str, value: float | None, ok: bool | None) -> None:
        out.append(f"| {name} | {fmt(value, 3)} | {'-' if ok is None else ('yes' if ok else 'no')} |")

    if h and ll:
        r = h["ttft_after_eviction_ms"] / ll["ttft_after_eviction_ms"]
        add("TTFT after eviction <= 0.4x llama.cpp load + turn", r, r <= 0.4)
        rec = min(v for v in (ll.get("prefill_ms"), tf.get("prefill_ms")) if v)
        r = h["ttft_after_eviction_ms"] / rec
        add("TTFT after eviction <= 0.1x the faster peer recompute", r, r <= 0.1)
        r = ll["prefill_ms"] / h["prefill_ms"]
        add(f"prefill speed >= {prefill_goal:g}x llama.cpp's (ratio of speeds)", r, r >= prefill_goal)
    if "hcache" in dec and "llama.cpp" in dec and n == largest:
        a, b = dec["hcache"], dec["llama.cpp"]
        r = a["tbt_b1_ms"] / b["tbt_b1_ms"]
        add("batch-1 TBT <= 1.0x llama.cpp's", r, r <= 1.0)
        big = max(peers["args"]["batches"])
        r = a.get(f"tokens_per_s_b{big}", 0) / max(1e-9, b.get(f"tokens_per_s_b{big}", 0))
        add(f"batch-{big} throughput >= 2x llama.cpp's (ratio)", r, r >= 2)
        if a.get("weights_mb"):
            r = a["weights_mb"] / a["gguf_mb"]
            add("resident weights <= 1.3x the GGUF file", r, r <= 1.3)
        if a.get("stream_read_gbps"):
            r = _step_gbps(a) / a["stream_read_gbps"]
            add("batch-1 weight stream >= 0.7x the machine's read rate", r, r >= 0.7)
    if h.get("resident_turn_rounds_ms"):  # rounds beside the TTFT's, in the same phase of the VM
        resident = h["resident_turn_rounds_ms"]
        how = f"in {len(resident)} rounds, each beside a TTFT round"
    else:  # older runs: one turn after each restore method
        resident = [h[f"turn_after_{m}_ms"] for m in ("auto", "kv", "hidden", "re") if h.get(f"turn_after_{m}_ms")]
        how = f"a turn after each of the {len(resident)} restores above"
    if resident and ll:
        turn, both = statistics.median(resident), ll["ttft_after_eviction_ms"]
        llama_turn = ll.get("turn_ms")
        out += [
            "",
            f"The same run's floor for the first target: hcache's turn with the context already resident "
            f"({how}, so no read or placing overlaps it; median) took {fmt(turn)} ms = "
            f"{turn / both:.2f}x of llama.cpp's load + turn"
            + (f" ({turn / llama_turn:.2f}x of llama.cpp's turn alone)" if llama_turn else "")
            + f"; the fused TTFT is {h['ttft_after_eviction_ms'] / turn:.2f}x of it. A restore, however fast, "
            "only adds to it.",
        ]
    if h.get("ttft_rounds_ms") and ll and ll.get("ttft_rounds_ms"):
        pairs = zip(h["ttft_rounds_ms"], ll["ttft_rounds_ms"], strict=False)
        out += ["", "TTFT rounds (hcache / llama.cpp, ms): " + ", ".join(f"{x:.0f} / {y:.0f}" for x, y in pairs) + "."]
    return out


def _step_gbps(dec: dict) -> float:
    """GB/s of weights a batch-1 decode step streamed."""
    return dec["step_weights_mb"] / dec["tbt_b1_ms"]


def _stream(a: dict) -> str:
    if not a.get("stream_read_gbps"):
        return ""
    return (
        f" A batch-1 step streams {a['step_weights_mb']:.1f} MB of weights: {_step_gbps(a):.1f} GB/s against "
        f"the machine's streaming read of {a['stream_read_gbps']:.1f} GB/s (a float32 sum, median), whose floor "
        f"is {a['step_weights_mb'] / a['stream_read_gbps']:.2f} ms a step."
    )


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
        out.append(f"| {k} | {q[k]:.3f} | {fmt(ratio, 4)} | {fmt(err, 2)} | {diff} |")
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
        "cache on a CPU with AVX-512 and no AMX, one pass of our kernel, `kernels/attention_bf16.cpp` (its "
        "AVX512-BF16 form, or without BF16 its AVX-512F form), over both), as GFLOP/s of 4 T S H D, against "
        "`torch.mm` on 2048-square matrices in the same dtype, same run.",
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
        "attention torch offers on this CPU, next to ours (`hcache`: our kernel where the CPU has AVX-512 and no "
        "AMX, in its AVX512-BF16 form or, without BF16, its AVX-512F form) and the library paths it replaced "
        "(oneDNN matmuls with AVX512-BF16, float32 flash over widened K/V without); the error is the largest "
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


def _eviction_rounds(rows: list[dict]) -> str:
    """How many evictions each TTFT median took (older runs kept no rounds: three)."""
    counts = {len(r["ttft_rounds_ms"]) for r in rows if r.get("ttft_rounds_ms")}
    return "/".join(str(c) for c in sorted(counts)) or "three"


def _machine_line(peers: dict) -> str:
    m = peers["machine"]
    kind = f"CPU kind {m.get('cpu_kind', 'not recorded')}" + "".join(f", {k}={v}" for k, v in m.get("caps", {}).items())
    ident = "; ".join(x for x in (m.get("cpu_family"), kind) if x)
    return (
        f"{m['cpu']} ({ident}), {m['cores']} cores, {m['memory_gb']:.0f} GB; Python {m['python']}, torch {m['torch']}, "
        f"llama-cpp-python {m['llama-cpp-python']}, transformers {m['transformers']}; run {m['date']}."
    )


def kind_section(peers: dict, name: str, model: str | None = None) -> list[str]:
    """A peers run on another CPU kind (`bench/results/peers-<kind>.json`) or of another model
    (`peers_<model>.json`, with its perplexities): its machine, the TTFT and prefill row,
    decode, and the targets."""
    rows, dec = peers["rows"], peers["decode"]
    n = max(r["tokens"] for r in rows)
    h = next((r for r in rows if r["system"] == "hcache" and r["tokens"] == n), {})
    ll = next((r for r in rows if r["system"] == "llama.cpp" and r["tokens"] == n), {})
    a, b = dec.get("hcache", {}), dec.get("llama.cpp", {})
    big = max(peers["args"]["batches"])
    kind = peers["machine"].get("cpu_kind", name)
    title = f"Model {model} on CPU kind {kind}" if model else f"CPU kind {kind}"
    return [
        f"## {title} (`bench/results/{name}.json`)",
        "",
        _machine_line(peers),
        "",
        *(
            [
                "Emulated on the machine above: torch, inductor, oneDNN and MKL capped by the variables named, "
                "hcache's probe with them, and llama.cpp built for "
                f"`{peers['machine'].get('llama_cpp_system', 'what its build was given')}`.",
                "",
            ]
            if peers["machine"].get("caps")
            else []
        ),
        f"| {n} tokens | hcache | llama.cpp (same GGUF) |",
        "|---|---:|---:|",
        f"| prefill (ms) | {fmt(h.get('prefill_ms'))} | {fmt(ll.get('prefill_ms'))} |",
        f"| KV restore / state load (ms) | {fmt(h.get('restore_kv_ms'))} | {fmt(ll.get('load_ms'))} |",
        f"| 32-token turn after it (ms) | {fmt(h.get('turn_after_kv_ms'))} | {fmt(ll.get('turn_ms'))} |",
        f"| TTFT after eviction (ms) | {fmt(h.get('ttft_after_eviction_ms'))} "
        f"| {fmt(ll.get('ttft_after_eviction_ms'))} |",
        f"| batch-1 TBT (ms) | {fmt(a.get('tbt_b1_ms'), 2)} | {fmt(b.get('tbt_b1_ms'), 2)} |",
        f"| batch-{big} tokens/s | {fmt(a.get(f'tokens_per_s_b{big}'))} | {fmt(b.get(f'tokens_per_s_b{big}'))} |",
        *(["", _stream(a).strip()] if _stream(a) else []),
        "",
        *_targets(peers, 1.5 if model else 2.0),
        "",
        *(_quality(peers) if model else []),
    ]


def peers_section(peers: dict, bench_dir: Path) -> list[str]:
    """The peers benchmark's sections: machine, restore and TTFT rows, decode, targets,
    quality, attention and the plots."""
    lines: list[str] = []
    hc = peers["decode"].get("hcache", {})
    lines += [
        "## Machine and versions",
        "",
        _machine_line(peers)
        + f" hcache ran in {peers['args']['dtype']} with {hc.get('weights', peers['args'].get('weights'))} weights "
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
        restore = " / ".join(fmt(h.get(f"restore_{k}_ms")) for k in ("auto", "kv", "hidden", "re"))
        lines.append(
            f"| {n} | {fmt(ll.get('prefill_ms'))} | {fmt(tf.get('prefill_ms'))} | {fmt(h.get('prefill_ms'))} | "
            f"{fmt(ll.get('save_ms'))} / {fmt(ll.get('load_ms'))} | {fmt(ll.get('ttft_after_eviction_ms'))} | "
            f"{restore} | {fmt(ttft)} | {fmt(r_ll, 2)}x | {fmt(r_re, 3)}x |"
        )
    lines += [
        "",
        "All times in ms, from one run: the TTFT columns (llama.cpp's load and turn, hcache's fused "
        f"restore and turn) are medians of {_eviction_rounds(rows)} evictions each (the rounds are listed "
        "under the targets), the rest single measurements. hcache's auto plans: "
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
        "| | batch 1 TBT (ms) | " + " | ".join(f"batch {b} tokens/s" for b in peers["args"]["batches"] if b > 1) + " |",
        "|---|---:|" + "---:|" * sum(1 for b in peers["args"]["batches"] if b > 1),
    ]
    for system, d in sorted(dec.items()):
        lines.append(
            f"| {system} | {fmt(d.get('tbt_b1_ms'), 1)} | "
            + " | ".join(fmt(d.get(f"tokens_per_s_b{b}"), 1) for b in peers["args"]["batches"] if b > 1)
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
                " Batch-1 rounds (hcache / llama.cpp, ms): " + ", ".join(f"{x:.2f} / {y:.2f}" for x, y in pairs) + "."
            )
        if a.get("weights_mb"):
            lines += [
                "",
                f"hcache: host (Python) time around the compiled decode graph {fmt(a.get('host_ms_b1'), 2)} ms "
                f"per batch-1 step; resident weights {a['weights_mb']:.1f} MB for a {a['gguf_mb']:.1f} MB GGUF; "
                f"peak RSS before llama.cpp loaded {a['peak_rss_mb']:.0f} MB.",
            ]
            lines[-1] += _stream(a)
    if saver_off := dec.get("hcache", {}).get("tbt_b1_saver_off_ms"):
        lines += [
            "",
            f"hcache batch-1 TBT with the two-stage saver on (sessions store what the planner chose) "
            f"{fmt(dec['hcache']['tbt_b1_ms'], 2)} ms, off (`--store-kinds none`) {fmt(saver_off, 2)} ms: "
            f"{(dec['hcache']['tbt_b1_ms'] / saver_off - 1):+.1%}.",
        ]
    lines += ["", *_targets(peers)]
    sizes = {r["tokens"] for r in peers["rows"]}
    if REAL_MODEL_CONTEXT in sizes and max(sizes) > REAL_MODEL_CONTEXT:
        # the goals set for real models (prefill 1.5x, TTFT 0.4x at 4K) on this one too
        lines += ["", *_targets(peers, 1.5, REAL_MODEL_CONTEXT)]
    lines += ["", *_quality(peers), *_attention(peers), *_attention_kernels(peers)]
    for name in peers_plots(peers, bench_dir):
        lines += [f"![{name}]({name})", ""]
    return lines
