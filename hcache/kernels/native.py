"""Kernels of our own in C++, built on first use by torch's extension builder (g++ and
ninja; cached under `TORCH_EXTENSIONS_DIR`, rebuilt when the source changes).

`attention_bf16`: a turn's causal attention over a bfloat16 cache with AVX512-BF16 dot
products (`attention_bf16.cpp`). No library kernel reaches that rate on a CPU without
AMX: torch's flash kernel multiplies through MKL's bfloat16 GEMM, inductor's templates
widen to float32, oneDNN's fused graph rounds the scores to bfloat16 (bench/RESULTS.md).
None when the CPU lacks AVX512-BF16, when building fails (logged once), or with
`HCACHE_COMPILE=0`: callers keep their library path."""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-fopenmp"]
_lock = threading.Lock()
_built: dict[str, Callable[..., torch.Tensor] | None] = {}


def attention_bf16() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor] | None:
    """`op(q [T, H, D], k [S, KvH, D], v, scale) -> [T, H*D]`, all bfloat16 on the CPU, head
    dims contiguous and a multiple of 16 up to 128; the last T positions attend causally."""
    with _lock:
        if "attention_bf16" not in _built:
            _built["attention_bf16"] = _build("attention_bf16") if _supported() else None
        return _built["attention_bf16"]


def _supported() -> bool:
    return os.environ.get("HCACHE_COMPILE", "1") != "0" and torch.cpu._is_avx512_bf16_supported()


def _build(name: str) -> Callable[..., torch.Tensor] | None:
    from torch.utils.cpp_extension import load

    try:
        if shutil.which("ninja") is None:  # the ninja package's binary, outside an activated venv
            import ninja

            os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])
        source = Path(__file__).with_name(f"{name}.cpp")
        load(f"hcache_{name}", [str(source)], extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"], is_python_module=False)
        return getattr(torch.ops.hcache_kernels, f"causal_{name}")
    except Exception as e:  # no compiler, or one without AVX512-BF16: the library path serves
        log.warning("building %s failed, attention runs on library kernels: %s", name, e)
        return None
