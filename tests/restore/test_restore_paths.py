"""The three restore paths and their mixes reproduce the KV the forward produced."""

from __future__ import annotations

import functools
import random

import pytest
import torch
from conftest import DEVICE, TINY, rel_err, tload

from hcache.engine.generate import generate
from hcache.engine.sampler import SamplingParams
from hcache.model import KVCache
from hcache.model.base import DecoderModel
from hcache.model.loader import load
from hcache.restore.executor import moved_by_buffer, restore
from hcache.restore.plan import Method, Plan
from hcache.restore.state import MemoryState

# the serving default on the default model (`--weights auto`: int4), and a tiny model quantized on load
MODELS = [*TINY, "default", "default-int4", "llama_gqa-int4"]
REL = 1e-5
# A recompute runs a session in one pass where the forward ran it turn by turn, so it rounds
# differently, and later layers carry that. float32's RE moves K/V by up to 18 float32
# roundings (2^-23) on the default model, within REL (84); int4's linears round to bfloat16,
# and its RE moves K/V by up to 4.3 bfloat16 roundings (2^-8): RE_INT4 allows 8.
RE_INT4 = 8 * 2**-8


@pytest.fixture(params=MODELS)
def model(request, tiny_folder) -> DecoderModel:
    name = request.param
    if name.endswith("-int4") and torch.device(DEVICE).type != "cpu":
        pytest.skip("int4 weights run on CPUs")
    if name == "default":
        return request.getfixturevalue("default_model").model
    if name == "default-int4":
        request.getfixturevalue("default_model")  # skips where the GGUF is missing
        return _int4("float32")
    if name.endswith("-int4"):
        return load(str(tiny_folder(name.removesuffix("-int4"))), "float32", weights="packed").model
    return tload(tiny_folder(name))


@functools.cache
def _int4(dtype: str = "bfloat16") -> DecoderModel:
    return load("default", dtype, weights="packed").model


def rel_tol(model: DecoderModel, method: Method = Method.KV) -> float:
    if model.weights == "packed" and method == Method.RECOMPUTE:
        return RE_INT4
    return REL if model.dtype == torch.float32 and model.weights == "float" else 2**-7  # bf16: an 8-bit mantissa


def chat_like(model: DecoderModel) -> tuple[MemoryState, KVCache]:
    """Two prompts and two decodes, as a session builds its state over turns."""
    g = torch.Generator().manual_seed(7)
    dev = model.device
    state, cache = (
        MemoryState(model.cfg, model.dtype, dev, capacity=4),
        KVCache(model.cfg, model.dtype, dev, capacity=4),
    )
    for n_prompt, n_new in ((40, 8), (25, 5)):
        prompt = torch.randint(3, model.cfg.vocab_size, (n_prompt,), generator=g).tolist()
        list(generate(model, cache, prompt, SamplingParams(max_new_tokens=n_new), set(), state))
    assert len(state.tokens) == cache.length == 40 + 7 + 25 + 4
    return state, cache


def assert_restored(model: DecoderModel, state: MemoryState, restored: KVCache, plan: Plan) -> None:
    assert restored.length == len(state.tokens)
    for layer, method in enumerate(plan.methods):
        for got, want in zip(restored.layer_kv(layer), state.kv(layer), strict=True):
            if method == Method.KV:
                assert torch.equal(got, want), f"layer {layer} KV path not identical"
            else:
                err = rel_err(got, want)
                assert err <= rel_tol(model, method), f"layer {layer} {method.value}: {err}"


@pytest.mark.parametrize("method", list(Method))
def test_single_method(model: DecoderModel, method: Method) -> None:
    state, _ = chat_like(model)
    plan = Plan.uniform(model.cfg.num_layers, method)
    restored, report = restore(model, plan, state)
    assert_restored(model, state, restored, plan)
    assert report.num_tokens == len(state.tokens)


def test_kv_from_hidden_each_layer(model: DecoderModel) -> None:
    state, _ = chat_like(model)
    pos = torch.arange(len(state.tokens), device=model.device)
    for layer in range(model.cfg.num_layers):
        k, v = model.kv_from_hidden(layer, state.hidden(layer), pos)
        want_k, want_v = state.kv(layer)
        assert rel_err(k, want_k) <= rel_tol(model) and rel_err(v, want_v) <= rel_tol(model)


def test_random_mixed_plans_and_continuation(model: DecoderModel) -> None:
    state, cache = chat_like(model)
    L = model.cfg.num_layers
    rng = random.Random(3)
    nxt = [5, 6, 7, 8]
    want = list(generate(model, cache, nxt, SamplingParams(max_new_tokens=6), set()))
    for _ in range(4):
        n_re = rng.randrange(L + 1)
        plan = Plan((Method.RECOMPUTE,) * n_re + tuple(rng.choice([Method.HIDDEN, Method.KV]) for _ in range(L - n_re)))
        restored, _ = restore(model, plan, state)
        assert_restored(model, state, restored, plan)
        got = list(generate(model, restored, nxt, SamplingParams(max_new_tokens=6), set()))
        assert got == want, f"continuation differs after {plan}"


@pytest.mark.parametrize("method", [Method.KV, Method.HIDDEN])
def test_int4_weights_restore_within_rounding(default_model, method: Method) -> None:
    """On packed int4 weights in bfloat16 activations the H path projects with the forward's
    kernel. (RE here moves K/V by up to 13 bfloat16 roundings, every op rounding to bfloat16:
    not a served mode's bound; the float32 served mode's RE is in the `model` tests.)"""
    model = _int4()
    state, _ = chat_like(model)
    plan = Plan.uniform(model.cfg.num_layers, method)
    restored, _ = restore(model, plan, state)
    assert_restored(model, state, restored, plan)


def test_restore_bfloat16_within_rounding(tiny_folder) -> None:
    model = tload(tiny_folder("llama_gqa"), "bfloat16")
    state, _ = chat_like(model)
    plan = Plan.split(model.cfg.num_layers, 1, 1)
    restored, _ = restore(model, plan, state)
    for layer in range(model.cfg.num_layers):
        for got, want in zip(restored.layer_kv(layer), state.kv(layer), strict=True):
            assert rel_err(got, want) <= 2**-7  # bf16 has an 8-bit mantissa


def test_plan_rules() -> None:
    with pytest.raises(ValueError, match="prefix"):
        Plan((Method.HIDDEN, Method.RECOMPUTE, Method.KV))
    with pytest.raises(ValueError):
        Plan.split(4, 3, 2)
    p = Plan.split(30, 4, 16)
    assert str(p) == "RE 0-3, H 4-19, KV 20-29"
    assert p.counts() == {"recompute": 4, "hidden": 16, "kv": 10}


def test_plan_bytes(default_model) -> None:
    cfg = default_model.model.cfg
    # SmolLM2 is grouped-query: a hidden state (576) is larger than K+V (2 x 3 x 64 = 384)
    h = Plan.uniform(30, Method.HIDDEN).bytes_to_read(cfg, 100, 4)
    kv = Plan.uniform(30, Method.KV).bytes_to_read(cfg, 100, 4)
    assert (h, kv) == (30 * 100 * 576 * 4, 30 * 100 * 384 * 4)
    assert Plan.uniform(30, Method.RECOMPUTE).bytes_to_read(cfg, 100, 4) == 400


def test_restore_rejects_wrong_plan_length(default_model) -> None:
    state, _ = chat_like(default_model.model)
    with pytest.raises(ValueError, match="layers"):
        restore(default_model.model, Plan.uniform(3, Method.KV), state)


@pytest.mark.parametrize("split", [0, 64, 100])
def test_tokenwise_split_restores_exactly(model: DecoderModel, split: int) -> None:
    from hcache.restore.executor import restore_tokenwise

    state, _ = chat_like(model)
    split = min(split, len(state.tokens))
    restored, report = restore_tokenwise(model, split, state)
    assert report.split == split
    for layer in range(model.cfg.num_layers):
        for got, want in zip(restored.layer_kv(layer), state.kv(layer), strict=True):
            assert torch.equal(got[split:], want[split:])
            assert rel_err(got, want) <= rel_tol(model, Method.RECOMPUTE)


def test_k_and_v_views_of_one_buffer_move_in_one_copy() -> None:
    """The CUDA feed's gather: a stored layer's K and V (strided views of one `[n, 2, kv_dim]`
    buffer, offset into it) go over as one contiguous span and come back as the same views;
    separate buffers each take their own copy. Run here with a clone standing in for the move."""
    pool = torch.arange(2 * 10 * 2 * 6, dtype=torch.float32).view(20, 2, 6)
    both = pool[3:13]  # a read buffer handed out from the middle of a larger one
    k, v = both[:, 0].unflatten(1, (2, 3)), both[:, 1].unflatten(1, (2, 3))
    other = torch.randn(4, 5)
    empty = torch.empty(0, 2, 3)
    copies: list[int] = []

    def move(flat: torch.Tensor) -> torch.Tensor:
        assert flat.is_contiguous()
        copies.append(flat.numel())
        return flat.clone()

    got = moved_by_buffer((k, v, other, empty), move)
    assert copies == [10 * 2 * 6, 20, 0]  # K and V: one span of exactly their rows; then the others
    for a, b in zip(got, (k, v, other, empty), strict=True):
        assert a.shape == b.shape and torch.equal(a, b)
    assert got[0].untyped_storage().data_ptr() == got[1].untyped_storage().data_ptr() != k.untyped_storage().data_ptr()


def test_projection_lands_in_the_cache_rows(model: DecoderModel) -> None:
    """The H path writes K/V straight into the cache (the same kernels as a plain
    `kv_from_hidden`, bit for bit); a paged cache whose blocks are not one run takes them
    through `write` instead."""
    from hcache.engine.block_pool import BlockPool, PagedCache
    from hcache.restore.projection import Projector

    state, _ = chat_like(model)
    n, cfg = len(state.tokens), model.cfg
    pos = torch.arange(n, device=model.device)
    pool = BlockPool(cfg, model.dtype, model.device, num_blocks=8)
    gap = PagedCache(pool)
    gap.reserve(64)
    pool.allocate(1)  # the next block is taken: the sequence's blocks are not one run
    gap.reserve(n)
    assert not gap.contiguous and gap.dest(0, 0, n) is None
    flat = KVCache(cfg, model.dtype, model.device, capacity=n)
    project = Projector(model)
    for layer in range(cfg.num_layers):
        want = model.kv_from_hidden(layer, state.hidden(layer), pos)
        for cache in (flat, gap):
            project(layer, state.hidden(layer), cache)
            for got, w in zip(cache.layer_kv(layer, n), want, strict=True):
                assert torch.equal(got, w), f"layer {layer}"
        k_rows, _ = flat.dest(layer, 0, n)
        assert k_rows.data_ptr() == flat.k[layer].data_ptr()  # the cache's own rows, no copy
    with pytest.raises(ValueError, match="capacity"):
        flat.dest(0, 0, flat.capacity + 1)
