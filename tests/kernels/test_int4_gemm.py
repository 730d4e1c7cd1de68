"""Our int4 kernel (hcache/kernels/int4_gemm.cpp), each form this CPU runs (AVX512-VNNI,
AVX2), bit for bit against its reference: the two int8 passes of `int8_rows_mm` over exact
integer sums per group of 32, each group's scale and zero applied in float32 in input
order, at the shapes that take each of its remainder paths."""

import pytest
import torch
from kernel_helpers import form_fixture

from hcache.kernels import native
from hcache.kernels.cpu import cpu
from hcache.model.quant import Int4Linear, int4_from_float, int8_rows_mm

FORMS = {"vnni": lambda: native.int4_gemm() if cpu().vnni else None, "avx2": native.int4_gemm_avx2}
served = native.int4_gemm()
pytestmark = pytest.mark.skipif(served is None, reason=f"needs AVX2 and a C++ compiler; this CPU is {cpu().kind}")


op = form_fixture(FORMS)


def integer_reference(a: torch.Tensor, q: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """uint8 activations around 128 times `(q - 8) * scale + zero`: each group's integer sum
    (exact), times its scale, plus the activations' sum times its zero (both products exact
    in float32), added group after group."""
    ai, qi = a.int() - 128, q.int() - 8
    out = torch.zeros(a.shape[0], q.shape[0])
    for g in range(a.shape[1] // 32):
        cols = slice(32 * g, 32 * g + 32)
        out = out + (ai[:, cols] @ qi[:, cols].T).float() * sz[g, :, 0].float()
        out = out + ai[:, cols].sum(1).float()[:, None] * sz[g, :, 1].float()
    return out


def operands(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 3
    x[0, k // 2] = 300.0  # an outlier channel
    if m > 3:
        x[3] = 0  # a row of zeros
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    sz = (torch.randn(k // 32, n, 2, generator=g) * 0.05).bfloat16()
    return x, q, sz


@pytest.mark.parametrize(
    "m,n,k",
    [
        (1, 16, 32),  # one tile, one group
        (1, 70, 96),  # one row: a tile at a time, a partial last
        (2, 17, 64),  # a tile of one row
        (5, 40, 96),  # rows past a micro-kernel's 4 (both passes of each); tiles past a pair
        (9, 300, 576),  # the default model's K; a partial last tile
        (32, 48, 1536),  # batch 32 over a down projection's K
        (300, 40, 896),  # a prefill chunk
    ],
)
def test_every_output_is_its_reference_bit_for_bit(op, m, n, k):
    x, q, sz = operands(m, n, k, m * 1000 + n)
    tiles = native.int4_pack(q)
    got = op(x, tiles, sz)
    assert torch.equal(got, int8_rows_mm(x, lambda a: integer_reference(a, q, sz), 8))
    # bfloat16 activations are the float32 ones they round to
    assert torch.equal(op(x.bfloat16(), tiles, sz), op(x.bfloat16().float(), tiles, sz))


def test_extreme_values_sum_exactly(op):
    """Activations at +-127 after quantizing and weights at 0 and 15 (-8 and 7 after the
    zero point) in every sign pattern: the AVX2 form sums a group in 16-bit lanes, so its
    largest sums are where it could wrap."""
    k, n = 96, 48
    x = torch.full((6, k), 127.0)
    x[1] = -127.0
    x[2, ::2] = -127.0
    x[3, 1::2] = -127.0
    x[4, : k // 2] = -127.0
    x[5] = torch.where(torch.arange(k) % 4 < 2, 127.0, -127.0)
    q = torch.zeros(n, k, dtype=torch.uint8)
    q[16:32] = 15
    q[32:40, ::2] = 15
    q[40:48] = torch.where(torch.arange(k) % 4 < 2, 15, 0).to(torch.uint8)
    sz = torch.ones(k // 32, n, 2).bfloat16()
    got = op(x, native.int4_pack(q), sz)
    assert torch.equal(got, int8_rows_mm(x, lambda a: integer_reference(a, q, sz), 8))


def test_a_row_has_the_same_bits_alone_in_any_batch_and_on_any_threads(op):
    x, q, sz = operands(70, 200, 96, 3)
    tiles = native.int4_pack(q)
    whole = op(x, tiles, sz)
    for i in (0, 3, 69):
        assert torch.equal(op(x[i : i + 1], tiles, sz), whole[i : i + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(op(x, tiles, sz), whole)
        # more threads than cores: a preempted thread's tile groups are taken by the others
        torch.set_num_threads(8)
        for _ in range(10):
            assert torch.equal(op(x, tiles, sz), whole)
    finally:
        torch.set_num_threads(threads)


def test_bad_operands_are_refused(op):
    x, q, sz = operands(2, 32, 64, 5)
    tiles = native.int4_pack(q)
    with pytest.raises(RuntimeError, match="K differs"):
        op(x[:, :32].contiguous(), tiles, sz)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        native.int4_pack(q[:, :48].contiguous())
    with pytest.raises(RuntimeError, match="past 15"):
        native.int4_pack(q + 16)


def test_the_linear_stays_within_bfloat16_rounding_of_torchs_kernel(monkeypatch):
    """The same groups on our tiles and on torch's int4 kernel, which takes bfloat16
    activations: our two passes keep about 14 bits of each row, so the two differ by their
    different summation and bfloat16's rounding of the output, not by a weight."""
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(96, 128, generator=g), torch.randn(96, generator=g)
    ours = int4_from_float(w, b)
    assert ours.tiles is not None and ours.packed is None
    x = torch.randn(9, 128, generator=g) * 3
    got = ours(x)
    monkeypatch.setattr(native, "int4_gemm", lambda: None)
    theirs = int4_from_float(w, b)
    assert theirs.tiles is None
    want = theirs(x)
    assert ((got - want).abs() <= 2**-7 * want.abs().amax(1, keepdim=True)).all()


def test_fused_rows_and_views_keep_the_separate_calls_bits():
    g = torch.Generator().manual_seed(4)
    mods = tuple(int4_from_float(torch.randn(n, 64, generator=g)) for n in (48, 16, 20))
    cat = Int4Linear.cat(mods)
    x = torch.randn(5, 64, generator=g)
    y = cat(x)
    assert torch.equal(y, torch.cat([m(x) for m in mods], dim=-1))
    assert torch.equal(cat.rows(48, 84)(x), y[:, 48:])
    with pytest.raises(ValueError, match="every 16 rows"):
        cat.rows(50, 84)
    with pytest.raises(ValueError, match="whole tiles"):
        Int4Linear.cat((mods[2], mods[0]))
