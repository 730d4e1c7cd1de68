"""The models and stored states the restore benchmarks run on: the default model, the
default expanded to multi-head (its K/V heads replicated: the same function, KV twice the
size of H), a random model of Llama-2-7B layer geometry, and a session's state stored from
a real prefill or synthesized (random hidden states, K/V projected from them)."""

from __future__ import annotations

from dataclasses import replace

import torch

from hcache.model.base import DecoderModel
from hcache.model.cache import KVCache
from hcache.model.geometry import ModelConfig
from hcache.model.llama import Llama
from hcache.model.loader import DEFAULT_GEOMETRY, load
from hcache.storage.layout import Kind
from hcache.storage.store import ChunkStore

BOTH = {Kind.HIDDEN, Kind.KV}


def expand_to_mha(model: DecoderModel) -> DecoderModel:
    """The same function with every query head owning a copy of its K/V head."""
    cfg = model.cfg
    group = cfg.num_heads // cfg.num_kv_heads
    mha = replace(cfg, num_kv_heads=cfg.num_heads)
    state = {}
    for name, t in model.state_dict().items():
        if name.endswith(("wk.weight", "wv.weight", "wk.bias", "wv.bias")):
            t = t.view(cfg.num_kv_heads, cfg.head_dim, *t.shape[1:]).repeat_interleave(group, 0)
            t = t.reshape(cfg.num_heads * cfg.head_dim, *t.shape[2:])
        state[name] = t.clone()
    with torch.device("meta"):
        out = Llama(mha)
    out.load_state_dict(state, strict=False, assign=True)
    if mha.tie_embeddings:
        out.lm_head.weight = out.embed_tokens.weight
    return out.eval()


def random_llama(cfg: ModelConfig, dtype: torch.dtype, device: str = "cpu") -> DecoderModel:
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
        for layer in model.layers:
            layer.attn_norm.weight.fill_(1.0)
            layer.ffn_norm.weight.fill_(1.0)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.to(dtype).eval()


def llama7b_geometry(layers: int, dtype: torch.dtype, device: str = "cpu") -> DecoderModel:
    cfg = ModelConfig("llama", 1000, 4096, 11008, layers, 32, 32, 128, 32768, rope_theta=10000.0)
    return random_llama(cfg, dtype, device)


def bench_model(name: str, dtype: torch.dtype, device: str = "cpu", random_weights: bool = False) -> DecoderModel:
    if name == "llama7b":
        return llama7b_geometry(2, dtype, device)
    if random_weights:
        model = random_llama(DEFAULT_GEOMETRY, dtype, device)
    else:  # "default", "default-mha", or any model by name or path, its weights dequantized
        model = load("default" if name == "default-mha" else name, str(dtype).removeprefix("torch."), device).model
    return expand_to_mha(model) if name == "default-mha" else model


def save_state(model: DecoderModel, store: ChunkStore, owner: str, n: int, real: bool, step: int = 1024) -> None:
    """Every layer's H and KV for `n` tokens, saved through the two-stage path."""
    cfg, dt = model.cfg, model.dtype
    store.create_owner(owner, [BOTH] * cfg.num_layers, model.fingerprint())
    g = torch.Generator().manual_seed(n)
    tokens = torch.randint(0, cfg.vocab_size, (n,), generator=g)
    dev = model.device
    cache = KVCache(cfg, dt, dev, capacity=n if real else step)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        batch = store.acquire([(owner, lo, hi - lo)])
        pos = torch.arange(lo, hi, device=dev)
        if real:
            model(tokens[lo:hi].to(dev), pos, cache, hidden_out=batch.hidden)
            for layer, dst in batch.kv.items():
                k, v = cache.layer_kv(layer, hi)
                dst[:, 0], dst[:, 1] = k[lo:].reshape(hi - lo, -1), v[lo:].reshape(hi - lo, -1)
        else:
            for layer, dst in batch.hidden.items():
                dst.copy_(torch.randn(hi - lo, cfg.hidden_size, generator=g).to(dt))
                k, v = model.kv_from_hidden(layer, dst.to(dev), pos)
                batch.kv[layer][:, 0], batch.kv[layer][:, 1] = k.reshape(hi - lo, -1), v.reshape(hi - lo, -1)
        store.submit(batch)
    store.mark_durable(owner, tokens.tolist())
