"""The three restore paths and a plan that combines them, layer by layer.

- recompute: run layers 0..k-1 forward over the stored token ids;
- hidden: K, V = the layer's own norm + projection + RoPE on its stored input;
- kv: copy the stored K and V.
This is the sequential executor; the pipelined one overlaps reads with compute."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from hcache.model.attention import KVCache
from hcache.model.base import DecoderModel
from hcache.restore.plan import Method, Plan
from hcache.restore.state import StateSource, StateUnavailable


@dataclass
class RestoreReport:
    plan: Plan
    num_tokens: int
    bytes_read: int
    ms: float
    ms_by_method: dict[str, float] = field(default_factory=dict)
    fallback_layers: int = 0  # layers recomputed because their stored state was unusable


def recompute_prefix(model: DecoderModel, tokens: list[int], cache: KVCache, num_layers: int) -> None:
    """KV of layers 0..num_layers-1 by a forward over the tokens from position 0."""
    ids = torch.tensor(tokens, dtype=torch.long, device=model.device)
    model(ids, torch.arange(len(tokens), device=model.device), cache, num_layers=num_layers)


def kv_from_hidden(model: DecoderModel, layer: int, hidden: torch.Tensor, cache: KVCache) -> None:
    positions = torch.arange(hidden.shape[0], device=model.device)
    k, v = model.kv_from_hidden(layer, hidden.to(model.device, model.dtype), positions)
    cache.write(layer, k, v, start=0)


def kv_as_saved(layer: int, k: torch.Tensor, v: torch.Tensor, cache: KVCache) -> None:
    cache.write(layer, k, v, start=0)


def restore(
    model: DecoderModel, plan: Plan, source: StateSource, cache: KVCache | None = None
) -> tuple[KVCache, RestoreReport]:
    """Run `plan` against `source`. A layer whose stored state is unusable is recomputed
    from tokens, together with every layer before it (recompute must be a prefix)."""
    cfg = model.cfg
    if len(plan.methods) != cfg.num_layers:
        raise ValueError(f"plan has {len(plan.methods)} layers, the model {cfg.num_layers}")
    tokens = source.tokens
    n = len(tokens)
    cache = cache or KVCache(cfg, model.dtype, model.device, capacity=max(256, n))
    cache.truncate(0)
    cache.reserve(n)
    source.prepare(plan)
    spent = dict.fromkeys((m.value for m in Method), 0.0)
    t0 = time.perf_counter()
    recomputed = plan.n_recompute
    if recomputed:
        recompute_prefix(model, tokens, cache, recomputed)
    spent[Method.RECOMPUTE.value] = time.perf_counter() - t0
    fallbacks = 0
    with torch.inference_mode():
        for layer in range(plan.n_recompute, cfg.num_layers):
            t = time.perf_counter()
            try:
                if plan.methods[layer] == Method.HIDDEN:
                    kv_from_hidden(model, layer, source.hidden(layer), cache)
                else:
                    kv_as_saved(layer, *source.kv(layer), cache)
            except StateUnavailable:
                fallbacks += layer + 1 - recomputed
                cache.truncate(0)
                recompute_prefix(model, tokens, cache, layer + 1)
                recomputed = layer + 1
                spent[Method.RECOMPUTE.value] += time.perf_counter() - t
                continue
            spent[plan.methods[layer].value] += time.perf_counter() - t
    cache.length = n
    ms = (time.perf_counter() - t0) * 1e3
    elem = torch.finfo(model.dtype).bits // 8
    report = RestoreReport(plan, n, plan.bytes_to_read(cfg, n, elem), ms, {k: v * 1e3 for k, v in spent.items()})
    report.fallback_layers = fallbacks
    return cache, report
