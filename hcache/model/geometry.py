"""A model's geometry: its architecture, sizes, attention heads, RoPE and special tokens,
read from a Hugging Face `config.json` (`from_hf`) or a GGUF header (the loader). Stored
state is shaped by it, so storage reads it too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ARCH_LLAMA = "llama"
ARCH_OPT = "opt"


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling ("llama3") or plain position interpolation ("linear")."""

    kind: str  # "llama3" | "linear"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # ARCH_LLAMA (Llama 2/3, Mistral, SmolLM2, Qwen2) or ARCH_OPT
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False  # Qwen2: bias on q/k/v only
    o_bias: bool = False  # Llama's attention_bias puts a bias on o_proj too
    mlp_bias: bool = False
    tie_embeddings: bool = False
    # OPT only
    pre_norm: bool = True  # OPT-350m is post-norm
    word_embed_dim: int = 0  # != hidden_size means project_in / project_out
    norm_affine: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    def fingerprint_fields(self) -> dict[str, Any]:
        """What a stored state depends on (geometry); weights are hashed separately."""
        return {
            k: getattr(self, k)
            for k in ("arch", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")
        }

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face `config.json` dict (transformers 4 and 5 spellings)."""
        model_type = cfg.get("model_type", "")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        if model_type == "opt":
            hidden = cfg["hidden_size"]
            heads = cfg["num_attention_heads"]
            return cls(
                arch=ARCH_OPT,
                vocab_size=cfg["vocab_size"],
                hidden_size=hidden,
                intermediate_size=cfg["ffn_dim"],
                num_layers=cfg["num_hidden_layers"],
                num_heads=heads,
                num_kv_heads=heads,
                head_dim=hidden // heads,
                max_position=cfg["max_position_embeddings"],
                norm_eps=1e-5,
                qkv_bias=cfg.get("enable_bias", True),
                o_bias=cfg.get("enable_bias", True),
                mlp_bias=cfg.get("enable_bias", True),
                tie_embeddings=cfg.get("tie_word_embeddings", True),
                pre_norm=cfg.get("do_layer_norm_before", True),
                word_embed_dim=cfg.get("word_embed_proj_dim", hidden),
                norm_affine=cfg.get("layer_norm_elementwise_affine", True),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        if model_type not in ("llama", "mistral", "qwen2"):
            raise ValueError(f"unsupported model_type {model_type!r}: hcache runs llama, mistral, qwen2 and opt")
        if cfg.get("sliding_window") and cfg.get("use_sliding_window", model_type == "mistral"):
            raise ValueError("sliding-window attention is not supported; use a model without it")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported activation {cfg['hidden_act']!r} for a llama-family model")
        heads = cfg["num_attention_heads"]
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        attention_bias = cfg.get("attention_bias", False)
        return cls(
            arch=ARCH_LLAMA,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_position=cfg.get("max_position_embeddings", 4096),
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=_rope_scaling(rope),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=attention_bias,
            mlp_bias=cfg.get("mlp_bias", False),
            tie_embeddings=cfg.get("tie_word_embeddings", False),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _rope_scaling(rope: dict[str, Any]) -> RopeScaling | None:
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind == "default":
        return None
    if kind == "llama3":
        return RopeScaling(
            kind="llama3",
            factor=float(rope["factor"]),
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            original_max_position=int(rope.get("original_max_position_embeddings", 8192)),
        )
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(rope["factor"]))
    raise ValueError(f"unsupported rope scaling {kind!r}: hcache supports default, linear and llama3")
