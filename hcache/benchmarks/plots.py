"""Plots of the benchmarks: RESULTS.md's of the peers benchmark, the serving trace's (matplotlib)."""

from __future__ import annotations

from pathlib import Path


def peers_plots(peers: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = peers["rows"]
    hc = sorted((r for r in rows if r["system"] == "hcache"), key=lambda r: r["tokens"])
    ll = sorted((r for r in rows if r["system"] == "llama.cpp"), key=lambda r: r["tokens"])
    tf = sorted((r for r in rows if r["system"] == "transformers"), key=lambda r: r["tokens"])
    names = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label in (
        ("restore_auto_ms", "hcache auto"),
        ("restore_kv_ms", "hcache KV"),
        ("restore_hidden_ms", "hcache H"),
        ("restore_re_ms", "hcache RE"),
    ):
        ax.plot([r["tokens"] for r in hc], [r[key] for r in hc], "o-", label=label)
    ax.plot([r["tokens"] for r in ll], [r["load_ms"] for r in ll], "s--", label="llama.cpp state load")
    ax.plot([r["tokens"] for r in ll], [r["prefill_ms"] for r in ll], "s:", label="llama.cpp recompute")
    ax.plot([r["tokens"] for r in tf], [r["prefill_ms"] for r in tf], "^:", label="transformers recompute")
    ax.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="ms", title="Bringing a context back")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "restore_vs_context.png", dpi=110)
    names.append("restore_vs_context.png")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot([r["tokens"] for r in hc], [r["ttft_after_eviction_ms"] for r in hc], "o-", label="hcache (fused)")
    ax.plot([r["tokens"] for r in ll], [r["ttft_after_eviction_ms"] for r in ll], "s--", label="llama.cpp load+turn")
    ax.plot([r["tokens"] for r in ll], [r["prefill_ms"] for r in ll], "s:", label="llama.cpp recompute")
    ax.set(
        xscale="log", yscale="log", xlabel="context tokens", ylabel="ms", title="TTFT of a 32-token turn after eviction"
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "ttft_after_eviction.png", dpi=110)
    names.append("ttft_after_eviction.png")

    dec = peers["decode"]
    keys = sorted(
        {k for v in dec.values() for k in v if k.startswith("tokens_per_s")}, key=lambda k: int(k.rsplit("b", 1)[1])
    )
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(dec)
    for i, (system, d) in enumerate(sorted(dec.items())):
        vals = [1e3 / d["tbt_b1_ms"]] + [d.get(k, 0) for k in keys]
        ax.bar([x + i * width for x in range(len(vals))], vals, width, label=system)
    ax.set_xticks(
        [x + width * (len(dec) - 1) / 2 for x in range(len(keys) + 1)],
        ["batch 1"] + [k.replace("tokens_per_s_b", "batch ") for k in keys],
    )
    ax.set(ylabel="tokens/s (all sequences)", title="Decode")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "decode.png", dpi=110)
    names.append("decode.png")
    return names


def serve_cdfs(rows: list[dict], path: Path) -> None:
    """The serving trace's TTFT and TBT distributions, a line per restore method (and API)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for row in rows:
        for ax, key in zip(axes, ("ttft_ms", "tbt_ms"), strict=True):
            xs = sorted(row[key])
            if xs:
                api = row.get("api", "grpc")
                label = row["method"] if api == "grpc" else f"{row['method']} ({api})"
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
    for ax, title in zip(axes, ("TTFT", "time between tokens"), strict=True):
        ax.set_xscale("log")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of turns" if title == "TTFT" else "fraction of tokens")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
