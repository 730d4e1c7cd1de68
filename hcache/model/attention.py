"""Attention over a KV cache. The model hands each layer's post-RoPE q, k, v to
`cache.attend`; the cache stores k, v and runs attention over everything it holds.
This single-sequence contiguous cache serves the demo and the restore paths; the
batched engine's paged cache implements the same contract (model/cache.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hcache.config import ModelConfig


class KVCache:
    """Per-layer K and V, token-major `[capacity, n_kv_heads, head_dim]`, grown by doubling."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu", capacity: int = 256):
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        self.length = 0  # tokens committed in every layer
        self._pending = 0  # tokens of the forward in progress
        self.k = [self._empty(capacity) for _ in range(cfg.num_layers)]
        self.v = [self._empty(capacity) for _ in range(cfg.num_layers)]

    def _empty(self, n: int) -> torch.Tensor:
        return torch.empty(n, self.cfg.num_kv_heads, self.cfg.head_dim, dtype=self.dtype, device=self.device)

    @property
    def capacity(self) -> int:
        return self.k[0].shape[0]

    def reserve(self, n: int) -> None:
        """Make room for `n` more tokens past `length`."""
        need = self.length + n
        if need <= self.capacity:
            return
        cap = max(need, 2 * self.capacity)
        for store in (self.k, self.v):
            for i, old in enumerate(store):
                new = self._empty(cap)
                new[: self.length] = old[: self.length]
                store[i] = new

    def begin(self, n: int, start: int | None = None) -> None:
        """Start a forward of `n` tokens at `start` (default: after the committed ones)."""
        if start is not None:
            self.length = start
        self.reserve(n)
        self._pending = n

    def commit(self) -> None:
        self.length += self._pending
        self._pending = 0

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int | None = None) -> None:
        s = self.length if start is None else start
        self.k[layer][s : s + k.shape[0]] = k
        self.v[layer][s : s + v.shape[0]] = v

    def dest(self, layer: int, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer `layer`'s K and V rows for positions `start..start+n`, to be written in place."""
        if start + n > self.capacity:  # a short view would be resized by out= kernels, not filled
            raise ValueError(f"rows {start}..{start + n} past the cache's capacity {self.capacity}")
        return self.k[layer][start : start + n], self.v[layer][start : start + n]

    def layer_kv(self, layer: int, n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.length if n is None else n
        return self.k[layer][:n], self.v[layer][:n]

    def truncate(self, n: int) -> None:
        """Forget tokens past `n` (a causal cache's prefix stays valid)."""
        self.length = min(self.length, n)

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
    ) -> torch.Tensor:
        """q `[T, H, D]`, k/v `[T, KvH, D]` for the new tokens; returns `[T, H*D]`."""
        t = q.shape[0]
        self.write(layer, k, v)
        keys, values = self.layer_kv(layer, self.length + t)
        return causal_attention(q, keys, values, scale)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """The last `T` of `S` positions attend causally: query i sees keys 0..S-T+i."""
    t, s = q.shape[0], k.shape[0]
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    gqa = qh.shape[1] != kh.shape[1]
    if t == 1:
        out = F.scaled_dot_product_attention(qh, kh, vh, scale=scale, enable_gqa=gqa)
    elif t == s:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(diagonal=s - t)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.squeeze(0).transpose(0, 1).reshape(t, -1)
