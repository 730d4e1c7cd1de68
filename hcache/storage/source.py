"""The chunk store as a restore source: the plan's H and KV layers stream in
through one prefetching reader while the restorer works layer by layer."""

from __future__ import annotations

import torch

from hcache.restore.plan import Method, Plan
from hcache.restore.state import StateSource
from hcache.storage.errors import ChunkError
from hcache.storage.layout import Kind
from hcache.storage.reader import OwnerReader
from hcache.storage.store import ChunkStore

METHOD_KIND = {Method.HIDDEN: Kind.HIDDEN, Method.KV: Kind.KV}


class StoreSource(StateSource):
    def __init__(self, store: ChunkStore, owner: str, fingerprint: str):
        self.store, self.owner = store, owner
        self.row = store.check_fingerprint(owner, fingerprint)
        self.stored = store.layer_kinds(self.row)
        self.reader: OwnerReader | None = None
        cfg = store.model
        self._kv_shape = (cfg.num_kv_heads, cfg.head_dim)

    @property
    def tokens(self) -> list[int]:
        return self.row.tokens

    def prepare(self, plan: Plan) -> None:
        """Fetch the layers the plan reads and that hold what it reads; others fail over to recompute."""
        layers = [
            layer
            for layer, m in enumerate(plan.methods)
            if m != Method.RECOMPUTE and self.stored[layer] == METHOD_KIND[m]
        ]
        self.reader = self.store.reader(self.owner, layers)

    def _get(self, layer: int, kind: Kind) -> torch.Tensor:
        if self.stored[layer] != kind:
            raise ChunkError(self.owner, layer, 0, f"layer stores {self.stored[layer]}, not {kind.value}")
        if self.reader is None or layer not in self.reader.slots:
            self.reader = self.store.reader(self.owner, [layer])
        return self.reader.get(layer)

    def release(self, layer: int) -> None:
        if self.reader is not None:
            self.reader.release(layer)

    @property
    def bytes_read(self) -> int:
        return self.reader.bytes_read if self.reader is not None else 0

    def hidden(self, layer: int) -> torch.Tensor:
        return self._get(layer, Kind.HIDDEN)

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        both = self._get(layer, Kind.KV)
        n = both.shape[1]
        return both[0].view(n, *self._kv_shape), both[1].view(n, *self._kv_shape)
