"""Restoration and the new turn's prefill as one layer-wise pipeline.

A job brings back the KV of a session's first `n_old` tokens (by its plan: a
recompute prefix, then H or KV per layer, read ahead by the store) and runs the
new tokens through each layer as soon as that layer's old KV is in place, so the
first token comes after about max(restore, prefill) instead of their sum. The
job yields after every layer so the engine can run decode steps in between, and
it never blocks on storage: while a layer's bytes are not in, it yields
without working. Long prompts run in pieces (chunked prefill) so one piece's
staged rows fit the saver's ring."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from hcache.engine.block_pool import PagedCache
from hcache.engine.saver import Saver
from hcache.model.base import DecoderModel
from hcache.restore.plan import Method, Plan
from hcache.restore.projection import Projector
from hcache.restore.restorer import to_device
from hcache.restore.state import StateSource, StateUnavailable


@dataclass
class PrefillReport:
    restore_ms: float = 0.0  # until every old layer's KV was in place
    prefill_ms: float = 0.0  # the whole job
    wait_ms: float = 0.0  # yielded while storage was behind
    fallback_layers: int = 0
    bytes_read: int = 0
    ms_by_method: dict[str, float] = field(default_factory=dict)


class PrefillJob:
    def __init__(
        self,
        model: DecoderModel,
        cache: PagedCache,
        old_tokens: list[int],
        new_tokens: list[int],
        plan: Plan | None = None,
        source: StateSource | None = None,
        saver: Saver | None = None,
        piece_tokens: int = 512,
        fused: bool = True,
    ):
        """`cache` has blocks for everything; with a plan, it holds nothing yet and the old
        tokens' KV comes from `source`; without one, it already holds the old tokens."""
        if plan is not None and source is None:
            raise ValueError("a restore plan needs a state source")
        self.model, self.cache = model, cache
        self.old, self.new = old_tokens, new_tokens
        self.plan, self.source, self.saver = plan, source, saver
        self.piece = max(1, piece_tokens)
        self.fused = fused
        self.report = PrefillReport(ms_by_method=dict.fromkeys((m.value for m in Method), 0.0))
        self.last_hidden: torch.Tensor | None = None  # final-norm hidden of the last new token
        self._recomputed = 0
        self._project = Projector(model)
        self.waiting_on: int | None = None  # the layer whose stored state is not in yet

    def wait_storage(self, timeout: float) -> None:
        """Block (at most `timeout` s) until the layer the job waits for is readable."""
        if self.waiting_on is not None and self.source is not None:
            self.source.wait(self.waiting_on, timeout)

    # --- the old tokens' KV --------------------------------------------------
    def _recompute_upto(self, n_layers: int) -> None:
        """KV of layers 0..n_layers-1 for the old tokens by a forward from position 0."""
        for layer in range(n_layers):
            self._recompute_layer_of_prefix(layer)

    def _restore_layer(self, layer: int) -> Iterator[bool]:
        """Make layer `layer`'s old KV present; yields False while storage is behind."""
        assert self.plan is not None and self.source is not None
        method = self.plan.methods[layer]
        t0 = time.perf_counter()
        if layer < self._recomputed:
            return
        if method == Method.RECOMPUTE:
            self._recompute_layer_of_prefix(layer)
            self.report.ms_by_method[method.value] += (time.perf_counter() - t0) * 1e3
            return
        while not self.source.ready(layer):
            t = time.perf_counter()
            self.waiting_on = layer
            yield False
            self.waiting_on = None
            self.report.wait_ms += (time.perf_counter() - t) * 1e3
        t1 = time.perf_counter()
        try:
            if method == Method.HIDDEN:
                self._project(layer, self.source.hidden(layer), self.cache)
            else:
                self.cache.write(layer, *to_device(self.source.kv(layer), self.model.device), start=0)
            self.source.release(layer)
        except StateUnavailable:
            self.report.fallback_layers += layer + 1 - self._recomputed
            self._recompute_upto(layer + 1)
            method = Method.RECOMPUTE
        self.report.ms_by_method[method.value] += (time.perf_counter() - t1) * 1e3

    def _recompute_layer_of_prefix(self, layer: int) -> None:
        """The RE prefix, one layer per step: the old tokens' hidden state is carried along."""
        m, n = self.model, len(self.old)
        if layer == 0:
            positions = torch.arange(n, device=m.device)
            ids = torch.tensor(self.old, dtype=torch.long, device=m.device)
            self._h_old = m.embed(ids, positions)
            self._pos_old = m.pos_context(positions)
        self.cache.length, self.cache._pending = 0, n
        self._h_old = m.layers[layer](self._h_old, self._pos_old, self.cache, layer)
        self._recomputed = layer + 1

    # --- the job -------------------------------------------------------------
    def run(self) -> Iterator[bool]:
        """Yields True after a unit of work, False when it waited on storage. Run it under
        torch.inference_mode (the engine's loop does: a generator cannot hold the mode)."""
        t0 = time.perf_counter()
        m, cfg = self.model, self.model.cfg
        n_old = len(self.old)
        restoring = self.plan is not None and n_old > 0
        if restoring:
            assert self.source is not None and self.plan is not None
            self.source.prepare(self.plan)
        if restoring and (not self.fused or not self.new):
            for layer in range(cfg.num_layers):
                yield from self._restore_layer(layer)
                yield True
            self.report.restore_ms = (time.perf_counter() - t0) * 1e3
            restoring = False
        for lo in range(0, len(self.new), self.piece):
            hi = min(len(self.new), lo + self.piece)
            start = n_old + lo
            positions = torch.arange(start, n_old + hi, device=m.device)
            h = m.embed(torch.tensor(self.new[lo:hi], device=m.device), positions)
            pos = m.pos_context(positions)
            slots = self.saver.begin(start, hi - lo) if self.saver else None
            for layer in range(cfg.num_layers):
                if restoring:
                    yield from self._restore_layer(layer)
                self.cache.length, self.cache._pending = start, hi - lo
                if slots is not None and layer in slots:
                    slots[layer].copy_(h)
                h = m.layers[layer](h, pos, self.cache, layer)
                if self.saver:
                    self.saver.after_layer(layer, self.cache, start, hi - lo)
                yield True
            if restoring:
                self.report.restore_ms = (time.perf_counter() - t0) * 1e3
                restoring = False
            self.cache.length, self.cache._pending = n_old + hi, 0
            if self.saver:
                self.saver.submit()
            if hi == len(self.new):
                self.last_hidden = m.head_norm(h[-1:])
        self.cache.length, self.cache._pending = n_old + len(self.new), 0
        if self.source is not None:
            self.report.bytes_read = self.source.bytes_read
        self.report.prefill_ms = (time.perf_counter() - t0) * 1e3
