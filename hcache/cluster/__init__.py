"""Cluster mode (`--cluster`): replicas sharing sessions through a Redis Cluster, plugged
into the engine at its one seam (`engine/sharing.py`). `sharing_for` is the one factory:
`Solo` without `--cluster`. Records and leases: `catalogue.py` (Redis) and `link.py`; what
the engine's calls do with them: `sharing.py`; session chunks: `tier.py` (their format in
Redis), `uploader.py` (up, behind turns), `fetch.py` (down, before turns), `chunks.py`
(when either is worth it)."""

from __future__ import annotations

import logging

from hcache.cluster.catalogue import RedisCatalogue
from hcache.cluster.link import ClusterLink
from hcache.cluster.sharing import ClusterSharing
from hcache.cluster.tier import ChunkTier
from hcache.config import Config
from hcache.engine.sharing import Sharing, Solo

log = logging.getLogger(__name__)


def sharing_for(cfg: Config) -> Sharing:
    """`Solo`, or with `--cluster` the Redis Cluster's (connected now: an unreachable cluster
    fails the start at once)."""
    s = cfg.server
    if not s.cluster:
        return Solo()
    catalogue = RedisCatalogue(s.cluster, ttl_ms=s.lease_ms)
    tier = ChunkTier(catalogue.r, s.cluster, s.chunk_ttl_s) if s.cluster_chunks != "off" else None
    link = ClusterLink(catalogue, s.replica_name or None, chunks=tier, chunk_policy=s.cluster_chunks)
    log.info("sessions shared through %s as replica %s", s.cluster, link.holder)
    return ClusterSharing(link)
