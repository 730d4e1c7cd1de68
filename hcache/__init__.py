"""hcache: a stateful LLM serving engine that restores KV caches from hidden states, KV and tokens."""

import os

# MKL's conditional numerical reproducibility, read at its first call: without it a float32
# GEMM rounds by its buffers' alignment, so torch's float32 attention gave a sequence other
# bits on the other thread (a batch moves it). Float32 matmul speed was unchanged here.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

__version__ = "0.1.0"
