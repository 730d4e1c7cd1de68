"""The one restore executor: `restore()` and the engine's fused restore+prefill run the
same job, and unusable layers fall back to recompute wherever they are."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY, rel_err, tload
from test_restore_paths import chat_like

from hcache.engine.block_pool import BlockPool, PagedCache
from hcache.engine.prefill import PrefillJob
from hcache.restore.executor import restore
from hcache.restore.plan import Method, Plan
from hcache.restore.state import MemoryState, StateUnavailable


class Flaky(MemoryState):
    """A memory source whose `bad` layers cannot be read."""

    def __init__(self, state: MemoryState, bad: set[int]):
        self.__dict__.update(state.__dict__)
        self.bad, self.reads = bad, []

    def hidden(self, layer: int, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        self.reads.append(layer)
        if layer in self.bad:
            raise StateUnavailable(layer, "bad chunk")
        return super().hidden(layer, lo, hi)

    def kv(self, layer: int, lo: int = 0, hi: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        self.reads.append(layer)
        if layer in self.bad:
            raise StateUnavailable(layer, "bad chunk")
        return super().kv(layer, lo, hi)


@pytest.mark.parametrize("name", list(TINY))
def test_unusable_layers_anywhere_are_recomputed_once(tiny_folder, name: str) -> None:
    """Layers 0 and 2 unusable, 1 fine: recompute covers 0, then 1..2 continuing the prefix."""
    model = tload(tiny_folder(name))
    state, ref = chat_like(model)
    src = Flaky(state, {0, 2})
    cache, rep = restore(model, Plan.uniform(3, Method.HIDDEN), src)
    assert rep.fallback_layers == 3
    assert sorted(src.reads) == [0, 1, 2]  # no layer read twice
    for layer in range(3):
        for got, want in zip(cache.layer_kv(layer), ref.layer_kv(layer), strict=True):
            assert rel_err(got, want) <= 1e-5


def _paged(model, n: int) -> PagedCache:
    pool = BlockPool(model.cfg, model.dtype, model.device, num_blocks=-(-n // 64) + 1)
    cache = PagedCache(pool)
    cache.reserve(n)
    return cache


@pytest.mark.parametrize("plan", ["RHK", "HHH", "KKK", "RRK", "RRR"])
def test_engine_job_and_restore_produce_the_same_bits(tiny_folder, plan: str) -> None:
    """What the profiler and `bench restore` time (restore) is what the engine runs."""
    model = tload(tiny_folder("llama_gqa"))
    state, _ = chat_like(model)
    p = Plan.from_letters(plan)
    want, _ = restore(model, p, state)
    n = len(state.tokens)
    for fused, new in ((True, []), (False, [5, 6, 7]), (True, [5, 6, 7])):
        cache = _paged(model, n + len(new))
        job = PrefillJob(model, cache, list(state.tokens), new, p, state, fused=fused)
        with torch.inference_mode():
            for _ in job.run():
                pass
        assert cache.length == n + len(new)
        assert job.report.restore_ms > 0 and job.report.fallback_layers == 0
        for layer in range(3):
            for got, ref in zip(cache.layer_kv(layer, n), want.layer_kv(layer), strict=True):
                assert torch.equal(got, ref), f"layer {layer} differs ({plan}, fused={fused})"


def test_engine_job_falls_back_like_restore(tiny_folder) -> None:
    model = tload(tiny_folder("llama_mha"))
    state, ref = chat_like(model)
    n = len(state.tokens)
    cache = _paged(model, n + 2)
    job = PrefillJob(model, cache, list(state.tokens), [5, 6], Plan.uniform(3, Method.KV), Flaky(state, {1}))
    with torch.inference_mode():
        for _ in job.run():
            pass
    assert job.report.fallback_layers == 2
    for layer in range(3):
        for got, want in zip(cache.layer_kv(layer, n), ref.layer_kv(layer), strict=True):
            assert rel_err(got, want) <= 1e-5
