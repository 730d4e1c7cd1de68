"""Saves a running sequence into the chunk store: the forward writes its hidden
states straight into a staging-ring slot, the new K/V rows are copied next to them,
and the end of a turn makes it durable."""

from __future__ import annotations

import torch

from hcache.model.cache import KVCache
from hcache.storage.staging import StagedBatch
from hcache.storage.store import ChunkStore


class StoreRecorder:
    def __init__(self, store: ChunkStore, owner: str):
        self.store, self.owner = store, owner
        self._tokens = list(store.owner_row(owner).tokens)
        self._batch: StagedBatch | None = None

    @property
    def tokens(self) -> list[int]:
        return self._tokens

    def hidden_slot(self, n: int) -> dict[int, torch.Tensor]:
        self._batch = self.store.acquire([(self.owner, len(self._tokens), n)])
        return self._batch.hidden

    def append(self, tokens: list[int], cache: KVCache) -> None:
        batch, self._batch = self._batch, None
        if batch is None or batch.num_rows != len(tokens):
            raise RuntimeError("append() must follow hidden_slot() for the same tokens")
        t = len(self._tokens)
        for layer, dst in batch.kv.items():
            k, v = cache.layer_kv(layer, t + len(tokens))
            dst[:, 0] = k[t:].reshape(len(tokens), -1)
            dst[:, 1] = v[t:].reshape(len(tokens), -1)
        self.store.submit(batch)
        self._tokens.extend(tokens)

    def truncate(self, n: int) -> None:
        if n < len(self._tokens):
            self.store.truncate(self.owner, n)
            del self._tokens[n:]

    def end_turn(self) -> None:
        self.store.mark_durable(self.owner, self._tokens)
