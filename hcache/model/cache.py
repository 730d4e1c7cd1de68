"""The KV-cache contract shared by the model, the restore executor and the engine.

The model's layers only `attend`: store this forward's K/V and attend over everything
held. A forward is framed by `begin` (reserve rows, and say where its tokens start) and
`commit`. The restore executor also places rows directly (`write`, or `dest` views that
kernels fill in place). The contiguous `KVCache` here, the engine's paged cache and its
batch of paged caches implement it."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch

from hcache.memory import aligned_buffer
from hcache.model.attention import causal_attention, decode_attention, key_width
from hcache.model.geometry import ModelConfig


class Cache(Protocol):
    """What a forward needs."""

    def begin(self, n: int, start: int | None = None) -> None:
        """Start a forward of `n` tokens at position `start` (default: after the committed ones)."""

    def commit(self) -> None:
        """The forward's tokens are now held: `length` moves past them."""

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
    ) -> torch.Tensor:
        """Store `k`, `v` `[T, KvH, D]` at the forward's rows; `q` `[T, H, D]` attends causally; `[T, H*D]`.
        The contiguous and paged caches also take q for only the last Tq of the T rows
        (`DecoderLayer.forward`'s `last_only`), and return `[Tq, H*D]`."""
        ...


class KVRows(Cache, Protocol):
    """One sequence's cache, as the restore executor fills it."""

    length: int  # tokens committed in every layer
    dtype: torch.dtype  # of the K/V rows held (may be narrower than the activations')

    def reserve(self, n: int) -> None:
        """Room for `n` tokens past `length`."""

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int | None = None) -> None:
        """Layer `layer`'s K and V rows for positions `start..` (default: `length`)."""

    def write_at(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Layer `layer`'s K and V rows for the tokens at `positions` `[T]` (any order, any gaps)."""

    def dest(self, layer: int, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Views of layer `layer`'s rows `start..start+n` to fill in place, or None (then `write`)."""
        ...

    def landing(self, layer: int, start: int, n: int) -> torch.Tensor | None:
        """Layer `layer`'s rows `start..start+n` as one contiguous `[n, 2, kv_heads, head_dim]`
        tensor (each token's K then V, as a stored chunk holds them) for reads to land in, or
        None where the cache cannot lend them."""
        ...

    def hold(self, settle: Callable[[], None] | None) -> None:
        """Reads may be landing in lent rows: `settle` waits them out, and is called before
        any of the cache's memory is let go (None: nothing lands any more)."""
        ...

    def layer_kv(self, layer: int, n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s K and V of the first `n` tokens (default: `length`)."""
        ...

    def truncate(self, n: int) -> None:
        """Forget tokens past `n`."""


def zeros_for_reads(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros that stored chunks can be read into as they are (`KVRows.landing`): in host
    memory, page-aligned for O_DIRECT and on huge pages (`hcache.memory`), which also
    leaves them untouched until used."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or not nbytes:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(aligned_buffer(nbytes), dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


def landed(rows: torch.Tensor, src: torch.Tensor) -> bool:
    """Is `src` the very view `rows` (same memory, shape, strides and dtype): K or V read
    straight into a cache's rows (`KVRows.landing`), which a write then need not copy?"""
    return (
        rows.data_ptr() == src.data_ptr()
        and rows.shape == src.shape
        and rows.stride() == src.stride()
        and rows.dtype == src.dtype
    )


class Lender:
    """A cache's side of `KVRows.hold`: rows it lent may still be filling until `_let_go`."""

    _settle: Callable[[], None] | None = None  # waits out reads landing in lent rows

    def hold(self, settle: Callable[[], None] | None) -> None:
        self._settle = settle

    def _let_go(self) -> None:
        """Before memory is let go or moved: no read may land in it afterwards."""
        if self._settle is not None:
            settle, self._settle = self._settle, None
            settle()


class KVCache(Lender):
    """Per-layer K and V, token-major: `kv[layer]` `[capacity, 2, n_kv_heads, head_dim]` holds
    each token's K row then its V row, as a stored chunk and the engine's pool hold them
    (`k`, `v` are views); grown by doubling."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu", capacity: int = 256):
        capacity = key_width(capacity)
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        self.length = 0  # tokens committed in every layer
        self._pending = 0  # tokens of the forward in progress
        # a one-token forward's key rows and length (`decode_attention`), for its layers
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None
        self.kv = [self._empty(capacity) for _ in range(cfg.num_layers)]
        self._views()

    def _empty(self, n: int) -> torch.Tensor:
        # zeros: a decode step reads (masked) rows past `length`, and 0 * NaN would leak through
        return zeros_for_reads((n, 2, self.cfg.num_kv_heads, self.cfg.head_dim), self.dtype, self.device)

    def _views(self) -> None:
        self.k = [kv[:, 0] for kv in self.kv]
        self.v = [kv[:, 1] for kv in self.kv]

    @property
    def capacity(self) -> int:
        return self.kv[0].shape[0]

    def reserve(self, n: int) -> None:
        """Make room for `n` more tokens past `length`."""
        need = self.length + n
        if need <= self.capacity:
            return
        cap = key_width(max(need, 2 * self.capacity))
        self._let_go()  # rows still landing (`landing`) are in before they move
        for i, old in enumerate(self.kv):
            new = self._empty(cap)
            new[: old.shape[0]] = old  # every row: a restore lands rows before `length` moves
            self.kv[i] = new
        self._views()

    def begin(self, n: int, start: int | None = None) -> None:
        """Start a forward of `n` tokens at `start` (default: after the committed ones)."""
        if start is not None:
            self.length = start
        self.reserve(n)
        self._pending = n
        self._rows = None

    def commit(self) -> None:
        self.length += self._pending
        self._pending = 0
        self._rows = None

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int | None = None) -> None:
        s = self.length if start is None else start
        kr, vr = self.k[layer][s : s + k.shape[0]], self.v[layer][s : s + v.shape[0]]
        if not (landed(kr, k) and landed(vr, v)):
            kr.copy_(k)
            vr.copy_(v)

    def write_at(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].index_copy_(0, positions, k.to(self.dtype))
        self.v[layer].index_copy_(0, positions, v.to(self.dtype))

    def dest(self, layer: int, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer `layer`'s K and V rows for positions `start..start+n`, to be written in place."""
        if start + n > self.capacity:  # a short view would be resized by out= kernels, not filled
            raise ValueError(f"rows {start}..{start + n} past the cache's capacity {self.capacity}")
        return self.k[layer][start : start + n], self.v[layer][start : start + n]

    def landing(self, layer: int, start: int, n: int) -> torch.Tensor | None:
        if start + n > self.capacity or self.device.type != "cpu":
            return None
        return self.kv[layer][start : start + n]

    def layer_kv(self, layer: int, n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.length if n is None else n
        return self.k[layer][:n], self.v[layer][:n]

    def truncate(self, n: int) -> None:
        """Forget tokens past `n` (a causal cache's prefix stays valid)."""
        self.length = min(self.length, n)

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
    ) -> torch.Tensor:
        """k/v `[T, KvH, D]` for the new tokens, q `[Tq, H, D]` for the last Tq of them; returns `[Tq, H*D]`."""
        t = k.shape[0]
        self.write(layer, k, v)
        if t == 1:
            n = self.length + 1
            if self._rows is None:
                self._rows = torch.arange(key_width(n), device=q.device)[None], torch.tensor([n], device=q.device)
            return decode_attention(q, self.k[layer], self.v[layer], *self._rows, scale)
        keys, values = self.layer_kv(layer, self.length + t)
        return causal_attention(q, keys, values, scale)
