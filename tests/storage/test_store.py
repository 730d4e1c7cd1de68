"""Chunk store: placement, two-stage saving, copy-on-write tails, restarts, quotas,
checksums and fsck, on a small geometry with self-describing rows."""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import itertools
import logging
import os
import sqlite3
import threading
from pathlib import Path

import pytest
import torch
from storage_helpers import GEOM, KINDS, check_all, dirs_in, expected, flip_byte, h_rows, kv_rows, open_store, save

from hcache.config import StorageConfig
from hcache.memory import aligned_buffer
from hcache.storage import slab
from hcache.storage.buffers import ChunkBuffers, LayerBuffers
from hcache.storage.errors import ChunkError, StorageError, StorageFull, StoreLocked, UnknownOwner
from hcache.storage.fsck import fsck
from hcache.storage.layout import CHUNK_TOKENS, Kind, chunk_shapes, home_dir
from hcache.storage.manifest import Manifest
from hcache.storage.outbox import HELD_STEPS
from hcache.storage.placement import Placement
from hcache.storage.stats import StoreStats
from hcache.storage.store import MANIFEST, ChunkStore


@pytest.fixture
def dirs(tmp_path):
    return dirs_in(tmp_path)


def chat_turns(store: ChunkStore, owner: str, turns=((70, 5), (30, 40)), kinds=KINDS) -> int:
    """Prompts prefilled at once, replies one token at a time, durable at the end of each turn."""
    n = 0
    for prompt, reply in turns:
        save(store, owner, n, prompt, kinds)
        n += prompt
        for _ in range(reply):
            save(store, owner, n, 1, kinds)
            n += 1
        store.mark_durable(owner, list(range(n)))
    return n


def test_open_chunks_cut_from_several_arenas_get_their_own_rows(dirs, monkeypatch) -> None:
    """The packer writes a token's row into all of an owner's open chunks of a kind with one
    assignment per arena of chunk buffers: with arenas of 3 buffers each owner's chunks
    span several, shared with the other owner's."""
    monkeypatch.setattr(ChunkBuffers, "GROW", 3)
    with open_store(dirs[:2]) as st:
        for owner in ("a", "b"):
            st.create_owner(owner, KINDS, "fp")
        n = {owner: chat_turns(st, owner, turns=((70, 5),)) for owner in ("a", "b")}
        for _ in range(70):  # a row at a time, the owners in turn, as decode steps stage them
            for owner in ("a", "b"):
                save(st, owner, n[owner], 1, KINDS)
                n[owner] += 1
        for owner in ("a", "b"):
            st.mark_durable(owner, list(range(n[owner])))
        for owner in ("a", "b"):
            check_all(st, owner, n[owner])


@pytest.mark.parametrize("n_dirs", [1, 3])
def test_roundtrip_and_placement(dirs, n_dirs: int) -> None:
    with open_store(dirs[:n_dirs]) as st:
        st.create_owner("s", KINDS, "fp")
        n = chat_turns(st, "s")
        check_all(st, "s", n)
        rows = st.manifest.chunks("s")
        assert {(r.layer, r.kind) for r in rows} == {(i, k.value) for i, k in enumerate(KINDS) if k}
        assert all(r.dir == home_dir(r.layer, r.idx, n_dirs) for r in rows)
        assert st.owner_row("s").tokens == list(range(n))
        if n_dirs > 1:
            assert all(u.chunks > 0 for u in st.usage())


def test_tail_is_replaced_copy_on_write(dirs) -> None:
    with open_store(dirs[:1]) as st:
        st.create_owner("s", KINDS, "fp")
        save(st, "s", 0, 70)
        st.mark_durable("s", list(range(70)))
        tail = {(r.layer, r.kind): r for r in st.manifest.chunks("s") if r.idx == 1}
        assert {r.ntokens for r in tail.values()} == {70 - CHUNK_TOKENS}
        save(st, "s", 70, 10)
        st.mark_durable("s", list(range(80)))
        new = {(r.layer, r.kind): r for r in st.manifest.chunks("s") if r.idx == 1}
        for key, old in tail.items():
            assert new[key].ntokens == 16 and new[key].slot != old.slot  # a fresh slot, never overwritten in place
        check_all(st, "s", 80)


def test_restart_keeps_durable_turns_and_continues(dirs) -> None:
    with open_store(dirs) as st:
        st.create_owner("s", KINDS, "fp")
        n = chat_turns(st, "s")
        save(st, "s", n, 50)  # staged but never made durable: lost by design, no harm done
    with open_store(dirs) as st:
        assert st.owner_row("s").num_tokens == n
        check_all(st, "s", n)
        save(st, "s", n, 100)  # continues from the durable tail, read back from disk
        st.mark_durable("s", list(range(n + 100)))
        check_all(st, "s", n + 100)
    assert fsck([str(d) for d in dirs]).clean


def test_truncate_rewrites_history(dirs) -> None:
    with open_store(dirs) as st:
        st.create_owner("s", KINDS, "fp")
        save(st, "s", 0, 150)
        st.mark_durable("s", list(range(150)))
        st.truncate("s", 100)
        save(st, "s", 100, 30, salt=0.5)
        st.mark_durable("s", list(range(130)))
        check_all(st, "s", 130, salt_from=100, salt=0.5)
    with open_store(dirs) as st:
        check_all(st, "s", 130, salt_from=100, salt=0.5)


def test_staged_rows_must_follow_on(dirs) -> None:
    with open_store(dirs[:1]) as st:
        st.create_owner("s", KINDS, "fp")
        save(st, "s", 0, 10)
        save(st, "s", 20, 5)  # a gap
        with pytest.raises(StorageError, match="expected 10"):
            st.mark_durable("s", list(range(15)))


def test_full_ring_blocks_producer_and_loses_nothing(dirs) -> None:
    one_batch = 64 * (2 * GEOM.hidden_size + 2 * 2 * GEOM.kv_dim) * 4
    with open_store(dirs, staging_bytes=one_batch + 4096) as st:
        st.create_owner("s", KINDS, "fp")
        for i in range(40):
            save(st, "s", i * 64, 64)
        st.mark_durable("s", list(range(40 * 64)))
        assert st.stats.ring_waits > 0
        check_all(st, "s", 40 * 64)


def test_delete_frees_everything(dirs) -> None:
    with open_store(dirs) as st:
        st.create_owner("a", KINDS, "fp")
        st.create_owner("b", KINDS, "fp")
        chat_turns(st, "a")
        nb = chat_turns(st, "b")
        st.delete("a")
        with pytest.raises(UnknownOwner):
            st.reader("a")
        check_all(st, "b", nb)
        used_b = sum(u.used_bytes for u in st.usage())
        st.delete("b")
        assert sum(u.used_bytes for u in st.usage()) == 0 < used_b
        assert sum(u.slab_bytes for u in st.usage()) == 0  # slab files shrink back
        assert st.owners() == []


def test_missing_directory_is_named(dirs) -> None:
    with pytest.raises(FileNotFoundError, match=r"storage directory missing: .*nope"):
        open_store([dirs[0], dirs[0].parent / "nope"])


def test_directory_list_must_not_change(dirs) -> None:
    open_store(dirs[:2]).close()
    with pytest.raises(StorageError, match="differ"):
        open_store([dirs[0], dirs[2]])


def test_store_with_the_old_kv_layout_is_refused_not_misread(dirs) -> None:
    """KV chunks written as K rows then V rows ([2, 64, kv_dim], before the layout was
    recorded) would read back as garbage that passes its checksum: the store says so
    and leaves every chunk as it was."""
    with open_store(dirs[:2]) as st:
        st.create_owner("s", KINDS, "fp")
        n = chat_turns(st, "s")
        st.manifest.db.execute("DELETE FROM meta WHERE key='kv_layout'")  # as an older hcache left it
    with pytest.raises(StorageError, match=r"K rows, then V rows.*empty directories"):
        open_store(dirs[:2])
    with sqlite3.connect(dirs[0] / MANIFEST) as db:  # these chunks are in fact token-major: nothing was lost
        db.execute("INSERT INTO meta VALUES('kv_layout', 'tokens,2,kv_dim')")
    with open_store(dirs[:2]) as st:
        check_all(st, "s", n)
    with open_store(dirs[2:3]) as st:  # no KV chunks yet: the layout is recorded, nothing refused
        assert st.manifest.get_meta("kv_layout") == "tokens,2,kv_dim"


def test_a_run_of_kv_chunks_is_read_as_one_segment(dirs, monkeypatch) -> None:
    """KV chunks are token-major ([64, 2, kv_dim]), so a layer's chunks in consecutive slots
    land in place as one iovec: on this VM's virtio disk every segment of a request costs
    (K and V rows in separate halves took two per chunk)."""
    segments, orig = [], slab.SlabFile.scatter
    monkeypatch.setattr(
        slab.SlabFile, "scatter", lambda sf, first, parts: segments.append(len(parts)) or orig(sf, first, parts)
    )
    kinds = [Kind.KV] * GEOM.num_layers
    with open_store(dirs[:1]) as st:
        st.create_owner("s", kinds, "fp")
        save(st, "s", 0, 8 * CHUNK_TOKENS, kinds)  # 8 full chunks per layer, in extents of 4 and 8 slots
        st.mark_durable("s", list(range(8 * CHUNK_TOKENS)))
        r = st.reader("s", range(GEOM.num_layers))
        for i in range(GEOM.num_layers):
            assert torch.equal(r.get(i), expected(i, Kind.KV, 8 * CHUNK_TOKENS))
        assert st.stats.chunks_read_in_place == 8 * GEOM.num_layers
    assert sum(segments) <= 3 * GEOM.num_layers, segments  # a run or two per layer (and gaps to skip), not 2 per chunk


def test_second_process_is_refused(dirs) -> None:
    with open_store(dirs), pytest.raises(StoreLocked, match="in use"):
        open_store(dirs)


def test_quota_skips_full_directory_then_says_full(dirs) -> None:
    slot_h = GEOM.hidden_size * CHUNK_TOKENS * 4
    with open_store(dirs[:2], quota_bytes=12 * slot_h) as st:
        st.create_owner("s", KINDS, "fp")
        save(st, "s", 0, 64 * 3)
        st.mark_durable("s", list(range(64 * 3)))
        check_all(st, "s", 64 * 3)
        rows = st.manifest.chunks("s")
        assert any(r.dir != home_dir(r.layer, r.idx, 2) for r in rows)  # placement moved off a full one
        assert all(u.slab_bytes <= 12 * slot_h for u in st.usage())
        save(st, "s", 64 * 3, 64 * 20)
        with pytest.raises(StorageFull, match="full"):
            st.mark_durable("s", list(range(64 * 23)))
        assert st.owner_row("s").num_tokens == 64 * 3  # the durable turn is intact
        check_all(st, "s", 64 * 3)


def _corrupt_one_chunk(st: ChunkStore, layer: int, idx: int = 0):
    row = next(r for r in st.manifest.chunks("s") if r.layer == layer and r.idx == idx)
    flip_byte(st, row)
    return row


def test_flipped_bytes_detected_on_read_and_by_fsck(dirs) -> None:
    with open_store(dirs) as st:
        st.create_owner("s", KINDS, "fp")
        n = chat_turns(st, "s")
        _corrupt_one_chunk(st, layer=2)
        r = st.reader("s", [1, 2, 3])
        with pytest.raises(ChunkError, match="layer 2 chunk 0: checksum mismatch") as e:
            r.get(2)
        assert (e.value.layer, e.value.index) == (2, 0)
        r.get(1), r.get(3)  # other layers unharmed
        assert st.stats.checksum_failures == 1
        with pytest.raises(ChunkError):
            st.read_chunk("s", 2, 0, Kind.KV)
    report = fsck([str(d) for d in dirs])
    assert not report.clean and [(r.layer, r.idx) for r, _ in report.bad_chunks] == [(2, 0)]
    repaired = fsck([str(d) for d in dirs], repair=True)
    assert any("removed 1" in a for a in repaired.actions)
    after = fsck([str(d) for d in dirs])
    assert [g for g in after.gaps] == ["owner s layer 2 chunk 0 missing (recompute covers it)"]
    with open_store(dirs) as st:
        with pytest.raises(ChunkError, match="missing"):
            st.reader("s", [2]).get(2)
        check_all(st, "s", n, kinds=[None, Kind.HIDDEN, None, Kind.HIDDEN, Kind.KV])


def test_fsck_drops_unrecoverable_owner_only_after_saying_so(dirs) -> None:
    with open_store(dirs) as st:
        st.create_owner("s", KINDS, "fp")
        chat_turns(st, "s")
        st.manifest.db.execute("UPDATE owners SET num_tokens = num_tokens + 7")  # tokens no longer match
    report = fsck([str(d) for d in dirs])
    assert [o for o, _ in report.bad_owners] == ["s"] and "unrecoverable owner s" in "\n".join(report.lines())
    with open_store(dirs) as st:
        assert [o.owner for o in st.owners()] == ["s"]  # not repaired: nothing dropped
    fsck([str(d) for d in dirs], repair=True)
    with open_store(dirs) as st:
        assert st.owners() == []


def test_fsck_refuses_a_running_store(dirs) -> None:
    with open_store(dirs), pytest.raises(StoreLocked):
        fsck([str(d) for d in dirs])


def test_buffered_fallback_where_odirect_is_refused(dirs, monkeypatch, caplog) -> None:
    """A filesystem that refuses O_DIRECT (EINVAL at open) gets buffered I/O and one warning."""
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(slab.os, "open", no_direct)
    monkeypatch.setattr(slab, "_warned_direct", False)
    with caplog.at_level(logging.WARNING), open_store(dirs) as st:
        st.create_owner("s", KINDS, "fp")
        n = chat_turns(st, "s")
        check_all(st, "s", n)
        assert st.placement.slabs and not any(s.direct for s in st.placement.slabs.values())
    warnings = [r for r in caplog.records if "O_DIRECT unavailable" in r.getMessage()]
    assert len(warnings) == 1


def test_read_cap_holds_the_rate(dirs) -> None:
    import time

    with open_store(dirs) as st:
        st.create_owner("s", KINDS, "fp")
        n = 64 * 40
        save(st, "s", 0, n)
        st.mark_durable("s", list(range(n)))
        nbytes = sum(u.used_bytes for u in st.usage())
        st.throttle.set_rate(nbytes / 0.5, burst_bytes=1)  # the whole owner in about half a second
        t0 = time.perf_counter()
        check_all(st, "s", n)
        took = time.perf_counter() - t0
        assert 0.4 < took < 2.0
        st.set_read_cap(0)
        t0 = time.perf_counter()
        check_all(st, "s", n)
        assert time.perf_counter() - t0 < took


def test_both_kinds_and_token_ranges(dirs) -> None:
    """A layer may store H and KV; a token-wise restore reads H's head and KV's tail."""
    from storage_helpers import expected

    from hcache.storage.reader import Want

    both = [{Kind.HIDDEN, Kind.KV}] * GEOM.num_layers
    with open_store(dirs) as st:
        st.create_owner("s", both, "fp")
        n = chat_turns(st, "s", kinds=both)
        assert st.owner_row("s").layer_kinds == "B" * GEOM.num_layers
        split = 128
        wants = [
            Want(i, k, *rng)
            for i in range(GEOM.num_layers)
            for k, rng in ((Kind.HIDDEN, (0, split)), (Kind.KV, (split, n)))
        ]
        r = st.reader("s", wants=wants)
        for i in range(GEOM.num_layers):
            assert torch.equal(r.get(i, Kind.HIDDEN), expected(i, Kind.HIDDEN, n)[:split])
            assert torch.equal(r.get(i, Kind.KV), expected(i, Kind.KV, n)[split:])
        with pytest.raises(ValueError, match="bad token range"):
            st.reader("s", wants=[Want(0, Kind.KV, 10, n)])


def test_reader_names_the_first_chunk_it_cannot_read(dirs) -> None:
    """A chunk holds fewer tokens than asked for, or is gone (a manifest that lags, say):
    that part fails naming the chunk; other parts read as usual."""
    from hcache.storage.reader import Want

    with open_store(dirs) as st:
        st.create_owner("s", KINDS, "fp")
        save(st, "s", 0, 192, KINDS)
        st.mark_durable("s", list(range(192)))
        kv = st.placement.index["s"][(2, Kind.KV.value)]
        kv[1] = dataclasses.replace(kv[1], ntokens=36)
        r = st.reader("s", wants=[Want(2, Kind.KV, 0, 192), Want(1, Kind.HIDDEN, 0, 192)])
        with pytest.raises(ChunkError, match="layer 2 chunk 1: holds 36 < 64 tokens"):
            r.get(2)
        assert torch.equal(r.get(1), expected(1, Kind.HIDDEN, 192))
        del st.placement.index["s"][(3, Kind.HIDDEN.value)][0]
        with pytest.raises(ChunkError, match="layer 3 chunk 0: missing"):
            st.reader("s", wants=[Want(3, Kind.HIDDEN, 0, 192)]).get(3)


def test_read_requests_follow_layer_order_and_grow():
    """Requests complete layers in order however their extents are spread through the slab;
    each covers consecutive wanted slots; a slab's first request is small, later ones double
    up to the max; every chunk is read exactly once."""
    import random

    from hcache.storage.manifest import ChunkRow
    from hcache.storage.readplan import plan_requests

    slot = 1 << 20
    rng = random.Random(0)
    # 6 layers written in 4 turns: each turn appends an extent per layer, so a layer's chunks
    # are spread over the slab, with free holes left between some extents
    rows, nxt, idx = [], 0, [0] * 6
    for _turn in range(4):
        for layer in range(6):
            for _ in range(rng.randint(1, 9)):
                rows.append(ChunkRow("o", layer, idx[layer], "h", 0, "h.x", nxt, 64, 0))
                idx[layer] += 1
                nxt += 1
            nxt += rng.choice([0, 0, 1, 5])
    qs = list(plan_requests(rows, {"h.x": slot}, max_bytes=8 << 20, first_bytes=2 << 20))
    got = sorted((c.layer, c.idx) for q in qs for c in q.chunks)
    assert got == sorted((r.layer, r.idx) for r in rows)
    bound = 2
    for q in qs:
        assert q.count <= bound and all(b.slot - a.slot <= 2 for a, b in zip(q.chunks, q.chunks[1:], strict=False))
        assert q.first == q.chunks[0].slot and q.count == q.chunks[-1].slot - q.first + 1
        bound = min(2 * bound, 8)
    assert qs[0].count <= 2 and max(q.count for q in qs) == 8
    for layer in range(6):
        done = max(i for i, q in enumerate(qs) if any(c.layer == layer for c in q.chunks))
        later = [i for i, q in enumerate(qs) if q.min_layer > layer]
        assert not later or done < min(later), f"layer {layer} completes after a later layer's request"
    # the first layer's requests hold its chunks alone: the consumer waits on them, idle
    assert all(c.layer == 0 for q in qs if q.min_layer == 0 for c in q.chunks)
    assert any(len({c.layer for c in q.chunks}) > 1 for q in qs)  # later ones run on into the next layers
    assert next(q.count for q in plan_requests(rows, {"h.x": slot}, max_bytes=8 << 20) if q.min_layer > 0) > 2
    near = list(plan_requests(rows, {"h.x": slot}, max_bytes=8 << 20, ahead=2))
    assert all(c.layer - q.min_layer < 2 for q in near for c in q.chunks)
    assert sorted((c.layer, c.idx) for q in near for c in q.chunks) == got


def _plan_chunk_by_chunk(rows, slot_bytes, max_bytes, max_gap=2, first_bytes=0, ahead=1 << 30):
    """plan_requests' rule, walked a chunk at a time: the reference for the extent-level planner."""
    from hcache.storage.readplan import Request

    by_slab = {}
    for r in sorted(rows, key=lambda r: r.slot):
        by_slab.setdefault((r.dir, r.slab), []).append(r)
    size = dict.fromkeys(by_slab, min(first_bytes or max_bytes, max_bytes))
    taken, out = set(), []
    first_layer = min((r.layer for r in rows), default=0)
    for r in sorted(rows, key=lambda r: (r.layer, r.idx)):
        if id(r) in taken:
            continue
        members = by_slab[(r.dir, r.slab)]
        p = members.index(r)
        limit = max(1, size[(r.dir, r.slab)] // slot_bytes[r.slab])
        stop = r.layer + (1 if r.layer == first_layer else ahead)
        j, last = p + 1, r.slot
        while j < len(members):
            c = members[j]
            if id(c) in taken or c.layer >= stop or c.slot - last > max_gap or c.slot - r.slot >= limit:
                break
            last, j = c.slot, j + 1
        taken.update(id(c) for c in members[p:j])
        out.append(Request(r.dir, r.slab, r.slot, last - r.slot + 1, members[p:j], r.layer))
        size[(r.dir, r.slab)] = min(2 * size[(r.dir, r.slab)], max_bytes)
    return out


def test_read_plan_equals_the_chunk_by_chunk_rule():
    """The planner works on extents for speed; on random layouts (several directories and
    kinds, extents of many turns, holes, chunks moved to other slots) it makes exactly the
    requests the rule gives when applied chunk by chunk."""
    import random
    from collections import defaultdict

    from hcache.storage.manifest import ChunkRow
    from hcache.storage.readplan import plan_requests

    def shape(qs):
        return [(q.dir, q.slab, q.first, q.count, q.min_layer, [(c.layer, c.idx) for c in q.chunks]) for q in qs]

    rng = random.Random(7)
    for _ in range(400):
        n_dirs, n_layers = rng.randint(1, 4), rng.randint(1, 8)
        rows, nxt, idx = [], defaultdict(int), [0] * n_layers
        for _turn in range(rng.randint(1, 5)):
            for layer in rng.sample(range(n_layers), n_layers):
                for _ in range(rng.randint(0, 9)):
                    d, kind = rng.randrange(n_dirs), rng.choice(["h", "kv"])
                    rows.append(ChunkRow("o", layer, idx[layer], kind, d, f"{kind}.x", nxt[(d, kind)], 64, 0))
                    idx[layer] += 1
                    nxt[(d, kind)] += 1 + rng.choice([0, 0, 0, 1, 2, 3])
                for k in nxt:
                    nxt[k] += rng.choice([0, 0, 1, 5])
        for _ in range(rng.randint(0, 4)):  # tails and reused slots: indices that fall with the slot
            if len(rows) < 2:
                break
            i, j = rng.sample(range(len(rows)), 2)
            a, b = rows[i], rows[j]
            if (a.dir, a.kind) == (b.dir, b.kind):
                rows[i], rows[j] = dataclasses.replace(a, slot=b.slot), dataclasses.replace(b, slot=a.slot)
        rng.shuffle(rows)
        sizes = {"h.x": rng.choice([1 << 20, 4096]), "kv.x": rng.choice([1 << 19, 8192])}
        kw = {
            "max_bytes": rng.choice([4 << 20, 8 << 20, 1 << 30]),
            "first_bytes": rng.choice([0, 1 << 20, 2 << 20]),
            "ahead": rng.choice([1, 2, 3, 1 << 30]),
            "max_gap": rng.choice([0, 1, 2]),
        }
        assert shape(plan_requests(rows, sizes, **kw)) == shape(_plan_chunk_by_chunk(rows, sizes, **kw)), kw


def test_restores_of_an_unchanged_owner_take_its_first_read_plan(dirs, monkeypatch) -> None:
    """Readers of the same rows of an owner whose chunks did not change (every session on a
    shared context) read by the first one's plan; any change to the chunks plans again, even
    one that leaves every range as it was."""
    import hcache.storage.readplan as readplan

    made, real = [], readplan.plan_requests
    monkeypatch.setattr(readplan, "plan_requests", lambda *a, **kw: made.append(1) or real(*a, **kw))
    with open_store(dirs) as st:
        st.create_owner("s", KINDS, "fp")
        save(st, "s", 0, 150)
        st.mark_durable("s", list(range(150)))
        check_all(st, "s", 150)
        check_all(st, "s", 150)
        assert len(made) == 1
        st.truncate("s", 100)
        save(st, "s", 100, 50, salt=0.5)
        st.mark_durable("s", list(range(150)))
        check_all(st, "s", 150, salt_from=100, salt=0.5)  # the same ranges over other chunks
        check_all(st, "s", 150, salt_from=100, salt=0.5)
        assert len(made) == 2
        st.release("s", 1)  # a layer's kind given up
        left = [next(iter(ks), None) for ks in st.layer_kinds(st.owner_row("s"))]
        assert left != KINDS
        check_all(st, "s", 150, kinds=left, salt_from=100, salt=0.5)
        assert len(made) == 3


def test_a_read_plan_is_reused_once_whole_as_fresh_requests() -> None:
    from hcache.storage.manifest import ChunkRow
    from hcache.storage.readplan import ReadPlan, Want

    index = {
        (layer, "h"): {i: ChunkRow("o", layer, i, "h", 0, "h.x", 4 * i + layer, 64, 0) for i in range(4)}
        for layer in range(4)
    }
    wants = [Want(layer, Kind.HIDDEN, 0, 256) for layer in range(4)]
    plan = ReadPlan("o", wants, index, {"h.x": 1 << 20}, 2 << 20, 1 << 20, 3)
    made = plan.requests()
    first = [next(made)]
    assert not plan.reusable
    with pytest.raises(RuntimeError):
        next(plan.requests())  # a plan being made has one reader
    first += list(made)
    first[0].gate, first[0].not_before = 2, 1.0  # what a reader marks on its requests
    assert plan.reusable and len(first) > 1
    again = list(plan.requests())
    fields = ("dir", "slab", "first", "count", "chunks", "min_layer")
    assert [[getattr(q, f) for f in fields] for q in again] == [[getattr(q, f) for f in fields] for q in first]
    assert not any(q.gate or q.not_before for q in again)


def test_read_ahead_covers_prefetch_bytes_past_the_consumer(dirs) -> None:
    """Small layers are read ahead by bytes, not only by the layer window: a consumer that is
    busy elsewhere (recomputing a prefix) finds them all in once it asks."""
    import time

    kinds = [Kind.KV] * GEOM.num_layers
    with open_store(dirs[:1], prefetch_layers=1) as st:
        st.create_owner("o", kinds, "fp")
        save(st, "o", 0, 64, kinds)
        st.mark_durable("o", list(range(64)))
        r = st.reader("o")
        deadline = time.monotonic() + 10
        while not all(r.slots[(i, Kind.KV)].ready.is_set() for i in range(GEOM.num_layers)):
            assert time.monotonic() < deadline, "later layers were not read ahead"
            time.sleep(0.01)
    with open_store(dirs[:1], prefetch_layers=1, prefetch_bytes=0) as st:
        r = st.reader("o")
        assert r.wait(0, Kind.KV, timeout=30)
        # one layer ahead, no more: requests for the later layers wait for the consumer
        assert r._next is not None and r._next.min_layer <= GEOM.num_layers - 1
        assert not r.ready(GEOM.num_layers - 1, Kind.KV)


def test_read_buffers_are_reused_by_the_next_restore(dirs) -> None:
    """Layer buffers freed by one restore serve the next: a reader holds every layer read
    ahead (more than the layer window when layers are small) and all of them come back."""
    kinds = [Kind.KV] * GEOM.num_layers
    with open_store(dirs[:1], prefetch_layers=1) as st:
        st.create_owner("o", kinds, "fp")
        save(st, "o", 0, 64, kinds)
        st.mark_durable("o", list(range(64)))

        def restore_all() -> None:
            r = st.reader("o")
            for layer in range(GEOM.num_layers):
                r.get(layer, Kind.KV)
            for layer in range(GEOM.num_layers):  # a restore keeps each layer until it is placed
                r.release(layer)

        restore_all()
        first = st.stats.read_buffers_allocated
        restore_all()
        assert first >= GEOM.num_layers and st.stats.read_buffers_allocated == first


def test_one_buffer_pool_serves_layers_of_every_size(dirs) -> None:
    """A free buffer large enough serves a smaller layer (H after KV, a shorter session): with
    a pool per power-of-two size, a KV-only restore after an H-only one faulted in fresh
    buffers for every layer. Over the budget, the least recently returned buffers go."""
    with open_store(dirs[:1], prefetch_bytes=1, prefetch_layers=0) as st:
        big = st.buffers.take((3 << 20,), torch.float32)  # a KV layer, say
        st.buffers.give(big)
        small = st.buffers.take((1 << 20, 1), torch.float32)  # an H layer a third the size: no fresh buffer
        assert st.stats.read_buffers_allocated == 1 and small.data_ptr() == big.data_ptr()
        st.buffers.give(small)
        # the budget keeps two restores' read-ahead, here 2 * (0 + 2) of the largest buffer
        more = [st.buffers.take((3 << 20,), torch.float32) for _ in range(6)]
        assert st.stats.read_buffers_allocated == 6
        for t in more:
            st.buffers.give(t)
        kept = {t.data_ptr() for t in st.buffers.free}
        assert kept == {t.data_ptr() for t in more[2:]}  # the first two returned went


def test_layer_buffers_reuse_the_smallest_that_fits() -> None:
    """Of the free buffers large enough, the smallest serves: a larger one stays for a larger layer."""
    stats = StoreStats()
    pool = LayerBuffers(False, prefetch_bytes=1 << 30, prefetch_layers=4, stats=stats)
    big, small, middle = (
        pool.take((3 << 20,), torch.float32),
        pool.take((1 << 20,), torch.float32),
        pool.take((2 << 20,), torch.float32),
    )
    for t in (big, small, middle):
        pool.give(t)
    assert pool.take((1 << 19, 2), torch.float32).data_ptr() == small.data_ptr()
    assert pool.take(((1 << 20) + 1,), torch.float32).data_ptr() == middle.data_ptr()
    assert pool.take((3 << 20,), torch.float32).data_ptr() == big.data_ptr()
    assert stats.read_buffers_allocated == 3


def test_placement_tries_home_then_the_next_directories_in_turn(dirs) -> None:
    """Chunk c of layer l goes to directory (l + c) mod N; a directory without room is
    skipped for the next one, wrapping around; with none left the store is full."""
    shapes = chunk_shapes(GEOM, torch.float32)
    h = shapes[Kind.HIDDEN]
    manifest = Manifest(dirs[0] / MANIFEST)
    cfg = StorageConfig([str(d) for d in dirs], quota_bytes=2 * h.slot_bytes)  # two slots per directory
    placement = Placement(dirs, manifest, shapes, cfg, StoreStats())
    try:
        tails = [(layer, idx) for idx in range(2) for layer in range(3)]
        placed = {key: placement.place(h, "o", *key, full=False) for key in tails}
        assert [d for d, _ in placed.values()] == [0, 1, 2, 1, 2, 0]  # (layer + idx) mod 3
        placement.release(0, h.slab, placed[(0, 0)][1])  # room in directories 0 and 2
        placement.release(2, h.slab, placed[(2, 0)][1])
        assert placement.place(h, "o", 0, 1, full=False)[0] == 2  # home is 1, which is full
        assert placement.place(h, "o", 0, 1, full=False)[0] == 0
        with pytest.raises(StorageFull, match="all 3 storage directories are full"):
            placement.place(h, "o", 1, 0, full=False)
    finally:
        placement.close()
        manifest.close()


def test_storage_threads_copy_on_one_core(dirs) -> None:
    """Reader and writer threads run their torch copies on one core each; the caller keeps
    its own thread count (a per-thread setting)."""
    import threading
    from types import SimpleNamespace

    before = torch.get_num_threads()
    with open_store(dirs[:1]) as st:
        seen: list[tuple[str, int]] = []
        st.on_flush = lambda d, s: seen.append(("writer", torch.get_num_threads()))
        st.create_owner("o", KINDS, "fp")
        save(st, "o", 0, 64, KINDS)
        st.mark_durable("o", list(range(64)))
        done = threading.Event()
        st.reads.submit(
            0, lambda q: (seen.append(("reader", torch.get_num_threads())), done.set()), SimpleNamespace(not_before=0.0)
        )
        assert done.wait(10)
    assert ("writer", 1) in seen and ("reader", 1) in seen and all(n == 1 for _, n in seen)
    assert torch.get_num_threads() == before


def test_close_verifies_reads_in_flight_then_stops_every_thread(dirs) -> None:
    """Reader threads read and check each request. A close with requests still queued
    ends every layer whole or failed (the slab files are closed), none waits forever, and
    no storage thread outlives the store."""
    st = open_store(dirs)
    st.create_owner("o", KINDS, "fp")
    save(st, "o", 0, 300, KINDS)
    st.mark_durable("o", list(range(300)))
    threads = list(st.reads.threads)
    assert threads and all(t.name.startswith("hcache-reader-") for t in threads)
    r = st.reader("o", window=GEOM.num_layers)  # every request queued before the close
    st.close()
    for layer, kind in enumerate(KINDS):
        if kind is not None:
            assert r.wait(layer, kind, 10)
            try:
                assert torch.equal(r.get(layer), expected(layer, kind, 300))
            except ChunkError as e:
                assert "read error" in str(e)
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads)


def test_a_closed_slab_refuses_io_rather_than_reach_the_next_file_opened(tmp_path) -> None:
    """A reader still working through a closing store's queue gets EBADF, a read error: the
    descriptor number, once closed, is the next file's, whose bytes it read before."""
    sf = slab.SlabFile(tmp_path / "slab", 4096)
    sf.write_slots(0, [memoryview(aligned_buffer(4096))])
    sf.close()
    other = os.open(tmp_path / "other", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(other, b"x" * 8192)
        with pytest.raises(OSError) as e:
            sf.read(0, 1, aligned_buffer(4096))
        assert e.value.errno == errno.EBADF
    finally:
        os.close(other)


def test_reads_are_booked_in_layer_order_across_directories(dirs) -> None:
    """Under a read cap the bandwidth goes to the layers a restore needs first: requests are
    booked and submitted in layer order over all directories, not one directory at a time."""
    kinds = [Kind.KV] * GEOM.num_layers
    with open_store(dirs, read_cap_gbps=0.05) as st:
        st.create_owner("o", kinds, "fp")
        save(st, "o", 0, 256, kinds)
        st.mark_durable("o", list(range(256)))
        seen: list[tuple[int, int]] = []
        submit = st.reads.submit
        st.reads.submit = lambda d, fn, q: (seen.append((q.min_layer, d)), submit(d, fn, q))[1]
        r = st.reader("o")
        for i in range(GEOM.num_layers):
            r.get(i)
        assert len({d for _, d in seen}) == len(dirs)
        assert [lay for lay, _ in seen] == sorted(lay for lay, _ in seen)


def test_the_first_layers_requests_are_read_alone_in_turn(dirs, monkeypatch) -> None:
    """A restore waits on its first layers with little else to do: the requests of each of
    the first `OPENING_LAYERS` (one per directory or more) are read before any later layer's,
    which would share the device."""
    from hcache.storage.reader import OPENING_LAYERS, OwnerReader

    kinds = [Kind.KV] * GEOM.num_layers
    log: list[tuple[str, int]] = []
    lock = threading.Lock()
    later = [threading.Event() for _ in range(GEOM.num_layers)]  # [m]: a request past layer m started
    read = OwnerReader._read

    def logged(self, q) -> None:
        with lock:
            log.append(("start", q.min_layer))
            for m in range(q.min_layer):
                later[m].set()
        later[q.min_layer].wait(0.2)  # ungated, a later request would start meanwhile
        try:
            read(self, q)
        finally:
            with lock:
                log.append(("end", q.min_layer))

    monkeypatch.setattr(OwnerReader, "_read", logged)
    with open_store(dirs, request_layers=1) as st:
        st.create_owner("o", kinds, "fp")
        save(st, "o", 0, 256, kinds)
        st.mark_durable("o", list(range(256)))
        r = st.reader("o")
        for i in range(GEOM.num_layers):
            assert torch.equal(r.get(i), expected(i, Kind.KV, 256)), f"layer {i} differs"
    assert GEOM.num_layers > OPENING_LAYERS
    for m in range(OPENING_LAYERS):
        mine = [i for i, (_, layer) in enumerate(log) if layer == m]
        after = [i for i, (_, layer) in enumerate(log) if layer > m]
        assert len(mine) >= 2 * len(dirs) and after, log  # every directory holds a chunk of the layer
        assert max(mine) < min(after), (m, log)


def _thp_fallbacks() -> int:
    for line in Path("/proc/vmstat").read_text().splitlines():
        if line.startswith("thp_fault_fallback "):
            return int(line.split()[1])
    return 0


def test_io_buffers_are_backed_by_huge_pages() -> None:
    """O_DIRECT requests are cut at the buffer's physical segments (virtio: 254 of them):
    on 4 KB pages a 32 MB read reaches the device as ~1 MB requests, on 2 MB pages at the
    queue's full request size. The buffer is marked for huge pages, and each of its 2 MB
    extents gets one unless the kernel finds no free one: a fragmented host counts that
    as a fault fallback, which is the kernel's answer, not ours."""
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("no transparent huge pages on this kernel")
    buf = aligned_buffer(32 << 20)
    fallbacks = _thp_fallbacks()
    for off in range(0, len(buf), 4096):  # fault every page in
        buf[off] = 1
    fallbacks = _thp_fallbacks() - fallbacks
    ref = ctypes.c_char.from_buffer(buf)
    addr = ctypes.addressof(ref)
    del ref
    huge_kb, flags, mine = None, "", False
    for block in Path("/proc/self/smaps").read_text().split("\n")[:-1]:
        head = block.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            mine = lo <= addr < hi
        elif mine and block.startswith("AnonHugePages:"):
            huge_kb = int(block.split()[1])
        elif mine and block.startswith("VmFlags:"):
            flags = block
    assert " hg" in flags, f"the buffer is not marked for huge pages: {flags}"
    # An unaligned mapping's two end extents take small pages; other processes'
    # fallbacks only add to the count, and the mark above is what this code controls.
    assert huge_kb is not None and huge_kb + fallbacks * 2048 >= 30 << 10, (
        f"{huge_kb} kB of 32 MB on huge pages, {fallbacks} fallbacks"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_chunks_are_read_in_place_and_tails_copied(dirs, dtype) -> None:
    """Full chunks land straight in the layer buffers, the tail through the bounce buffer;
    both read back exactly, from 1 or 3 directories."""
    for n_dirs in (1, 3):
        d = [p / f"inplace-{n_dirs}" for p in dirs[:n_dirs]]
        for x in d:
            x.mkdir()
        with ChunkStore(StorageConfig([str(x) for x in d]), GEOM, dtype) as st:
            st.create_owner("s", KINDS, "fp")
            n = chat_turns(st, "s", turns=((200, 3), (90, 7)))  # 300 tokens: 4 full chunks and a tail
            before = st.stats.chunks_read_in_place
            r = st.reader("s", [1, 2, 3, 4])
            for i, k in enumerate(KINDS):
                if k is not None:
                    want = expected(i, k, n).to(dtype)
                    assert torch.equal(r.get(i), want), f"layer {i} differs"
            assert st.stats.chunks_read_in_place - before == 4 * (n // CHUNK_TOKENS)


def test_rows_that_break_alignment_are_copied(tmp_path) -> None:
    """A geometry whose chunk rows are not whole 4096-byte pages cannot be read in place."""
    geom = dataclasses.replace(GEOM, hidden_size=40, num_heads=4, num_kv_heads=2, head_dim=10, num_layers=2)
    (tmp_path / "a").mkdir()
    with ChunkStore(StorageConfig([str(tmp_path / "a")]), geom, torch.float32) as st:
        st.create_owner("s", [Kind.HIDDEN, Kind.KV], "fp")
        g = torch.Generator().manual_seed(0)
        h, kv = torch.randn(200, 40, generator=g), torch.randn(200, 2, 20, generator=g)
        st.save_rows("s", 0, {0: h}, {1: kv})
        st.mark_durable("s", list(range(200)))
        r = st.reader("s", [0, 1])
        assert torch.equal(r.get(0), h) and torch.equal(r.get(1), kv)
        assert st.stats.chunks_read_in_place == 0


def test_a_staged_batch_fills_each_kind_with_one_copy() -> None:
    """A ring entry holds a kind's layers as one strided view: filling it fills each layer's rows."""
    from hcache.storage.staging import StagingRing

    ring = StagingRing(1 << 20, 48, 16, torch.float32, torch.device("cpu"), kv_dtype=torch.bfloat16)
    layers = {0: Kind.HIDDEN, 1: Kind.KV, 2: {Kind.HIDDEN, Kind.KV}, 4: Kind.HIDDEN}
    batch = ring.acquire(3, layers)
    assert list(batch.hidden) == [0, 2, 4] and list(batch.kv) == [1, 2]
    assert batch.hidden_all is not None and batch.kv_all is not None
    hidden = torch.randn(3, 3, 48)
    kv = torch.randn(2, 3, 2, 16).bfloat16()
    batch.hidden_all.copy_(hidden)
    batch.kv_all.copy_(kv)
    for i, layer in enumerate([0, 2, 4]):
        assert torch.equal(batch.hidden[layer], hidden[i])
    for i, layer in enumerate([1, 2]):
        assert torch.equal(batch.kv[layer], kv[i])
    ends = [(t.data_ptr(), t.data_ptr() + t.nbytes) for t in [*batch.hidden.values(), *batch.kv.values()]]
    assert all(a_end <= b for (_, a_end), (b, _) in itertools.pairwise(sorted(ends)))  # no overlap
    assert all(lo >= ring.buf.data_ptr() + batch.offset for lo, _ in ends)
    assert all(hi <= ring.buf.data_ptr() + batch.offset + batch.nbytes for _, hi in ends)


def _decode_rows(st: ChunkStore, owners: list[str], start: int, steps: int) -> None:
    """Decode steps as the engine stages them: a row per owner per step, each batch held."""
    for p in range(start, start + steps):
        batch = st.acquire([(o, p, 1) for o in owners])
        for layer, t in batch.hidden.items():
            t.copy_(torch.cat([h_rows(layer, p, 1) for _ in owners]))
        for layer, t in batch.kv.items():
            t.copy_(torch.cat([kv_rows(layer, p, 1) for _ in owners]))
        st.submit(batch, hold=True)


def test_held_decode_batches_reach_the_packer_before_anything_after_them(dirs) -> None:
    """Decode steps' batches wait to be sent together; a turn's end (and every other request
    to the packer) sends them first, so what the turn made is durable and in order."""
    with open_store(dirs[:2]) as st:
        for owner in ("a", "b"):
            st.create_owner(owner, KINDS, "fp")
            save(st, owner, 0, 70)
            st.mark_durable(owner, list(range(70)))  # the packer has taken everything sent so far
        _decode_rows(st, ["a", "b"], 70, 5)  # fewer than HELD_STEPS: all still held
        assert st.packer.inbox.qsize() == 0 and len(st.outbox.held) == 5
        st.mark_durable("a", list(range(75)))
        st.mark_durable("b", list(range(75)))
        for owner in ("a", "b"):
            check_all(st, owner, 75)
        _decode_rows(st, ["a"], 75, HELD_STEPS + 3)  # a full hold goes out on its own
        assert len(st.outbox.held) == 3
        st.send_held()  # as the engine's loop does when it idles
        assert not st.outbox.held
        st.mark_durable("a", list(range(75 + HELD_STEPS + 3)))
        check_all(st, "a", 75 + HELD_STEPS + 3)


def test_a_full_ring_sends_the_held_batches_instead_of_waiting_on_them(dirs) -> None:
    """A ring with room for fewer batches than a hold keeps: acquiring sends the held ones
    (which the packer then frees) rather than waiting forever for room they occupy."""
    with open_store(dirs[:1], staging_bytes=6 << 10) as st:
        st.create_owner("a", KINDS, "fp")
        t = threading.Thread(target=_decode_rows, args=(st, ["a"], 0, 200), daemon=True)
        t.start()
        t.join(30)
        assert not t.is_alive(), "staging waits on room that held batches occupy"
        st.mark_durable("a", list(range(200)))
        check_all(st, "a", 200)
        assert st.ring.waits > 0
