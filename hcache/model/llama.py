"""The Llama family: Llama 2/3, Mistral, SmolLM2 and Qwen2 (q/k/v bias).
Pre-norm blocks of RMSNorm -> grouped-query attention with RoPE -> RMSNorm -> SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hcache.config import ModelConfig
from hcache.model.base import DecoderLayer, DecoderModel, KVOut
from hcache.model.cache import Cache
from hcache.model.layers import RMSNorm, Rope, apply_rope, linear_into

CosSin = tuple[torch.Tensor, torch.Tensor]


class LlamaLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.wq = nn.Linear(cfg.hidden_size, cfg.q_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.hidden_size, cfg.kv_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.hidden_size, cfg.kv_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.q_dim, cfg.hidden_size, bias=cfg.o_bias)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.w_gate = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.w_up = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.w_down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def _kv(self, x: torch.Tensor, pos: CosSin, out: KVOut = None) -> tuple[torch.Tensor, torch.Tensor]:
        t = x.shape[0]
        k_out, v_out = out or (None, None)
        k = apply_rope(self.wk(x).view(t, self.n_kv, self.hd), *pos, out=k_out)
        return k, linear_into(x, self.wv, v_out).view(t, self.n_kv, self.hd)

    def forward(self, h: torch.Tensor, pos: CosSin, cache: Cache, index: int) -> torch.Tensor:
        x = self.attn_norm(h)
        q = apply_rope(self.wq(x).view(x.shape[0], self.n_heads, self.hd), *pos)
        k, v = self._kv(x, pos)
        h = h + self.wo(cache.attend(index, q, k, v))
        x = self.ffn_norm(h)
        return h + self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))

    def kv_from_hidden(self, h: torch.Tensor, pos: CosSin, out: KVOut = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self._kv(self.attn_norm(h), pos, out)


class Llama(DecoderModel):
    def __init__(self, cfg: ModelConfig, rope_freq_factors: torch.Tensor | None = None):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = Rope(cfg, rope_freq_factors)

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens)

    def pos_context(self, positions: torch.Tensor) -> CosSin:
        return self.rope.cos_sin(positions, self.dtype)

    def head_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h)
