"""Every GGUF block type with a packed form loads onto its kernel with the file's weights:
4-bit blocks within the rounding of the kernel's bfloat16 scale and zero, 5- to 8-bit blocks
within half a step of their row's int8 grid. Tensors are written and read back with the
`gguf` package: types it quantizes from a float matrix, K-quants as random blocks (any bytes
are a valid block)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFWriter
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from hcache.kernels import native
from hcache.kernels.cpu import cpu
from hcache.model.gguf_blocks import INT4_TYPES, PACKED_TYPES, packed_linear, unpermute
from hcache.model.loader import dequantized, load
from hcache.model.quant import Int4Linear, Int8Linear

ROWS, COLS = 48, 512
# where each K-quant block keeps its float16 super-block scales (d, then dmin where it has one)
_F16_AT = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def _blocks(qtype: T, g: np.random.Generator) -> np.ndarray:
    block, size = GGML_QUANT_SIZES[qtype]
    if qtype not in _F16_AT:
        w = g.standard_normal((ROWS, COLS)).astype(np.float32) * 0.05
        w[3, 7] = 1.5  # an outlier, as real matrices have
        return quantize(w, qtype)
    raw = g.integers(0, 256, (ROWS * COLS // block, size), dtype=np.uint8)
    for at in _F16_AT[qtype]:
        raw[:, at : at + 2] = g.uniform(1e-4, 2e-3, (len(raw), 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(ROWS, -1)


def _written(qtype: T, tmp_path: Path) -> tuple[np.ndarray, np.ndarray]:
    """The tensor's raw blocks as a GGUF file holds them, and the file's dequantized weights."""
    path = tmp_path / f"{qtype.name}.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.ffn_up.weight", _blocks(qtype, np.random.default_rng(int(qtype))), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    t = GGUFReader(str(path)).tensors[0]
    assert t.tensor_type == qtype and tuple(int(x) for x in reversed(t.shape)) == (ROWS, COLS)
    return t.data, dequantize(t.data, qtype).reshape(ROWS, COLS)


def _kernel_weights(lin: torch.nn.Module) -> torch.Tensor:
    """`[N, K]` as the kernel applies them: its output for the identity."""
    return lin(torch.eye(lin.in_features, dtype=torch.bfloat16)).float().t()


@pytest.mark.parametrize("qtype", PACKED_TYPES, ids=lambda t: t.name)
def test_the_kernel_applies_the_files_weights(qtype, tmp_path):
    raw, file_w = _written(qtype, tmp_path)
    want = torch.from_numpy(np.ascontiguousarray(file_w, dtype=np.float32))
    lin = packed_linear(raw, qtype, ROWS, COLS)
    got = _kernel_weights(lin)
    out = 2**-8 * want.abs()  # the kernel's bfloat16 output
    if qtype in INT4_TYPES:
        assert isinstance(lin, Int4Linear)
        # scale and zero are kept in bfloat16 (2^-9 of each): a nibble out of place would move
        # a weight by up to its block's span, 2^8 times this
        blocks = want.reshape(ROWS, -1, 32)
        span = (blocks.amax(-1) - blocks.amin(-1)).repeat_interleave(32, dim=1)
        scale_zero = 2**-9 * (span + want.abs()) * 2
        assert ((got - want).abs() <= scale_zero + out + 1e-7).all()
    else:
        assert isinstance(lin, Int8Linear)
        step = want.abs().amax(1, keepdim=True) / 127  # the row's int8 grid
        assert ((got - want).abs() <= step / 2 + step * 127 * 2**-9 + out + 1e-7).all()
        assert ((got - want).abs().amax(1, keepdim=True) > 0).any()  # requantized, not a float copy


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q8_0], ids=lambda t: t.name)
def test_llama_q_rows_are_unpermuted_with_their_scales(qtype, tmp_path):
    raw, _ = _written(qtype, tmp_path)
    heads = 4
    plain = _kernel_weights(packed_linear(raw, qtype, ROWS, COLS))
    got = _kernel_weights(packed_linear(raw, qtype, ROWS, COLS, heads))
    assert torch.equal(got, torch.from_numpy(unpermute(plain.numpy(), heads)))


def test_a_type_nothing_reads_is_named(tmp_path):
    path = tmp_path / "i32.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((4, 32), np.int32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up\.weight is of type I32"):
        dequantized(GGUFReader(str(path)).tensors[0])


def test_types_without_a_packed_form_are_left_to_the_caller():
    assert packed_linear(np.zeros((ROWS, COLS), np.float32), T.F32, ROWS, COLS) is None
    assert packed_linear(np.zeros((ROWS, COLS // 256 * 84), np.uint8), T.Q2_K, ROWS, COLS) is None


@pytest.mark.parametrize(
    "onednn", [None, 8, 7, "native", "native-a7"], ids=["int8pack", "onednn-a8", "onednn-a7", "native", "native-a7"]
)
def test_int8_rows_are_row_independent_and_concatenate(onednn):
    """Every int8 kernel computes each output row from its activation row alone: a row's
    result is the same bits at any batch size, eager or compiled, and Q/K/V concatenated give
    the separate calls' bits. oneDNN's and ours, whose activations are quantized in two passes
    per row to about 14 bits, stay within bfloat16's rounding of `_weight_int8pack_mm`'s bfloat16 activations, at
    8-bit activations (VNNI) and at the 7 bits every CPU sums exactly (and an LM head takes on ours)."""
    g = torch.Generator().manual_seed(0)
    mods = tuple(Int8Linear.from_float(torch.randn(n, 96, generator=g), torch.randn(n, generator=g)) for n in (40, 8))
    x = torch.randn(70, 96, generator=g) * 3
    x[:, 5] *= 40  # an outlier channel, as real hidden states have
    x[7] = 0  # a row of zeros
    cat = Int8Linear.cat(mods)
    reference = cat(x)  # `_weight_int8pack_mm`
    sliced = cat.rows(40, 48)
    if onednn in ("native", "native-a7"):
        for m in (*mods, cat, sliced):
            m.bits = 7 if onednn == "native-a7" else 8
        if not all(m.pack_native() for m in (*mods, cat, sliced)):
            pytest.skip(f"our int8 kernel needs AVX2 and a C++ compiler; this CPU is {cpu().kind}")
        assert cat.q.numel() == 0 and cat.tiles.numel() == 48 * 96  # the rows live in the tiles alone
    elif onednn:
        if onednn > cpu().onednn_activation_bits:
            pytest.skip(f"8-bit activations need VNNI; this CPU is {cpu().kind}")
        if not all(m.pack_for_onednn(onednn) for m in (*mods, cat, sliced)):
            pytest.skip("this torch has no oneDNN")
        assert cat.q.numel() == 0 and cat.packed_bytes == 48 * 96  # the rows live in oneDNN's copy alone
    y = cat(x)
    assert torch.equal(y, torch.cat([m(x) for m in mods], dim=-1))
    assert torch.equal(sliced(x), y[:, 40:48])
    for n in (1, 3, 17):
        assert torch.equal(cat(x[:n]), y[:n])
    assert torch.equal(y[7], cat.bias)
    compiled = torch.compile(lambda t: cat(t), dynamic=True, fullgraph=True)
    # the default stance (a server started in this process leaves `eager_on_recompile`)
    with torch.inference_mode(), torch.compiler.set_stance("default"):
        assert torch.equal(compiled(x[:2]), y[:2])
        with torch.compiler.set_stance("fail_on_recompile"):  # one graph serves every batch
            for n in (9, 70):
                assert torch.equal(compiled(x[:n]), y[:n]), n
    assert ((y - reference).abs() <= 2**-7 * reference.abs().amax(1, keepdim=True)).all()


def test_the_fingerprint_does_not_depend_on_the_packed_form(tiny_folder, monkeypatch):
    """Our tiles, oneDNN's copy and the plain rows hold the same weights, so a session stored
    by a replica on one CPU kind restores on another: the fingerprint names none of them."""
    path = str(tiny_folder("llama_gqa"))
    forms = {}
    forms["best"] = load(path, weights="packed").model
    monkeypatch.setattr(native, "int8_gemm", lambda: None)
    forms["onednn"] = load(path, weights="packed").model
    monkeypatch.setattr(Int8Linear, "pack", lambda self, keep_rows=False: False)
    forms["rows"] = load(path, weights="packed").model
    assert forms["rows"].lm_head.q.numel() and not forms["rows"].lm_head.is_packed
    assert len({m.fingerprint() for m in forms.values()}) == 1
    other = load(str(tiny_folder("llama_mha")), weights="packed").model
    assert other.fingerprint() != forms["best"].fingerprint()
