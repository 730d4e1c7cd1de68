"""The Llama family: Llama 2/3, Mistral, SmolLM2 and Qwen2 (q/k/v bias).
Pre-norm blocks of RMSNorm -> grouped-query attention with RoPE -> RMSNorm -> SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hcache.kernels.fused import rope_eager
from hcache.model.base import DecoderLayer, DecoderModel, KVOut
from hcache.model.cache import Cache
from hcache.model.geometry import ModelConfig
from hcache.model.layers import RMSNorm, Rope, apply_rope, linear_into
from hcache.model.quant import Int4Linear, Int8Glu, Int8Linear

CosSin = tuple[torch.Tensor, torch.Tensor]


def fused(mods: tuple[nn.Module, ...]) -> Int4Linear | Int8Linear | None:
    """The packed modules as one, or None: not all of one packed kind, or the int4 kernel's
    packing does not concatenate them on this CPU (`Int4Linear.joins`). Int8 rows always
    concatenate: the kernel computes each output row alone from its own row."""
    if all(isinstance(m, Int8Linear) for m in mods):
        return Int8Linear.cat(mods)  # type: ignore[arg-type]
    if not all(isinstance(m, Int4Linear) for m in mods):
        return None
    if not all(Int4Linear.joins(m.out_features) for m in mods[:-1]):
        return None
    return Int4Linear.cat(mods)  # type: ignore[arg-type]


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
        # packed weights, fused (`fuse`): Q, K, V as one matrix, K and V its row view, gate and
        # up as one matrix, or as one that applies the activation too (int8 rows: `Int8Glu`)
        self.wqkv: nn.Module | None = None
        self.wkv: nn.Module | None = None
        self.w_gu: nn.Module | None = None
        self.w_glu: nn.Module | None = None

    def fuse(self) -> None:
        """Q, K and V as one packed matrix and gate and up as another: one kernel call each where
        there were five, which matters most at a decode step's few rows (the kernel's per-call
        cost, and its split of a small N over the threads). The kernel computes each output
        column alone, so the results are the separate calls' bits. The H restore projects K
        and V alone through `wkv`, rows of the same packed weights. Int8 gate and up rows
        become an `Int8Glu`, which applies the activation too: its kernel's silu, so other
        bits than the separate calls', but the same on every path. Each pair stays separate
        where the packing does not concatenate (`fused`)."""
        qkv = fused((self.wq, self.wk, self.wv))
        if qkv is not None:
            self.wqkv, self.wkv = qkv, qkv.rows(self.wq.out_features, qkv.out_features)
            del self.wq, self.wk, self.wv
        pair = (self.w_gate, self.w_up)
        glu = Int8Glu.of(*pair) if all(isinstance(m, Int8Linear) for m in pair) else None  # type: ignore[arg-type]
        if glu is not None:
            self.w_glu = glu
            del self.w_gate, self.w_up
            return
        gu = fused(pair)
        if gu is not None:
            self.w_gu = gu
            del self.w_gate, self.w_up

    def _kv(self, x: torch.Tensor, pos: CosSin, out: KVOut = None) -> tuple[torch.Tensor, torch.Tensor]:
        t = x.shape[0]
        k_out, v_out = out or (None, None)
        if self.wkv is not None:
            k, v = self.wkv(x).view(t, 2, self.n_kv, self.hd).unbind(1)
            return apply_rope(k, *pos, out=k_out), (v if v_out is None else v_out.copy_(v))
        k = apply_rope(self.wk(x).view(t, self.n_kv, self.hd), *pos, out=k_out)
        return k, linear_into(x, self.wv, v_out).view(t, self.n_kv, self.hd)

    def forward(self, h: torch.Tensor, pos: CosSin, cache: Cache, index: int, last_only: bool = False) -> torch.Tensor:
        x = self.attn_norm(h)
        t = x.shape[0]
        if self.wqkv is None:
            q = self.wq(x)
            k, v = self._kv(x, pos)
        else:
            q, kv = self.wqkv(x).split((self.n_heads * self.hd, 2 * self.n_kv * self.hd), dim=-1)
            k, v = kv.unflatten(-1, (2, self.n_kv, self.hd)).unbind(1)
            k = apply_rope(k, *pos)
        q = apply_rope(q.view(t, self.n_heads, self.hd), *pos)
        if last_only:
            q, h = q[-1:], h[-1:]
        h = h + self.wo(cache.attend(index, q, k, v))
        x = self.ffn_norm(h)
        if self.w_glu is not None:
            return h + self.w_down(self.w_glu(x))
        if self.w_gu is None:
            return h + self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))
        gate, up = self.w_gu(x).chunk(2, dim=-1)
        return h + self.w_down(F.silu(gate) * up)

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

    def shift_keys(self, k: torch.Tensor, delta: int) -> torch.Tensor:
        # RoPE rotations compose: rotating by `delta` more moves a key to position p + delta
        if delta == 0:
            return k
        cos, sin = self.rope.cos_sin(torch.full((k.shape[0],), delta, device=k.device), torch.float32)
        return rope_eager(k.float(), cos, sin, None).to(k.dtype)
