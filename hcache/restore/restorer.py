"""The three restore paths and a plan that combines them, layer by layer.

- recompute: run layers 0..k-1 forward over the stored token ids;
- hidden: K, V = the layer's own norm + projection + RoPE on its stored input;
- kv: copy the stored K and V.
The executor is a pipeline: the source reads ahead (a store's reader threads fetch a
window of layers) while this thread recomputes the RE prefix, then projects or places
layer by layer, waiting only when a layer's bytes are not in yet. On CUDA host tensors
are copied on a side stream."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hcache.model.attention import KVCache
from hcache.model.base import DecoderModel
from hcache.restore.plan import Method, Plan
from hcache.restore.projection import Projector
from hcache.restore.state import StateSource, StateUnavailable


@dataclass
class RestoreReport:
    plan: Plan
    num_tokens: int
    bytes_read: int  # what the plan reads (a store reports what it actually read in `source_bytes`)
    ms: float
    ms_by_method: dict[str, float] = field(default_factory=dict)  # compute per method
    wait_ms: float = 0.0  # compute stalled on storage: the pipeline's bubble
    fallback_layers: int = 0  # layers recomputed because their stored state was unusable
    predicted_ms: float | None = None
    source_bytes: int = 0
    split: int | None = None  # token-wise restores: tokens before this came from H


def recompute_prefix(model: DecoderModel, tokens: list[int], cache: KVCache, num_layers: int) -> None:
    """KV of layers 0..num_layers-1 by a forward over the tokens from position 0."""
    ids = torch.tensor(tokens, dtype=torch.long, device=model.device)
    model(ids, torch.arange(len(tokens), device=model.device), cache, num_layers=num_layers)


def kv_as_saved(layer: int, k: torch.Tensor, v: torch.Tensor, cache: KVCache) -> None:
    cache.write(layer, k, v, start=0)


def to_device(
    ts: tuple[torch.Tensor, ...], device: torch.device, non_blocking: bool = False
) -> tuple[torch.Tensor, ...]:
    """Host tensors on `device`. A stored layer's K and V are strided views of one `[n, 2,
    kv_dim]` buffer; moved one by one, each would first be gathered into pageable memory on
    the CPU and copied synchronously. A no-op for tensors already there."""
    if all(t.device == device for t in ts):
        return ts
    return moved_by_buffer(ts, lambda flat: flat.to(device, non_blocking=non_blocking, copy=True))


def moved_by_buffer(
    ts: tuple[torch.Tensor, ...], move: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[torch.Tensor, ...]:
    """`move` applied once per buffer, to the contiguous span its views cover; each tensor
    comes back as the same view of the moved span."""
    spans: dict[int, tuple[int, int]] = {}  # storage -> element span its views cover
    for t in ts:
        if t.numel():
            key, lo = t.untyped_storage().data_ptr(), t.storage_offset()
            hi = lo + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) + 1
            a, b = spans.get(key, (lo, hi))
            spans[key] = (min(a, lo), max(b, hi))
    moved: dict[int, torch.Tensor] = {}
    out = []
    for t in ts:
        if not t.numel():
            out.append(move(t.reshape(-1)).view(t.shape))
            continue
        key = t.untyped_storage().data_ptr()
        lo, hi = spans[key]
        if key not in moved:
            moved[key] = move(t.as_strided((hi - lo,), (1,), lo))
        out.append(moved[key].as_strided(t.shape, t.stride(), t.storage_offset() - lo))
    return tuple(out)


class _DeviceFeed:
    """Moves a layer's host tensors to the model's device (on CUDA through a copy stream,
    off the compute stream, so the copy overlaps the previous layer's kernels)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def __call__(self, *ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not self.cuda:
            return to_device(ts, self.device)
        assert self.stream is not None
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            out = to_device(ts, self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        for t in out:  # used on the compute stream: its memory must not be reused before that is done
            t.record_stream(compute)
        # the host buffers go back to the reader's pool right after: the copy must have landed
        done.synchronize()
        return out


def _empty_cache(model: DecoderModel, cache: KVCache | None, n: int) -> KVCache:
    cache = cache or KVCache(model.cfg, model.dtype, model.device, capacity=max(256, n))
    cache.truncate(0)
    cache.reserve(n)
    return cache


def restore(
    model: DecoderModel,
    plan: Plan,
    source: StateSource,
    cache: KVCache | None = None,
    predicted_ms: float | None = None,
) -> tuple[KVCache, RestoreReport]:
    """Run `plan` against `source`. A layer whose stored state is unusable is recomputed
    from tokens, together with every layer before it (recompute must be a prefix)."""
    cfg = model.cfg
    if len(plan.methods) != cfg.num_layers:
        raise ValueError(f"plan has {len(plan.methods)} layers, the model {cfg.num_layers}")
    t0 = time.perf_counter()
    tokens = source.tokens
    n = len(tokens)
    cache = _empty_cache(model, cache, n)
    source.prepare(plan)  # reads start now, behind the recompute below
    feed = _DeviceFeed(model.device)
    project = Projector(model)
    spent = dict.fromkeys((m.value for m in Method), 0.0)
    wait = 0.0
    pending = deque(range(plan.n_recompute, cfg.num_layers))  # layers to read, in order
    unusable = -1  # the last layer whose stored state could not be used

    def load(layer: int) -> None:
        nonlocal wait, unusable
        method = plan.methods[layer]
        t = time.perf_counter()
        try:
            data = source.hidden(layer) if method == Method.HIDDEN else source.kv(layer)
        except StateUnavailable:
            unusable = layer
            return
        t1 = time.perf_counter()
        wait += t1 - t
        if method == Method.HIDDEN:
            project(layer, *feed(data), cache)  # type: ignore[misc]
        else:
            kv_as_saved(layer, *feed(*data), cache)
        source.release(layer)
        spent[method.value] += time.perf_counter() - t1

    with torch.inference_mode():
        if plan.n_recompute:
            # the prefix a layer at a time; in between, every layer whose bytes are in: its read
            # buffers go back, so the bounded read-ahead keeps reading while the prefix runs
            # (run whole first, a 4-layer prefix at 16K tokens under a 200 MB/s cap stalled the
            # reads after the window's 12 layers: 4.1 s against 2.5 predicted)
            for _ in model.prefix_steps(tokens, cache, plan.n_recompute):
                t = time.perf_counter()
                while pending and source.ready(pending[0]):
                    load(pending.popleft())
                spent[Method.RECOMPUTE.value] -= time.perf_counter() - t
        spent[Method.RECOMPUTE.value] += time.perf_counter() - t0
        while pending:
            load(pending.popleft())
        fallbacks = max(0, unusable + 1 - plan.n_recompute)
        if fallbacks:  # recompute must be a prefix: every layer up to the last unusable one
            t = time.perf_counter()
            cache.truncate(0)
            recompute_prefix(model, tokens, cache, unusable + 1)
            spent[Method.RECOMPUTE.value] += time.perf_counter() - t
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    cache.length = n
    ms = (time.perf_counter() - t0) * 1e3
    elem = torch.finfo(model.dtype).bits // 8
    return cache, RestoreReport(
        plan,
        n,
        plan.bytes_to_read(cfg, n, elem),
        ms,
        {k: v * 1e3 for k, v in spent.items()},
        wait * 1e3,
        fallbacks,
        predicted_ms,
        source.bytes_read,
    )


def restore_tokenwise(
    model: DecoderModel,
    split: int,
    source: StateSource,
    cache: KVCache | None = None,
    predicted_ms: float | None = None,
) -> tuple[KVCache, RestoreReport]:
    """Token-wise (KVPR style): in every layer, K/V of tokens before `split` are projected
    from H and the rest are loaded as KV. Unusable state falls back to recompute."""
    cfg = model.cfg
    t0 = time.perf_counter()
    tokens = source.tokens
    n = len(tokens)
    if not 0 <= split <= n:
        raise ValueError(f"split {split} outside 0..{n}")
    cache = _empty_cache(model, cache, n)
    source.prepare_split(split)
    feed = _DeviceFeed(model.device)
    project = Projector(model)
    spent = dict.fromkeys((m.value for m in Method), 0.0)
    wait, recomputed = 0.0, 0
    with torch.inference_mode():
        for layer in range(cfg.num_layers):
            if layer < recomputed:
                continue
            t = time.perf_counter()
            try:
                h = source.hidden(layer, 0, split) if split else None
                kv = source.kv(layer, split, n) if split < n else None
            except StateUnavailable:
                cache.truncate(0)
                recompute_prefix(model, tokens, cache, layer + 1)
                recomputed = layer + 1
                spent[Method.RECOMPUTE.value] += time.perf_counter() - t
                continue
            t1 = time.perf_counter()
            wait += t1 - t
            if h is not None:
                project(layer, *feed(h), cache)
            spent[Method.HIDDEN.value] += time.perf_counter() - t1
            t2 = time.perf_counter()
            if kv is not None:
                k, v = feed(*kv)
                cache.write(layer, k, v, start=split)
            source.release(layer)
            spent[Method.KV.value] += time.perf_counter() - t2
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    cache.length = n
    elem = torch.finfo(model.dtype).bits // 8
    nbytes = cfg.num_layers * (split * cfg.hidden_size + (n - split) * 2 * cfg.kv_dim) * elem
    report = RestoreReport(
        Plan.uniform(cfg.num_layers, Method.HIDDEN),
        n,
        nbytes,
        (time.perf_counter() - t0) * 1e3,
        {k: v * 1e3 for k, v in spent.items()},
        wait * 1e3,
        recomputed,
        predicted_ms,
        source.bytes_read,
        split,
    )
    return cache, report
