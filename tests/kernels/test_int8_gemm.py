"""Our int8 kernel (hcache/kernels/int8_gemm.cpp), each form this CPU runs (AVX512-VNNI,
AVX2), bit for bit against its integer reference, at the shapes that take each of its
remainder paths; and the two forms' bits against each other."""

import pytest
import torch
import torch.nn.functional as F

from hcache.kernels import native
from hcache.kernels.cpu import cpu
from hcache.model.quant import Int8Linear, Int8Rows, glu_rows, int8_rows_mm

FORMS = {"vnni": lambda: native.int8_gemm() if cpu().vnni else None, "avx2": native.int8_gemm_avx2}
LIBRARIES = {"vnni": "hcache_int8", "avx2": "hcache_int8_avx2"}
pytestmark = pytest.mark.skipif(
    native.int8_gemm() is None, reason=f"needs AVX2 and a C++ compiler; this CPU is {cpu().kind}"
)


@pytest.fixture(params=sorted(FORMS))
def ops(request):
    """A form's library (`int8_mm`, `int8_linear`, `int8_glu`), skipped where it cannot run."""
    if FORMS[request.param]() is None:
        pytest.skip(f"the {request.param} form does not run on this CPU ({cpu().kind})")
    return getattr(torch.ops, LIBRARIES[request.param])


@pytest.fixture
def op(ops):
    return ops.int8_mm


def reference(a: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, zero: int) -> torch.Tensor:
    """Exact integer sums, then the kernel's one rounding: int32 to float32, times the scale."""
    return ((a.int() - zero) @ w.int().T).float() * scales.float()


def operands(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(0, 256, (m, k), dtype=torch.uint8, generator=g)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scales = (torch.rand(n, generator=g) * 0.1).bfloat16()
    return a, w, scales


@pytest.mark.parametrize(
    "m,n,k",
    [
        (1, 16, 4),  # one tile, one step
        (2, 17, 32),  # a decode step's two passes; a tile of one row
        (9, 65, 96),  # rows past a block of 8; tiles past a group of 3
        (13, 300, 64),  # an LM head's shape class: a partial last tile and group
        (64, 48, 4864),  # batch 32's two passes over a down projection's K
        (300, 40, 896),  # a prefill chunk
    ],
)
def test_every_output_is_its_integer_reference_bit_for_bit(op, m, n, k):
    a, w, scales = operands(m, n, k, m * 1000 + n)
    tiles, sums = native.int8_pack(w)
    assert torch.equal(sums, w.int().sum(1))
    for zero in (128, 64):
        assert torch.equal(op(a, tiles, sums, scales, zero), reference(a, w, scales, zero)), zero


def test_extreme_values_sum_exactly(op):
    """255 * -127 at every input of the longest K: the sums stay inside int32 (and the AVX2
    form's pairs inside 16 bits)."""
    m, n, k = 2, 32, 4864
    a = torch.full((m, k), 255, dtype=torch.uint8)
    a[1] = 0
    w = torch.full((n, k), -127, dtype=torch.int8)
    w[1::2] = 127
    scales = torch.ones(n).bfloat16()
    tiles, sums = native.int8_pack(w)
    for zero in (0, 128):
        assert torch.equal(op(a, tiles, sums, scales, zero), reference(a, w, scales, zero))


def test_a_row_has_the_same_bits_alone_in_any_batch_and_on_any_threads(op):
    a, w, scales = operands(70, 200, 96, 3)
    tiles, sums = native.int8_pack(w)
    whole = op(a, tiles, sums, scales, 128)
    for i in (0, 6, 69):
        assert torch.equal(op(a[i : i + 1], tiles, sums, scales, 128), whole[i : i + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(op(a, tiles, sums, scales, 128), whole)
        # more threads than cores: a preempted thread's tile groups are taken by the others
        torch.set_num_threads(8)
        for _ in range(10):
            assert torch.equal(op(a, tiles, sums, scales, 128), whole)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("bits", [8, 7])
@pytest.mark.parametrize("m,k", [(1, 4), (2, 36), (5, 100), (33, 896), (17, 4864), (300, 896)])
def test_the_linear_quantizes_inside_to_the_graphs_bits(op, ops, m, k, bits):
    """`int8_linear` quantizes each row in the op and combines its two passes in registers:
    the same bits as `int8_rows_mm`'s two passes in the graph around `int8_mm`, at K with and
    without a partial vector of 16, for rows of every magnitude (a zero row, a tiny one, a
    large one), row counts past a micro-kernel's and an L2 block's, a partial last tile and
    group of tiles, and for bfloat16 input; with 8-bit passes and an LM head's 7-bit ones."""
    g = torch.Generator().manual_seed(m * 7 + k)
    w = torch.randint(-127, 128, (50, k), dtype=torch.int8, generator=g)
    scales = (torch.rand(50, generator=g) * 0.1).bfloat16()
    tiles, sums = native.int8_pack(w)
    x = torch.randn(m, k, generator=g) * torch.logspace(-30, 4, m)[:, None]
    x[0] = 0
    for xs in (x, x.bfloat16()):
        want = int8_rows_mm(xs, lambda q: op(q, tiles, sums, scales, 2 ** (bits - 1)), bits)
        assert torch.equal(ops.int8_linear(xs, tiles, sums, scales, None, bits), want)
    if bits == 8:
        assert torch.equal(ops.int8_linear(xs, tiles, sums, scales), want)  # the default


def test_seven_bit_passes_at_their_extremes_sum_exactly(op, ops):
    """Passes of +-63 against weights of +-127 over the longest K: the AVX2 form's pairs of
    (w + 128) * a stay inside 16 bits, and its sums inside int32."""
    m, k = 3, 4864
    x = torch.full((m, k), 63 / 32)  # a scale of 2^-5: every byte of the first pass is 63
    x[1] = -x[1]
    x[2, 1::2] = -(63 / 32 - 63 * 2**-15)  # first-pass bytes of -63 leaving 63 * 2^-15: second-pass ones of 63
    w = torch.full((32, k), -127, dtype=torch.int8)
    w[1::2] = 127
    scales = torch.ones(32).bfloat16()
    tiles, sums = native.int8_pack(w)
    want = int8_rows_mm(x, lambda q: op(q, tiles, sums, scales, 64), 7)
    assert torch.equal(ops.int8_linear(x, tiles, sums, scales, None, 7), want)
    assert torch.allclose(want[0, :2], torch.tensor([-127.0, 127.0]) * k * 63 / 32, rtol=1e-6)


@pytest.mark.parametrize("m", [1, 7, 33])
def test_a_bias_is_added_inside_as_torch_adds_it(ops, m):
    g = torch.Generator().manual_seed(m)
    w = torch.randint(-127, 128, (50, 96), dtype=torch.int8, generator=g)
    scales = (torch.rand(50, generator=g) * 0.1).bfloat16()
    tiles, sums = native.int8_pack(w)
    x, bias = torch.randn(m, 96, generator=g), torch.randn(50, generator=g)
    want = ops.int8_linear(x, tiles, sums, scales) + bias
    assert torch.equal(ops.int8_linear(x, tiles, sums, scales, bias), want)


@pytest.mark.parametrize("m,n,k", [(1, 8, 4), (5, 40, 100), (33, 200, 896), (70, 64, 4864)])
def test_the_glu_applies_silu_gate_times_up_to_each_rows_sums(ops, m, n, k):
    """`int8_glu` over `glu_rows(gate, up)`: each output is `silu(gate) * up` of the sums
    `int8_linear` gives for those rows, its own silu within a few float32 roundings of
    torch's; and a row's bits do not depend on the rows beside it."""
    g = torch.Generator().manual_seed(m * 100 + n)
    gate, up = (torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g) for _ in range(2))
    sg, su = ((torch.rand(n, generator=g) * 0.02 + 0.001).bfloat16() for _ in range(2))
    tiles, sums = native.int8_pack(glu_rows(gate, up))
    scales = glu_rows(sg, su)
    x = torch.randn(m, k, generator=g)
    sums_of = ops.int8_linear(x, tiles, sums, scales).view(m, n // 8, 2, 8)
    want = (F.silu(sums_of[:, :, 0]) * sums_of[:, :, 1]).reshape(m, n)
    got = ops.int8_glu(x, tiles, sums, scales)
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert ((got - want).abs() <= 4e-6 * want.abs() + 1e-30).all()
    assert torch.equal(ops.int8_glu(x[-1:], tiles, sums, scales), got[-1:])
    # the gate's sign decides: a large negative gate gives 0, a large positive one gate * up
    tiles1, sums1 = native.int8_pack(
        glu_rows(torch.full((8, 4), 127, dtype=torch.int8), torch.ones(8, 4, dtype=torch.int8))
    )
    big = ops.int8_glu(torch.tensor([[-1e3] * 4, [1e3] * 4]), tiles1, sums1, torch.ones(16).bfloat16())
    assert torch.equal(big[0], torch.zeros(8))  # its power overflows: gate / inf
    assert torch.allclose(big[1], torch.full((8,), 127 * 4e3 * 4e3), rtol=0.02)


@pytest.mark.skipif(not cpu().vnni, reason=f"needs AVX512-VNNI to run both forms; this CPU is {cpu().kind}")
def test_the_avx2_form_gives_the_vnni_forms_bits():
    """AVX2 and AVX-512 replicas share sessions: every op of the two forms gives the same
    bits, the GLU's silu included, over gates from its power's overflow to its underflow."""
    assert native.int8_gemm_avx2() is not None
    vnni, avx2 = torch.ops.hcache_int8, torch.ops.hcache_int8_avx2
    g = torch.Generator().manual_seed(7)
    w = torch.randint(-127, 128, (96, 160), dtype=torch.int8, generator=g)
    tiles, sums = native.int8_pack(w)
    scales = (torch.rand(96, generator=g) * 0.05).bfloat16()
    x = torch.randn(11, 160, generator=g) * torch.logspace(-3, 3, 11)[:, None]
    a = torch.randint(0, 256, (5, 160), dtype=torch.uint8, generator=g)
    bias = torch.randn(96, generator=g)
    assert torch.equal(avx2.int8_mm(a, tiles, sums, scales, 128), vnni.int8_mm(a, tiles, sums, scales, 128))
    for bits in (8, 7):
        got = avx2.int8_linear(x, tiles, sums, scales, bias, bits)
        assert torch.equal(got, vnni.int8_linear(x, tiles, sums, scales, bias, bits)), bits
    assert torch.equal(avx2.int8_glu(x, tiles, sums, scales), vnni.int8_glu(x, tiles, sums, scales))


def test_bad_operands_are_refused(op, ops):
    a, w, scales = operands(2, 32, 64, 5)
    tiles, sums = native.int8_pack(w)
    with pytest.raises(RuntimeError, match="shapes differ"):
        op(a[:, :60].contiguous(), tiles, sums, scales, 128)
    with pytest.raises(RuntimeError, match="multiple of 4"):
        native.int8_pack(w[:, :30].contiguous())
    with pytest.raises(RuntimeError, match="within"):
        native.int8_pack(torch.full((16, 64), -128, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="K differs"):
        ops.int8_linear(torch.randn(2, 60), tiles, sums, scales)
    with pytest.raises(RuntimeError, match="activations"):
        ops.int8_linear(torch.ones(2, 64, dtype=torch.int32), tiles, sums, scales)
    with pytest.raises(RuntimeError, match="bias of N"):
        ops.int8_linear(torch.randn(2, 64), tiles, sums, scales, torch.zeros(31))
    with pytest.raises(RuntimeError, match="7 or 8 bits"):
        ops.int8_linear(torch.randn(2, 64), tiles, sums, scales, None, 6)
    tiles24, sums24 = native.int8_pack(torch.ones(24, 64, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="multiple of 8 each"):
        ops.int8_glu(torch.randn(2, 64), tiles24, sums24, torch.ones(24).bfloat16())


def test_a_tied_embedding_looks_its_rows_up_in_the_tiles():
    g = torch.Generator().manual_seed(1)
    rows = Int8Rows.from_float(torch.randn(100, 64, generator=g))
    tokens = torch.tensor([[0, 17, 99], [15, 16, 3]])
    want = rows.lookup(tokens, torch.float32)
    assert rows.pack_native() and rows.q.numel() == 0
    assert torch.equal(rows.lookup(tokens, torch.float32), want)


def test_a_linear_on_the_kernel_equals_it_on_onednn():
    """The same rows and activations through our tiles and through oneDNN's copy: both sum
    exactly and scale once, so the logits are the same bits."""
    if not cpu().int8_vnni or not torch.backends.mkldnn.is_available():
        pytest.skip(f"oneDNN's 8-bit activations need VNNI; this CPU is {cpu().kind}")
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(96, 128, generator=g), torch.randn(96, generator=g)
    ours, theirs = Int8Linear.from_float(w, b), Int8Linear.from_float(w, b)
    assert ours.pack_native() and theirs.pack_for_onednn()
    x = torch.randn(9, 128, generator=g) * 3
    assert torch.equal(ours(x), theirs(x))
