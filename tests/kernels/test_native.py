"""Our attention kernel (hcache/kernels/attention_bf16.cpp, attention_avx2.cpp), in the form
this CPU builds (AVX512-BF16 dot products, or the same arithmetic from AVX-512F or AVX2 FMAs),
against a float64 reference; the property the engine leans on: a position's output has the
same bits whether its prompt was attended in one call or in pieces; and the forms' bits
against each other."""

import shutil

import pytest
import torch
import torch.nn.functional as F

from hcache.kernels import COMPILE, native
from hcache.kernels.cpu import cpu
from hcache.model.attention import _matmul_attention

op = native.attention_bf16()
needs_op = pytest.mark.skipif(op is None, reason=f"needs AVX2 and a C++ compiler; this CPU is {cpu().kind}")


@pytest.mark.skipif(not COMPILE or shutil.which("c++") is None, reason="no C++ compiler, or HCACHE_COMPILE=0")
@pytest.mark.parametrize("form", native.FORMS, ids=lambda k: k.name)
def test_every_form_this_cpu_runs_builds(form):
    """A form whose build fails serves on library kernels with a warning, and its tests would
    skip as if this CPU lacked it: each form this CPU runs must build."""
    if not form.runs_here():
        pytest.skip(f"{form.name} does not run on this CPU ({cpu().kind})")
    assert form.get() is not None, f"{form.name} did not build (its warning is in the log)"


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    t, s = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0).double() for x in (q, k, v))
    kh, vh = kh.repeat_interleave(group, 1), vh.repeat_interleave(group, 1)
    mask = torch.ones(t, s, dtype=torch.bool).tril(diagonal=s - t)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return out.squeeze(0).transpose(0, 1).reshape(t, -1)


def inputs(t: int, s: int, heads: int, kv_heads: int, d: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(t, heads, d, generator=g) * 2).bfloat16()
    # rows of a larger pool, one KV head skipped: strided in both leading dims, never copied
    pool = torch.randn(2, s + 3, kv_heads + 1, d, generator=g).bfloat16()
    return q, pool[0, 3:, 1:], pool[1, 3:, 1:]


@pytest.mark.parametrize(
    "t,s,heads,kv_heads,d",
    [
        (2, 2, 9, 3, 64),  # the first rows see one key
        (32, 8032, 9, 3, 64),  # a turn over a long context: 8 spans of keys, 1 block of rows
        (70, 70, 9, 3, 64),  # a prompt: rows in 3 blocks, the last one partial
        (5, 1100, 4, 4, 128),  # multi-head, head dim 128, a span boundary inside
        (33, 300, 8, 2, 16),  # the tiny models' head dim
        (17, 700, 6, 2, 80),  # a head dim of 5 vectors: P V in blocks of 4 and of 1
        (200, 3000, 9, 3, 64),  # a prefill chunk: blocks of rows that end mid-head-group
    ],
)
@needs_op
def test_matches_the_reference_as_closely_as_the_matmul_path(t, s, heads, kv_heads, d):
    q, k, v = inputs(t, s, heads, kv_heads, d, t * 7 + s)
    scale = d**-0.5
    want = reference(q, k, v, scale)
    out = op(q, k, v, scale)
    assert out.dtype == torch.bfloat16 and out.shape == (t, heads * d)
    err = (out.double() - want).abs().max().item() / want.abs().max().item()
    ours_before = (_matmul_attention(q, k, v, s - t, scale).double() - want).abs().max().item()
    assert err < 1e-2
    assert err <= 1.5 * ours_before / want.abs().max().item()


@pytest.mark.parametrize(
    "pieces",
    [
        (64, 300, 236),  # a prompt in chunks
        (32, 1),  # a turn of 33 rows per head group: its rows in even blocks, unlike 32 + 1's
    ],
)
@needs_op
def test_a_position_has_the_same_bits_in_one_call_or_in_pieces(pieces):
    t, s = sum(pieces), 2600
    q, k, v = inputs(t, s, 9, 3, 64, 1)
    whole = op(q, k, v, 0.125)
    # the last t positions of s, as chunks of rows, each over the keys so far
    done, parts = s - t, []
    for n in pieces:
        parts.append(op(q[done - (s - t) : done - (s - t) + n], k[: done + n], v[: done + n], 0.125))
        done += n
    assert torch.equal(torch.cat(parts), whole)


@needs_op
def test_the_threads_change_no_bit():
    """Many row blocks run a block per thread, few share their key spans across threads: the
    same partials merged in the same order either way."""
    q, k, v = inputs(200, 3000, 9, 3, 64, 4)  # 21 blocks of rows: per block on 2 threads, shared on 8
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        few = op(q, k, v, 0.125)
        torch.set_num_threads(8)
        many = [op(q, k, v, 0.125) for _ in range(5)]  # more threads than cores: spans change hands
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(few, m) for m in many)


@needs_op
def test_a_row_never_sees_a_later_key():
    q, k, v = inputs(4, 1500, 9, 3, 64, 2)
    before = op(q, k, v, 0.125)
    k2, v2 = k.clone(), v.clone()
    k2[-1], v2[-1] = 30.0, 30.0  # only the last row may see the last key
    after = op(q, k2, v2, 0.125)
    assert torch.equal(before[:3], after[:3])
    assert not torch.equal(before[3], after[3])


@needs_op
def test_bad_input_is_refused():
    q, k, v = inputs(4, 10, 9, 3, 64, 3)
    with pytest.raises(RuntimeError, match="bfloat16"):
        op(q.float(), k, v, 0.125)
    with pytest.raises(RuntimeError, match="head_dim"):
        op(q[..., :40], k[..., :40], v[..., :40], 0.125)


@pytest.mark.skipif(not cpu().bf16, reason="needs AVX512-BF16 to run both forms")
@pytest.mark.parametrize("t,s,heads,kv_heads,d", [(32, 3000, 9, 3, 64), (200, 1100, 14, 2, 64), (33, 300, 8, 2, 16)])
@needs_op
def test_the_avx512f_form_gives_the_dot_product_forms_bits(t, s, heads, kv_heads, d):
    """Replicas on CPUs with and without AVX512-BF16 share sessions: a turn must attend to
    the same bits on either (inputs without subnormals, which the instruction reads as 0)."""
    f = native.attention_avx512f()
    assert f is not None
    q, k, v = inputs(t, s, heads, kv_heads, d, t + s)
    assert torch.equal(f(q, k, v, d**-0.5), op(q, k, v, d**-0.5))


@pytest.mark.skipif(
    not cpu().avx512, reason=f"needs AVX-512 to run an AVX-512 form beside the AVX2 one; this CPU is {cpu().kind}"
)
@pytest.mark.parametrize(
    "t,s,heads,kv_heads,d",
    [(1, 900, 9, 3, 64), (32, 3000, 9, 3, 64), (200, 1100, 14, 2, 64), (33, 300, 8, 2, 16), (7, 7, 4, 4, 128)],
)
@needs_op
def test_the_avx2_form_gives_the_served_forms_bits(t, s, heads, kv_heads, d):
    """AVX2 and AVX-512 replicas share sessions: the served form and the AVX2 one attend to
    the same bits (rows past a vector of 8, odd key counts, every head size's tiles)."""
    f = native.attention_avx2()
    assert f is not None
    q, k, v = inputs(t, s, heads, kv_heads, d, t + s)
    assert torch.equal(f(q, k, v, d**-0.5), op(q, k, v, d**-0.5))
