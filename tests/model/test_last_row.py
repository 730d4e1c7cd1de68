"""A forward whose last row alone is wanted (a turn, before its first token) may run its last
layer past the K/V for that row only (`DecoderModel.last_row_alone`): that row and every
row's K/V keep the bits of the whole forward."""

import pytest
import torch

from hcache.kernels import native
from hcache.kernels.fused import MIN_ROWS
from hcache.model.attention import rows_alone
from hcache.model.cache import KVCache
from hcache.model.loader import load

PREFIX = 100


def _packed(tiny_folder, name: str):
    if not rows_alone(torch.bfloat16, 16):
        pytest.skip("our attention kernel needs AVX-512 and a C++ compiler")
    if native.int4_gemm() is None:
        pytest.skip("our int4 kernel needs AVX2 and a C++ compiler")
    return load(str(tiny_folder(name)), "float32", weights="packed").model


@pytest.mark.parametrize("name", ["llama_mha", "qwen2_bias"])
def test_the_last_row_alone_gets_the_bits_of_the_whole_forward(tiny_folder, name):
    m = _packed(tiny_folder, name)
    g = torch.Generator().manual_seed(0)
    cache = KVCache(m.cfg, torch.bfloat16, capacity=PREFIX + MIN_ROWS)
    m(torch.randint(0, m.cfg.vocab_size, (PREFIX,), generator=g), torch.arange(PREFIX), cache)
    for t in (2, 9, MIN_ROWS - 1):
        assert m.last_row_alone(t, cache.dtype)
        ids, pos = torch.randint(0, m.cfg.vocab_size, (t,), generator=g), torch.arange(PREFIX, PREFIX + t)
        cache.length = PREFIX
        whole = m(ids, pos, cache)
        kv = [
            (k[PREFIX : PREFIX + t].clone(), v[PREFIX : PREFIX + t].clone())
            for k, v in zip(cache.k, cache.v, strict=True)
        ]
        cache.length = PREFIX
        alone = m(ids, pos, cache, last_only=True)
        assert alone.shape == (1, m.cfg.hidden_size)
        assert torch.equal(alone, whole[-1:]), t
        for layer, (k, v) in enumerate(kv):
            assert torch.equal(cache.k[layer][PREFIX : PREFIX + t], k), (t, layer)
            assert torch.equal(cache.v[layer][PREFIX : PREFIX + t], v), (t, layer)


def test_rows_run_alone_only_where_every_op_computes_a_row_alone(tiny_folder):
    m = _packed(tiny_folder, "llama_mha")
    assert m.last_row_alone(32, torch.bfloat16)
    assert not m.last_row_alone(1, torch.bfloat16)  # a decode step: its own kernel
    assert not m.last_row_alone(MIN_ROWS, torch.bfloat16)  # compiled norms round otherwise
    assert not m.last_row_alone(32, torch.float32)  # torch's flash kernel blocks rows together
    float_weights = load(str(tiny_folder("llama_mha")), "float32").model
    assert not float_weights.last_row_alone(32, torch.bfloat16)  # a float GEMM may too
