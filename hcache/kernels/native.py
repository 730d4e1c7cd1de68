"""Kernels of our own in C++, built on first use by torch's extension builder (g++ and
ninja; cached under `TORCH_EXTENSIONS_DIR`, rebuilt when the source changes).

`attention_bf16`: a turn's causal attention over a bfloat16 cache with AVX512-BF16 dot
products (`attention_bf16.cpp`). No library kernel reaches that rate on a CPU without
AMX: torch's flash kernel multiplies through MKL's bfloat16 GEMM, inductor's templates
widen to float32, oneDNN's fused graph rounds the scores to bfloat16 (bench/RESULTS.md).
None when the CPU lacks AVX512-BF16 (`Cpu.bf16`), when building fails (logged once), or with
`HCACHE_COMPILE=0`: callers keep their library path."""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from hcache.kernels import COMPILE
from hcache.kernels.cpu import cpu

log = logging.getLogger(__name__)

_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-fopenmp"]
_lock = threading.Lock()
_UNBUILT = object()
_attention: Callable[..., torch.Tensor] | object | None = _UNBUILT


def attention_bf16() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor] | None:
    """`op(q [T, H, D], k [S, KvH, D], v, scale) -> [T, H*D]`, all bfloat16 on the CPU, head
    dims contiguous and a multiple of 16 up to 128; the last T positions attend causally."""
    global _attention
    if _attention is _UNBUILT:  # every layer of every forward asks: the lock only until built
        with _lock:
            if _attention is _UNBUILT:
                _attention = _build() if COMPILE and cpu().bf16 else None
    return _attention  # type: ignore[return-value]


def _build() -> Callable[..., torch.Tensor] | None:
    from torch.utils.cpp_extension import load

    try:
        if shutil.which("ninja") is None:  # the ninja package's binary, outside an activated venv
            import ninja

            os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])
        source = Path(__file__).with_name("attention_bf16.cpp")
        load(
            "hcache_attention_bf16",
            [str(source)],
            extra_cflags=_FLAGS,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
        return torch.ops.hcache_kernels.causal_attention_bf16
    except Exception as e:  # no compiler, or one without AVX512-BF16: the library path serves
        log.warning("building attention_bf16 failed, attention runs on library kernels: %s", e)
        return None
