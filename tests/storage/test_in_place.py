"""Stored KV read straight into the engine's pool: O_DIRECT lands each chunk in the
sequence's blocks (the pool holds each token's K then V, as chunks do), and nothing is
copied after; a chunk that fails its checksum there is recomputed over, and blocks given
up mid-restore wait until no read can still land in them."""

from __future__ import annotations

import pytest
import torch
from conftest import tload
from test_restart_and_corruption import _session_tokens

import hcache.engine.block_pool as block_pool
from hcache.config import StorageConfig
from hcache.engine.block_pool import BlockPool, PagedCache
from hcache.engine.generate import generate
from hcache.engine.sampler import SamplingParams
from hcache.model import KVCache
from hcache.restore.executor import RestoreJob
from hcache.restore.plan import Method, Plan
from hcache.restore.sources import StoreSource
from hcache.restore.state import MemoryState
from hcache.storage.layout import Kind
from hcache.storage.store import ChunkStore


@pytest.fixture(scope="module")
def tiny_llama(tiny_folder):
    return tload(tiny_folder("llama_gqa"))


def _stored(model, tmp_path) -> tuple[StorageConfig, list[int]]:
    for d in "ab":
        (tmp_path / d).mkdir()
    cfg = StorageConfig([str(tmp_path / "a"), str(tmp_path / "b")])
    with ChunkStore(cfg, model.cfg, model.dtype, str(model.device)) as st:
        st.create_owner("s", [Kind.KV] * model.cfg.num_layers, model.fingerprint())
        tokens = _session_tokens(model, st, "s")
    return cfg, tokens


def _pool_cache(model, n: int) -> PagedCache:
    cache = PagedCache(BlockPool(model.cfg, model.dtype, model.device, -(-n // 64) + 2))
    cache.reserve(n)
    return cache


def _restore(model, cfg: StorageConfig, n: int, corrupt: bool) -> PagedCache:
    L = model.cfg.num_layers
    with ChunkStore(cfg, model.cfg, model.dtype, str(model.device)) as st:
        cache = _pool_cache(model, n)
        with torch.inference_mode():
            rep = RestoreJob(model, Plan.uniform(L, Method.KV), StoreSource(st, "s", model.fingerprint()), cache).run()
        assert rep.fallback_layers == (2 if corrupt else 0)
        assert st.stats.checksum_failures == (1 if corrupt else 0)
    return cache


@pytest.mark.parametrize("corrupt", [False, True])
def test_a_kv_restore_lands_in_the_pool_and_copies_nothing(tiny_llama, tmp_path, monkeypatch, corrupt: bool) -> None:
    model, L = tiny_llama, tiny_llama.cfg.num_layers
    cfg, tokens = _stored(model, tmp_path)
    if corrupt:  # a chunk of layer 1 that lands in the pool, then fails its checksum there
        with ChunkStore(cfg, model.cfg, model.dtype, str(model.device)) as st:
            row = next(r for r in st.manifest.chunks("s") if r.layer == 1 and r.idx == 0)
            with open(st.dirs[row.dir] / f"{row.slab}.slab", "r+b") as f:
                f.seek(row.slot * st.placement.slab(row.dir, row.slab).slot_bytes + 8)
                f.write(bytes([0, 1, 2, 3]))
    in_place: list[bool] = []
    same = block_pool.same_memory
    monkeypatch.setattr(block_pool, "same_memory", lambda a, b: in_place.append(same(a, b)) or in_place[-1])
    got = _restore(model, cfg, len(tokens), corrupt)
    # every layer read was placed by the reads themselves: `write` found its K and V in place
    assert in_place.count(True) == 2 * (L - corrupt)  # each layer read whole (recomputes are written)
    monkeypatch.setattr(PagedCache, "kv_rows", lambda self, layer, lo, hi: None)  # read buffers, then copies
    want = _restore(model, cfg, len(tokens), corrupt)
    ref = MemoryState(model.cfg, model.dtype, model.device)
    list(
        generate(
            model, KVCache(model.cfg, model.dtype, model.device), tokens, SamplingParams(max_new_tokens=1), set(), ref
        )
    )
    for layer in range(L):
        for a, b, r in zip(got.layer_kv(layer), want.layer_kv(layer), ref.kv(layer), strict=True):
            assert torch.equal(a, b)
            assert (a - r.view_as(a)).abs().max() <= 1e-5 * r.abs().max()


def test_blocks_given_up_mid_restore_wait_for_the_reads(tiny_llama, tmp_path) -> None:
    """A turn that fails or is cancelled while its restore reads frees its blocks: `free`
    returns only once no read of that restore can land in them (another sequence may get
    them next)."""
    model, L = tiny_llama, tiny_llama.cfg.num_layers
    cfg, tokens = _stored(model, tmp_path)
    cfg.read_cap_gbps = 0.0005  # 0.5 MB/s: the reads are still in flight when the blocks go
    with ChunkStore(cfg, model.cfg, model.dtype, str(model.device)) as st:
        cache = _pool_cache(model, len(tokens))
        src = StoreSource(st, "s", model.fingerprint())
        job = RestoreJob(model, Plan.uniform(L, Method.KV), src, cache)
        job.start()
        assert src.reader is not None
        reader = src.reader
        assert reader._reading > 0  # requests submitted, not yet read
        cache.free()
        assert reader._reading == 0
