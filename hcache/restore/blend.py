"""Documents stored apart, attended together: CacheBlend (Yao et al., EuroSys '25).

Each document was stored as a context of its own, from position 0. A query puts several
in an order of its own. Every document's KV is restored by its own plan (RE, H or KV per
layer) into a cache of its own, moved to its offset (K re-rotated, V as it is) and placed.
That alone (`fraction` 0: concat) leaves each document blind to the ones before it. With a
fraction, the layers up to the check layer run over every token; there the document
tokens whose K/V deviate most from the placed ones are chosen, and from then on only they
and the tokens after the documents are recomputed, attending over everything placed. The
job runs a layer at a time: a layer's documents are read and placed, then its tokens run."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from hcache.model.attention import causal_attention, positional_attention
from hcache.model.base import DecoderModel
from hcache.model.cache import KVCache, KVRows
from hcache.restore.executor import RestoreJob
from hcache.restore.plan import Plan
from hcache.restore.state import StateSource

CHECK_LAYER = 1  # CacheBlend's: layer 0's K/V depend on no other token, so it cannot tell


@dataclass
class Document:
    """A stored context and how its state is read back."""

    id: str
    tokens: list[int]
    plan: Plan
    source: StateSource


@dataclass
class BlendReport:
    restore_ms: float = 0.0  # until every document's last layer was placed (before its tokens ran)
    wait_ms: float = 0.0  # yielded while storage was behind
    bytes_read: int = 0
    placed_tokens: int = 0  # document tokens whose K/V came from storage
    recomputed_tokens: int = 0  # of those, recomputed by the blend
    fallback_layers: int = 0  # document layers recomputed alone: their stored bytes were unreadable
    fallbacks: list[str] = field(default_factory=list)  # the documents those were in


class _Placed:
    """The cache a blended layer attends over: the placed rows, with the K/V of the tokens
    it computes (`positions`) written over theirs. Told to `choose` n, it keeps the document
    tokens whose new K/V deviate most from the placed ones, and those after the documents."""

    def __init__(self, cache: KVRows, total: int, n_docs: int):
        self.cache, self.total, self.n_docs = cache, total, n_docs
        self.positions = torch.empty(0, dtype=torch.long)
        self.choose: int | None = None
        self.chosen: torch.Tensor | None = None  # rows kept by the last choice

    def begin(self, n: int, start: int | None = None) -> None:
        pass

    def commit(self) -> None:
        pass

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
    ) -> torch.Tensor:
        pos, t = self.positions, q.shape[0]
        keep = None
        if self.choose is not None:
            keep = self.chosen = self._chosen(layer, pos, k, v, self.choose)
            q, k, v, pos = q[keep], k[keep], v[keep], pos[keep]
        self.cache.write_at(layer, pos, k, v)
        keys, values = self.cache.layer_kv(layer, self.total)
        if pos.shape[0] == self.total:  # every token, in order: plain causal attention
            out = causal_attention(q, keys, values, scale)
        else:
            out = positional_attention(q, keys, values, pos, scale)
        if keep is None:
            return out
        full = out.new_zeros(t, out.shape[1])  # rows not kept are dropped after this layer
        full[keep] = out
        return full

    def _chosen(self, layer: int, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int) -> torch.Tensor:
        old_k, old_v = self.cache.layer_kv(layer, self.total)
        doc = (pos < self.n_docs).nonzero().squeeze(1)
        at = pos[doc]
        dev = (k[doc].float() - old_k[at].float()).square().sum((1, 2))
        dev += (v[doc].float() - old_v[at].float()).square().sum((1, 2))
        top = doc[dev.topk(min(n, doc.shape[0])).indices].sort().values
        return torch.cat([top, (pos >= self.n_docs).nonzero().squeeze(1)])


class Blend:
    """Documents placed into `cache` from position 0 on, then `suffix` after them; the
    final hidden state of the last suffix token is `last_hidden`. `cache` has room for
    everything; its `length` is set when the job ends."""

    def __init__(self, model: DecoderModel, cache: KVRows, docs: list[Document], suffix: list[int], fraction: float):
        if not suffix:
            raise ValueError("a blend feeds at least one token after its documents")
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"the recompute fraction must be within 0..1, not {fraction}")
        self.model, self.cache, self.docs, self.suffix = model, cache, docs, suffix
        self.offsets = [0]
        for d in docs:
            self.offsets.append(self.offsets[-1] + len(d.tokens))
        self.n_docs = self.offsets.pop()
        L = model.cfg.num_layers
        self.check = CHECK_LAYER if fraction > 0 and L > CHECK_LAYER else None
        self.n_chosen = math.ceil(round(fraction * self.n_docs, 6))  # 0.3 * 210 is 63, not 63.000...01
        self._own = [KVCache(model.cfg, cache.dtype, model.device, capacity=len(d.tokens)) for d in docs]
        self._jobs = [RestoreJob(model, d.plan, d.source, c) for d, c in zip(docs, self._own, strict=True)]
        self._waiting: RestoreJob | None = None
        self.report = BlendReport(placed_tokens=self.n_docs)
        self.last_hidden: torch.Tensor | None = None

    def wait_storage(self, timeout: float) -> None:
        if self._waiting is not None:
            self._waiting.wait_storage(timeout)

    def run(self) -> Iterator[bool]:
        """Yields True after a layer, False while a document's bytes are not in. Run it under
        torch.inference_mode (a generator cannot hold the mode)."""
        t0 = time.perf_counter()
        m, dev = self.model, self.model.device
        total = self.n_docs + len(self.suffix)
        first = 0 if self.check is not None else self.n_docs  # tokens from here on are computed
        ids = [t for d in self.docs for t in d.tokens][first:] + self.suffix
        positions = torch.arange(first, total, device=dev)
        h = m.embed(torch.tensor(ids, device=dev), positions)
        pos = m.pos_context(positions)
        rows = _Placed(self.cache, total, self.n_docs)
        for job in self._jobs:
            job.start()
        for layer in range(m.cfg.num_layers):
            for d, job, own, at in zip(self.docs, self._jobs, self._own, self.offsets, strict=True):
                self._waiting = job
                for _ in job.ensure(layer):
                    yield False
                self._waiting = None
                if self.check is None or layer >= self.check:  # else every row is recomputed
                    k, v = own.layer_kv(layer, len(d.tokens))
                    self.cache.write(layer, m.shift_keys(k, at), v, start=at)
            if layer == m.cfg.num_layers - 1:
                self.report.restore_ms = (time.perf_counter() - t0) * 1e3
            rows.positions, rows.choose = positions, self.n_chosen if layer == self.check else None
            h = m.layers[layer](h, pos, rows, layer)
            if rows.choose is not None:
                assert rows.chosen is not None
                h, positions = h[rows.chosen], positions[rows.chosen]
                pos = m.pos_context(positions)
                self.report.recomputed_tokens = int((positions < self.n_docs).sum())
            yield True
        self._finish()
        self.cache.length = total
        self.last_hidden = m.head_norm(h[-1:])

    def _finish(self) -> None:
        r = self.report
        for d, job in zip(self.docs, self._jobs, strict=True):
            rep = job.finish()
            r.wait_ms += rep.wait_ms
            r.bytes_read += rep.source_bytes
            r.fallback_layers += rep.fallback_layers
            if rep.fallback_layers:
                r.fallbacks.append(d.id)
        if self.check is None:
            r.recomputed_tokens = 0
