"""Side measurements of the peers benchmark: each weight mode's perplexity on the text the
tests ship, next to llama.cpp's on the same tokens, and the rate of a short turn's
attention over a long context against this CPU's matmul peak."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from hcache import demo, omp
from hcache.engine.generate import ChatSession
from hcache.engine.sampler import SamplingParams
from hcache.model.attention import _matmul_attention, causal_attention, widened_attention
from hcache.model.base import DecoderModel
from hcache.model.loader import load
from hcache.model.quality import logits_of, perplexity_of
from hcache.model.quant import WEIGHT_MODES
from hcache.model.tokenizer import Tokenizer
from hcache.restore.profiler import median_ms

DEMO_TOKENS = 64  # `hcache demo`'s default
TEXT = Path(__file__).resolve().parents[2] / "tests" / "data" / "perplexity.txt"


def perplexities(dtype: str, llama: Callable[[int], Any], model: str = "default") -> dict[str, Any]:
    """Every hcache weight mode (in `dtype`, and over a bfloat16 KV cache too in float32)
    against the float oracle, keyed "hcache MODE[, bfloat16 KV]": perplexity over the shipped
    text's token ids (llama.cpp's too: `llama(n_ctx)` gives a loaded llama_cpp.Llama); under
    "max_logit_err", the largest |logit - oracle's| over that text; under "demo_chat", how the
    greedy replies of `hcache demo`'s 3-turn chat differ from the oracle's."""
    lm = load(model, dtype)
    ids = lm.tokenizer.encode(TEXT.read_text())
    out: dict[str, Any] = {"text": str(TEXT.relative_to(TEXT.parents[2])), "tokens": len(ids)}
    out["max_logit_err"], out["demo_chat"] = {}, {}
    oracle = omp.on_worker(lambda: logits_of(lm.model, ids))
    replies = omp.on_worker(lambda: _demo_replies(lm.model, lm.tokenizer, None))
    for mode in WEIGHT_MODES:
        served = lm.model if mode == "float" else load(model, dtype, weights=mode).model
        for kv in (None, torch.bfloat16) if dtype == "float32" else (None,):  # `--kv-dtype bfloat16`
            name = f"hcache {mode}" + (", bfloat16 KV" if kv else "")
            logits = omp.on_worker(lambda m=served, kv=kv: logits_of(m, ids, kv))
            out[name] = perplexity_of(logits, ids)
            out["max_logit_err"][name] = (logits - oracle).abs().max().item()
            got = omp.on_worker(lambda m=served, kv=kv: _demo_replies(m, lm.tokenizer, kv))
            out["demo_chat"][name] = _token_diff(replies, got)
    out["llama.cpp"] = _llama_perplexity(llama(len(ids) + 16), ids)
    return out


def _demo_replies(model: DecoderModel, tok: Tokenizer, kv_dtype: torch.dtype | None) -> list[list[int]]:
    chat = ChatSession(model, tok, demo.SYSTEM, kv_dtype=kv_dtype)
    return [chat.reply(m, SamplingParams(max_new_tokens=DEMO_TOKENS))[1] for m in demo.TURNS]


def _token_diff(want: list[list[int]], got: list[list[int]]) -> list[dict[str, int]]:
    """Per turn: the oracle reply's greedy tokens, how many of `got`'s differ position by
    position (a missing or extra token counts), and the first that does (-1: none)."""
    rows = []
    for w, g in zip(want, got, strict=True):
        pairs = list(zip(w, g, strict=False))
        differ = sum(a != b for a, b in pairs) + abs(len(w) - len(g))
        first = next((i for i, (a, b) in enumerate(pairs) if a != b), len(pairs) if len(w) != len(g) else -1)
        rows.append({"tokens": len(w), "differ": differ, "first_difference": first})
    return rows


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


def attention_kernels(heads: int, kv_heads: int, head_dim: int, context: int, turn: int) -> dict[str, Any]:
    """The same layer's attention (bfloat16 cache, `turn` new tokens after `context - turn`
    cached ones) through every fused attention that torch offers on this CPU, next to ours:
    ms, GFLOP/s, and the largest error against a float64 reference over the largest |output|.
    Ours is our kernel where the CPU has AVX-512 (its AVX512-BF16 or its AVX-512F form); its
    library paths too: oneDNN matmuls (AVX512-BF16) and float32 flash over widened K/V (others)."""

    def run() -> dict[str, Any]:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(turn, heads, head_dim, generator=g).mul_(2).bfloat16()
        k, v = (torch.randn(context, kv_heads, head_dim, generator=g).mul_(2).bfloat16() for _ in range(2))
        prefix, scale = context - turn, head_dim**-0.5
        seen = torch.ones(turn, context, dtype=torch.bool).tril(diagonal=prefix)  # [T, S]
        qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, heads, len, D]: views
        group = heads // kv_heads
        s = (qh.double() @ kh.double().repeat_interleave(group, 1).transpose(-1, -2)) * scale
        ref = s.masked_fill(~seen, float("-inf")).softmax(-1) @ vh.double().repeat_interleave(group, 1)
        ref = ref.squeeze(0).transpose(0, 1).reshape(turn, -1)
        flops = 4 * turn * context * heads * head_dim
        out: dict[str, Any] = {"context": context, "turn": turn}

        def measure(name: str, make: Callable[[], Callable[[], torch.Tensor]]) -> None:
            try:
                fn = make()
                got = fn().float().reshape(turn, -1)
                ms = median_ms(fn, 20)
            except Exception as e:  # a kernel this torch lacks here is a finding, not a crash
                out[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                return
            err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
            out[name] = {"ms": ms, "gflops": flops / ms / 1e6, "max_rel_err": err}

        def sdpa() -> torch.Tensor:
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=seen, scale=scale, enable_gqa=True)
            return o.squeeze(0).transpose(0, 1)

        measure("hcache", lambda: lambda: causal_attention(q, k, v, scale))
        measure("hcache on oneDNN matmuls", lambda: lambda: _matmul_attention(q, k, v, prefix, scale))
        measure("hcache on float32 flash, K/V widened", lambda: lambda: widened_attention(q, k, v, prefix, scale))
        measure("torch sdpa", lambda: sdpa)
        measure("flex_attention", lambda: _flex(qh, kh, vh, prefix, scale))
        measure("onednn graph", lambda: _onednn_graph(qh, kh, vh, seen, scale, group))
        return out

    return omp.on_worker(run)


def _flex(
    qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, prefix: int, scale: float
) -> Callable[[], torch.Tensor]:
    """inductor's CPU flex-attention template, compiled for these shapes."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    t, s = qh.shape[2], kh.shape[2]
    mask = create_block_mask(lambda b, h, i, j: j <= i + prefix, None, None, t, s, device="cpu")
    fn = torch.compile(flex_attention, dynamic=False)
    return lambda: fn(qh, kh, vh, block_mask=mask, scale=scale, enable_gqa=True).squeeze(0).transpose(0, 1)


def _onednn_graph(
    qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, seen: torch.Tensor, scale: float, group: int
) -> Callable[[], torch.Tensor]:
    """oneDNN Graph's fused partition (matmul, scale, mask, softmax, matmul), reached through
    TorchScript's oneDNN fusion: query heads grouped as rows of their KV head, the mask
    additive. Its intermediates keep the pattern's dtype: bfloat16 scores. K and V are copied
    head-major first: with the cache's strided views the fused partition returns wrong values
    (torch 2.13, oneDNN 3.12)."""
    t, kvh = qh.shape[2], kh.shape[1]
    rows = qh.squeeze(0).view(kvh, group, t, -1).reshape(1, kvh, group * t, -1)
    add = torch.zeros(seen.shape).masked_fill_(~seen, float("-inf")).repeat(group, 1).bfloat16()[None, None]

    def pattern(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.softmax(q @ k.transpose(-1, -2) * scale + mask, dim=-1) @ v

    with _onednn_fusion():
        fn = torch.jit.trace(pattern, (rows, kh.contiguous(), vh.contiguous(), add))
        for _ in range(3):  # the profiling executor fuses from the third call on
            fn(rows, kh.contiguous(), vh.contiguous(), add)
        if "oneDNNFusionGroup" not in str(torch.jit.last_executed_optimized_graph()):
            raise RuntimeError("TorchScript did not fuse the pattern")

    def call() -> torch.Tensor:
        with _onednn_fusion():
            o = fn(rows, kh.contiguous(), vh.contiguous(), add)
        return o.squeeze(0).view(kvh, group, t, -1).permute(2, 0, 1, 3).reshape(t, -1)

    return call


@contextmanager
def _onednn_fusion() -> Iterator[None]:
    """TorchScript's oneDNN fusion on (without autograd) for the calls inside, as it was after."""
    was = torch._C._jit_llga_enabled()
    torch.jit.enable_onednn_fusion(True)
    try:
        with torch.no_grad():
            yield
    finally:
        torch.jit.enable_onednn_fusion(was)


def stream_read_gbps(device: str = "cpu", mb: int = 512, repeats: int = 9) -> float:
    """The device's streaming read rate, GB/s: a float32 sum over `mb` MB (on a CPU, on the
    bench's threads), median of `repeats` after one to fault the pages in. Decode's bound.
    On a GPU the buffer is 8x larger, to stay well past its L2 cache."""
    if torch.device(device).type != "cpu":
        mb *= 8
    x = torch.ones(mb * 2**20 // 4, device=device)
    return x.numel() * 4 / median_ms(x.sum, repeats) / 1e6
