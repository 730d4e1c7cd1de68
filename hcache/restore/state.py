"""What a store holds for one owner (a session or a context), and the source the
restorer reads from. `MemoryState` keeps it in memory: the demo and the tests use
it; the chunk store (hcache/storage) is the persistent source with the same ABC."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Protocol

import torch

from hcache.model.cache import KVCache
from hcache.model.geometry import ModelConfig
from hcache.restore.plan import Plan


class StateUnavailable(Exception):
    """A layer's stored state cannot be used (missing or corrupt): recompute it from tokens instead."""

    def __init__(self, layer: int, reason: str):
        super().__init__(reason)
        self.layer = layer


# (layer, lo, hi) -> where tokens lo:hi of that layer's stored K/V may land, `[hi - lo, 2,
# kv_dim]` rows of the restored cache itself, or None (`KVRows.landing`)
Landing = Callable[[int, int, int], torch.Tensor | None]


class StateSource(ABC):
    def prepare(self, plan: Plan, into: Landing | None = None) -> None:  # noqa: B027 - optional hook
        """Start fetching what `plan` will read (a store prefetches; memory has nothing to do).
        With `into`, KV may be read straight into the rows it gives; `kv()` then returns views
        of them."""

    def settle(self) -> None:  # noqa: B027 - optional hook
        """Wait out reads still landing in memory given by `into`, and start no more."""

    def ready(self, layer: int) -> bool:
        """Is what `layer` needs under the prepared plan already here? (Never blocks.)"""
        return True

    def wait(self, layer: int, timeout: float) -> bool:
        """Block until `ready(layer)` or `timeout` seconds; returns `ready(layer)`."""
        return self.ready(layer)

    def release(self, layer: int) -> None:  # noqa: B027 - optional hook
        """The restorer is done with what `hidden(layer)` / `kv(layer)` returned."""

    @property
    def bytes_read(self) -> int:
        return 0

    @property
    @abstractmethod
    def tokens(self) -> list[int]: ...

    def prepare_split(self, split: int) -> None:  # noqa: B027 - optional hook
        """Token-wise restore: every layer's H for tokens before `split`, KV from there on."""

    @abstractmethod
    def hidden(self, layer: int, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Layer `layer`'s input hidden states for tokens `lo:hi`, `[n, hidden]`."""

    @abstractmethod
    def kv(self, layer: int, lo: int = 0, hi: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s post-RoPE K and V for tokens `lo:hi`, `[n, kv_heads, head_dim]`."""


class Recorder(Protocol):
    """Takes what each forward produced, as the generation loop runs (memory, or a store)."""

    @property
    def tokens(self) -> list[int]: ...

    def hidden_slot(self, n: int) -> torch.Tensor | dict[int, torch.Tensor]: ...

    def append(self, tokens: list[int], cache: KVCache) -> None: ...

    def truncate(self, n: int) -> None: ...

    def end_turn(self) -> None: ...


class MemoryState(StateSource):
    """Every representation of every layer, appended as the session runs."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu", capacity: int = 256):
        self.cfg = cfg
        self._tokens: list[int] = []
        self._hidden = torch.empty(cfg.num_layers, capacity, cfg.hidden_size, dtype=dtype, device=device)
        self._kv = KVCache(cfg, dtype, device, capacity)

    @property
    def tokens(self) -> list[int]:
        return self._tokens

    def hidden_slot(self, n: int) -> torch.Tensor:
        """A `[L, n, hidden]` view for the next forward to write its hidden states into."""
        t = len(self._tokens)
        if t + n > self._hidden.shape[1]:
            grown = self._hidden.new_empty(
                self.cfg.num_layers, max(t + n, 2 * self._hidden.shape[1]), self.cfg.hidden_size
            )
            grown[:, :t] = self._hidden[:, :t]
            self._hidden = grown
        return self._hidden[:, t : t + n]

    def append(self, tokens: list[int], cache: KVCache) -> None:
        """Commit tokens whose hidden states were written to `hidden_slot`; copy their K/V from `cache`."""
        t, n = len(self._tokens), len(tokens)
        self._kv.reserve(n)
        for layer in range(self.cfg.num_layers):
            k, v = cache.layer_kv(layer, t + n)
            self._kv.write(layer, k[t:], v[t:], start=t)
        self._kv.length = t + n
        self._tokens.extend(tokens)

    def truncate(self, n: int) -> None:
        del self._tokens[n:]
        self._kv.truncate(n)

    def end_turn(self) -> None:
        """Memory is as durable as it gets."""

    def hidden(self, layer: int, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        return self._hidden[layer, lo : len(self._tokens) if hi is None else hi]

    def kv(self, layer: int, lo: int = 0, hi: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self._kv.layer_kv(layer)
        return k[lo:hi], v[lo:hi]

    def copy(self) -> MemoryState:
        other = MemoryState(self.cfg, self._hidden.dtype, self._hidden.device, capacity=max(1, len(self._tokens)))
        n = len(self._tokens)
        other._hidden[:, :n] = self._hidden[:, :n]
        other._kv.reserve(n)
        for layer in range(self.cfg.num_layers):
            other._kv.write(layer, *self._kv.layer_kv(layer), start=0)
        other._kv.length = n
        other._tokens = list(self._tokens)
        return other
