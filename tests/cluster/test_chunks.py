"""Session chunks in a real 3-master Redis Cluster: a replica that lacks a session (or holds
a stale turn of it) fetches the chunks another replica uploaded instead of recomputing,
token-identical to the single-sequence reference; chunks Redis evicted under `maxmemory`
(volatile-lru) cost recompute, never correctness, and records survive the eviction."""

from __future__ import annotations

import random

import pytest
import redis
from cluster_helpers import redis_cluster, two_replicas  # noqa: F401 - a fixture
from conftest import tload
from engine_helpers import make_engine, turn, word_tokenizer
from prometheus_client import generate_latest
from test_replicas import History, P, ids

from hcache.cluster.catalogue import RedisCatalogue
from hcache.cluster.link import ClusterLink
from hcache.cluster.tier import ChunkTier, chunk_key, pack, prefix_hash, unpack
from hcache.engine.errors import InvalidArgument, Unavailable
from hcache.server.metrics import Metrics
from hcache.storage.layout import Kind


@pytest.fixture(scope="module")
def model(tiny_folder):
    return tload(tiny_folder("llama_gqa"))


def replica(model, url: str, d, name: str, policy: str = "always"):
    cat = RedisCatalogue(url, ttl_ms=1500)
    link = ClusterLink(cat, name, chunks=ChunkTier(cat.r, url, ttl_s=600), chunk_policy=policy)
    return make_engine(model, word_tokenizer(model.cfg.vocab_size), [d], cluster=link)


@pytest.fixture
def pair(model, redis_cluster, tmp_path):  # noqa: F811
    with two_replicas(lambda name, d: replica(model, redis_cluster.url, d, name), tmp_path) as p:
        yield p


def made_on(eng, model, seed: int, n: int):
    """A session of `n` fed tokens run on `eng`, its chunks uploaded: (rng, session, history)."""
    rng = random.Random(seed)
    s = eng.create_session()
    h = History(model)
    h.run(eng, s.id, ids(rng, n))
    assert eng.sharing.chunks.uploader.flush()
    return rng, s, h


def by_source(eng) -> dict[str, float]:
    m = Metrics()
    m.attach(eng)
    out = {}
    for line in generate_latest(m.registry).decode().splitlines():
        if line.startswith("hcache_restores_by_source_total{"):
            out[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
    return out


def test_chunk_values_are_refused_unless_intact_and_of_the_same_tokens():
    rows, toks = b"\x01" * 64, prefix_hash([5, 6, 7, 8])
    v = pack(rows, 4, toks)
    assert bytes(unpack(v, toks, 4, 16)) == rows
    assert unpack(v, prefix_hash([5, 6, 7, 9]), 4, 16) is None  # another prefix: a rewritten turn's chunk
    assert unpack(v, toks, 3, 16) is None  # cut short
    assert unpack(v[:-1] + b"\x02", toks, 4, 16) is None  # flipped
    assert unpack(None, toks, 4, 16) is None  # evicted
    assert prefix_hash([5, 6, 7, 8]) != prefix_hash([5, 6, 7])


def test_evicted_chunks_are_recomputed_and_the_output_stays_exact(model, pair, redis_cluster):  # noqa: F811
    """First of the cluster tests: no other test's chunks are there for Redis to evict instead."""
    a, b = pair
    rng, s, h = made_on(a, model, 13, 200)
    # the session's keys share its hash tag: one master holds them all
    node = a.sharing.link.cat.r.get_node_from_key(f"hc:{{{s.id}}}:rec")
    r = redis.Redis(host=node.host, port=node.port)
    keys = [chunk_key(s.id, layer, Kind.KV, i) for layer in range(model.cfg.num_layers) for i in range(4)]
    used = int(r.info("memory")["used_memory"])
    r.config_set("maxmemory-policy", "volatile-lru")
    r.config_set("maxmemory", str(used - a.sharing.chunks.uploads.bytes // 2))
    try:
        r.set(f"hc:{{{s.id}}}:nudge", b"x", ex=60)  # any write makes Redis evict down to the limit
        left = sum(r.exists(k) for k in keys)
        assert 0 <= left < len(keys)
    finally:
        r.config_set("maxmemory", "0")
    assert a.sharing.link.get(s.id) is not None  # records carry no TTL: never evicted
    h.run(b, s.id, ids(rng, 6))  # exact: what the cluster lost is recomputed
    assert b.sharing.chunks.counters.misses > 0
    assert b.sharing.link.counters.recomputed_tokens > 0 and by_source(b)["recompute"] == 1.0


def test_a_replica_restores_a_session_from_the_clusters_chunks(model, pair):
    a, b = pair
    rng = random.Random(11)
    s = a.create_session()
    h = History(model)
    h.run(a, s.id, ids(rng, 150))  # three chunks per layer, the last a tail
    h.run(a, s.id, ids(rng, 20))
    assert a.sharing.chunks.uploader.flush()
    up = a.sharing.chunks.uploads
    assert up.chunks > 0 and up.dropped == up.failed == 0
    h.run(b, s.id, ids(rng, 7))  # b has nothing of it: fetched, then restored from its store
    c = b.sharing.chunks.counters
    assert c.fetches == 1 and c.tokens == len(h.fed) - 7 - 5 - 1 and c.misses == 0
    assert b.sharing.link.counters.recomputed_tokens == 0 and b.counters.restores == 1
    assert by_source(b) == {"local": 0.0, "cluster": 1.0, "recompute": 0.0}
    assert b.sharing.chunks.uploader.flush()
    a.evict(s.id)  # (a resident stale turn is cheaper to extend by prefill than to reload)
    h.run(a, s.id, ids(rng, 9))  # a holds a stale turn: the turn b ran comes from b's chunks
    assert a.sharing.chunks.counters.fetches == 1 and a.sharing.chunks.counters.tokens == 7 + 5
    assert a.sharing.link.counters.recomputed_tokens == 0


def test_fetched_rows_turn_durable_with_the_turn_and_a_refused_turn_drops_them(model, pair):
    """The turn restores from the fetched rows in memory and stages them behind it: after
    it they are b's own. A turn refused after its fetch leaves b's session as it was."""
    a, b = pair
    rng, s, h = made_on(a, model, 17, 150)
    with pytest.raises(InvalidArgument):  # a token id past the vocabulary: refused after the fetch
        turn(b, s.id, token_ids=[model.cfg.vocab_size], params=P)
    bs = b.registry.sessions[s.id]
    assert b.sharing.chunks.counters.bytes_read > 0 and b.sharing.chunks.counters.fetches == 0
    assert bs.fetched is None and not bs.busy
    assert bs.tokens == [] and bs.history is not None and b.store.owner_row(s.id).num_tokens == 0
    h.run(b, s.id, ids(rng, 7))  # fetched again, restored from memory
    assert b.sharing.chunks.counters.fetches == 1 and b.sharing.link.counters.recomputed_tokens == 0
    assert b.store.owner_row(s.id).tokens == h.fed[:-1]  # durable with the turn, fetched rows included
    b.evict(s.id)
    h.run(b, s.id, ids(rng, 5))  # from b's own disks now
    assert b.sharing.chunks.counters.fetches == 1 and by_source(b) == {"local": 1.0, "cluster": 1.0, "recompute": 0.0}


def test_a_chunk_damaged_in_the_cluster_fails_one_turn_and_its_retry_is_exact(model, pair):
    """Its header passes (so the fetch starts), its body fails the checksum: the restore
    recomputes that layer, the store cannot take the rows, so the turn fails UNAVAILABLE and
    the chunk is dropped; the retry fetches up to it and recomputes the rest."""
    a, b = pair
    rng, s, h = made_on(a, model, 19, 150)
    recorded = len(h.fed) - 1
    key = chunk_key(s.id, 1, Kind.KV, 1)
    r = a.sharing.link.cat.r
    v = bytearray(r.get(key))
    v[-1] ^= 1
    r.set(key, bytes(v))
    new = ids(rng, 7)
    with pytest.raises(Unavailable, match="checksum"):
        turn(b, s.id, token_ids=new, params=P)
    assert r.get(key) is None
    bs = b.registry.sessions[s.id]
    assert not bs.busy and bs.fetched is None and b.store.owner_row(s.id).num_tokens == 0
    h.run(b, s.id, new)  # exact: chunk 0 of every layer fetched, the rest recomputed
    assert b.sharing.chunks.counters.misses == 1 and b.sharing.chunks.counters.tokens == recorded + 64
    assert b.store.owner_row(s.id).tokens == h.fed[:-1]


def test_a_context_precomputed_on_one_replica_is_fetched_by_another(model, pair):
    a, b = pair
    rng = random.Random(12)
    doc = ids(rng, 130)
    ctx = a.precompute_context(token_ids=doc)
    assert a.sharing.chunks.uploader.flush()
    s = b.create_session(context_ids=[ctx.id])
    assert b.sharing.chunks.counters.tokens == len(doc) and b.sharing.link.counters.recomputed_tokens == 0
    h = History(model, doc)
    h.run(b, s.id, ids(rng, 8))
    h.run(a, s.id, ids(rng, 8))


def test_auto_prices_the_fetch_with_the_clusters_measured_bandwidth(model, redis_cluster, tmp_path):  # noqa: F811
    eng, store = replica(model, redis_cluster.url, tmp_path / "c", "replica-c", policy="auto")
    try:
        ch = eng.sharing.chunks
        assert ch.read_gbps() > 0 and ch.counters.read_gbps == ch.read_gbps()  # measured once, kept
        recompute_ms = model.cfg.num_layers * (eng.profile.re_ms(200) - eng.profile.re_ms(0))
        fetch_ms = 200 * ch.bytes_per_token / (ch.read_gbps() * 1e9) * 1e3
        assert ch.worth_it(0, 200) == (fetch_ms < recompute_ms)
        ch.counters.read_gbps = 1e-9  # a cluster slower than recomputing: it is not asked
        assert not ch.worth_it(0, 200)
        ch.counters.read_gbps = 1e9
        assert ch.worth_it(0, 200)
    finally:
        eng.close()
        store.close()
