"""Replicas of `hcache serve --cluster` on one real 3-master Redis Cluster, with the default
model and chat turns checked against a single-server reference: a session moves between
replicas, a replica killed with -9 mid-turn is taken over from the last acknowledged turn,
a leased session is ABORTED naming its holder, the client routes and fails over, and an
unreachable cluster shows in /readyz and as UNAVAILABLE."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from cluster_helpers import RedisCluster, redis_cluster  # noqa: F401 - a fixture
from engine_helpers import SERVER_START_S, free_port, profile_for

from hcache.client import Client, rendezvous, wait_for_server
from hcache.cluster.catalogue import RedisCatalogue
from hcache.config import Config, EngineConfig, ServerConfig, StorageConfig
from hcache.engine.generate import ChatSession
from hcache.engine.sampler import SamplingParams
from hcache.server.app import Running, start

pytestmark = pytest.mark.model
SYSTEM = "You are a helpful assistant. Answer briefly."
TURNS = ["What is the capital of France?", "And of Italy?", "Which of the two is larger?", "Thanks! Bye."]
MAX_NEW = 16
LEASE_MS = 2000


def replica(loaded, url: str, d: Path, name: str, http_port: int = -1) -> Running:
    cfg = Config(
        storage=StorageConfig([str(d)]),
        engine=EngineConfig(store_kinds="both", kv_budget_bytes=256 << 20),
        server=ServerConfig(
            port=0, http_port=http_port, drain_seconds=5, cluster=url, lease_ms=LEASE_MS, replica_name=name
        ),
    )
    return start(cfg, profile_for(loaded.model), loaded)


@pytest.fixture(scope="module")
def replicas(default_model, redis_cluster, tmp_path_factory):  # noqa: F811
    d = tmp_path_factory.mktemp("replicas")
    a = replica(default_model, redis_cluster.url, d / "a", "replica-a")
    b = replica(default_model, redis_cluster.url, d / "b", "replica-b")
    yield a, b
    a.stop(1)
    b.stop(1)


@pytest.fixture(scope="module")
def ref_replies(default_model):
    chat = ChatSession(default_model.model, default_model.tokenizer, SYSTEM)
    return [chat.reply(m, SamplingParams(max_new_tokens=MAX_NEW))[0] for m in TURNS]


def target(run: Running) -> str:
    return f"127.0.0.1:{run.port}"


def test_a_session_moves_between_replicas_token_for_token(replicas, ref_replies):
    a, b = replicas
    with Client(target(a)) as ca, Client(target(b)) as cb:
        sid = ca.create_session(SYSTEM).session_id
        for c, msg, want in zip([ca, cb, ca, cb], TURNS, ref_replies, strict=True):
            assert c.reply(sid, msg, max_new_tokens=MAX_NEW).text == want
        assert cb.get(sid).turns == 4 and ca.get(sid).turns == 4


def test_a_leased_session_is_aborted_naming_its_holder(replicas, redis_cluster):  # noqa: F811
    a, _ = replicas
    with Client(target(a)) as c:
        sid = c.create_session(SYSTEM).session_id
        other = RedisCatalogue(redis_cluster.url, ttl_ms=60_000)
        lease = other.acquire(sid, "replica-elsewhere")
        try:
            with pytest.raises(grpc.RpcError) as e:
                c.reply(sid, "Hello?", max_new_tokens=4)
            assert e.value.code() == grpc.StatusCode.ABORTED
            assert "leased by replica 'replica-elsewhere'" in e.value.details()
        finally:
            other.release(lease)
            other.close()
        assert c.reply(sid, "Hello?", max_new_tokens=4).finish_reason in ("stop", "length")


def test_the_client_routes_by_rendezvous_and_fails_over(replicas, ref_replies):
    a, b = replicas
    dead = f"127.0.0.1:{free_port()}"
    targets = [dead, target(a), target(b)]
    with Client(targets) as c:
        sids = [c.create_session(SYSTEM).session_id for _ in range(3)]  # round robin, past the dead one
        # a session whose first choice is the dead replica, to show the failover
        sids += [
            s for s in (c.create_session(SYSTEM).session_id for _ in range(30)) if rendezvous(s, targets)[0] == dead
        ][:1]
        assert rendezvous(sids[-1], targets)[0] == dead
        for sid in sids:
            assert c.reply(sid, TURNS[0], max_new_tokens=MAX_NEW).text == ref_replies[0]
        assert rendezvous(sids[0], targets) == rendezvous(sids[0], list(reversed(targets)))


def test_a_replica_killed_mid_turn_is_taken_over_exactly(default_model, redis_cluster, replicas, ref_replies, tmp_path):  # noqa: F811
    _, b = replicas
    prof = tmp_path / "profile.json"
    profile_for(default_model.model).save(prof)
    port = free_port()
    cmd = [sys.executable, "-m", "hcache.cli", "serve", "--port", str(port), "--profile", str(prof)]
    cmd += ["--dirs", str(tmp_path / "killed"), "--kv-budget-mb", "256", "--http-port", "-1", "--store-kinds", "both"]
    cmd += ["--weights", "float"]  # the other replicas' model
    cmd += ["--cluster", redis_cluster.url, "--lease-ms", str(LEASE_MS), "--replica-name", "replica-killed"]
    env = {**os.environ, "HCACHE_HOME": str(tmp_path / "home")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_server(f"127.0.0.1:{port}", SERVER_START_S, alive=lambda: proc.poll() is None)
    except RuntimeError:
        proc.kill()
        raise RuntimeError(f"server did not start:\n{proc.communicate()[0]}") from None
    try:
        with Client(f"127.0.0.1:{port}") as ca, Client(target(b)) as cb:
            sid = ca.create_session(SYSTEM).session_id
            assert ca.reply(sid, TURNS[0], max_new_tokens=MAX_NEW).text == ref_replies[0]
            stream = ca.generate(sid, TURNS[1], max_new_tokens=400)
            assert next(stream).token_ids  # mid-turn
            proc.kill()
            proc.wait()
            with pytest.raises(grpc.RpcError) as e:
                cb.reply(sid, TURNS[1], max_new_tokens=MAX_NEW)
            assert e.value.code() == grpc.StatusCode.ABORTED and "replica-killed" in e.value.details()
            deadline = time.monotonic() + LEASE_MS / 1e3 + 30
            while True:
                try:
                    got = cb.reply(sid, TURNS[1], max_new_tokens=MAX_NEW)
                    break
                except grpc.RpcError as err:
                    if err.code() != grpc.StatusCode.ABORTED or time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            assert got.text == ref_replies[1]  # from the last acknowledged turn, exactly
            assert cb.reply(sid, TURNS[2], max_new_tokens=MAX_NEW).text == ref_replies[2]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_an_unreachable_cluster_is_not_ready_and_unavailable(default_model, tmp_path):
    cluster = RedisCluster(tmp_path / "redis")
    run = replica(default_model, cluster.url, tmp_path / "a", "replica-a", http_port=0)
    try:
        ready = f"http://127.0.0.1:{run.http_port}/readyz"
        with urllib.request.urlopen(ready, timeout=10) as r:
            assert json.load(r) == {"ready": True, "problems": []}
        with Client(target(run)) as c:
            sid = c.create_session(SYSTEM).session_id
            c.reply(sid, TURNS[0], max_new_tokens=4)
            base = f"http://127.0.0.1:{run.http_port}"
            with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
                text = r.read().decode()
            for line in (
                "hcache_cluster_up 1.0",
                "hcache_cluster_commits_total 1.0",
                "hcache_cluster_errors_total 0.0",
            ):
                assert line in text
            assert 'hcache_restores_by_source_total{source="local"}' in text
            assert "hcache_cluster_written_bytes_total" in text and "hcache_cluster_lease_takeovers_total" in text
            cluster.stop()
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(ready, timeout=30)
            body = json.load(e.value)
            assert e.value.code == 503 and any("unreachable" in p for p in body["problems"])
            for call in (lambda: c.reply(sid, TURNS[1], max_new_tokens=4), lambda: c.create_session(SYSTEM)):
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "session cluster" in err.value.details() and "unreachable" in err.value.details()
            assert run.store.owner_row(sid).num_tokens > 0  # nothing local is lost
            time.sleep(LEASE_MS / 1e3)  # the lease thread checks the cluster a few times per lease
            with urllib.request.urlopen(base + "/api/dashboard", timeout=30) as r:
                feed = json.load(r)["cluster"]
            assert not feed["up"] and feed["errors"] >= 2 and feed["replica"] == "replica-a"
    finally:
        run.stop(1)
        cluster.stop()
