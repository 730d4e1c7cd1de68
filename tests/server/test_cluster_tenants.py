"""Tenants across replicas: two `hcache serve --cluster --api-keys` replicas on one real Redis
Cluster with the same keys file. A key's sessions and contexts are its own on every replica:
another key gets NOT_FOUND on the other replica (as on one server), and its owner continues
them there."""

from __future__ import annotations

import grpc
import pytest
from cluster_helpers import redis_cluster  # noqa: F401 - a fixture
from engine_helpers import profile_for

from hcache.client import Client
from hcache.config import Config, EngineConfig, ServerConfig, StorageConfig
from hcache.server.app import start

pytestmark = pytest.mark.model
KEY_A = "alice-key-0123456789abcdef"
KEY_B = "bob-key-0123456789abcdef00"


@pytest.fixture(scope="module")
def replicas(default_model, redis_cluster, tmp_path_factory):  # noqa: F811
    d = tmp_path_factory.mktemp("tenants")
    (d / "keys").write_text(f"alice {KEY_A}\nbob {KEY_B}\n")
    runs = []
    for name in ("a", "b"):
        cfg = Config(
            storage=StorageConfig([str(d / name)]),
            engine=EngineConfig(store_kinds="kv", kv_budget_bytes=128 << 20),
            server=ServerConfig(
                port=0, http_port=-1, cluster=redis_cluster.url, replica_name=name, api_keys_file=str(d / "keys")
            ),
        )
        runs.append(start(cfg, profile_for(default_model.model), default_model))
    yield runs
    for r in runs:
        r.stop(1)


def code_of(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        r = fn()
        if hasattr(r, "__iter__"):
            list(r)
    return e.value.code()


def test_a_keys_sessions_are_unknown_to_another_key_on_every_replica(replicas):
    a, b = replicas
    with (
        Client(f"127.0.0.1:{a.port}", api_key=KEY_A) as alice_a,
        Client(f"127.0.0.1:{b.port}", api_key=KEY_A) as alice_b,
        Client(f"127.0.0.1:{b.port}", api_key=KEY_B) as bob_b,
        Client(f"127.0.0.1:{b.port}") as anon_b,
    ):
        sid = alice_a.create_session("Be brief.").session_id
        assert alice_a.reply(sid, "Hi!", max_new_tokens=4).token_ids
        ctx = alice_a.precompute_context("A short document about owls.").context_id
        for fn in (
            lambda: bob_b.get(sid),
            lambda: bob_b.generate(sid, "hello"),
            lambda: bob_b.restore(sid),
            lambda: bob_b.evict(sid),
            lambda: bob_b.delete(sid),
            lambda: bob_b.delete(ctx),
            lambda: bob_b.create_session(context_ids=[ctx]),
        ):
            assert code_of(fn) == grpc.StatusCode.NOT_FOUND
        assert sid not in {s.session_id for s in bob_b.list()}
        assert code_of(lambda: anon_b.get(sid)) == grpc.StatusCode.UNAUTHENTICATED
        # what bob tried changed nothing: alice continues on b, then on a
        assert alice_b.reply(sid, "Bye!", max_new_tokens=4).token_ids
        assert alice_a.get(sid).turns == 2
        on_ctx = alice_b.create_session(context_ids=[ctx]).session_id
        assert alice_b.reply(on_ctx, "Owls?", max_new_tokens=4).token_ids
