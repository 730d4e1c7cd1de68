"""The session catalogue's one interface over its two implementations (the SQLite manifest,
Redis: a 3-master cluster and one plain server): records, leases with fencing epochs."""

from __future__ import annotations

import time

import pytest
from cluster_helpers import RedisServer, redis_cluster  # noqa: F401 - a fixture

from hcache.cluster.catalogue import RedisCatalogue, parse_url
from hcache.storage.catalogue import Catalogue, LocalCatalogue, Record
from hcache.storage.errors import ClusterUnavailable, LeaseHeld, LeaseLost, UnknownOwner
from hcache.storage.manifest import Manifest

TTL_MS = 400


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    s = RedisServer(tmp_path_factory.mktemp("single"))
    yield s
    s.stop()


@pytest.fixture(params=["local", "cluster", "single"])
def cat(request, tmp_path) -> Catalogue:
    if request.param == "local":
        c: Catalogue = LocalCatalogue(Manifest(tmp_path / "m.sqlite"), ttl_ms=TTL_MS)
    elif request.param == "cluster":
        c = RedisCatalogue(request.getfixturevalue("redis_cluster").url, ttl_ms=TTL_MS)
        assert c.cluster
    else:
        c = RedisCatalogue(request.getfixturevalue("redis_server").url, ttl_ms=TTL_MS)
        assert not c.cluster
    yield c
    c.close()


def new_record(n: int = 0) -> Record:
    owner = f"{time.time_ns():032x}"[-32:]
    return Record(owner, "session", "fp", "HK-", [], {"tenant": "t1", "turns": 0, "labels": {"a": "b"}})


def test_records_round_trip_and_turns_commit_under_a_lease(cat):
    rec = new_record()
    cat.create(rec)
    with pytest.raises(ValueError, match="already exists"):
        cat.create(rec)
    got = cat.get(rec.owner)
    assert got is not None and (got.kind, got.fingerprint, got.layer_kinds, got.tokens) == ("session", "fp", "HK-", [])
    assert got.tenant == "t1" and got.meta["labels"] == {"a": "b"}
    lease = cat.acquire(rec.owner, "replica-a")
    cat.commit_turn(lease, [5, 6, 7], {**rec.meta, "turns": 1})
    cat.release(lease)
    got = cat.get(rec.owner)
    assert got is not None and got.tokens == [5, 6, 7] and got.turns == 1
    assert cat.get("0" * 32) is None and cat.get("not an id {x}") is None


def test_one_writer_and_the_epoch_fences_a_late_commit(cat):
    rec = new_record()
    cat.create(rec)
    a = cat.acquire(rec.owner, "replica-a")
    with pytest.raises(LeaseHeld, match="replica-a") as held:
        cat.acquire(rec.owner, "replica-b")
    assert held.value.holder == "replica-a" and 0 < held.value.ttl_ms <= TTL_MS
    assert cat.renew(a)
    time.sleep(TTL_MS * 1.5 / 1e3)  # a dies: its lease expires
    assert not cat.renew(a)
    b = cat.acquire(rec.owner, "replica-b")
    assert b.epoch > a.epoch and b.takeover
    with pytest.raises(LeaseLost, match=r"taken over|superseded"):
        cat.commit_turn(a, [1, 2], {"turns": 1})  # the old owner's late commit
    cat.commit_turn(b, [3, 4], {"turns": 1})
    cat.release(a)  # a stale release leaves b's lease alone
    with pytest.raises(LeaseHeld):
        cat.acquire(rec.owner, "replica-c")
    cat.release(b)
    got = cat.get(rec.owner)
    assert got is not None and got.tokens == [3, 4]
    c = cat.acquire(rec.owner, "replica-c")
    assert not c.takeover
    cat.delete(c)
    assert cat.get(rec.owner) is None
    with pytest.raises(UnknownOwner):
        cat.acquire(rec.owner, "replica-c")


def test_cluster_urls():
    assert parse_url("redis://a:1,b:2") == [("a", 1), ("b", 2)]
    assert parse_url("redis://h") == [("h", 6379)]
    for bad in ("http://a:1", "redis://a:x"):
        with pytest.raises(ValueError, match="--cluster"):
            parse_url(bad)


def test_an_unreachable_cluster_is_a_clear_error():
    from cluster_helpers import cluster_ports

    with pytest.raises(ClusterUnavailable, match="unreachable"):
        RedisCatalogue(f"redis://127.0.0.1:{cluster_ports(1)[0]}", timeout_s=0.5)
