"""Next-token choice: greedy, or temperature / top-k / top-p sampling from a seeded generator."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no limit
    seed: int | None = None
    ignore_eos: bool = False  # benchmarks: run to max_new_tokens

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        if not self.temperature >= 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")


class Sampler:
    """One per sequence: the generator carries the seed across steps, so a seeded run repeats exactly."""

    def __init__(self, params: SamplingParams):
        params.validate()
        self.params = params
        self.generator: torch.Generator | None = None
        if params.temperature > 0:
            self.generator = torch.Generator()
            if params.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(params.seed)

    def __call__(self, logits: torch.Tensor, argmax: int | None = None) -> int:
        """logits: `[vocab]` float32; `argmax`, where given, is theirs (taken with them)."""
        p = self.params
        if p.temperature == 0:
            return int(logits.argmax()) if argmax is None else argmax
        logits = logits.float().cpu()
        scaled = logits / p.temperature
        if not torch.isfinite(scaled).all():  # a temperature this small overflows float32: shift to the max first
            scaled = (logits - logits.max()) / p.temperature
        logits = scaled
        if p.top_k:
            kth = torch.topk(logits, min(p.top_k, logits.shape[-1])).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1:
            sorted_p, order = probs.sort(descending=True)
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            drop = sorted_p.cumsum(-1) - sorted_p >= p.top_p
            sorted_p[drop] = 0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        return int(torch.multinomial(probs, 1, generator=self.generator))
