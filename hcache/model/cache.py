"""The KV-cache contract shared by the model, the restore executor and the engine.

The model's layers only `attend`: store this forward's K/V and attend over everything
held. A forward is framed by `begin` (reserve rows, and say where its tokens start) and
`commit`. The restore executor also places rows directly (`write`, or `dest` views that
kernels fill in place). The contiguous `KVCache` (model/attention.py), the engine's
paged cache and its batch of paged caches implement it."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch

from hcache.memory import aligned_buffer


class Cache(Protocol):
    """What a forward needs."""

    def begin(self, n: int, start: int | None = None) -> None:
        """Start a forward of `n` tokens at position `start` (default: after the committed ones)."""

    def commit(self) -> None:
        """The forward's tokens are now held: `length` moves past them."""

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
    ) -> torch.Tensor:
        """Store `k`, `v` `[T, KvH, D]` at the forward's rows; `q` `[T, H, D]` attends causally; `[T, H*D]`."""
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
