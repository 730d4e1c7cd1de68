"""Hot ops of the restore paths."""

import os

import torch

from hcache.config import hcache_home
from hcache.kernels.cpu import COMPILE

__all__ = ["COMPILE"]


def _pin_compile_cache() -> None:
    """Inductor's artefacts under $HCACHE_HOME (kept with the store across restarts, where
    a container's /tmp is not), a folder per torch version and CPU kind: inductor's cache
    keys name no ISA, and a kernel generated for AVX-512 but built for AVX2 computes
    garbage. A TORCHINDUCTOR_CACHE_DIR the user set is kept."""
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        return
    from hcache.kernels.cpu import cpu

    c = cpu()
    folder = f"torch-{torch.__version__}-{c.kind}-{c.aten.lower()}"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(hcache_home() / "compiled" / folder)


_pin_compile_cache()
