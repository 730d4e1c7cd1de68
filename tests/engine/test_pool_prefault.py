"""The KV pool's pages are faulted in at start, beside serving (`EngineConfig.prefault_pool`),
without touching what the engine writes meanwhile: a first write into a fresh huge page
zeroes and compacts it inside a turn."""

from __future__ import annotations

import ctypes
import mmap
import sys

import pytest
import torch

from hcache.engine.block_pool import BlockPool
from hcache.memory import aligned_buffer, populate
from hcache.model.loader import DEFAULT_GEOMETRY

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")


def resident(addr: int, nbytes: int) -> float:
    """The share of the pages at `addr` in memory now (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pages = -(-nbytes // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(nbytes), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) / pages


def test_populate_faults_pages_in_and_keeps_what_they_hold():
    buf = aligned_buffer(8 << 20)
    t = torch.frombuffer(buf, dtype=torch.uint8)
    t[: 1 << 20] = 7  # the first megabyte written, the rest never touched
    if not populate(t.data_ptr(), t.numel()):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14+)")
    assert resident(t.data_ptr(), t.numel()) == 1.0
    assert bool((t[: 1 << 20] == 7).all()) and not bool(t[1 << 20 :].any())


def test_a_prefaulting_pool_is_resident_once_populated_and_a_plain_one_is_not():
    cfg = DEFAULT_GEOMETRY
    blocks = (16 << 20) // BlockPool.bytes_per_block(cfg, torch.bfloat16)
    plain = BlockPool(cfg, torch.bfloat16, "cpu", blocks)
    assert plain.populated.is_set()  # nothing to wait for
    if not populate(plain.kv[0].data_ptr(), mmap.PAGESIZE):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14+)")
    layer_bytes = plain.kv[0].numel() * plain.kv[0].element_size()
    assert resident(plain.kv[1].data_ptr(), layer_bytes) < 0.5
    pool = BlockPool(cfg, torch.bfloat16, "cpu", blocks, prefault=True)
    assert pool.populated.wait(60)
    for kv in pool.kv:
        assert resident(kv.data_ptr(), layer_bytes) == 1.0
        assert not bool(kv.any())  # still the zeros reads land in
