"""A sequence's decode step gives the same bits alone and in any batch, eager and compiled:
its attention covers whole key blocks with the rest masked (`decode_attention`), so the
padding a batch adds around it changes nothing. Without this, sessions served together
and one at a time diverge (a bfloat16 KV pool flipped one greedy token in 64 sessions)."""

from __future__ import annotations

import pytest
import torch

from hcache.engine.block_pool import BatchCache, BlockPool, PagedCache
from hcache.model.base import DecoderModel
from hcache.model.decode import BLOCK_TOKENS, DecodeGraph

# the batch's other sequences are shorter and longer, in and past the first 512-key block
LENGTHS = [37, 5, 130, 63, 700, 64, 1100]


def _sessions(model: DecoderModel, kv_dtype: torch.dtype) -> tuple[BlockPool, list[PagedCache]]:
    """Sequences of LENGTHS with random K/V rows (finite: masked rows are read, weighted 0)."""
    cfg = model.cfg
    pool = BlockPool(cfg, kv_dtype, "cpu", sum(n // BLOCK_TOKENS + 2 for n in LENGTHS) + 1)
    g = torch.Generator().manual_seed(3)
    caches = []
    for i, n in enumerate(LENGTHS):
        c = PagedCache(pool)
        c.begin(n)
        for layer in range(cfg.num_layers):
            shape = (n, cfg.num_kv_heads, cfg.head_dim)
            c.write(layer, torch.randn(shape, generator=g), torch.randn(shape, generator=g))
        c.commit()
        if i == 2:  # a sequence whose blocks are not one run
            gap = pool.allocate(1)
            c.reserve(BLOCK_TOKENS)
            pool.release(gap)
        caches.append(c)
    return pool, caches


def _eager(model: DecoderModel, caches: list[PagedCache], idx: list[int]) -> torch.Tensor:
    tokens = torch.tensor([11 + i for i in idx])
    positions = torch.tensor([caches[i].length for i in idx])
    h = model(tokens, positions, BatchCache([caches[i] for i in idx]))
    for i in idx:
        caches[i].truncate(LENGTHS[i])
    return model.logits(h)


def _compiled(graph: DecodeGraph, pool: BlockPool, caches: list[PagedCache], idx: list[int]) -> torch.Tensor:
    for i in idx:
        caches[i].reserve(1)
    lengths = [caches[i].length for i in idx]
    out = graph([11 + i for i in idx], lengths, lengths, [caches[i].blocks for i in idx], pool.kv)
    return out.logits


@pytest.mark.parametrize("decode", ["eager", "compiled"])
def test_a_sequence_decodes_to_the_same_bits_alone_and_in_any_batch(served_default, decode):
    """As served (int4 weights, a bfloat16 pool), whose int4 and int8 kernels round a row
    alike in any batch. (Float32 linears do not: MKL rounds one row, a GEMV, otherwise
    than the same row in a GEMM; attention is checked in both dtypes in test_block_pool.)
    The compiled form is the warmed graph: no batch here may compile another."""
    model = served_default.model
    pool, caches = _sessions(model, torch.bfloat16)
    graph = served_default.graph if decode == "compiled" else None

    def step(idx: list[int]) -> torch.Tensor:
        return _eager(model, caches, idx) if graph is None else _compiled(graph, pool, caches, idx)

    everyone = list(range(len(LENGTHS)))
    together = step(everyone)
    pairs = step([4, 0, 6, 1])
    for i in everyone:
        alone = step([i])[0]
        assert torch.equal(alone, together[i]), (decode, LENGTHS[i])
    for j, i in enumerate([4, 0, 6, 1]):
        assert torch.equal(pairs[j], together[i]), (decode, LENGTHS[i])
    assert served_default.graph.graphs() == served_default.warmed
