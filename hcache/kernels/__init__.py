"""Hot ops of the restore paths."""

import hashlib
import os
from pathlib import Path

import torch

from hcache.config import hcache_home
from hcache.kernels.cpu import COMPILE

__all__ = ["COMPILE", "source_digest"]


def source_digest(*patterns: str) -> str:
    """A hash of our kernel sources matching `patterns` (say "*.h"), in name order."""
    here = Path(__file__).parent
    files = sorted(f for p in patterns for f in here.glob(p))
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:16]


def _pin_compile_cache() -> None:
    """Inductor's artefacts under $HCACHE_HOME (kept with the store across restarts, where
    a container's /tmp is not), a folder per torch version, CPU kind and version of our
    kernels' sources: inductor's cache keys name no ISA (a kernel generated for AVX-512 but
    built for AVX2 computes garbage), nor our ops' schemas (a graph cached before an op
    gained an argument crashes calling it). A TORCHINDUCTOR_CACHE_DIR the user set is kept."""
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        return
    from hcache.kernels.cpu import cpu

    c = cpu()
    folder = f"torch-{torch.__version__}-{c.kind}-{c.aten.lower()}-{source_digest('*.cpp', '*.h')}"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(hcache_home() / "compiled" / folder)


_pin_compile_cache()
