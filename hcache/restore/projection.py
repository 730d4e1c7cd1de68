"""The H restore path: a layer's K and V from its stored input (norm, K/V projection,
RoPE on K), written straight into the KV cache's rows. The positions' RoPE tables are
made once per restore, not once per layer, and no K/V temporaries are copied into the
cache afterwards: at 4K tokens on the multi-head default model each of those cost about
as much as the norm."""

from __future__ import annotations

from typing import Any

import torch

from hcache.model.base import DecoderModel
from hcache.model.cache import KVRows


class Projector:
    """H -> KV for the layers of one restore (every call projects positions `0..n-1`)."""

    def __init__(self, model: DecoderModel):
        self.model = model
        self._n = -1
        self._pos: Any = None

    def __call__(self, layer: int, hidden: torch.Tensor, cache: KVRows) -> None:
        m, n = self.model, hidden.shape[0]
        if n != self._n:
            self._n, self._pos = n, m.pos_context(torch.arange(n, device=m.device))
        # into a narrower cache: projected in the model's dtype, rounded as it is written
        out = cache.dest(layer, 0, n) if cache.dtype == m.dtype else None
        with torch.inference_mode():
            k, v = m.layers[layer].kv_from_hidden(hidden.to(m.device, m.dtype), self._pos, out)
        if out is None:
            cache.write(layer, k, v, start=0)


def warm_up(model: DecoderModel) -> None:
    """Compile what a prefill and an H restore run (hcache/kernels/fused.py, native.py) before
    the first request: inductor takes seconds per kernel, twenty on a machine's first run.
    Dynamo guards on each input's kind, so this runs as the engine does: under inference
    mode, into a cache made outside it, projecting hidden states made outside it (as read
    buffers are). The row count is odd and shared with no other dimension, so the kernels
    compile for every length (no divisibility or duck-sized equality to guard on)."""
    from hcache.kernels import native
    from hcache.kernels.fused import MIN_ROWS
    from hcache.model.cache import KVCache

    if model.device.type == "cpu":
        native.attention_bf16()  # built here (seconds, once per machine), not in a turn

    n = MIN_ROWS + 3
    cache = KVCache(model.cfg, model.dtype, model.device, capacity=n)
    h = torch.zeros(n, model.cfg.hidden_size, dtype=model.dtype, device=model.device)  # as read buffers are
    with torch.compiler.set_stance("default"), torch.inference_mode():
        ids = torch.zeros(n, dtype=torch.long, device=model.device)
        model(ids, torch.arange(n, device=model.device), cache, hidden_out={0: h})
        Projector(model)(0, h, cache)


def serve_compiled_only() -> None:
    """From now on a kernel whose inputs would need compiling again runs eager for that
    call: no request waits for inductor (`warm_up` compiles what serving runs)."""
    torch.compiler.set_stance("eager_on_recompile")
