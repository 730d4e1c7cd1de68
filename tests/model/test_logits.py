"""Our logits against transformers' on the same weights: full prefill and cached decode."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY

from hcache.model import KVCache, load

TOL = 1e-4


def _ours_prefill_then_decode(model, ids: list[int], split: int) -> torch.Tensor:
    """Logits for every position, computed as a prefill of `split` tokens then one token at a time."""
    cache = KVCache(model.cfg, model.dtype, capacity=8)  # small capacity: exercises growth
    out = [model.logits(model(torch.tensor(ids[:split]), torch.arange(split), cache))]
    for i in range(split, len(ids)):
        out.append(model.logits(model(torch.tensor(ids[i : i + 1]), torch.tensor([i]), cache)))
    return torch.cat(out)


def _check(model, ref, ids: list[int]) -> None:
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].float()
    full = model.logits(model(torch.tensor(ids), torch.arange(len(ids)), KVCache(model.cfg, model.dtype)))
    assert (full - want).abs().max() <= TOL
    stepped = _ours_prefill_then_decode(model, ids, len(ids) // 2)
    assert (stepped - want).abs().max() <= TOL


def test_default_model_matches_transformers(default_model, hf_default) -> None:
    tok = default_model.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": "Write a haiku about caches and 42 disks."}])
    _check(default_model.model, hf_default, ids)
    cfg = default_model.model.cfg
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert cfg.tie_embeddings


def test_default_model_long_random_context(default_model, hf_default) -> None:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, default_model.model.cfg.vocab_size, (300,), generator=g).tolist()
    _check(default_model.model, hf_default, ids)


@pytest.mark.parametrize("name", list(TINY))
def test_tiny_models_match_transformers(name: str, tiny_folder) -> None:
    from transformers import AutoModelForCausalLM

    folder = tiny_folder(name)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model = load(str(folder)).model
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.cfg.vocab_size, (96,), generator=g).tolist()
    _check(model, ref, ids)


def test_sharded_checkpoint_loads(tiny_folder, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_folder("llama_gqa"), dtype=torch.float32)
    ref.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    ids = list(range(1, 40))
    _check(load(str(tmp_path)).model, ref.eval(), ids)


def test_bfloat16_runs_close_to_float32(tiny_folder) -> None:
    folder = str(tiny_folder("llama_gqa"))
    m32, m16 = load(folder, "float32").model, load(folder, "bfloat16").model
    assert m16.dtype == torch.bfloat16
    ids = torch.arange(1, 33)
    a = m32.logits(m32(ids, torch.arange(32), KVCache(m32.cfg, m32.dtype)))
    b = m16.logits(m16(ids, torch.arange(32), KVCache(m16.cfg, m16.dtype)))
    assert (a - b).abs().max() / a.abs().max() < 0.1
