"""One decode step for a batch of sequences, compiled whole: a token per sequence
through every layer and the LM head in one graph.

K/V live in per-layer pools of 64-token blocks, token-major `[rows, kv_heads, head_dim]`;
a sequence's blocks are a row of a block table. Inside the graph each layer writes the
new token's K/V to its pool row, gathers every sequence's rows (padded to the longest,
the padding masked) and attends in one call, a KV head's query heads as that head's
query rows so K/V are never repeated. Eager, the same step is about 450 small ops and
their Python dispatch; compiled, inductor fuses the elementwise chains around the
matmul kernels and the step pays one guard check.

Shapes are dynamic: one graph serves a single sequence and one every larger batch, at
any context length, so a request never waits for a compile once `warm` ran."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hcache.model.base import DecoderModel

log = logging.getLogger(__name__)

BLOCK_TOKENS = 64  # tokens per block of the engine's pool (engine/block_pool.py)


@dataclass
class StepOut:
    logits: torch.Tensor  # [B, vocab] float32
    hidden: torch.Tensor  # [L, B, hidden]: each layer's input (what the H store keeps)
    kv: torch.Tensor  # [L, B, 2, kv_dim]: each layer's new K then V as the pool holds them (the KV store's rows)


class _Paged:
    """The cache contract (model/cache.py) inside a traced step: `rows` `[B]` is where each
    sequence's new K/V go, `keys(pool)` its K/V rows `[B, width, kv_heads, head_dim]`
    (the new token's included) and `mask` which of them it attends to (None: all)."""

    def __init__(
        self,
        k: list[torch.Tensor],
        v: list[torch.Tensor],
        rows: torch.Tensor,
        keys: Callable[[torch.Tensor], torch.Tensor],
        mask: torch.Tensor | None,
    ):
        self.k, self.v, self.rows, self.keys, self.mask = k, v, rows, keys, mask
        self.new: list[torch.Tensor] = []  # per layer, the rows written: [B, 2, kv_dim]

    def begin(self, n: int, start: int | None = None) -> None:
        pass

    def commit(self) -> None:
        pass

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
    ) -> torch.Tensor:
        pk, pv = self.k[layer], self.v[layer]
        pk.index_copy_(0, self.rows, k.to(pk.dtype))
        pv.index_copy_(0, self.rows, v.to(pv.dtype))
        self.new.append(torch.stack((k.to(pk.dtype), v.to(pv.dtype)), 1).flatten(2))
        b, kvh, d = q.shape[0], k.shape[1], k.shape[2]
        keys, values = self.keys(pk).transpose(1, 2), self.keys(pv).transpose(1, 2)
        # in the pool's dtype (a bfloat16 pool under float32 activations: q is cast, not K/V)
        qg = q.to(pk.dtype).view(b, kvh, -1, d)
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=self.mask, scale=scale)
        return out.reshape(b, -1).to(q.dtype)


def _forward(
    model: DecoderModel, tokens: torch.Tensor, positions: torch.Tensor, cache: _Paged
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    h = model.embed(tokens, positions)
    pos = model.pos_context(positions)
    hidden = []
    for i, layer in enumerate(model.layers):
        hidden.append(h)
        h = layer(h, pos, cache, i)
    return model.lm_head(model.head_norm(h)).float(), torch.stack(hidden), torch.stack(cache.new)


def _step_one(
    model: DecoderModel,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    k: list[torch.Tensor],
    v: list[torch.Tensor],
    end: int,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sequence whose `width` rows (its new token's last) end before pool row `end`:
    attention reads them where they lie."""
    start = end - width
    rows = torch.full((1,), end - 1, dtype=torch.long, device=tokens.device)
    kvh, d = k[0].shape[1:]
    cache = _Paged(k, v, rows, lambda pool: pool.narrow(0, start, width).view(1, width, kvh, d), None)
    return _forward(model, tokens, positions, cache)


def _step_batch(
    model: DecoderModel,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    lengths: torch.Tensor,
    table: torch.Tensor,
    k: list[torch.Tensor],
    v: list[torch.Tensor],
    width: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sequences of `lengths` `[B]` rows before this token, their blocks a row of `table`
    `[B, blocks]` (padded with any valid block); `width`: the longest with its new token.
    Each layer gathers every sequence's rows, padded to `width`, the padding masked."""
    b, dev = tokens.shape[0], tokens.device
    kvh, d = k[0].shape[1:]
    all_rows = (table[:, :, None] * BLOCK_TOKENS + torch.arange(BLOCK_TOKENS, device=dev)).view(b, -1)
    flat = all_rows[:, :width].reshape(-1)
    rows = all_rows.gather(1, lengths[:, None]).view(b)
    mask = (torch.arange(width, device=dev)[None, :] <= lengths[:, None])[:, None, None, :]
    cache = _Paged(k, v, rows, lambda pool: pool.index_select(0, flat).view(b, width, kvh, d), mask)
    return _forward(model, tokens, positions, cache)


class DecodeGraph:
    """The decode step of one model, compiled: one graph for a single sequence whose
    blocks are one run, one for every other batch (a lone fragmented sequence runs as a
    batch of two copies of itself: both write the same K/V to the same rows)."""

    def __init__(self, model: DecoderModel):
        import torch._dynamo.config
        import torch._inductor.config

        torch._inductor.config.emulate_precision_casts = True  # the eager forms' roundings
        # a graph per model (the model is a guarded input): several models in one process
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.model = model
        self._one = torch.compile(_step_one, dynamic=True, fullgraph=True)
        self._batch = torch.compile(_step_batch, dynamic=True, fullgraph=True)

    def __call__(
        self,
        tokens: list[int],
        positions: list[int],
        lengths: list[int],
        blocks: list[list[int]],
        k: list[torch.Tensor],
        v: list[torch.Tensor],
    ) -> StepOut:
        """Sequence i feeds `tokens[i]` at `positions[i]`; it holds `lengths[i]` rows in the
        pools `k`, `v`, in `blocks[i]`, which already has room for one more."""
        dev = k[0].device
        n = len(tokens)
        with torch.inference_mode():
            if n == 1 and blocks[0][-1] - blocks[0][0] == len(blocks[0]) - 1:
                end = blocks[0][0] * BLOCK_TOKENS + lengths[0] + 1
                t, pos = torch.tensor(tokens, device=dev), torch.tensor(positions, device=dev)
                logits, hidden, kv = self._one(self.model, t, pos, k, v, end, lengths[0] + 1)
                return StepOut(logits, hidden, kv)
            if n == 1:
                tokens, positions, lengths, blocks = tokens * 2, positions * 2, lengths * 2, blocks * 2
            cols = max(2, *(len(b) for b in blocks))  # never 1: that size would get a graph of its own
            table = torch.tensor([b + b[-1:] * (cols - len(b)) for b in blocks], device=dev)
            logits, hidden, kv = self._batch(
                self.model,
                torch.tensor(tokens, device=dev),
                torch.tensor(positions, device=dev),
                torch.tensor(lengths, device=dev),
                table,
                k,
                v,
                max(lengths) + 1,
            )
        return StepOut(logits[:n], hidden[:, :n], kv[:, :n])

    def warm(self, k: list[torch.Tensor], v: list[torch.Tensor], free_block: int) -> float:
        """Compile both graphs now, on rows of one free pool block (written and left as
        garbage: a free block holds nothing). Returns the seconds it took."""
        t0 = time.perf_counter()
        # compile even where serving already refuses to (`serve_compiled_only`: a later engine)
        with torch.compiler.set_stance("default"):
            for n in (2, 3):  # two values of each size, so that none is compiled as a constant
                self([0], [n], [n], [[free_block]], k, v)
                # sizes that differ from each other, so none is assumed equal to another
                self([0] * n, [n] * n, [n] * n, [[free_block] * (n + 2)] * n, k, v)
        took = time.perf_counter() - t0
        log.info("decode step compiled in %.1f s", took)
        return took
