"""Restoration and the new turn's prefill as one layer-wise pipeline.

The restore executor's job (restore/executor.py) brings back the KV of a session's
first `n_old` tokens a layer at a time, and this job runs the new tokens through
each layer as soon as that layer's old KV is in place, so the
first token comes after about max(restore, prefill) instead of their sum. The
job yields after every layer so the engine can run decode steps in between, and
it never blocks on storage: while a layer's bytes are not in, it yields
without working. Long prompts run in pieces (chunked prefill) so one piece's
staged rows fit the saver's ring."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from hcache.engine.block_pool import PagedCache
from hcache.engine.saver import Saver
from hcache.model.base import DecoderModel
from hcache.restore.executor import RestoreJob
from hcache.restore.plan import Method, Plan
from hcache.restore.state import StateSource


@dataclass
class PrefillReport:
    restore_ms: float = 0.0  # until every old layer's KV was in place
    prefill_ms: float = 0.0  # the whole job
    wait_ms: float = 0.0  # yielded while storage was behind
    fallback_layers: int = 0
    bytes_read: int = 0
    ms_by_method: dict[str, float] = field(default_factory=dict)
    placed_tokens: int = 0  # a blend's: context tokens whose stored K/V were placed
    recomputed_tokens: int = 0  # of those, recomputed
    context_fallbacks: list[str] = field(default_factory=list)  # contexts recomputed where unreadable


class Job(Protocol):
    """What the runner drives: a turn's restore+prefill (`PrefillJob`) or a blend (compose.py)."""

    report: PrefillReport

    @property
    def last_hidden(self) -> torch.Tensor | None: ...

    def wait_storage(self, timeout: float) -> None: ...

    def run(self) -> Iterator[bool]: ...


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
        self.saver = saver
        self.piece = max(1, piece_tokens)
        self.fused = fused
        self.restore = RestoreJob(model, plan, source, cache) if plan is not None and source and old_tokens else None
        self.report = PrefillReport(ms_by_method=dict.fromkeys((m.value for m in Method), 0.0))
        self.last_hidden: torch.Tensor | None = None  # final-norm hidden of the last new token

    def wait_storage(self, timeout: float) -> None:
        """Block (at most `timeout` s) until the layer the restore waits for is readable."""
        if self.restore is not None:
            self.restore.wait_storage(timeout)

    def _restored(self, layer: int) -> Iterator[bool]:
        """The old tokens' KV of `layer`; yields False while storage is behind."""
        assert self.restore is not None
        for _ in self.restore.ensure(layer):
            yield False

    def _restore_done(self, t0: float) -> None:
        assert self.restore is not None
        rep = self.restore.finish()
        self.report.restore_ms = (time.perf_counter() - t0) * 1e3
        self.report.wait_ms, self.report.fallback_layers = rep.wait_ms, rep.fallback_layers
        self.report.ms_by_method, self.report.bytes_read = rep.ms_by_method, rep.source_bytes

    def run(self) -> Iterator[bool]:
        """Yields True after a unit of work, False when it waited on storage. Run it under
        torch.inference_mode (the engine's loop does: a generator cannot hold the mode)."""
        t0 = time.perf_counter()
        m, cfg = self.model, self.model.cfg
        n_old = len(self.old)
        restoring = self.restore is not None
        if self.restore is not None:
            self.restore.start()
            if not self.fused or not self.new:
                for layer in range(cfg.num_layers):
                    yield from self._restored(layer)
                    yield True
                self._restore_done(t0)
                restoring = False
        for lo in range(0, len(self.new), self.piece):
            hi = min(len(self.new), lo + self.piece)
            start = n_old + lo
            positions = torch.arange(start, n_old + hi, device=m.device)
            h = m.embed(torch.tensor(self.new[lo:hi], device=m.device), positions)
            pos = m.pos_context(positions)
            slots = self.saver.begin(start, hi - lo) if self.saver else None
            alone = hi == len(self.new) and m.last_row_alone(hi - lo, self.cache.dtype)
            for layer in range(cfg.num_layers):
                if restoring:
                    yield from self._restored(layer)
                self.cache.begin(hi - lo, start=start)
                if slots is not None and layer in slots:
                    slots[layer].copy_(h)
                h = m.layers[layer](h, pos, self.cache, layer, last_only=alone and layer == cfg.num_layers - 1)
                if self.saver:
                    self.saver.after_layer(layer, self.cache, start, hi - lo)
                yield True
            if restoring:
                self._restore_done(t0)
                restoring = False
            self.cache.commit()
            if self.saver:
                self.saver.submit()
            if hi == len(self.new):
                self.last_hidden = m.head_norm(h[-1:])
        self.cache.length = n_old + len(self.new)
        self.report.prefill_ms = (time.perf_counter() - t0) * 1e3
