"""Chunks up to a (dict-backed) cluster tier and back into another store: every stored row
comes back in place; an evicted, damaged or other-prefix chunk stops the fetch right there,
so the tokens after it are left for recompute; a fetch in the background, layer by layer."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from storage_helpers import GEOM, KINDS, check_all, expected, save

from hcache.cluster.fetch import fetch, hydrate
from hcache.cluster.tier import ChunkTier, chunk_key
from hcache.cluster.uploader import ChunkUploader
from hcache.config import StorageConfig
from hcache.engine.errors import Unavailable
from hcache.engine.saver import stage_fetched
from hcache.storage.buffers import FetchBuffers
from hcache.storage.layout import Kind
from hcache.storage.store import ChunkStore

N = 150  # three chunks, the last a tail


class DictRedis:
    """What ChunkTier asks of redis-py, in a dict."""

    def __init__(self) -> None:
        self.d: dict[str, bytes] = {}

    def pipeline(self, transaction: bool = False) -> Any:
        outer, ops = self, []

        class Pipe:
            def set(self, k: str, v: bytes, ex: int | None = None) -> None:
                ops.append(lambda: outer.d.__setitem__(k, v))

            def delete(self, k: str) -> None:
                ops.append(lambda: outer.d.pop(k, None))

            def execute(self) -> list:
                return [op() for op in ops]

        return Pipe()

    def register_script(self, src: str) -> Any:
        assert "GETRANGE" in src  # the one script ChunkTier runs: each key's first bytes
        return lambda keys, args: [self.d.get(k, b"")[: int(args[0]) + 1] for k in keys]

    def mget(self, keys: list[str]) -> list[bytes | None]:
        return [self.d.get(k) for k in keys]

    def set(self, k: str, v: bytes, ex: int | None = None) -> None:
        self.d[k] = v

    def get(self, k: str) -> bytes | None:
        return self.d.get(k)

    def delete(self, k: str) -> None:
        self.d.pop(k, None)


def open_store(path) -> ChunkStore:
    path.mkdir()
    st = ChunkStore(StorageConfig([str(path)]), GEOM, torch.float32)
    st.create_owner("s", KINDS, "fp")
    return st


@pytest.fixture
def tier(tmp_path):
    t = ChunkTier(DictRedis(), "dict://", ttl_s=60)
    with open_store(tmp_path / "up") as st:
        save(st, "s", 0, 100)
        st.mark_durable("s", list(range(100)))
        up = ChunkUploader(st, t)
        up.offer("s", list(range(100)), 0)
        save(st, "s", 100, N - 100)  # a second turn: its chunks (the rewritten tail's too) go up
        st.mark_durable("s", list(range(N)))
        up.offer("s", list(range(N)), 100)
        assert up.flush(10)
        up.close()
        assert up.counters.failed == up.counters.dropped == 0
    return t


@pytest.mark.parametrize("background", [False, True])
def test_a_fetch_brings_every_row_back_in_place(tier, tmp_path, background):
    with open_store(tmp_path / "down") as st:
        if background:
            got = fetch(st, tier, "s", list(range(N)), background=True)
            assert got.intact()
            st.stage_rows("s", got.start, got.hidden, got.kv)
            st.mark_durable("s", list(range(N)))
        else:
            got = hydrate(st, tier, "s", list(range(N)), None)
        assert got.tokens == N and got.missing == 0
        assert st.owner_row("s").tokens == list(range(N))
        check_all(st, "s", N)


def test_a_fetch_continues_a_stale_store_from_mid_chunk(tier, tmp_path):
    with open_store(tmp_path / "down") as st:
        save(st, "s", 0, 40)
        st.mark_durable("s", list(range(40)))
        assert (
            hydrate(
                st,
                tier,
                "s",
                list(range(N)),
                None,
            ).tokens
            == N - 40
        )
        check_all(st, "s", N)


def test_fetched_rows_stage_behind_nothing_and_ahead_of_the_next_turn(tier, tmp_path):
    """`fetch` leaves the store as it was; its rows, staged without the ring and followed by a
    turn's own rows through the ring, become durable with that turn."""
    with open_store(tmp_path / "down") as st:
        save(st, "s", 0, 40)
        st.mark_durable("s", list(range(40)))
        got = fetch(
            st,
            tier,
            "s",
            list(range(N)),
        )
        assert (got.start, got.tokens, got.missing) == (40, N - 40, 0)
        assert st.owner_row("s").num_tokens == 40
        for layer, k in enumerate(KINDS):
            rows = {Kind.HIDDEN: got.hidden, Kind.KV: got.kv}.get(k, {}).get(layer)
            assert (rows is None) == (k is None)
            if k is not None:
                assert torch.equal(rows, expected(layer, k, N)[40:])
        st.stage_rows("s", got.start, got.hidden, got.kv, got.release)
        save(st, "s", N, 30)  # the turn's own rows, through the ring
        st.mark_durable("s", list(range(N + 30)))
        check_all(st, "s", N + 30)
        assert st.ring.used_bytes() == 0


def test_fetches_reuse_the_memory_of_the_last_one_once_it_is_packed(tier, tmp_path):
    pool = FetchBuffers(keep=1)
    with open_store(tmp_path / "one") as st:
        got = fetch(st, tier, "s", list(range(N)), pool=pool)
        mem = got.memory.data_ptr()
        st.stage_rows("s", got.start, got.hidden, got.kv, got.release)
        st.mark_durable("s", list(range(N)))  # packed: given back
        assert [t.data_ptr() for t in pool.free] == [mem]
    with open_store(tmp_path / "two") as st:
        save(st, "s", 0, 10)  # a shorter fetch fits the same buffer
        st.mark_durable("s", list(range(10)))
        again = fetch(st, tier, "s", list(range(N)), pool=pool)
        assert again.memory.data_ptr() == mem and pool.free == []
        for layer, k in enumerate(KINDS):
            if k is not None:
                rows = (again.hidden if k == Kind.HIDDEN else again.kv)[layer]
                assert torch.equal(rows, expected(layer, k, N)[10:])


def test_a_cluster_lost_mid_fetch_marks_the_layers_not_in_as_bad(tier, tmp_path):
    calls = {"n": 0}
    mget = tier.r.mget

    def failing(keys):
        calls["n"] += 1
        if calls["n"] > 2:
            raise ConnectionError("cluster gone")
        return mget(keys)

    tier.r.mget = failing
    with open_store(tmp_path / "down") as st:
        got = fetch(st, tier, "s", list(range(N)), background=True)
        assert not got.intact() and isinstance(got.progress.error, ConnectionError)
        layers = sorted(got.progress.layers)
        assert [la for la in layers if got.usable(la)] == layers[:2]  # what came before it is good
        assert all(got.ready(la) for la in layers)  # nobody waits forever
        with pytest.raises(Unavailable, match="cluster failed: cluster gone"):
            stage_fetched(st, "s", got, None)
        assert st.owner_row("s").num_tokens == 0


@pytest.mark.parametrize("harm", ["evicted", "flipped"])
def test_a_lost_chunk_stops_the_fetch_there(tier, tmp_path, harm):
    key = chunk_key("s", 2, Kind.KV, 1)
    if harm == "evicted":
        tier.r.delete(key)
    else:
        v = bytearray(tier.r.get(key))
        v[-1] ^= 1
        tier.r.set(key, bytes(v))
    with open_store(tmp_path / "down") as st:
        got = hydrate(
            st,
            tier,
            "s",
            list(range(N)),
            None,
        )
        assert got.tokens == 64 and got.missing == 1
        check_all(st, "s", 64)


def test_chunks_of_other_tokens_are_not_used(tier, tmp_path):
    rewritten = list(range(N))
    rewritten[100] = 7  # the record's turn differs from the one the chunks were made from
    with open_store(tmp_path / "down") as st:
        got = hydrate(st, tier, "s", rewritten, None)
        assert got.tokens == 64 and got.missing > 0
        check_all(st, "s", 64)
