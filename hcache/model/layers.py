"""Building blocks shared by the model files: RMSNorm and rotary embeddings."""

from __future__ import annotations

import math

import torch
from torch import nn

from hcache.kernels.fused import rms_norm, rope
from hcache.model.geometry import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the reference's roundings: normalise in float32, scale in the model dtype
        return rms_norm(x, self.weight, self.eps)


class Rope:
    """Rotary position embedding in the "rotate half" layout of Hugging Face weights."""

    def __init__(self, cfg: ModelConfig, freq_factors: torch.Tensor | None = None):
        dim = cfg.head_dim
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
        sc = cfg.rope_scaling
        if freq_factors is not None:  # GGUF files carry Llama-3 scaling as precomputed factors
            inv = inv / freq_factors.float().cpu()
        elif sc is not None and sc.kind == "linear":
            inv = inv / sc.factor
        elif sc is not None and sc.kind == "llama3":
            inv = _llama3_inv_freq(inv, sc.factor, sc.low_freq_factor, sc.high_freq_factor, sc.original_max_position)
        self._inv = {torch.device("cpu"): inv}

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        dev = positions.device
        if dev not in self._inv:
            self._inv[dev] = self._inv[torch.device("cpu")].to(dev)
        freqs = positions.float()[:, None] * self._inv[dev][None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _llama3_inv_freq(inv: torch.Tensor, factor: float, low: float, high: float, old_ctx: int) -> torch.Tensor:
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x `[T, heads, head_dim]`, cos/sin `[T, head_dim]` (both halves equal, as `Rope` makes
    them), in the rotate-half layout; the result goes to `out` when given (a KV cache's rows)."""
    return rope(x, cos, sin, out)


def linear_into(x: torch.Tensor, lin: nn.Module, out: torch.Tensor | None = None) -> torch.Tensor:
    """`lin(x)` for `x` `[T, in]`, written to `out` (any contiguous tensor of `T * out_features`
    elements, say a KV cache's rows) when given: the same kernel as `lin(x)` (mm, or addmm
    with a bias), so a restore's K/V equal the forward's."""
    if out is None:
        return lin(x)
    dst = out.view(x.shape[0], -1)
    # a packed low-bit kernel has no out=; on CUDA, addmm into a strided out= (a V half of the
    # cache's rows) rounds otherwise than `lin(x)`: there the result is computed, then copied
    if not isinstance(lin, nn.Linear) or x.device.type != "cpu":
        return dst.copy_(lin(x))
    if lin.bias is None:
        return torch.mm(x, lin.weight.t(), out=dst)
    return torch.addmm(lin.bias, x, lin.weight.t(), out=dst)
