"""Quantized weights: the int4 kernel's weights are the GGUF file's Q4_1 blocks, and the
int4 model stays close to the float oracle (logits, greedy tokens, perplexity)."""

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hcache.engine.block_pool import resident_kv_dtype
from hcache.kernels.cpu import cpu
from hcache.model.gguf_blocks import unpermute
from hcache.model.loader import auto_weights, default_model_path, load
from hcache.model.quality import logits_of, perplexity
from hcache.model.quant import Int4Linear, Int8Glu, Int8Linear, Int8Rows, int4_from_float, int8_rows_mm

TEXT = Path(__file__).parent.parent / "data" / "perplexity.txt"


@pytest.fixture(scope="module")
def int4_model(default_model):
    return load("default", "bfloat16", weights="packed")


def _kernel_weights(lin: Int4Linear) -> torch.Tensor:
    """`[N, K]` as the kernel applies them: its output for the identity."""
    eye = torch.eye(lin.in_features, dtype=torch.bfloat16)
    return lin(eye).float().t()


@pytest.mark.parametrize(
    "name,path,heads", [("blk.0.attn_q.weight", "layers.0.wqkv", 9), ("blk.7.ffn_down.weight", "layers.7.w_down", None)]
)
def test_int4_weights_are_the_files_q4_1_blocks(int4_model, name, path, heads):
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    t = next(t for t in GGUFReader(str(default_model_path())).tensors if t.name == name)
    assert t.tensor_type == GGMLQuantizationType.Q4_1
    shape = tuple(int(x) for x in reversed(t.shape))
    want = dequantize(t.data, t.tensor_type).reshape(shape)
    if heads:
        want = unpermute(want, heads)
    want = torch.from_numpy(np.ascontiguousarray(want, dtype=np.float32))
    lin = int4_model.model.get_submodule(path)
    got = _kernel_weights(lin if lin.out_features == shape[0] else lin.rows(0, shape[0]))  # Q: wqkv's first rows
    # the kernel keeps each block's scale and zero in bfloat16 (relative error 2^-9) and
    # rounds its output to bfloat16: beyond that the weights are the file's
    blocks = want.reshape(shape[0], -1, 32)
    span = (blocks.amax(-1) - blocks.amin(-1)).repeat_interleave(32, dim=1)
    bound = 2**-9 * (span + want.abs()) * 2 + 2**-8 * want.abs() + 1e-7
    assert ((got - want).abs() <= bound).all()
    # and the nibbles are the file's: no weight moved by a quantization step
    assert ((got - want).abs() < span / 15 / 4 + 1e-6).all()


def test_int8_rows_round_trip():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=g)
    rows = Int8Rows.from_float(w)
    deq = rows.q.float() * rows.scales.float()[:, None]
    # each weight within half a quantization step (plus the bf16 scale's rounding)
    step = rows.scales.float()[:, None]
    assert ((deq - w).abs() <= step * 0.5 + w.abs() * 2**-8).all()
    # the kernel applies exactly those weights, up to its bf16 output's rounding
    x = torch.randn(3, 96, generator=g).bfloat16()
    want = x.float() @ deq.t()
    assert ((rows(x).float() - want).abs() <= want.abs() * 2**-7 + 1e-2).all()
    torch.testing.assert_close(rows.lookup(torch.tensor([5]), torch.float32)[0], deq[5])


def test_int4_from_float_is_q4_1_of_the_matrix():
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    got = _kernel_weights(int4_from_float(w))
    step = (w.reshape(64, 4, 32).amax(-1) - w.reshape(64, 4, 32).amin(-1)) / 15
    assert ((got - w).abs() <= step.repeat_interleave(32, dim=1) * 0.55 + 0.02).all()


def test_int4_stays_close_to_the_float_oracle_in_bfloat16(default_model, int4_model):
    """Every logit within 4.0 of the oracle's (logits span about 60 here; bfloat16
    activations keep 8 bits of the residual stream), 90% of greedy tokens the same,
    perplexity within 1%."""
    stays_close(default_model, int4_model.model, None, 4.0)


def test_int4_stays_close_to_the_float_oracle_as_served(default_model, served_model):
    """As served (`--weights auto --kv-dtype auto` in float32: int4 weights over a bfloat16
    KV cache): every logit within 3.0 of the oracle's, 90% of greedy tokens the same,
    perplexity within 1%."""
    stays_close(default_model, served_model, torch.bfloat16, 3.0)


def stays_close(default_model, model, kv, tolerance: float) -> None:
    ids = default_model.tokenizer.encode(TEXT.read_text())
    oracle = logits_of(default_model.model, ids)
    got = logits_of(model, ids, kv)
    assert (got - oracle).abs().max().item() < tolerance
    assert (got.argmax(-1) == oracle.argmax(-1)).float().mean().item() > 0.9
    ppl_float, ppl_int4 = perplexity(default_model.model, ids), perplexity(model, ids, kv)
    assert ppl_int4 < 1.01 * ppl_float, (ppl_int4, ppl_float)


def test_int4_runs_on_cpus_with_bfloat16_scales_in_any_dtype():
    with pytest.raises(ValueError, match="runs on CPUs"):
        load("default", "float32", device="meta", weights="packed")
    m = load("default", "float32", weights="packed").model
    assert m.dtype == torch.float32 and m.layers[0].wqkv.scales_zeros.dtype == torch.bfloat16
    assert m.lm_head.scales.dtype == torch.bfloat16 and m.embed_tokens(torch.tensor([5])).dtype == torch.float32
    with pytest.raises(ValueError, match="unsupported weights"):
        load("default", "bfloat16", weights="int3")


def test_the_lm_head_quantizes_its_activations_in_seven_bit_passes():
    """The loaded model's int8 LM head (the default model's is tied to the embedding) takes
    7-bit passes (`LM_HEAD_BITS`) on whichever path serves it: its logits are the bits of
    `int8_rows_mm` at 7 over the head's rows, not at 8, and within a few hundredths of the
    rows' float product (logits span about 60)."""
    m = load("default", "float32", weights="packed").model
    head = m.lm_head
    assert isinstance(head, Int8Rows) and head.bits == 7 and head.is_packed
    rows = head.lookup(torch.arange(head.out_features), torch.float32) / head.scales.float()[:, None]
    g = torch.Generator().manual_seed(3)
    x = m.head_norm(torch.randn(5, m.cfg.hidden_size, generator=g) * 4)
    exact = x @ (rows * head.scales.float()[:, None]).t()
    got = head(x).float()
    for bits in (7, 8):
        zero = 2 ** (bits - 1)
        ref = int8_rows_mm(x, lambda q, z=zero: ((q.float() - z) @ rows.t()) * head.scales.float(), bits)
        assert torch.equal(got, ref) == (bits == 7), bits
    assert (got - exact).abs().max() < 0.05


def test_auto_runs_a_q4_1_files_blocks_on_cpus_and_keeps_float_weights_float(tiny_folder, tmp_path):
    import gguf

    assert auto_weights(default_model_path()) == "packed"
    assert auto_weights(default_model_path(), "cuda") == "float"
    folder = tiny_folder("llama_gqa")
    assert auto_weights(folder) == "float"  # safetensors: quantizing would lose what the file has
    f32 = tmp_path / "f32.gguf"  # a GGUF whose linears are not Q4_1
    w = gguf.GGUFWriter(str(f32), "llama")
    w.add_tensor("blk.0.attn_q.weight", np.zeros((64, 64), np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(64, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert auto_weights(f32) == "float"
    # a bfloat16 KV pool under int4 weights, whose linears already give K and V in bfloat16
    fl, q = load(str(folder), "float32").model, load(str(folder), "float32", weights="auto").model
    assert fl.weights == q.weights == "float"
    q = load(str(folder), "float32", weights="packed").model
    assert q.weights == "packed" and resident_kv_dtype("auto", q) == torch.bfloat16
    assert resident_kv_dtype("auto", fl) == resident_kv_dtype("model", q) == torch.float32


def test_a_safetensors_model_is_quantized_on_load(tiny_folder):
    folder = str(tiny_folder("llama_gqa"))
    q = load(folder, "bfloat16", weights="packed").model
    assert isinstance(q.layers[0].w_down, Int4Linear) and isinstance(q.lm_head, Int8Rows)
    # the float model with the weights the kernels apply computes what the int4 model does
    ref = load(folder, "bfloat16").model
    q = _unfused(q)  # the separate modules, named as the float model's
    with torch.no_grad():
        for name, mod in q.named_modules():
            if isinstance(mod, Int4Linear):
                ref.get_submodule(name).weight.copy_(_kernel_weights(mod))
        ref.embed_tokens.weight.copy_(q.embed_tokens.rows.q.float() * q.embed_tokens.rows.scales.float()[:, None])
        # an untied head keeps only oneDNN's copy: its weights are its output for the identity
        ref.lm_head.weight.copy_(q.lm_head(torch.eye(q.cfg.hidden_size)).float().t())
    ids = list(range(3, 40))
    a, b = logits_of(ref, ids), logits_of(q, ids)
    # both round every op to bfloat16, in different orders: under 5% of the largest logit
    # alone, 5.1% after this file's other tests; a wrong mapping of the weights is off by ~100%
    assert (a - b).abs().max().item() < 0.1 * a.abs().max().item()


def _unfused(model):
    """The model with each fused int4 matrix split back into its separate modules (row views)."""
    for layer in model.layers:
        q, kv = layer.n_heads * layer.hd, layer.n_kv * layer.hd
        if layer.wqkv is not None:
            parts = ((0, q), (q, q + kv), (q + kv, q + 2 * kv))
            layer.wq, layer.wk, layer.wv = (layer.wqkv.rows(a, b) for a, b in parts)
        if layer.w_gu is not None:
            f = layer.w_gu.out_features // 2
            layer.w_gate, layer.w_up = layer.w_gu.rows(0, f), layer.w_gu.rows(f, 2 * f)
        layer.wqkv = layer.wkv = layer.w_gu = None
    return model


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_int4_projections_give_the_separate_calls_bits(default_model, tiny_folder, dtype):
    """Q/K/V and gate/up run as one int4 call each: logits at every row count, and an H
    restore's K/V (through the K/V rows of the fused matrix), are the separate calls' bits.
    Where the kernel's packing on this CPU does not concatenate (`Int4Linear.joins`: the
    tiny model's 16-row K, and its 160-row gate where the packing's blocks are 64 wide),
    they stay apart."""
    tiny = load(str(tiny_folder("llama_gqa")), dtype, weights="packed").model
    c = tiny.cfg
    assert (tiny.layers[0].wqkv is not None) == (Int4Linear.joins(c.q_dim) and Int4Linear.joins(c.kv_dim))
    assert (tiny.layers[0].w_gu is not None) == Int4Linear.joins(c.intermediate_size)
    fused = load("default", dtype, weights="packed").model
    assert fused.layers[0].wqkv is not None and not hasattr(fused.layers[0], "wq")
    separate = _unfused(load("default", dtype, weights="packed").model)
    g = torch.Generator().manual_seed(0)
    for n in (1, 5, 37, 100):
        ids = torch.randint(3, fused.cfg.vocab_size, (n,), generator=g).tolist()
        assert torch.equal(logits_of(fused, ids), logits_of(separate, ids)), n
        h = torch.randn(n, fused.cfg.hidden_size, generator=g).to(fused.dtype)
        pos = fused.pos_context(torch.arange(n))
        with torch.inference_mode():
            got, want = fused.layers[1].kv_from_hidden(h, pos), separate.layers[1].kv_from_hidden(h, pos)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), n


@pytest.mark.parametrize("bits", [8, 7])
def test_the_onednn_head_is_row_independent_close_and_the_same_compiled(bits):
    """The LM head on oneDNN's int8 GEMM quantizes each row on its own: a row's logits are
    the same bits alone or in any batch, eager or inside a compiled graph, and stay within
    the bfloat16 kernel's rounding of `_weight_int8pack_mm`'s. Both activation widths: 8 bits
    where oneDNN has VNNI, 7 (no pair of byte products past 16 bits) on every CPU."""
    if bits > cpu().onednn_activation_bits:
        pytest.skip(f"8-bit activations need VNNI; this CPU is {cpu().kind}")
    g = torch.Generator().manual_seed(0)
    rows = Int8Rows.from_float(torch.randn(300, 64, generator=g))
    x = torch.randn(9, 64, generator=g) * 3
    x[:, 5] *= 40  # an outlier channel, as real hidden states have
    want = rows(x)  # `_weight_int8pack_mm`, on bfloat16 activations
    if not rows.pack_for_onednn(bits):
        pytest.skip("this torch has no oneDNN")
    got = rows(x)
    assert (got - want).abs().max() <= 2**-7 * want.abs().max()
    for i in range(len(x)):
        assert torch.equal(rows(x[i : i + 1]), got[i : i + 1])
    compiled = torch.compile(lambda t: rows(t), dynamic=True, fullgraph=True)
    with torch.inference_mode():
        assert torch.equal(compiled(x), got) and torch.equal(compiled(x[:3]), got[:3])


def test_an_int8_glu_is_silu_gate_times_up_on_every_path():
    """Gate and up int8 rows as one `Int8Glu`: on `_weight_int8pack_mm` (the rows as they
    are), on oneDNN and on our kernel (which applies its own silu), each within float32
    roundings of `silu(gate(x)) * up(x)` from the separate modules on the same path; and a
    pair that does not interleave stays apart."""
    g = torch.Generator().manual_seed(3)
    w_gate, w_up = torch.randn(40, 64, generator=g), torch.randn(40, 64, generator=g)
    x = torch.randn(9, 64, generator=g)
    forms = {"rows": lambda m: True, "onednn": Int8Linear.pack_for_onednn, "native": Int8Linear.pack_native}
    for name, pack in forms.items():
        gate, up = Int8Linear.from_float(w_gate), Int8Linear.from_float(w_up)
        glu = Int8Glu.of(gate, up)
        assert glu is not None and glu.out_features == 80
        if not (pack(gate) and pack(up) and pack(glu)):
            continue  # this CPU or torch lacks the form
        want = F.silu(gate(x)) * up(x)
        got = glu(x)
        assert got.shape == (9, 40) and ((got - want).abs() <= 1e-5 * want.abs() + 1e-30).all(), name
    assert Int8Glu.of(Int8Linear.from_float(w_gate[:36]), Int8Linear.from_float(w_up[:36])) is None
    assert Int8Glu.of(Int8Linear.from_float(w_gate, torch.ones(40)), Int8Linear.from_float(w_up)) is None
