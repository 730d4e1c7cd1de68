"""The paged pool: a decode step of several sequences attends in one call per layer over
their gathered rows, and equals attending per sequence."""

import pytest
import torch

from hcache.engine.block_pool import BLOCK_TOKENS, BatchCache, BlockPool, PagedCache
from hcache.model.loader import DEFAULT_GEOMETRY


def _filled(pool: BlockPool, n: int, seed: int) -> PagedCache:
    c = PagedCache(pool)
    c.begin(n)
    g = torch.Generator().manual_seed(seed)
    for layer in range(pool.cfg.num_layers):
        shape = (n, pool.cfg.num_kv_heads, pool.cfg.head_dim)
        c.write(layer, torch.randn(shape, generator=g), torch.randn(shape, generator=g))
    c.commit()
    return c


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_decode_equals_per_sequence(dtype):
    """Each sequence's keys are whole blocks, the rest masked, alone or padded: to the bit
    (float32 through MKL only with its reproducible mode, which `hcache` sets)."""
    cfg = DEFAULT_GEOMETRY
    pool = BlockPool(cfg, dtype, "cpu", 32)
    a = _filled(pool, 70, 1)
    b = _filled(pool, 5, 2)
    gap = pool.allocate(1)
    b.begin(BLOCK_TOKENS)
    b.commit()  # b grows past its block: its second block is not next to its first
    pool.release(gap)
    c = _filled(pool, 130, 3)
    d = _filled(pool, 900, 4)  # past the attention kernel's first 512 keys
    caches = [a, b, c, d]
    assert not all(x.contiguous for x in caches)
    lengths = [x.length for x in caches]
    g = torch.Generator().manual_seed(9)
    q = torch.randn(4, cfg.num_heads, cfg.head_dim, generator=g)
    k = torch.randn(4, cfg.num_kv_heads, cfg.head_dim, generator=g).to(dtype)
    v = torch.randn(4, cfg.num_kv_heads, cfg.head_dim, generator=g).to(dtype)

    batch = BatchCache(caches)
    batch.begin(4)
    got = batch.attend(4, q, k, v)
    batch.commit()
    assert [x.length for x in caches] == [n + 1 for n in lengths]
    for i, x in enumerate(caches):  # the new rows landed where each sequence keeps them
        keys, values = x.layer_kv(4)
        assert torch.equal(keys[-1], k[i]) and torch.equal(values[-1], v[i])

    for x, n in zip(caches, lengths, strict=True):
        x.truncate(n)
    want = []
    for i, x in enumerate(caches):
        x.begin(1)
        want.append(x.attend(4, q[i : i + 1], k[i : i + 1], v[i : i + 1]))
        x.commit()
    assert torch.equal(got, torch.cat(want))
