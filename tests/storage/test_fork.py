"""Forks: a session that shares another's chunks through slots both rows reference.
Each reads its own tokens exactly whatever the other does (rewrites, releases, deletion),
across restarts; a slot is freed with its last reference; fsck stays clean. The prefix
index finds a stored conversation by a longer one's chunk hashes, only in its namespace."""

from __future__ import annotations

import pytest
import torch
from storage_helpers import KINDS, check_all, dirs_in, expected, open_store, save

from hcache.storage.fsck import fsck
from hcache.storage.layout import CHUNK_TOKENS, Kind
from hcache.storage.prefixes import prefix_hashes
from hcache.storage.store import ChunkStore


@pytest.fixture
def dirs(tmp_path):
    return dirs_in(tmp_path)


def parent_with(st: ChunkStore, n: int = 200) -> list[int]:
    st.create_owner("p", KINDS, "fp")
    save(st, "p", 0, n)
    st.mark_durable("p", list(range(n)), {"m": 1}, index_as="alice")
    return list(range(n))


def used(st: ChunkStore) -> int:
    return sum(u.used_bytes for u in st.usage())


def test_fork_shares_slots_and_outlives_its_parent(dirs) -> None:
    with open_store(dirs) as st:
        parent_with(st)
        before = used(st)
        row = st.fork("p", "c", 128, {"m": 2})
        assert row.tokens == list(range(128)) and row.layer_kinds == st.owner_row("p").layer_kinds
        assert used(st) == before  # nothing copied
        shared = {(r.dir, r.slab, r.slot) for r in st.manifest.chunks("c")}
        assert shared <= {(r.dir, r.slab, r.slot) for r in st.manifest.chunks("p")}
        assert len(shared) == 2 * sum(k is not None for k in KINDS)  # two whole chunks per stored layer
        check_all(st, "c", 128)
        # the child continues with its own rows (from a chunk boundary: no tail to copy)
        save(st, "c", 128, 40, salt=0.5)
        st.mark_durable("c", list(range(168)))
        check_all(st, "c", 168, salt_from=128, salt=0.5)
        check_all(st, "p", 200)  # the parent is untouched
        # the parent rewrites inside the shared chunks: its rows move to fresh slots, the child's stay
        st.truncate("p", 100)
        save(st, "p", 100, 20, salt=0.25)
        st.mark_durable("p", list(range(120)))
        check_all(st, "p", 120, salt_from=100, salt=0.25)
        check_all(st, "c", 168, salt_from=128, salt=0.5)
        st.delete("p")
        check_all(st, "c", 168, salt_from=128, salt=0.5)
    assert fsck([str(d) for d in dirs]).clean
    with open_store(dirs) as st:  # references are counted again from the manifest
        check_all(st, "c", 168, salt_from=128, salt=0.5)
        st.delete("c")
        assert used(st) == 0 and sum(u.slab_bytes for u in st.usage()) == 0


def test_deleting_the_fork_frees_only_its_own_slots(dirs) -> None:
    with open_store(dirs) as st:
        parent_with(st)
        alone = used(st)
        st.fork("p", "c", 192, {})
        save(st, "c", 192, 10)
        st.mark_durable("c", list(range(202)))
        assert used(st) > alone
        st.delete("c")
        assert used(st) == alone
        check_all(st, "p", 200)


def test_a_released_layer_of_the_parent_stays_readable_in_the_fork(dirs) -> None:
    with open_store(dirs) as st:
        parent_with(st)
        st.fork("p", "c", 128, {})
        freed = st.release("p", 1)  # gives up at least one layer's chunks
        assert freed > 0  # the parent's unshared tail chunks of that layer
        check_all(st, "c", 128)
        r = st.reader("c", [2])
        assert torch.equal(r.get(2), expected(2, Kind.KV, 128))


def test_fork_mid_chunk_refills_the_shared_tail_copy_on_write(dirs) -> None:
    with open_store(dirs) as st:
        parent_with(st)  # chunks 0-2 whole, chunk 3 a tail of 8 rows
        st.fork("p", "c", 150, {})  # 22 rows into the parent's chunk 2
        assert {r.idx for r in st.manifest.chunks("c")} == {0, 1, 2}
        check_all(st, "c", 150)
        save(st, "c", 150, 60, salt=0.5)  # fills chunk 2 past the shared rows, then a tail
        st.mark_durable("c", list(range(210)))
        check_all(st, "c", 210, salt_from=150, salt=0.5)
        check_all(st, "p", 200)  # the parent's chunk 2 kept its own rows
        st.fork("p", "d", 195, {})  # inside the parent's tail
        check_all(st, "d", 195)
        st.delete("p")
        check_all(st, "d", 195)
        check_all(st, "c", 210, salt_from=150, salt=0.5)
    assert fsck([str(d) for d in dirs]).clean
    with open_store(dirs) as st:  # a restart reloads the partly shared tail before new rows
        save(st, "d", 195, 10, salt=0.75)
        st.mark_durable("d", list(range(205)))
        check_all(st, "d", 205, salt_from=195, salt=0.75)
    assert fsck([str(d) for d in dirs]).clean


def test_fork_refuses_what_the_parent_does_not_hold(dirs) -> None:
    with open_store(dirs) as st:
        parent_with(st, 100)
        with pytest.raises(ValueError, match="cannot share 128"):
            st.fork("p", "c", 128, {})
        st.fork("p", "c", 64, {})
        with pytest.raises(ValueError, match="already exists"):
            st.fork("p", "c", 64, {})
        assert [o.owner for o in st.owners()] == ["p", "c"]


def test_prefix_index_finds_whole_chunks_in_its_namespace_only(dirs) -> None:
    with open_store(dirs) as st:
        toks = parent_with(st)  # 200 tokens: three whole chunks indexed
        longer = [*toks, 7, 8, 9]
        assert st.find_prefix(longer, "alice") == [("p", 192), ("p", 128), ("p", 64)]
        assert st.find_prefix(longer, "bob") == []
        assert st.find_prefix([1, *longer[1:]], "alice") == []  # chained: a changed first token misses all
        st.fork("p", "c", 128, {}, index_as="alice")
        assert ("c", 128) in st.find_prefix(longer, "alice") and ("c", 192) not in st.find_prefix(longer, "alice")
        st.truncate("p", 130)  # rewinding drops the hashes past what stays
        assert [h for h in st.find_prefix(longer, "alice") if h[0] == "p"] == [("p", 128), ("p", 64)]
        st.delete("p")
        assert st.find_prefix(longer, "alice") == [("c", 128), ("c", 64)]
    assert len(prefix_hashes(list(range(CHUNK_TOKENS * 2 - 1)), "x")) == 1
