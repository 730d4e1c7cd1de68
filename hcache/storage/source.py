"""The chunk store as a restore source: the plan's H and KV layers (or, token-wise,
each layer's H head and KV tail) stream in through one prefetching reader while the
restorer works layer by layer."""

from __future__ import annotations

import torch

from hcache.restore.plan import Method, Plan
from hcache.restore.state import StateSource
from hcache.storage.errors import ChunkError
from hcache.storage.layout import Kind
from hcache.storage.reader import OwnerReader, Want
from hcache.storage.store import ChunkStore

METHOD_KIND = {Method.HIDDEN: Kind.HIDDEN, Method.KV: Kind.KV}


class StoreSource(StateSource):
    def __init__(self, store: ChunkStore, owner: str, fingerprint: str):
        self.store, self.owner = store, owner
        self.row = store.check_fingerprint(owner, fingerprint)
        self.stored = store.layer_kinds(self.row)
        self.reader: OwnerReader | None = None
        self._ranges: dict[tuple[int, Kind], tuple[int, int]] = {}
        cfg = store.model
        self._kv_shape = (cfg.num_kv_heads, cfg.head_dim)

    @property
    def tokens(self) -> list[int]:
        return self.row.tokens

    def _start(self, wants: list[Want]) -> None:
        self._ranges = {(w.layer, w.kind): (w.lo, w.hi) for w in wants}
        self.reader = self.store.reader(self.owner, wants=wants)

    def prepare(self, plan: Plan) -> None:
        """Fetch what the plan reads where the layer stores it; the rest fails over to recompute."""
        n = self.row.num_tokens
        self._start(
            [
                Want(layer, METHOD_KIND[m], 0, n)
                for layer, m in enumerate(plan.methods)
                if m != Method.RECOMPUTE and METHOD_KIND[m] in self.stored[layer]
            ]
        )

    def prepare_split(self, split: int) -> None:
        """Token-wise: tokens before `split` from H, the rest from KV, in every layer."""
        n = self.row.num_tokens
        wants = []
        for layer in range(len(self.stored)):
            if split:
                wants.append(Want(layer, Kind.HIDDEN, 0, split))
            if split < n:
                wants.append(Want(layer, Kind.KV, split, n))
        self._start([w for w in wants if w.kind in self.stored[w.layer]])

    def _get(self, layer: int, kind: Kind, lo: int, hi: int | None) -> torch.Tensor:
        hi = self.row.num_tokens if hi is None else hi
        if kind not in self.stored[layer]:
            raise ChunkError(self.owner, layer, lo // 64, f"layer does not store {kind.value}")
        if self.reader is None or self._ranges.get((layer, kind)) != (lo, hi):
            self._start([Want(layer, kind, lo, hi)])  # not prepared: fetch it now
        assert self.reader is not None
        return self.reader.get(layer, kind)

    def hidden(self, layer: int, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        return self._get(layer, Kind.HIDDEN, lo, hi)

    def kv(self, layer: int, lo: int = 0, hi: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        both = self._get(layer, Kind.KV, lo, hi)  # [n, 2, kv_dim]: K and V are strided views of it
        return both[:, 0].unflatten(1, self._kv_shape), both[:, 1].unflatten(1, self._kv_shape)

    def ready(self, layer: int) -> bool:
        if self.reader is None:
            return True
        kinds = [k for (lay, k) in self._ranges if lay == layer]
        return all(self.reader.ready(layer, k) for k in kinds)

    def wait(self, layer: int, timeout: float) -> bool:
        if self.reader is not None:
            for k in [k for (lay, k) in self._ranges if lay == layer]:
                self.reader.wait(layer, k, timeout)
        return self.ready(layer)

    def release(self, layer: int) -> None:
        if self.reader is not None:
            self.reader.release(layer)

    @property
    def bytes_read(self) -> int:
        return self.reader.bytes_read if self.reader is not None else 0
