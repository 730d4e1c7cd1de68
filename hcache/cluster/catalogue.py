"""The session catalogue in Redis (a Redis Cluster, or one plain server). A session's keys
share its id as hash tag, so they sit in one slot and one server-side script sees them all:

  hc:{id}:rec    hash: kind, fp, layers, tokens (int32), meta (JSON), created, updated, turns,
                 epoch (the last lease granted), cepoch (the epoch of the last commit),
                 released (the last epoch given back: an acquire past any other is a takeover)
  hc:{id}:lease  "holder epoch", with a TTL (PX): the one writer

Records carry no TTL, so `volatile-lru` never evicts them. Leases are `SET NX PX` inside the
acquiring script, which bumps the epoch in the same step; renewing and releasing compare the
value first; a commit is refused unless its epoch is still the record's (fencing)."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from hcache.storage.catalogue import Catalogue, Lease, Record, pack_tokens, unpack_tokens
from hcache.storage.errors import ClusterUnavailable, LeaseHeld, LeaseLost, UnknownOwner

T = TypeVar("T")
# what redis-py raises when it cannot get an answer (its cluster client: RedisClusterException
# when no startup node answers, IndexError when none is left to ask)
UNREACHABLE = (redis.RedisError, RedisClusterException, IndexError)
OWNER_ID = re.compile(r"(ctx-)?[0-9a-f]{32}")  # the ids hcache makes; anything else is unknown

ACQUIRE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {-1} end
local cur = redis.call('GET', KEYS[2])
if cur then return {0, cur, redis.call('PTTL', KEYS[2])} end
local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
redis.call('SET', KEYS[2], ARGV[1] .. ' ' .. epoch, 'NX', 'PX', ARGV[2])
local released = tonumber(redis.call('HGET', KEYS[1], 'released') or '0')
return {1, epoch, (epoch > 1 and released ~= epoch - 1) and 1 or 0}
"""
RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
RELEASE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('HSET', KEYS[2], 'released', ARGV[2]) end
return redis.call('DEL', KEYS[1])
"""
COMMIT = """
local cur = redis.call('HGET', KEYS[1], 'epoch')
if not cur then return {-1} end
if tonumber(cur) ~= tonumber(ARGV[1]) then return {0, tonumber(cur)} end
redis.call('HSET', KEYS[1], 'tokens', ARGV[2], 'meta', ARGV[3], 'updated', ARGV[4], 'turns', ARGV[5], 'cepoch', ARGV[1])
return {1}
"""
CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""
DELETE = """
local cur = redis.call('HGET', KEYS[1], 'epoch')
if not cur then return {-1} end
if tonumber(cur) ~= tonumber(ARGV[1]) then return {0, tonumber(cur)} end
redis.call('DEL', KEYS[1], KEYS[2])
return {1}
"""


def parse_url(url: str) -> list[tuple[str, int]]:
    """`redis://HOST:PORT[,HOST:PORT...]` -> [(host, port), ...]."""
    if not url.startswith("redis://"):
        raise ValueError(f"--cluster takes redis://HOST:PORT[,HOST:PORT...], not {url!r}")
    nodes = []
    for part in url[len("redis://") :].rstrip("/").split(","):
        u = urlsplit("redis://" + part.strip())
        try:
            port = u.port or 6379
        except ValueError:
            raise ValueError(f"--cluster: bad port in {part!r}") from None
        if not u.hostname:
            raise ValueError(f"--cluster: no host in {part!r}")
        nodes.append((u.hostname, port))
    return nodes


def keys(owner: str) -> tuple[str, str]:
    if not OWNER_ID.fullmatch(owner):
        raise UnknownOwner(f"unknown owner {owner[:64]!r}")
    return f"hc:{{{owner}}}:rec", f"hc:{{{owner}}}:lease"


class RedisCatalogue(Catalogue):
    name = "redis"

    def __init__(self, url: str, ttl_ms: int = 10_000, timeout_s: float = 2.0):
        self.url, self.ttl_ms = url, ttl_ms
        nodes = parse_url(url)
        # fail fast: a call that cannot reach the cluster is refused with UNAVAILABLE, not retried for minutes
        opts: dict[str, Any] = dict(
            socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 1)
        )
        self.r: Any = self._guard(lambda: self._connect(nodes, opts))
        self.cluster = isinstance(self.r, RedisCluster)
        self._scripts = {
            name: self.r.register_script(src)
            for name, src in dict(
                acquire=ACQUIRE, renew=RENEW, release=RELEASE, commit=COMMIT, create=CREATE, delete=DELETE
            ).items()
        }

    @staticmethod
    def _connect(nodes: list[tuple[str, int]], opts: dict[str, Any]) -> Any:
        if len(nodes) == 1:
            single = redis.Redis(host=nodes[0][0], port=nodes[0][1], **opts)
            if not int(single.info("cluster").get("cluster_enabled", 0)):
                return single
            single.close()
        startup = [ClusterNode(h, p) for h, p in nodes]
        return RedisCluster(startup_nodes=startup, **opts)

    def _guard(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except UNREACHABLE as e:
            raise ClusterUnavailable(f"the session cluster {self.url} is unreachable: {e}") from None

    def _run(self, script: str, keys_: list[str], args: list[Any]) -> Any:
        return self._guard(lambda: self._scripts[script](keys=keys_, args=args))

    # --- records ------------------------------------------------------------------
    def get(self, owner: str) -> Record | None:
        try:
            rec, _ = keys(owner)
        except UnknownOwner:
            return None
        h = self._guard(lambda: self.r.hgetall(rec))
        if not h:
            return None
        s = {k.decode(): v for k, v in h.items()}
        return Record(
            owner=owner,
            kind=s["kind"].decode(),
            fingerprint=s["fp"].decode(),
            layer_kinds=s["layers"].decode(),
            tokens=unpack_tokens(s["tokens"]),
            meta=json.loads(s["meta"]),
            created=float(s["created"]),
            updated=float(s["updated"]),
            epoch=int(s.get("cepoch", b"0")),
        )

    def create(self, rec: Record) -> None:
        k, _ = keys(rec.owner)
        fields = dict(
            kind=rec.kind,
            fp=rec.fingerprint,
            layers=rec.layer_kinds,
            tokens=pack_tokens(rec.tokens),
            meta=json.dumps(rec.meta),
            created=repr(rec.created),
            updated=repr(rec.updated),
            turns=rec.turns,
            epoch=0,
            cepoch=0,
        )
        if not self._run("create", [k], [x for kv in fields.items() for x in kv]):
            raise ValueError(f"owner {rec.owner} already exists")

    # --- leases -------------------------------------------------------------------
    def acquire(self, owner: str, holder: str) -> Lease:
        rec, lease = keys(owner)
        out = self._run("acquire", [rec, lease], [holder, self.ttl_ms])
        if out[0] == -1:
            raise UnknownOwner(f"unknown owner {owner}")
        if out[0] == 0:
            who, _, epoch = out[1].decode().rpartition(" ")
            raise LeaseHeld(owner, who, int(epoch), int(out[2]))
        return Lease(owner, holder, int(out[1]), takeover=bool(out[2]))

    def renew(self, lease: Lease) -> bool:
        _, k = keys(lease.owner)
        return bool(self._run("renew", [k], [lease.value, self.ttl_ms]))

    def release(self, lease: Lease) -> None:
        rec, k = keys(lease.owner)
        self._run("release", [k, rec], [lease.value, lease.epoch])

    def _fenced(self, lease: Lease, out: list[Any]) -> None:
        if out[0] == -1:
            raise UnknownOwner(f"session {lease.owner} was deleted")
        if out[0] == 0:
            raise LeaseLost(
                f"session {lease.owner} was taken over by another replica (lease epoch {out[1]}, this one "
                f"held {lease.epoch}): this turn is not committed"
            )

    def commit_turn(self, lease: Lease, tokens: list[int], meta: dict[str, Any]) -> None:
        rec, _ = keys(lease.owner)
        args = [lease.epoch, pack_tokens(tokens), json.dumps(meta), repr(time.time()), int(meta.get("turns", 0))]
        self._fenced(lease, self._run("commit", [rec], args))

    def delete(self, lease: Lease) -> None:
        rec, k = keys(lease.owner)
        self._fenced(lease, self._run("delete", [rec, k], [lease.epoch]))

    # --- operations ---------------------------------------------------------------
    def problems(self) -> list[str]:
        try:
            if self.cluster:
                self.r.ping(target_nodes=RedisCluster.PRIMARIES)
                state = self.r.cluster_info().get("cluster_state", "ok")
                if state != "ok":
                    return [f"the session cluster {self.url} is in state {state}"]
            else:
                self.r.ping()
        except UNREACHABLE as e:
            return [f"the session cluster {self.url} is unreachable: {e}"]
        return []

    def close(self) -> None:
        self.r.close()
