"""Attention over cached rows: the CPU path (prefix and causal block merged by their
log-sum-exp, query heads grouped over their KV head) against a float64 reference."""

import pytest
import torch
import torch.nn.functional as F

from hcache.kernels import native
from hcache.model import attention
from hcache.model.attention import _matmul_attention, causal_attention


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    t, s = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0).double() for x in (q, k, v))
    kh, vh = kh.repeat_interleave(group, 1), vh.repeat_interleave(group, 1)
    mask = torch.ones(t, s, dtype=torch.bool).tril(diagonal=s - t)
    return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask).squeeze(0).transpose(0, 1).reshape(t, -1)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("t,s", [(1, 1), (1, 70), (9, 9), (9, 200), (64, 700), (32, 1600)])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4)])
def test_matches_reference(dtype, tol, t, s, heads, kv_heads):
    g = torch.Generator().manual_seed(t * 1000 + s)
    q = torch.randn(t, heads, 16, generator=g).to(dtype)
    # the cache's rows are views into a larger pool: strided, never copied
    pool_k = torch.randn(s + 5, kv_heads, 16, generator=g).to(dtype)
    pool_v = torch.randn(s + 5, kv_heads, 16, generator=g).to(dtype)
    k, v = pool_k[3 : 3 + s], pool_v[3 : 3 + s]
    out = causal_attention(q, k, v)
    assert out.shape == (t, heads * 16) and out.dtype == dtype
    assert (out.double() - reference(q, k, v)).abs().max().item() < tol


@pytest.mark.parametrize("path", ["native", "flash", "float32"])
@pytest.mark.parametrize("t,s", [(9, 9), (9, 200), (32, 1600)])
def test_each_cpu_kinds_path_over_a_bfloat16_cache_matches_the_reference(monkeypatch, path, t, s):
    """`Cpu.attention`'s three paths, each run on every CPU that can: our kernel (AVX-512),
    AMX's flash kernel, and the float32 kernels over widened K/V (AVX2), which give the
    bits of a float32 cache holding the same values."""
    if path == "native" and native.attention_bf16() is None:
        pytest.skip("our kernel needs AVX-512 and a C++ compiler")
    monkeypatch.setattr(attention, "_PATH", path)
    g = torch.Generator().manual_seed(s)
    q = torch.randn(t, 9, 64, generator=g).bfloat16()
    pool = torch.randn(2, s + 5, 3, 64, generator=g).bfloat16()
    k, v = pool[0, 5:], pool[1, 5:]
    out = causal_attention(q, k, v)
    assert out.dtype == torch.bfloat16 and (out.double() - reference(q, k, v)).abs().max().item() < 2e-2
    if path == "float32":
        assert torch.equal(out, causal_attention(q.float(), k.float(), v.float()).bfloat16())


def test_the_float32_path_serves_callers_in_and_out_of_inference_mode(monkeypatch):
    """Its widened K/V reuse one buffer per thread: made under an engine's inference mode, it
    must still take a copy from a caller outside it (a test, a benchmark)."""
    monkeypatch.setattr(attention, "_PATH", "float32")
    monkeypatch.setattr(attention._scratch, "buf", None, raising=False)
    q, k, v = torch.randn(3, 9, 64).bfloat16(), torch.randn(20, 3, 64).bfloat16(), torch.randn(20, 3, 64).bfloat16()
    with torch.inference_mode():
        inside = causal_attention(q, k, v)
    assert torch.equal(causal_attention(q, k, v), inside)


@pytest.mark.parametrize("cache", ["float32", "bfloat16 widened"])
@pytest.mark.parametrize("t,s", [(30, 108), (64, 700), (200, 300)])
def test_a_turn_over_a_float32_cache_gives_the_one_pass_bits(monkeypatch, cache, t, s):
    """A float32 cache (and the float32 path's widened bfloat16 one, AVX2's) attends a turn
    in one masked pass over every key: its rows get the bits the one-pass prefill gave
    them, so a restored session's turn is the never-evicted one's."""
    monkeypatch.setattr(attention, "_PATH", "float32")
    dtype = torch.float32 if cache == "float32" else torch.bfloat16
    g = torch.Generator().manual_seed(t)
    q = torch.randn(s, 9, 64, generator=g).to(dtype)
    pool = torch.randn(2, s, 3, 64, generator=g).to(dtype)
    whole = causal_attention(q, pool[0], pool[1])
    assert torch.equal(causal_attention(q[s - t :], pool[0], pool[1]), whole[s - t :])


def test_a_query_never_sees_a_later_key():
    q = torch.randn(4, 2, 8)
    k, v = torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    before = causal_attention(q, k, v)
    k2, v2 = k.clone(), v.clone()
    k2[-1], v2[-1] = 100.0, 100.0  # only the last query may see the last key
    after = causal_attention(q, k2, v2)
    assert torch.equal(before[:3], after[:3])
    assert not torch.equal(before[3], after[3])


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
@pytest.mark.parametrize("t", [1, 40, 200])
def test_the_matmul_path_matches_the_reference(t):
    """The path a bfloat16 cache takes without AMX, run here on any CPU: grouped rows in
    whole blocks and a tail, the new block masked causally, over strided keys."""
    g = torch.Generator().manual_seed(t)
    s = 700 + t
    q = (torch.randn(t, 9, 64, generator=g) * 2).bfloat16()
    pool = torch.randn(2, s + 5, 3, 64, generator=g).bfloat16()
    k, v = pool[0, 5:], pool[1, 5:]
    out = _matmul_attention(q, k, v, s - t, None)
    assert out.dtype == torch.bfloat16 and out.shape == (t, 9 * 64)
    assert (out.double() - reference(q, k, v)).abs().max().item() < 2e-2
