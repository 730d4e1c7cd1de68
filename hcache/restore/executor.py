"""The restore executor: one job that brings a sequence's KV back, a layer at a time.

Per layer, by the plan: recompute (a forward of the stored token ids; recompute layers
are a prefix 0..k-1), hidden (the layer's own norm + K/V projection + RoPE on its stored
input) or kv (place the stored K and V). The source reads ahead (a store's reader
threads fetch a window of layers) while the job recomputes the prefix; between prefix
layers it places every layer whose bytes are in, so the bounded read-ahead keeps going.
A layer whose stored state is unusable is recomputed, with every layer before it.

`restore()` runs a job to the end; the engine's fused restore+prefill (engine/prefill.py)
drives the same job a layer at a time, between the new tokens' layers."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from hcache.model.base import DecoderModel
from hcache.model.cache import KVCache, KVRows
from hcache.restore.plan import Method, Plan
from hcache.restore.projection import Projector
from hcache.restore.state import StateSource, StateUnavailable


@dataclass
class RestoreReport:
    plan: Plan
    num_tokens: int
    bytes_read: int  # what the plan reads (what a store actually read is `source_bytes`)
    ms: float = 0.0
    ms_by_method: dict[str, float] = field(default_factory=dict)  # compute per method
    wait_ms: float = 0.0  # compute stalled on storage: the pipeline's bubble
    fallback_layers: int = 0  # layers recomputed because their stored state was unusable
    predicted_ms: float | None = None
    source_bytes: int = 0
    split: int | None = None  # token-wise restores: tokens before this came from H


def to_device(
    ts: tuple[torch.Tensor, ...], device: torch.device, non_blocking: bool = False
) -> tuple[torch.Tensor, ...]:
    """Host tensors on `device`, a no-op for tensors already there. A stored layer's K and V
    are strided views of one `[n, 2, kv_dim]` buffer: moved one by one, each would first be
    gathered into pageable memory and copied synchronously."""
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


class DeviceFeed:
    """Moves a layer's host tensors to the model's device; on CUDA through a copy stream,
    so the copy overlaps the previous layer's kernels."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def __call__(self, *ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.stream is None:
            return to_device(ts, self.device)
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            out = to_device(ts, self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        for t in out:  # used on the compute stream: its memory must not be reused before that is done
            t.record_stream(compute)
        done.synchronize()  # the host buffers go back to the reader's pool right after
        return out


class RestoreJob:
    """Brings back the KV of `source.tokens` into `cache` by `plan`. With `split`, token-wise
    (KVPR style): in every layer, tokens before `split` are projected from H and the rest
    loaded as KV. Call `start()`, then drive `ensure(layer)` for every layer in order."""

    def __init__(
        self,
        model: DecoderModel,
        plan: Plan,
        source: StateSource,
        cache: KVRows,
        split: int | None = None,
        predicted_ms: float | None = None,
    ):
        cfg = model.cfg
        if len(plan.methods) != cfg.num_layers:
            raise ValueError(f"plan has {len(plan.methods)} layers, the model {cfg.num_layers}")
        self.model, self.plan, self.source, self.cache, self.split = model, plan, source, cache, split
        self.tokens = source.tokens
        n = len(self.tokens)
        if split is not None and not 0 <= split <= n:
            raise ValueError(f"split {split} outside 0..{n}")
        elem, kv_elem = model.dtype.itemsize, cache.dtype.itemsize  # stored KV is the cache's dtype
        if split is None:
            nbytes = plan.bytes_to_read(cfg, n, elem, kv_elem)
        else:
            nbytes = cfg.num_layers * (split * cfg.hidden_size * elem + (n - split) * 2 * cfg.kv_dim * kv_elem)
        self.report = RestoreReport(plan, n, nbytes, predicted_ms=predicted_ms, split=split)
        self._spent = dict.fromkeys(Method, 0.0)
        self._wait = 0.0
        self._feed = DeviceFeed(model.device)
        self._project = Projector(model)
        self._to_load = deque(range(plan.n_recompute, cfg.num_layers))  # stored layers, in order
        self._placed: set[int] = set()
        self._recomputed = 0  # layers 0.._recomputed-1 hold recomputed KV
        self._prefix: Iterator[int] | None = None
        self.waiting_on: int | None = None  # the layer whose bytes are not in yet
        self._t0 = 0.0

    def start(self) -> None:
        """Start the reads (they run behind the recompute prefix)."""
        self._t0 = time.perf_counter()
        if self.split is None:
            # stored K/V read straight into the cache's rows where it lends them: no copy after
            self.cache.hold(self.source.settle)
            self.source.prepare(self.plan, self.cache.landing)
        else:
            self.source.prepare_split(self.split)
        if self.plan.n_recompute:  # read setup delays the prefix: the planner charges it there
            self._spent[Method.RECOMPUTE] += time.perf_counter() - self._t0

    def ensure(self, layer: int, block: bool = False) -> Iterator[None]:
        """Make layer `layer`'s KV present. Yields, without working, while its bytes are not
        in: the caller blocks on `wait_storage` or does other work in between. With `block`,
        it never yields: the read blocks until the bytes are in."""
        if layer < self._recomputed or layer in self._placed:
            return
        if self.plan.methods[layer] == Method.RECOMPUTE:
            self._recompute_through(layer)
            return
        while not block and not self.source.ready(layer):
            t = time.perf_counter()
            self.waiting_on = layer
            yield
            self.waiting_on = None
            self._wait += time.perf_counter() - t
        self._load(layer)

    def wait_storage(self, timeout: float) -> None:
        """Block (at most `timeout` s) until the layer the job waits for is readable."""
        if self.waiting_on is not None:
            self.source.wait(self.waiting_on, timeout)

    def run(self) -> RestoreReport:
        """The whole restore, blocking on storage when it is behind."""
        self.start()
        for layer in range(self.model.cfg.num_layers):
            for _ in self.ensure(layer, block=True):
                pass
        return self.finish()

    def finish(self) -> RestoreReport:
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        self.source.settle()  # reads of layers recomputed instead land nowhere now
        self.cache.hold(None)
        self.cache.length = len(self.tokens)
        r = self.report
        r.ms = (time.perf_counter() - self._t0) * 1e3
        r.ms_by_method = {m.value: s * 1e3 for m, s in self._spent.items()}
        r.wait_ms = self._wait * 1e3
        r.source_bytes = self.source.bytes_read
        return r

    def _recompute_through(self, layer: int) -> None:
        """Recompute layers up to `layer`, continuing the prefix; between its layers, place
        every later stored layer whose bytes are in (their read buffers go back to the reader)."""
        while self._to_load and self._to_load[0] <= layer:
            self._to_load.popleft()  # recomputed instead
        if self._prefix is None:
            self._prefix = self.model.prefix_steps(self.tokens, self.cache)
        while self._recomputed <= layer:
            t = time.perf_counter()
            self._recomputed = next(self._prefix) + 1
            self._spent[Method.RECOMPUTE] += time.perf_counter() - t
            while self._to_load and self.source.ready(self._to_load[0]):
                self._load(self._to_load.popleft())

    def _load(self, layer: int) -> None:
        """Project or place a stored layer whose bytes are in; recompute it when unusable."""
        if layer in self._placed or layer < self._recomputed:
            return
        t = time.perf_counter()
        try:
            if self.split is None:
                method = self.plan.methods[layer]
                data = (self.source.hidden(layer),) if method == Method.HIDDEN else self.source.kv(layer)
                t1 = time.perf_counter()
                self._wait += t1 - t  # a blocking read waits here
                if method == Method.HIDDEN:
                    self._project(layer, *self._feed(*data), self.cache)
                else:
                    self.cache.write(layer, *self._feed(*data), start=0)
                self._spent[method] += time.perf_counter() - t1
            else:
                self._load_split(layer)
        except StateUnavailable:
            self.report.fallback_layers += layer + 1 - self._recomputed
            self._recompute_through(layer)
            return
        self.source.release(layer)
        self._placed.add(layer)

    def _load_split(self, layer: int) -> None:
        n, split = len(self.tokens), self.split
        assert split is not None
        t0 = time.perf_counter()
        h = self.source.hidden(layer, 0, split) if split else None
        kv = self.source.kv(layer, split, n) if split < n else None
        t = time.perf_counter()
        self._wait += t - t0
        if h is not None:
            self._project(layer, *self._feed(h), self.cache)
        t1 = time.perf_counter()
        self._spent[Method.HIDDEN] += t1 - t
        if kv is not None:
            self.cache.write(layer, *self._feed(*kv), start=split)
        self._spent[Method.KV] += time.perf_counter() - t1


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
    split: int | None = None,
) -> tuple[KVCache, RestoreReport]:
    """Run `plan` (or, with `split`, a token-wise restore) against `source` into `cache`."""
    cache = _empty_cache(model, cache, len(source.tokens))
    with torch.inference_mode():
        report = RestoreJob(model, plan, source, cache, split=split, predicted_ms=predicted_ms).run()
    return cache, report


def restore_tokenwise(
    model: DecoderModel,
    split: int,
    source: StateSource,
    cache: KVCache | None = None,
    predicted_ms: float | None = None,
) -> tuple[KVCache, RestoreReport]:
    """Token-wise: tokens before `split` from H, the rest from KV, in every layer."""
    plan = Plan.uniform(model.cfg.num_layers, Method.HIDDEN)
    return restore(model, plan, source, cache, predicted_ms, split=split)


def recompute_prefix(model: DecoderModel, tokens: list[int], cache: KVRows, num_layers: int) -> None:
    """KV of layers 0..num_layers-1 by a forward over the tokens from position 0."""
    with torch.inference_mode():
        for layer in model.prefix_steps(tokens, cache) if num_layers else ():
            if layer + 1 == num_layers:
                break
    cache.length = len(tokens)
