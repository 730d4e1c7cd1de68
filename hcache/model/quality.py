"""How far a weight mode is from the float oracle: perplexity over a fixed text."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hcache.model.base import DecoderModel
from hcache.model.cache import KVCache


@torch.inference_mode()
def logits_of(model: DecoderModel, ids: list[int], kv_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Float32 logits `[T, vocab]` of one forward over `ids` from position 0, its KV cache in
    `kv_dtype` (default: the model's)."""
    cache = KVCache(model.cfg, kv_dtype or model.dtype, model.device, capacity=len(ids))
    t = torch.tensor(ids, device=model.device)
    return model.logits(model(t, torch.arange(len(ids), device=model.device), cache)).float()


def perplexity(model: DecoderModel, ids: list[int], kv_dtype: torch.dtype | None = None) -> float:
    return perplexity_of(logits_of(model, ids, kv_dtype), ids)


def perplexity_of(logits: torch.Tensor, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of each token after the first."""
    nll = F.cross_entropy(logits[:-1], torch.tensor(ids[1:], device=logits.device))
    return math.exp(nll.item())
