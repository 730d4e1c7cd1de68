"""The capacity policy in the store: what an owner gives up first, the manifest recording
what each owner still stores per layer, slots coming back, fsck after releases, and a
process killed with SIGKILL in the middle of releases losing no acknowledged turn and
leaking no slot."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from storage_helpers import GEOM, KINDS, check_all, dirs_in, expected, open_store, save

from hcache.storage.capacity import Space, release_order
from hcache.storage.fsck import fsck
from hcache.storage.layout import CHUNK_TOKENS, Kind, chunk_shapes, stored
from hcache.storage.store import ChunkStore

HERE = Path(__file__).parents[1]  # tests/: release_proc.py and its helpers
H, KV = Kind.HIDDEN, Kind.KV


def check_stored(st: ChunkStore, owner: str) -> None:
    """Every layer the manifest says the owner stores reads back whole and right."""
    n = st.owner_row(owner).num_tokens
    kinds = st.layer_kinds(st.owner_row(owner))
    layers = [i for i, ks in enumerate(kinds) if ks]
    if not layers:
        return
    r = st.reader(owner, layers)
    for i in layers:
        (kind,) = kinds[i]
        assert torch.equal(r.get(i), expected(i, kind, n)), f"{owner} layer {i} differs"


def test_release_order_is_h_first_then_bottom_up() -> None:
    both = frozenset(Kind)
    kinds = [frozenset(), frozenset({H}), both, frozenset({KV}), both]
    assert release_order(kinds) == [(2, H), (4, H), (1, H), (2, KV), (3, KV), (4, KV)]
    # a plan's layout (recompute, then H, then KV) is given up from the bottom: the recompute
    # prefix grows by one layer at a time and every layer above it stays readable
    plan = [frozenset(), frozenset({H}), frozenset({H}), frozenset({KV})]
    assert release_order(plan) == [(1, H), (2, H), (3, KV)]


def test_space_asks_for_release_only_below_the_low_watermark() -> None:
    assert Space(1000, 850).to_release(0.2, 0.3) == 150  # 15% free: below 20%, back up to 30%
    assert Space(1000, 850).to_release(0.1, 0.3) == 0  # above 10%
    assert Space(1000, 950).to_release(0.1, 0.3) == 250
    assert Space(0, 10).to_release(0.1, 0.3) == 0  # no capacity known: nothing to do


def test_release_records_what_is_left_and_frees_slots(tmp_path) -> None:
    dirs = dirs_in(tmp_path, 2)
    with open_store(dirs) as st:
        for o in ("a", "b"):
            st.create_owner(o, KINDS, "fp")
            save(st, o, 0, 200)
            st.mark_durable(o, list(range(200)))
        before = st.space().used
        freed = st.release("a", 1)  # the cheapest step: layer 1's H
        assert freed > 0 and st.space().used == before - freed
        assert st.owner_row("a").layer_kinds == "--KHK"
        assert not [r for r in st.manifest.chunks("a") if r.layer == 1]
        check_stored(st, "a")
        check_stored(st, "b")
        assert st.release("a", 1 << 40) > 0  # everything else
        assert st.owner_row("a").layer_kinds == "-----"
        assert st.owner_row("a").tokens == list(range(200))  # token ids stay
        assert st.manifest.chunks("a") == []
        assert st.release("a", 1) == 0
        # a demoted owner takes new turns for what it still stores (here: nothing)
        batch = st.acquire([("a", 200, 10)])
        assert not batch.hidden and not batch.kv
        st.submit(batch)
        st.mark_durable("a", list(range(210)))
        st.release("b", 1)
        save(st, "b", 200, 70, kinds=[stored(k) - {H} if i == 1 else k for i, k in enumerate(KINDS)])
        st.mark_durable("b", list(range(270)))
        check_stored(st, "b")
        assert st.stats.demotions == 3 and st.stats.bytes_released > 0
    report = fsck([str(d) for d in dirs])
    assert report.clean, report.lines()
    with open_store(dirs) as st:  # what the manifest says survives a restart
        assert st.owner_row("a").layer_kinds == "-----"
        check_stored(st, "b")


def test_an_owner_with_no_chunks_gives_up_nothing(tmp_path) -> None:
    with open_store(dirs_in(tmp_path, 2)) as st:
        st.create_owner("new", KINDS, "fp")  # created, no turn yet
        assert st.stored_bytes("new") == 0
        assert st.release("new", 1 << 40) == 0
        assert st.owner_row("new").layer_kinds == "-HKHK"  # it still stores its first turn
        assert st.stats.demotions == 0
        save(st, "new", 0, 130)
        st.mark_durable("new", list(range(130)))
        held = st.stored_bytes("new")
        assert 0 < held <= st.space().used
        assert st.release("new", 1 << 40) >= held
        assert st.stored_bytes("new") == 0


def test_tombstones_are_pruned_by_age(tmp_path) -> None:
    dirs = dirs_in(tmp_path, 1)
    with open_store(dirs) as st:
        for o in ("old", "new"):
            st.create_owner(o, KINDS, "fp")
        st.delete("old", expired=True)
        time.sleep(0.01)
        cutoff = time.time()
        st.delete("new", expired=True)
        assert st.prune_expired(cutoff) == 1
        assert st.expired("old") is None and st.expired("new") is not None
        assert st.prune_expired(cutoff) == 0
    with open_store(dirs) as st:  # pruned for good; the newer one survives a restart
        assert st.expired("old") is None and st.expired("new") is not None


def test_a_full_store_takes_back_extents_reserved_ahead(tmp_path) -> None:
    slot = GEOM.hidden_size * CHUNK_TOKENS * 4  # H and KV slots are the same size here
    assert all(sh.slot_bytes == slot for sh in chunk_shapes(GEOM, torch.float32).values())
    with open_store(dirs_in(tmp_path, 1), quota_bytes=20 * slot) as st:
        st.create_owner("a", KINDS, "fp")
        save(st, "a", 0, CHUNK_TOKENS)  # one full chunk in each of 4 layers: extents of 4
        st.mark_durable("a", list(range(CHUNK_TOKENS)))
        assert st.placement.occupied(0) == 16 * slot
        assert st.space().used == 4 * slot  # what is reserved ahead counts as free
        st.create_owner("b", KINDS, "fp")
        save(st, "b", 0, 2 * CHUNK_TOKENS)  # 8 slots: fits only in slots reserved for a
        st.mark_durable("b", list(range(2 * CHUNK_TOKENS)))
        check_all(st, "a", CHUNK_TOKENS)
        check_all(st, "b", 2 * CHUNK_TOKENS)
        assert st.space().used == 12 * slot


def test_released_slots_take_new_chunks_under_a_quota(tmp_path) -> None:
    dirs = dirs_in(tmp_path, 1)
    with open_store(dirs, max_bytes=1 << 20) as st:
        assert st.placement.quota_bytes == 1 << 20
        for i in range(70):  # ~13x the quota in chunks, made room for by releasing the oldest owner
            o = f"o{i}"
            st.create_owner(o, KINDS, "fp")
            save(st, o, 0, 130)
            st.mark_durable(o, list(range(130)))
            need = st.space().to_release(0.3, 0.5)
            for victim in (r.owner for r in st.owners()):
                if need <= 0:
                    break
                need -= st.release(victim, need)
        assert st.stats.bytes_released > 10 * (1 << 20)
        for r in st.owners():
            check_stored(st, r.owner)
    assert fsck([str(d) for d in dirs]).clean


def test_kill_9_during_releases_loses_no_turn_and_leaks_no_slot(tmp_path) -> None:
    dirs = dirs_in(tmp_path, 2)
    env = {**os.environ, "PYTHONPATH": f"{HERE}:{os.environ.get('PYTHONPATH', '')}"}
    acked: dict[str, int] = {}
    releases = 0
    for round_ in range(3):
        p = subprocess.Popen(
            [sys.executable, str(HERE / "release_proc.py"), *map(str, dirs)], stdout=subprocess.PIPE, text=True, env=env
        )
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "START"
        seen = 0
        while seen < 3 + round_:
            word, owner, n = p.stdout.readline().split()
            if word == "DURABLE":
                acked[owner] = int(n)
            else:
                seen += 1
                releases += 1
        time.sleep(0.002 * round_)  # land somewhere in the next turn or release
        p.send_signal(signal.SIGKILL)
        p.wait()
        with open_store(dirs) as st:
            for owner, n in acked.items():
                row = st.owner_row(owner)  # no acknowledged turn lost
                assert row.num_tokens >= n and row.tokens == list(range(row.num_tokens))
                check_stored(st, owner)  # what it says it stores is there and right
            free = sum(len(a.free) for a in st.placement.allocs.values())
        report = fsck([str(d) for d in dirs])
        assert report.clean, report.lines()
        assert report.orphan_slots == free  # every unreferenced slot is on the free list
    assert releases >= 9
