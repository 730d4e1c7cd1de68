"""Side measurements of the peers benchmark: each weight mode's perplexity on the text the
tests ship, next to llama.cpp's on the same tokens, and the rate of a short turn's
attention over a long context against this CPU's matmul peak."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hcache import omp
from hcache.model.attention import causal_attention
from hcache.model.loader import load
from hcache.model.quality import perplexity
from hcache.model.quant import WEIGHT_MODES
from hcache.restore.profiler import median_ms

TEXT = Path(__file__).resolve().parents[2] / "tests" / "data" / "perplexity.txt"


def perplexities(dtype: str, llama: Callable[[int], Any]) -> dict[str, Any]:
    """Perplexity of every hcache weight mode (in `dtype`) and of llama.cpp (`llama(n_ctx)`
    gives a loaded llama_cpp.Llama) over the same token ids of the shipped text."""
    lm = load("default", dtype)
    ids = lm.tokenizer.encode(TEXT.read_text())
    out: dict[str, Any] = {"text": str(TEXT.relative_to(TEXT.parents[2])), "tokens": len(ids)}
    for mode in WEIGHT_MODES:
        model = lm.model if mode == "float" else load("default", dtype, weights=mode).model
        out[f"hcache {mode}"] = omp.on_worker(lambda m=model: perplexity(m, ids))
        if dtype == "float32":  # and over a bfloat16 KV cache (`--kv-dtype bfloat16`)
            out[f"hcache {mode}, bfloat16 KV"] = omp.on_worker(lambda m=model: perplexity(m, ids, torch.bfloat16))
    out["llama.cpp"] = _llama_perplexity(llama(len(ids) + 16), ids)
    return out


def _llama_perplexity(llm: Any, ids: list[int]) -> float:
    llm.reset()
    llm.eval(ids)
    logits = np.asarray(llm.scores[: len(ids)], dtype=np.float64)
    logits -= logits.max(axis=1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    nll = -logp[np.arange(len(ids) - 1), ids[1:]].mean()
    return float(np.exp(nll))


def attention_rates(heads: int, kv_heads: int, head_dim: int, contexts: list[int], turn: int) -> dict[str, Any]:
    """One layer's attention for a `turn`-token block after `S - turn` cached tokens (what a
    short turn over a long context runs per layer), in float32 and bfloat16, as GFLOP/s
    (4 T S H D: scores and values), against `torch.mm`'s rate on 2048-square matrices."""

    def run() -> dict[str, Any]:
        out: dict[str, Any] = {}
        g = torch.Generator().manual_seed(0)
        for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            a, b = (torch.randn(2048, 2048, generator=g).to(dt) for _ in range(2))
            ms = median_ms(lambda a=a, b=b: torch.mm(a, b), 10)
            out[f"mm_gflops_{name}"] = 2 * 2048**3 / ms / 1e6
            for s in contexts:
                q = torch.randn(turn, heads, head_dim, generator=g).to(dt)
                k, v = (torch.randn(s, kv_heads, head_dim, generator=g).to(dt) for _ in range(2))
                ms = median_ms(lambda q=q, k=k, v=v: causal_attention(q, k, v), 20)
                out[f"attn_ms_{name}_{s}"] = ms
                out[f"attn_gflops_{name}_{s}"] = 4 * turn * s * heads * head_dim / ms / 1e6
        return out

    return omp.on_worker(run)
