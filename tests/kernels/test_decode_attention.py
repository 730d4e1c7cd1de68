"""A decode step's attention (`decode_attention`): each form of our kernel this CPU runs
(hcache/kernels/decode_attention.cpp: AVX-512, AVX2) and the inductor path of CPUs without
it, against a float64 reference, and the property the engine leans on: a sequence's output
has the same bits alone or in any batch, wherever its rows lie in the pool and whatever the
padding. The AVX2 form gives the AVX-512 form's bits."""

import pytest
import torch
from kernel_helpers import form_fixture

from hcache.kernels import native
from hcache.kernels.cpu import cpu
from hcache.model.attention import _compiled_decode

FORMS = {"avx512": lambda: native.decode_attention() if cpu().avx512 else None, "avx2": native.decode_attention_avx2}
needs_kernel = pytest.mark.skipif(
    native.decode_attention() is None, reason=f"needs AVX2 and a C++ compiler; this CPU is {cpu().kind}"
)


op = form_fixture(FORMS)


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    out = []
    for b in range(q.shape[0]):
        r = rows[b, : int(lengths[b])]
        kk, vv = k[r].double(), v[r].double()  # [L, KvH, D]
        kvh, d = kk.shape[1:]
        qq = q[b].double().view(kvh, -1, d)
        p = (torch.einsum("hgd,lhd->hgl", qq, kk) * d**-0.5).softmax(-1)
        out.append(torch.einsum("hgl,lhd->hgd", p, vv).reshape(-1))
    return torch.stack(out)


def inputs(lengths: list[int], heads: int, kv_heads: int, d: int, dtype: torch.dtype, seed: int) -> tuple:
    """Sequences scattered over a pool (a KV head skipped: strided rows), each row of `rows`
    padded to a whole key block past its length with rows of other sequences."""
    g = torch.Generator().manual_seed(seed)
    width = -(-max(lengths) // 64) * 64
    n = sum(lengths) + 64
    pool = (torch.randn(2, n, kv_heads + 1, d, generator=g) * 2).to(dtype)
    k, v = pool[0, :, 1:], pool[1, :, 1:]
    perm = torch.randperm(n, generator=g)
    rows = torch.stack([perm[torch.arange(width) * len(lengths) % n] for _ in lengths])
    start = 0
    for b, n_b in enumerate(lengths):  # each sequence's own rows first, disjoint from the others'
        rows[b, :n_b] = perm[start : start + n_b]
        start += n_b
    q = torch.randn(len(lengths), heads, d, generator=g)
    return q, k, v, rows, torch.tensor(lengths)


CASES = [
    ([1, 17, 64, 65], 9, 3, 64),  # a lone key, a partial 16, a whole block, one past it
    ([700, 1100, 5], 14, 2, 64),  # spans of 512 keys: one boundary, two
    ([40, 300], 4, 4, 128),  # multi-head, head dim 128
    ([33, 9], 8, 2, 16),  # the tiny models' head dim
]


@needs_kernel
@pytest.mark.parametrize("lengths,heads,kv_heads,d", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernel_matches_the_reference(op, lengths, heads, kv_heads, d, dtype):
    """float32 products and sums over float32 or widened bfloat16 rows: within float32's
    rounding of a weighted mean of values of a few units."""
    q, k, v, rows, n = inputs(lengths, heads, kv_heads, d, dtype, 1)
    got = op(q, k, v, rows, n, d**-0.5)
    assert got.dtype == torch.float32 and got.shape == (len(lengths), heads * d)
    torch.testing.assert_close(got.double(), reference(q, k, v, rows, n), rtol=0, atol=2e-5)
    half = op(q.bfloat16(), k, v, rows, n, d**-0.5)  # bfloat16 q: the output rounded to it
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.double(), reference(q.bfloat16(), k, v, rows, n), rtol=2**-8, atol=2e-5)


def _alone_and_batched(attend, q, k, v, rows, n) -> None:
    together = attend(q, k, v, rows, n)
    for b in range(q.shape[0]):
        w = -(-int(n[b]) // 64) * 64  # alone, padded only to its own whole block
        assert torch.equal(attend(q[b : b + 1], k, v, rows[b : b + 1, :w], n[b : b + 1]), together[b : b + 1]), b
    # the same rows moved elsewhere in a larger pool
    k2, v2 = torch.cat([v, k]), torch.cat([k, v])
    moved = attend(q, k2, v2, rows + k.shape[0], n)
    assert torch.equal(moved, together)


@needs_kernel
def test_a_sequence_has_the_same_bits_alone_in_a_batch_and_anywhere_in_the_pool(op):
    q, k, v, rows, n = inputs([700, 5, 1100, 64], 9, 3, 64, torch.bfloat16, 2)
    _alone_and_batched(lambda *a: op(*a, 0.125), q, k, v, rows, n)


def test_the_inductor_path_has_the_same_bits_alone_and_batched():
    """CPUs without our kernel run `_decode_rows` compiled, which reads the padding's rows
    and weighs them by exact zeros."""
    q, k, v, rows, n = inputs([130, 5, 70], 9, 3, 64, torch.bfloat16, 3)
    attend = _compiled_decode(q, k)
    _alone_and_batched(lambda *a: attend(*a, 0.125), q, k, v, rows, n)
    torch.testing.assert_close(attend(q, k, v, rows, n, 0.125).double(), reference(q, k, v, rows, n), rtol=0, atol=2e-5)


@needs_kernel
def test_the_threads_change_no_bit(op):
    q, k, v, rows, n = inputs([1100, 300], 14, 2, 64, torch.bfloat16, 4)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = op(q, k, v, rows, n, 0.125)
        torch.set_num_threads(8)
        many = op(q, k, v, rows, n, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


@needs_kernel
def test_rows_past_a_sequence_are_never_read(op):
    q, k, v, rows, n = inputs([100, 30], 9, 3, 64, torch.float32, 5)
    before = op(q, k, v, rows, n, 0.125)
    k2, v2 = k.clone(), v.clone()
    for b in range(2):
        k2[rows[b, int(n[b]) :]] = float("nan")
        v2[rows[b, int(n[b]) :]] = float("nan")
    k2[rows[0, :100]], v2[rows[0, :100]] = k[rows[0, :100]], v[rows[0, :100]]  # sequence 0's padding is 1's rows
    k2[rows[1, :30]], v2[rows[1, :30]] = k[rows[1, :30]], v[rows[1, :30]]
    assert torch.equal(op(q, k2, v2, rows, n, 0.125), before)


@needs_kernel
def test_bad_input_is_refused(op):
    q, k, v, rows, n = inputs([10, 20], 9, 3, 64, torch.bfloat16, 6)
    with pytest.raises(RuntimeError, match="length outside"):
        op(q, k, v, rows, torch.tensor([0, 20]), 0.125)
    with pytest.raises(RuntimeError, match="length outside"):
        op(q, k, v, rows, torch.tensor([10, 65]), 0.125)
    with pytest.raises(RuntimeError, match="outside the pool"):
        op(q, k, v, torch.where(rows == rows[0, 3], k.shape[0], rows), n, 0.125)
    with pytest.raises(RuntimeError, match="head dim of 16, 32"):
        op(q[..., :40], k[..., :40], v[..., :40], rows, n, 0.125)
    with pytest.raises(RuntimeError, match="one dtype"):
        op(q, k, v.float(), rows, n, 0.125)


@pytest.mark.skipif(
    not cpu().avx512, reason=f"needs AVX-512 to run the AVX-512 form beside the AVX2 one; this CPU is {cpu().kind}"
)
@pytest.mark.parametrize("lengths,heads,kv_heads,d", [*CASES, ([2000, 1, 513, 15], 7, 1, 32), ([80], 2, 1, 256)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_avx2_form_gives_the_avx512_forms_bits(lengths, heads, kv_heads, d, dtype):
    """A session decodes alike on AVX2 and AVX-512 replicas: every head size, partial
    groups of 16 keys, spans past 512, float32 and bfloat16 q."""
    avx2, avx512 = native.decode_attention_avx2(), native.decode_attention()
    assert avx2 is not None and avx512 is not None
    q, k, v, rows, n = inputs(lengths, heads, kv_heads, d, dtype, 7)
    for qd in (torch.float32, torch.bfloat16):
        assert torch.equal(avx2(q.to(qd), k, v, rows, n, d**-0.5), avx512(q.to(qd), k, v, rows, n, d**-0.5))
