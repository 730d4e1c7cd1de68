"""Our AVX512-VNNI int4 kernel (hcache/kernels/int4_gemm.cpp) bit for bit against its
references at the shapes that take each of its remainder paths: `int4_linear`, the two int8
passes of `int8_rows_mm` over exact integer sums per group of 32, each group's scale and
zero applied in float32 in input order; `int4_group_linear`, one 8-bit pass per group of 32
(`int4_groups_mm`)."""

import pytest
import torch

from hcache.kernels import native
from hcache.kernels.cpu import cpu
from hcache.model.quant import GROUP, Int4Linear, _pow2_scale, int4_from_float, int4_groups_mm, int8_rows_mm

op = native.int4_gemm()
group_op = torch.ops.hcache_int4.int4_group_linear if op is not None else None
pytestmark = pytest.mark.skipif(op is None, reason=f"needs AVX512-VNNI and a C++ compiler; this CPU is {cpu().kind}")


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
        (2, 17, 64),  # a tile of one row
        (5, 40, 96),  # rows past a block of 4 (8 and 2 with the second pass); tiles past a pair
        (9, 300, 576),  # the default model's K; a partial last tile
        (32, 48, 1536),  # batch 32 over a down projection's K
        (300, 40, 896),  # a prefill chunk
    ],
)
@pytest.mark.parametrize("groups", [False, True], ids=["two-passes", "one-pass-groups"])
def test_every_output_is_its_reference_bit_for_bit(m, n, k, groups):
    x, q, sz = operands(m, n, k, m * 1000 + n)
    x = x * torch.logspace(-3, 3, k)  # groups of every magnitude
    tiles = native.int4_pack(q)
    f = group_op if groups else op
    want = int4_groups_mm(x, q, sz) if groups else int8_rows_mm(x, lambda a: integer_reference(a, q, sz), 8)
    assert torch.equal(f(x, tiles, sz), want)
    # bfloat16 activations are the float32 ones they round to
    assert torch.equal(f(x.bfloat16(), tiles, sz), f(x.bfloat16().float(), tiles, sz))


def test_one_pass_per_group_stays_within_its_half_steps():
    """Each output is off the exact product by at most half a step of each group's
    activations times that group's weights' magnitudes, plus float32's rounding."""
    x, q, sz = operands(9, 100, 576, 6)
    x = x * torch.logspace(-2, 2, 576)
    w = ((q.float() - 8).reshape(100, -1, GROUP) * sz[:, :, :1].float().permute(1, 0, 2)).reshape(100, 576)
    w = w + sz[:, :, 1].float().t().repeat_interleave(GROUP, dim=1)
    exact = x.double() @ w.double().T
    steps = _pow2_scale(x.reshape(-1, GROUP), 8).reshape(9, -1).double() / 2
    bound = steps @ w.abs().reshape(100, -1, GROUP).sum(-1).double().T
    err = (group_op(x, native.int4_pack(q), sz).double() - exact).abs()
    assert (err <= bound * 1.001 + 1e-5 * exact.abs().amax(1, keepdim=True)).all()


@pytest.mark.parametrize("groups", [False, True], ids=["two-passes", "one-pass-groups"])
def test_a_row_has_the_same_bits_alone_in_any_batch_and_on_any_threads(groups):
    x, q, sz = operands(70, 200, 96, 3)
    tiles = native.int4_pack(q)
    f = group_op if groups else op
    whole = f(x, tiles, sz)
    for i in (0, 3, 69):
        assert torch.equal(f(x[i : i + 1], tiles, sz), whole[i : i + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(f(x, tiles, sz), whole)
    finally:
        torch.set_num_threads(threads)


def test_bad_operands_are_refused():
    x, q, sz = operands(2, 32, 64, 5)
    tiles = native.int4_pack(q)
    with pytest.raises(RuntimeError, match="K differs"):
        op(x[:, :32].contiguous(), tiles, sz)
    with pytest.raises(RuntimeError, match="int4_group_linear: K differs"):
        group_op(x[:, :32].contiguous(), tiles, sz)
    with pytest.raises(RuntimeError, match="int4_group_linear: N differs"):
        group_op(x, tiles, sz[:, :16].contiguous())
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
    monkeypatch.setattr(native, "int4_gemm", lambda: None)
    theirs = int4_from_float(w, b)
    assert theirs.tiles is None
    x = torch.randn(9, 128, generator=g) * 3
    want = theirs(x)
    assert ((ours(x) - want).abs() <= 2**-7 * want.abs().amax(1, keepdim=True)).all()


@pytest.mark.parametrize("groups", [False, True], ids=["two-passes", "one-pass-groups"])
def test_fused_rows_and_views_keep_the_separate_calls_bits(groups):
    g = torch.Generator().manual_seed(4)
    mods = tuple(int4_from_float(torch.randn(n, 64, generator=g)) for n in (48, 16, 20))
    for m in mods:
        m.groups = groups
    cat = Int4Linear.cat(mods)
    x = torch.randn(5, 64, generator=g) * torch.logspace(-2, 2, 64)
    y = cat(x)
    assert torch.equal(y, torch.cat([m(x) for m in mods], dim=-1))
    assert torch.equal(cat.rows(48, 84)(x), y[:, 48:])
    assert cat.groups == cat.rows(48, 84).groups == groups
    mods[0].groups = not groups  # one matrix of two activation passes' rows would mix them
    with pytest.raises(ValueError, match="same activation passes"):
        Int4Linear.cat(mods)
    mods[0].groups = groups
    with pytest.raises(ValueError, match="every 16 rows"):
        cat.rows(50, 84)
    with pytest.raises(ValueError, match="whole tiles"):
        Int4Linear.cat((mods[2], mods[0]))
