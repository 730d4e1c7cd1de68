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
any context length, so a request never waits for a compile once `warm` ran.

`tuned`, on packed low-bit weights (CPU), freezes and autotunes the batch graph: inductor's C++
GEMM templates (AMX tiles where the CPU has them) replace torch's int4/int8 weight-only
kernels, which compute a row at a time. The templates keep their own packed copy of each
weight (see `frozen_bytes`) and float32 outputs where torch's kernels round theirs to
bfloat16, so the step is not bit-identical to the eager forward (its K/V differ within
that rounding), which is why it is not the default. The single-sequence graph keeps
torch's kernels, the faster ones for one row."""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hcache.model.base import DecoderModel
from hcache.model.quant import Int4Linear, Int8Rows

log = logging.getLogger(__name__)

BLOCK_TOKENS = 64  # tokens per block of the engine's pool (engine/block_pool.py)


@dataclass
class StepOut:
    logits: torch.Tensor  # [B, vocab] float32
    hidden: torch.Tensor  # [L, B, hidden]: each layer's input (what the H store keeps)


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
        b, kvh, d = q.shape[0], k.shape[1], k.shape[2]
        keys, values = self.keys(pk).transpose(1, 2), self.keys(pv).transpose(1, 2)
        out = F.scaled_dot_product_attention(q.view(b, kvh, -1, d), keys, values, attn_mask=self.mask, scale=scale)
        return out.reshape(b, -1)


def _forward(
    model: DecoderModel, tokens: torch.Tensor, positions: torch.Tensor, cache: _Paged
) -> tuple[torch.Tensor, torch.Tensor]:
    h = model.embed(tokens, positions)
    pos = model.pos_context(positions)
    hidden = []
    for i, layer in enumerate(model.layers):
        hidden.append(h)
        h = layer(h, pos, cache, i)
    return model.lm_head(model.head_norm(h)).float(), torch.stack(hidden)


def _step_one(
    model: DecoderModel,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    k: list[torch.Tensor],
    v: list[torch.Tensor],
    end: int,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor]:
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
) -> tuple[torch.Tensor, torch.Tensor]:
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


class _Bound(nn.Module):
    """`fn(model, ...)` as a module holding the model, so that freezing sees its weights as
    the graph's parameters (a model passed as an argument is an input)."""

    def __init__(self, fn: Callable[..., Any], model: DecoderModel):
        super().__init__()
        self.fn, self.model = fn, model

    def forward(self, *args: Any) -> Any:
        return self.fn(self.model, *args)


class _Frozen(_Bound):
    """The same, under code of its own: dynamo keys its graphs by code object, and a frozen
    graph and a plain one of the same model would otherwise pass each other's guards."""

    def forward(self, *args: Any) -> Any:
        return self.fn(self.model, *args)


def packed_on_cpu(model: DecoderModel) -> bool:
    return model.device.type == "cpu" and any(isinstance(m, (Int4Linear, Int8Rows)) for m in model.modules())


# the batch size the batch graph is compiled at first: autotuning picks each GEMM's kernel
# at this size, and the step's cost is in large batches
TUNE_BATCH = 16


class DecodeGraph:
    """The decode step of one model, compiled: one graph for a single sequence whose
    blocks are one run, one for every other batch (a lone fragmented sequence runs as a
    batch of two copies of itself: both write the same K/V to the same rows)."""

    def __init__(self, model: DecoderModel, tuned: bool = False):
        import torch._dynamo.config
        import torch._inductor.config

        torch._inductor.config.emulate_precision_casts = True  # the eager forms' roundings
        # a graph per model (the model is a guarded input): several models in one process
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.model = model
        self.tuned = tuned and packed_on_cpu(model)
        # epilogue fusion off: fused into the int4 template it broke outputs whose width is no
        # multiple of the template's block (a tiny model's 160-wide MLP came out wrong)
        tune = {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN", "epilogue_fusion": False}
        self._one = torch.compile(_step_one, dynamic=True, fullgraph=True)
        bound = _Frozen(_step_batch, model) if self.tuned else _Bound(_step_batch, model)
        self._batch = torch.compile(bound, dynamic=True, fullgraph=True, options=tune if self.tuned else None)
        self.frozen_bytes = 0  # the tuned graph's own copies of the weights, known after `warm`

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
                logits, hidden = self._one(self.model, t, pos, k, v, end, lengths[0] + 1)
                return StepOut(logits, hidden)
            if n == 1:
                tokens, positions, lengths, blocks = tokens * 2, positions * 2, lengths * 2, blocks * 2
            cols = max(2, *(len(b) for b in blocks))  # never 1: that size would get a graph of its own
            table = torch.tensor([b + b[-1:] * (cols - len(b)) for b in blocks], device=dev)
            # freezing is read outside the options `torch.compile` patches in
            with torch._inductor.config.patch(freezing=True) if self.tuned else contextlib.nullcontext():
                logits, hidden = self._batch(
                    torch.tensor(tokens, device=dev),
                    torch.tensor(positions, device=dev),
                    torch.tensor(lengths, device=dev),
                    table,
                    k,
                    v,
                    max(lengths) + 1,
                )
        return StepOut(logits[:n], hidden[:, :n])

    def warm(self, k: list[torch.Tensor], v: list[torch.Tensor], free_block: int) -> float:
        """Compile both graphs now, on rows of one free pool block (written and left as
        garbage: a free block holds nothing). Returns the seconds it took."""
        t0 = time.perf_counter()
        gc.collect()  # what earlier objects leave behind must not be freed between the counts
        before = _tensor_bytes()
        # compile even where serving already refuses to (`serve_compiled_only`: a later engine)
        with torch.compiler.set_stance("default"):
            for n in (2, 3):  # two values of each size, so that none is compiled as a constant
                self([0], [n], [n], [[free_block]], k, v)
            for n in (TUNE_BATCH, TUNE_BATCH + 1):
                # sizes that differ from each other, so none is assumed equal to another
                self([0] * n, [n] * n, [n] * n, [[free_block] * (n + 2)] * n, k, v)
        self.frozen_bytes = max(0, _tensor_bytes() - before)
        took = time.perf_counter() - t0
        log.info("decode step compiled in %.1f s", took)
        return took


def _tensor_bytes() -> int:
    """Bytes of every live CPU tensor storage (each once): what compiling left behind is
    the difference across it."""
    seen: dict[int, int] = {}
    for o in gc.get_objects():
        # dead weak proxies, fake and opaque tensors raise
        with contextlib.suppress(ReferenceError, RuntimeError, NotImplementedError):
            if type(o) in (torch.Tensor, nn.Parameter) and o.device.type == "cpu" and o.layout == torch.strided:
                st = o.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())
