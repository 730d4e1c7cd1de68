"""Two engines sharing sessions through a real 3-master Redis Cluster (tiny model, token
turns), each turn checked against the single-sequence reference over the whole history:
continuation on any replica, one writer per session, takeover after a dead owner's lease
expires, a late commit fenced off, contexts across replicas, tenants, a master restarted
from its append-only file, and an unreachable cluster."""

from __future__ import annotations

import random
import threading

import pytest
from cluster_helpers import RedisCluster, redis_cluster, two_replicas  # noqa: F401 - a fixture
from conftest import tload
from engine_helpers import make_engine, reference, turn, wait_until, word_tokenizer

from hcache.cluster.catalogue import RedisCatalogue, keys
from hcache.cluster.link import ClusterLink
from hcache.engine.errors import FailedPrecondition, NotFound
from hcache.engine.sampler import SamplingParams
from hcache.storage.errors import ClusterUnavailable, LeaseHeld, LeaseLost

TTL_MS = 1500
P = SamplingParams(max_new_tokens=5)


@pytest.fixture(scope="module")
def model(tiny_folder):
    return tload(tiny_folder("llama_gqa"))


def replica(model, url: str, d, name: str):
    link = ClusterLink(RedisCatalogue(url, ttl_ms=TTL_MS), name)
    eng, store = make_engine(model, word_tokenizer(model.cfg.vocab_size), [d], cluster=link)
    return eng, store


@pytest.fixture
def pair(model, redis_cluster, tmp_path):  # noqa: F811
    with two_replicas(lambda name, d: replica(model, redis_cluster.url, d, name), tmp_path) as p:
        yield p


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(300) for _ in range(n)]


class History:
    """The session as a single server would have run it: every turn against the reference."""

    def __init__(self, model, prefix: list[int] | None = None):
        self.model, self.fed = model, list(prefix or [])

    def run(self, eng, sid: str, new: list[int], **kw) -> list[int]:
        got, _ = turn(eng, sid, token_ids=new, params=P, **kw)
        assert got == reference(self.model, [*self.fed, *new], P, set())
        self.fed += [*new, *got]
        return got


def test_any_replica_continues_any_session_token_for_token(model, pair):
    a, b = pair
    rng = random.Random(1)
    s = a.create_session()
    h = History(model)
    h.run(a, s.id, ids(rng, 40))
    h.run(b, s.id, ids(rng, 7))  # b has nothing of it: recomputed from the record
    assert b.sharing.link.counters.adoptions == 1 and b.sharing.link.counters.recomputed_tokens >= 40
    h.run(a, s.id, ids(rng, 9))  # a holds a stale turn: its local state is a prefix
    h.run(a, s.id, ids(rng, 3))  # and now the current one
    h.run(b, s.id, ids(rng, 5))
    rec = a.sharing.link.get(s.id)
    assert rec is not None and rec.turns == 5 and rec.tokens == h.fed[:-1]
    view = b.get(s.id)
    assert view.meta.turns == 5 and len(view.acknowledged) == len(h.fed) - 1
    assert a.sharing.link.counters.commits == 3 and b.sharing.link.counters.commits == 2


def test_two_replicas_racing_a_turn_commit_exactly_one(model, pair):
    a, b = pair
    rng = random.Random(2)
    s = a.create_session()
    h = History(model)
    h.run(a, s.id, ids(rng, 20))
    start = threading.Barrier(2)
    out: dict[str, object] = {}
    new = ids(rng, 6)

    def race(name, eng):
        start.wait()
        try:
            out[name] = [t for ev in eng.stream(eng.generate(s.id, token_ids=new, params=P)) for t in ev.token_ids]
        except Exception as e:
            out[name] = e

    threads = [threading.Thread(target=race, args=(n, e)) for n, e in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = [n for n, v in out.items() if isinstance(v, list)]
    lost = [v for v in out.values() if isinstance(v, Exception)]
    assert len(won) == 1 and len(lost) == 1 and isinstance(lost[0], LeaseHeld), out
    assert "leased by replica" in str(lost[0]) and f"replica-{won[0]}" in str(lost[0])
    assert out[won[0]] == reference(model, [*h.fed, *new], P, set())
    rec = a.sharing.link.get(s.id)
    assert rec is not None and rec.turns == 2


def test_a_dead_owners_lease_expires_and_its_late_commit_is_refused(model, pair):
    a, b = pair
    rng = random.Random(3)
    s = a.create_session()
    h = History(model)
    h.run(a, s.id, ids(rng, 30))
    # a dies mid-turn: its lease stays behind, unrenewed, and its turn never commits
    dead, _ = a.sharing.link.lease(s.id)
    with a.sharing.link._lock:
        a.sharing.link._held.clear()
    with pytest.raises(LeaseHeld, match="replica-a"):
        b.generate(s.id, token_ids=ids(rng, 4), params=P)
    lease_key = keys(s.id)[1]
    wait_until(lambda: not b.sharing.link.cat.r.exists(lease_key), "the dead owner's lease to expire")
    h.run(b, s.id, ids(rng, 4))  # from the last acknowledged turn, exactly
    assert b.sharing.link.counters.takeovers == 1
    with pytest.raises(LeaseLost, match="taken over"):
        a.sharing.link.commit(dead, [1, 2, 3], {"turns": 9})
    rec = b.sharing.link.get(s.id)
    assert rec is not None and rec.turns == 2 and rec.tokens == h.fed[:-1]
    h.run(a, s.id, ids(rng, 4))


def test_a_context_computed_on_one_replica_serves_sessions_on_another(model, pair):
    a, b = pair
    rng = random.Random(4)
    doc = ids(rng, 70)
    ctx = a.precompute_context(token_ids=doc)
    s = b.create_session(context_ids=[ctx.id])  # b recomputes the context from its record
    h = History(model, doc)
    h.run(b, s.id, ids(rng, 8))
    h.run(a, s.id, ids(rng, 8))
    h.run(b, s.id, ids(rng, 8))
    with pytest.raises(FailedPrecondition, match="shared by sessions"):
        b.delete(ctx.id)


def test_tenants_stay_apart_across_replicas(model, pair):
    a, b = pair
    s = a.create_session(tenant="t1")
    for call in (lambda: b.generate(s.id, token_ids=[1, 2], params=P, tenant="t2"), lambda: b.get(s.id, "t2")):
        with pytest.raises(NotFound):
            call()
    turn(b, s.id, token_ids=[1, 2], params=P, tenant="t1")
    b.delete(s.id, "t1")
    with pytest.raises(NotFound):
        a.generate(s.id, token_ids=[3], params=P, tenant="t1")


def test_sessions_survive_a_master_restarted_from_its_append_only_file(model, tmp_path):
    cluster = RedisCluster(tmp_path / "redis")
    a = replica(model, cluster.url, tmp_path / "a", "replica-a")
    b = replica(model, cluster.url, tmp_path / "b", "replica-b")
    try:
        rng = random.Random(5)
        h = History(model)
        sessions = [a[0].create_session() for _ in range(6)]  # some land on every master
        fed = {}
        for s in sessions:
            h = History(model)
            h.run(a[0], s.id, ids(rng, 12))
            fed[s.id] = h
        for port in list(cluster.ports):
            cluster.kill(port)
            cluster.restart(port)
        for s in sessions:
            fed[s.id].run(b[0], s.id, ids(rng, 5))
    finally:
        for eng, store in (a, b):
            eng.close()
            store.close()
        cluster.stop()


def test_an_unreachable_cluster_refuses_with_a_clear_error_and_keeps_local_state(model, tmp_path):
    cluster = RedisCluster(tmp_path / "redis")
    eng, store = replica(model, cluster.url, tmp_path / "a", "replica-a")
    try:
        rng = random.Random(6)
        s = eng.create_session()
        h = History(model)
        h.run(eng, s.id, ids(rng, 25))
        cluster.stop()
        assert any("unreachable" in p for p in eng.sharing.link.problems())
        for call in (
            lambda: eng.generate(s.id, token_ids=ids(rng, 3), params=P),
            lambda: eng.create_session(),
            lambda: eng.get(s.id),
        ):
            with pytest.raises(ClusterUnavailable, match="unreachable"):
                call()
        assert eng.sharing.link.counters.errors >= 3
        assert store.owner_row(s.id).tokens == h.fed[:-1]  # the local cache of the last turn stays
        assert not s.busy
    finally:
        eng.close()
        store.close()
        cluster.stop()
