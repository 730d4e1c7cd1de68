"""Faults that must not lose an acknowledged turn or serve wrong state: a writer killed
with SIGKILL mid-flush, and corrupt chunks under a real restore."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import tload
from storage_helpers import GEOM, check_all

from hcache.config import StorageConfig
from hcache.engine.generate import ChatSession
from hcache.engine.sampler import SamplingParams
from hcache.restore.plan import Method, Plan
from hcache.restore.recorder import StoreRecorder
from hcache.restore.sources import StoreSource
from hcache.storage.fsck import fsck
from hcache.storage.layout import Kind
from hcache.storage.store import ChunkStore

HERE = Path(__file__).parents[1]  # tests/: writer_proc.py and its helpers


def test_kill_9_mid_flush_loses_no_durable_turn(tmp_path) -> None:
    dirs = [tmp_path / f"d{i}" for i in range(2)]
    for d in dirs:
        d.mkdir()
    env = {**os.environ, "PYTHONPATH": f"{HERE}:{os.environ.get('PYTHONPATH', '')}"}
    acked = 0
    for round_ in range(3):
        p = subprocess.Popen(
            [sys.executable, str(HERE / "writer_proc.py"), *map(str, dirs)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert p.stdout is not None
        start = int(p.stdout.readline().split()[1])
        assert start >= acked  # every acknowledged turn survived the previous kill
        seen = 0
        while seen < 4 + round_:
            line = p.stdout.readline()
            assert line.startswith("DURABLE"), line
            acked = int(line.split()[1])
            seen += 1
        time.sleep(0.003 * round_)  # land somewhere inside the next turn's flush
        p.send_signal(signal.SIGKILL)
        p.wait()
        with ChunkStore(StorageConfig([str(d) for d in dirs]), GEOM, torch.float32) as st:
            durable = st.owner_row("s").num_tokens
            assert durable >= acked
            check_all(st, "s", durable)  # every committed chunk verifies and holds the right rows
            free = sum(len(a.free) for a in st.placement.allocs.values())
            assert all(a.high == (max(a.used) + 1 if a.used else 0) for a in st.placement.allocs.values())
        report = fsck([str(d) for d in dirs])
        assert report.clean, report.lines()
        # every unreferenced slot the killed writer left is either cut off or on the free list
        assert report.orphan_slots == free


@pytest.fixture(scope="module")
def tiny_llama(tiny_folder):
    return tload(tiny_folder("llama_gqa"))


def _session_tokens(model, store, owner: str, turns: int = 3) -> list[int]:
    """Drive a session through the store recorder with token ids (the tiny model has no tokenizer)."""
    from hcache.engine.generate import generate
    from hcache.model import KVCache

    rec = StoreRecorder(store, owner)
    cache = KVCache(model.cfg, model.dtype, model.device)
    g = torch.Generator().manual_seed(5)
    for _ in range(turns):
        prompt = torch.randint(3, model.cfg.vocab_size, (int(torch.randint(20, 90, (1,), generator=g)),), generator=g)
        list(generate(model, cache, prompt.tolist(), SamplingParams(max_new_tokens=9), set(), rec))
        rec.end_turn()
    return rec.tokens


@pytest.mark.parametrize("corrupt", [False, True])
def test_store_restore_exact_with_corrupt_chunk_fallback(tiny_llama, tmp_path, corrupt: bool) -> None:
    from hcache.engine.generate import generate
    from hcache.model import KVCache
    from hcache.restore.executor import restore
    from hcache.restore.state import MemoryState

    model, L = tiny_llama, tiny_llama.cfg.num_layers
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    kinds = [None, Kind.HIDDEN, Kind.KV]
    fp = model.fingerprint()
    with ChunkStore(StorageConfig([str(d) for d in dirs]), model.cfg, model.dtype, str(model.device)) as st:
        st.create_owner("s", kinds, fp)
        tokens = _session_tokens(model, st, "s")
    # reference: a never-evicted cache over the same tokens
    dev = model.device
    ref_cache, ref_state = KVCache(model.cfg, model.dtype, dev), MemoryState(model.cfg, model.dtype, dev)
    list(generate(model, ref_cache, tokens, SamplingParams(max_new_tokens=1), set(), ref_state))
    want = list(generate(model, ref_cache, [7, 8, 9], SamplingParams(max_new_tokens=8), set()))
    with ChunkStore(
        StorageConfig([str(d) for d in dirs]), model.cfg, model.dtype, str(model.device)
    ) as st:  # after a restart
        if corrupt:
            row = next(r for r in st.manifest.chunks("s") if r.layer == 2 and r.idx == 1)
            with open(st.dirs[row.dir] / f"{row.slab}.slab", "r+b") as f:
                f.seek(row.slot * st.placement.slab(row.dir, row.slab).slot_bytes + 8)
                f.write(bytes([0, 1, 2, 3]))
        plan = Plan((Method.RECOMPUTE, Method.HIDDEN, Method.KV))
        cache, report = restore(model, plan, StoreSource(st, "s", fp))
        assert report.fallback_layers == (2 if corrupt else 0)  # layers 1 and 2 join the RE prefix
        assert st.stats.checksum_failures == (1 if corrupt else 0)
        for layer in range(L):
            for got, ref in zip(cache.layer_kv(layer), ref_state.kv(layer), strict=True):
                assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
        got = list(generate(model, cache, [7, 8, 9], SamplingParams(max_new_tokens=8), set()))
        assert got == want


def test_other_model_fingerprint_is_refused(tiny_llama, tiny_folder, tmp_path) -> None:
    from hcache.storage.errors import FingerprintMismatch

    other = tload(tiny_folder("llama_mha"))
    with ChunkStore(StorageConfig([str(tmp_path)]), tiny_llama.cfg, tiny_llama.dtype) as st:
        st.create_owner("s", [Kind.KV] * 3, tiny_llama.fingerprint())
        assert other.fingerprint() != tiny_llama.fingerprint()
        with pytest.raises(FingerprintMismatch, match="saved by another model"):
            StoreSource(st, "s", other.fingerprint())
    bf16 = tload(tiny_folder("llama_gqa"), "bfloat16")
    assert bf16.fingerprint() != tiny_llama.fingerprint()


def test_default_model_chat_restored_from_store_after_restart(default_model, tmp_path) -> None:
    from hcache import demo

    m, tok = default_model.model, default_model.tokenizer
    fp, P = m.fingerprint(), SamplingParams(max_new_tokens=16)
    kinds = [None] * 4 + [Kind.HIDDEN] * 16 + [Kind.KV] * 10
    plans = {
        "mixed": Plan.split(30, 4, 16),
        "all-RE": Plan.uniform(30, Method.RECOMPUTE),
        "stored": Plan((Method.RECOMPUTE,) * 4 + (Method.HIDDEN,) * 16 + (Method.KV,) * 10),
    }
    reference = ChatSession(m, tok, demo.SYSTEM)
    with ChunkStore(StorageConfig([str(tmp_path)]), m.cfg, m.dtype) as st:
        st.create_owner("s", kinds, fp)
        saved = ChatSession(m, tok, demo.SYSTEM, recorder=StoreRecorder(st, "s"))
        for msg in demo.TURNS[:2]:
            assert saved.reply(msg, P)[1] == reference.reply(msg, P)[1]
    want = reference.reply(demo.TURNS[2], P)[1]
    for name, plan in plans.items():
        with ChunkStore(StorageConfig([str(tmp_path)]), m.cfg, m.dtype) as st:
            s = ChatSession(m, tok, None, recorder=StoreRecorder(st, "s"))
            s.messages = list(reference.messages[:-2])
            s.restore(plan, StoreSource(st, "s", fp))
            got = s.reply(demo.TURNS[2], P)[1]
            assert got == want, name
            st.truncate("s", len(reference.state.tokens) - len(want) + 1)  # back to before the third turn
