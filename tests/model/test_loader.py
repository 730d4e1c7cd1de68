from __future__ import annotations

import numpy as np
import pytest
import torch

from hcache.model.geometry import ModelConfig
from hcache.model.gguf_blocks import unpermute
from hcache.model.llama import Llama
from hcache.model.loader import build_model


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows (the layout stored in GGUF files)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("shape, heads", [((576, 576), 9), ((192, 576), 3), ((128,), 2)])
def test_unpermute_inverts_llama_cpp(shape: tuple[int, ...], heads: int) -> None:
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    permuted = llama_cpp_permute(w, heads)
    assert not np.array_equal(permuted, w)
    assert np.array_equal(unpermute(permuted, heads), w)


def _tiny_cfg() -> ModelConfig:
    return ModelConfig.from_hf(
        {
            "model_type": "llama",
            "vocab_size": 10,
            "hidden_size": 8,
            "intermediate_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "tie_word_embeddings": True,
        }
    )


def test_checkpoint_mismatch_is_named() -> None:
    cfg = _tiny_cfg()
    with torch.device("meta"):
        names = list(Llama(cfg).state_dict())
    state = {n: torch.zeros(1) for n in names if n != "layers.0.wk.weight"}
    with pytest.raises(ValueError, match=r"missing \['layers.0.wk.weight'\]"):
        build_model(cfg, state)


def test_tied_embeddings_stay_tied() -> None:
    cfg = _tiny_cfg()
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in Llama(cfg).state_dict().items()}
    model = build_model(cfg, {n: torch.randn(s) for n, s in shapes.items() if n != "lm_head.weight"})
    assert model.lm_head.weight is model.embed_tokens.weight


def test_bench_default_geometry_is_the_ggufs(default_model) -> None:
    """The restore bench's stand-in for the default model (GPU machines without the GGUF)."""
    from dataclasses import replace

    from hcache.model.loader import DEFAULT_GEOMETRY

    assert replace(default_model.model.cfg, norm_eps=1e-5) == DEFAULT_GEOMETRY


def test_the_gguf_reader_reads_what_the_librarys_reads() -> None:
    """`_gguf_reader` slices a plain array where `gguf`'s reader slices its memmap: every
    field's parts and every tensor's data must still be the library's."""
    from gguf import GGUFReader

    from hcache.model.loader import _gguf_reader, default_model_path

    path = default_model_path()
    ours, theirs = _gguf_reader(path), GGUFReader(str(path))
    assert ours.fields.keys() == theirs.fields.keys()
    for name, a in ours.fields.items():
        b = theirs.fields[name]
        assert (a.types, a.data, a.offset) == (b.types, b.data, b.offset), name
        assert len(a.parts) == len(b.parts) and all(np.array_equal(p, q) for p, q in zip(a.parts, b.parts, strict=True))
    assert [(t.name, t.tensor_type, t.data_offset) for t in ours.tensors] == [
        (t.name, t.tensor_type, t.data_offset) for t in theirs.tensors
    ]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, theirs.tensors, strict=True))
