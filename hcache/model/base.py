"""The decoder loop shared by every architecture. A forward can record each
layer's input hidden state (what the H store keeps) and can stop after a prefix
of layers (what the RE restore path runs). `kv_from_hidden` is the H restore
path: the same projection and RoPE the forward applies, from a given hidden state."""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from hcache.kernels.fused import MIN_ROWS
from hcache.model.attention import rows_alone
from hcache.model.cache import Cache
from hcache.model.geometry import ModelConfig
from hcache.model.quant import Int4Linear, Int8Linear

# where a layer's K and V `[T, kv_heads, head_dim]` go (a KV cache's rows), or None: new tensors
KVOut = tuple[torch.Tensor, torch.Tensor] | None


class DecoderLayer(nn.Module, ABC):
    @abstractmethod
    def forward(self, h: torch.Tensor, pos: Any, cache: Cache, index: int, last_only: bool = False) -> torch.Tensor:
        """`h` `[T, hidden]` -> `[T, hidden]`, the rows' K/V into `cache`. With `last_only`, every
        row's K/V still, but the rest for the last row alone: `[1, hidden]` (`last_row_alone`)."""

    @abstractmethod
    def kv_from_hidden(self, h: torch.Tensor, pos: Any, out: KVOut = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Post-RoPE K and V `[T, kv_heads, head_dim]` of this layer from its input `h` `[T, hidden]`,
        written to `out` (contiguous, the model's dtype) when given."""


class DecoderModel(nn.Module, ABC):
    cfg: ModelConfig
    layers: nn.ModuleList
    lm_head: nn.Module

    @abstractmethod
    def embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def pos_context(self, positions: torch.Tensor) -> Any:
        """Per-forward position data handed to every layer (RoPE cos/sin, or None)."""

    @abstractmethod
    def head_norm(self, h: torch.Tensor) -> torch.Tensor:
        """Whatever sits between the last layer and the LM head."""

    def shift_keys(self, k: torch.Tensor, delta: int) -> torch.Tensor:
        """Keys `[T, kv_heads, head_dim]` of tokens moved `delta` positions later. Without
        rotary embeddings keys do not encode their position: they stay as they are."""
        return k

    @property
    def dtype(self) -> torch.dtype:
        """The activations' and the KV cache's dtype: the first float parameter's (weights
        may be quantized)."""
        return self._float_param().dtype

    @property
    def weights(self) -> str:
        """The weight mode `load` gave: "packed" where linear layers run packed low-bit kernels."""
        return "packed" if any(isinstance(m, (Int4Linear, Int8Linear)) for m in self.modules()) else "float"

    def weight_bytes(self) -> int:
        """Bytes the weights hold resident: every tensor once (tied and viewed ones share
        storage), plus oneDNN's prepacked copies."""
        return _bytes(self)

    def step_bytes(self) -> int:
        """Bytes of weights a decode step streams: every layer, the final norm and the LM
        head (the embedding table only where the head is tied to it; a step looks up one row)."""
        norm = getattr(self, "norm", None)
        return _bytes(*self.layers, *([norm] if norm is not None else []), self.lm_head)

    @property
    def device(self) -> torch.device:
        return self._float_param().device

    def last_row_alone(self, t: int, kv_dtype: torch.dtype) -> bool:
        """May a forward of `t` new rows whose last row alone is wanted run its last layer past
        the K/V for that row only (`DecoderLayer.forward`'s `last_only`)? Where it gets the
        bits it gets beside the other rows: our attention kernel, which computes each row on
        its own, packed weights whose kernels do too (a float GEMM may block a row's sum
        by the rows beside it), and eager norms (fewer than `MIN_ROWS` rows; the compiled
        ones round otherwise). A turn's last layer then skips all but one row's attention
        and MLP."""
        if not (1 < t < MIN_ROWS and self.device.type == "cpu" and rows_alone(kv_dtype, self.cfg.head_dim)):
            return False
        linears = [m for m in self.layers[-1].modules() if isinstance(m, (nn.Linear, Int4Linear, Int8Linear))]
        return all(isinstance(m, Int8Linear) or (isinstance(m, Int4Linear) and m.tiles is not None) for m in linears)

    def _float_param(self) -> torch.Tensor:
        ref = self.__dict__.get("_ref")
        if ref is None:
            ref = next(p for p in self.parameters() if p.is_floating_point())
            self.__dict__["_ref"] = ref
        return ref

    def _apply(self, fn: Callable, recurse: bool = True) -> DecoderModel:  # .to() makes new tensors
        self.__dict__.pop("_ref", None)
        return super()._apply(fn, recurse)

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: Cache,
        hidden_out: torch.Tensor | dict[int, torch.Tensor] | None = None,
        num_layers: int | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Run `tokens` `[T]` at `positions` `[T]`, appending their K/V to `cache`.

        hidden_out: `[L, T, hidden]` or {layer: `[T, hidden]`}; layer l's input is copied to `hidden_out[l]`
            (a staging-ring slot: the one copy per layer of the save path).
        num_layers: run only layers 0..n-1 (recompute a prefix) and return layer n's input.
        last_only: the last layer runs past its K/V for the last row alone, the only row
            returned (where the caller found `last_row_alone`).
        Returns the final normalised hidden states `[T, hidden]` (or layer n's input)."""
        n = self.cfg.num_layers if num_layers is None else num_layers
        cache.begin(tokens.shape[0])
        h = self.embed(tokens, positions)
        pos = self.pos_context(positions)
        for i in range(n):
            dst = _slot(hidden_out, i)
            if dst is not None:
                dst.copy_(h)
            h = self.layers[i](h, pos, cache, i, last_only=last_only and i == self.cfg.num_layers - 1)
        cache.commit()
        return self.head_norm(h) if n == self.cfg.num_layers else h

    def prefix_steps(self, tokens: list[int], cache: Cache) -> Iterator[int]:
        """`forward` of `tokens` from position 0, a layer per step: yields each layer's index
        once its K/V are in `cache`. Other forwards may use `cache` between steps (each step
        frames its own), and nothing is committed: the caller sets the length it restored.
        The caller holds `torch.inference_mode` (a generator cannot)."""
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(len(tokens), device=self.device)
        h = self.embed(ids, positions)
        pos = self.pos_context(positions)
        for i in range(self.cfg.num_layers):
            cache.begin(len(tokens), start=0)
            h = self.layers[i](h, pos, cache, i)
            yield i

    @torch.inference_mode()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h).float()

    def fingerprint(self) -> str:
        """Identifies what stored state depends on: geometry, dtype and the weights themselves
        (a strided sample of every tensor, so loading a 7B model does not hash 14 GB). An int8
        matrix counts by its scales and bias alone: its rows live in whichever packed form
        this CPU runs (our tiles, oneDNN's opaque copy, or the rows), all the same weights,
        so replicas on other CPU kinds share its sessions."""
        h = hashlib.sha256(json.dumps(self.cfg.fingerprint_fields(), sort_keys=True).encode())
        h.update(str(self.dtype).encode())
        packed = [n for n, m in self.named_modules() if isinstance(m, Int8Linear)]
        int8 = {f"{n}.{b}" for n in packed for b in ("q", "tiles", "sums")}
        for name, t in sorted(self.state_dict().items()):
            if name in int8:
                continue
            flat = t.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 65536)].contiguous().cpu()
            h.update(name.encode())
            h.update(str(tuple(t.shape)).encode())
            h.update(sample.view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    @torch.inference_mode()
    def kv_from_hidden(
        self, layer: int, h: torch.Tensor, positions: torch.Tensor, out: KVOut = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layers[layer].kv_from_hidden(h, self.pos_context(positions), out)


def _slot(hidden_out: torch.Tensor | dict[int, torch.Tensor] | None, layer: int) -> torch.Tensor | None:
    if isinstance(hidden_out, dict):
        return hidden_out.get(layer)
    return None if hidden_out is None else hidden_out[layer]


def _bytes(*mods: nn.Module) -> int:
    """Bytes of the modules' tensors, each storage once, plus oneDNN's prepacked copies."""
    seen: dict[int, int] = {}
    for t in [p for m in mods for p in (*m.parameters(), *m.buffers())]:
        st = t.untyped_storage()
        seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
    packed = {id(m): m.packed_bytes for mod in mods for m in mod.modules() if isinstance(m, Int8Linear)}
    return sum(seen.values()) + sum(packed.values())
