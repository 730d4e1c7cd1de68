"""OPT: learned positions (offset 2), LayerNorm, multi-head attention with biases,
ReLU MLP. Pre-norm by default; OPT-350m is post-norm with project_in/out."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hcache.model.base import DecoderLayer, DecoderModel, KVOut
from hcache.model.cache import Cache
from hcache.model.geometry import ModelConfig
from hcache.model.layers import linear_into

POSITION_OFFSET = 2  # OPT reserves the first two rows of its position table


class OPTLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, b = cfg.hidden_size, cfg.qkv_bias
        self.n_heads, self.hd, self.pre_norm = cfg.num_heads, cfg.head_dim, cfg.pre_norm
        self.attn_norm = nn.LayerNorm(d, eps=cfg.norm_eps, elementwise_affine=cfg.norm_affine)
        self.wq, self.wk, self.wv = nn.Linear(d, d, bias=b), nn.Linear(d, d, bias=b), nn.Linear(d, d, bias=b)
        self.wo = nn.Linear(d, d, bias=cfg.o_bias)
        self.ffn_norm = nn.LayerNorm(d, eps=cfg.norm_eps, elementwise_affine=cfg.norm_affine)
        self.fc1 = nn.Linear(d, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.fc2 = nn.Linear(cfg.intermediate_size, d, bias=cfg.mlp_bias)

    def _kv(self, x: torch.Tensor, out: KVOut = None) -> tuple[torch.Tensor, torch.Tensor]:
        t = x.shape[0]
        k_out, v_out = out or (None, None)
        k, v = linear_into(x, self.wk, k_out), linear_into(x, self.wv, v_out)
        return k.view(t, self.n_heads, self.hd), v.view(t, self.n_heads, self.hd)

    def forward(self, h: torch.Tensor, pos: None, cache: Cache, index: int, last_only: bool = False) -> torch.Tensor:
        x = self.attn_norm(h) if self.pre_norm else h
        q = self.wq(x).view(x.shape[0], self.n_heads, self.hd)
        k, v = self._kv(x)
        if last_only:
            q, h = q[-1:], h[-1:]
        h = h + self.wo(cache.attend(index, q, k, v))
        if not self.pre_norm:
            h = self.attn_norm(h)
        x = self.ffn_norm(h) if self.pre_norm else h
        h = h + self.fc2(F.relu(self.fc1(x)))
        return h if self.pre_norm else self.ffn_norm(h)

    def kv_from_hidden(self, h: torch.Tensor, pos: None, out: KVOut = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self._kv(self.attn_norm(h) if self.pre_norm else h, out)


class OPT(DecoderModel):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        d, w = cfg.hidden_size, cfg.word_embed_dim or cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, w)
        self.embed_positions = nn.Embedding(cfg.max_position + POSITION_OFFSET, d)
        self.project_in = nn.Linear(w, d, bias=False) if w != d else None
        self.project_out = nn.Linear(d, w, bias=False) if w != d else None
        self.layers = nn.ModuleList(OPTLayer(cfg) for _ in range(cfg.num_layers))
        # Post-norm OPT normalises inside each layer and has no final LayerNorm.
        self.norm = nn.LayerNorm(d, eps=cfg.norm_eps, elementwise_affine=cfg.norm_affine) if cfg.pre_norm else None
        self.lm_head = nn.Linear(w, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        if self.project_in is not None:
            x = self.project_in(x)
        return x + self.embed_positions(positions + POSITION_OFFSET)

    def pos_context(self, positions: torch.Tensor) -> None:
        return None

    def head_norm(self, h: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            h = self.norm(h)
        return self.project_out(h) if self.project_out is not None else h
