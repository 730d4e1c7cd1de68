"""The session catalogue: where a session's record (token ids, conversation meta, model
fingerprint, what each layer stores) is committed when a turn is acknowledged, and the
lease that makes one writer of it at a time. Two implementations: the local SQLite
manifest (one process owns the store, so leases are in-process) and a Redis Cluster
(`hcache/cluster/catalogue.py`), which replicas share."""

from __future__ import annotations

import itertools
import threading
import time
from abc import ABC, abstractmethod
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hcache.storage.errors import LeaseHeld, LeaseLost, UnknownOwner
from hcache.storage.manifest import Manifest, OwnerRow


def pack_tokens(tokens: list[int]) -> bytes:
    return array("i", tokens).tobytes()


def unpack_tokens(blob: bytes) -> list[int]:
    a = array("i")
    a.frombytes(blob)
    return a.tolist()


@dataclass
class Record:
    """A session (or context) as of its last acknowledged turn."""

    owner: str
    kind: str  # session | context
    fingerprint: str
    layer_kinds: str  # one letter per layer: H, K or -
    tokens: list[int]  # the owner's own token ids (after its context's)
    meta: dict[str, Any] = field(default_factory=dict)  # SessionMeta.to_dict()
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    epoch: int = 0  # the lease epoch of the last commit

    @property
    def tenant(self) -> str | None:
        return self.meta.get("tenant")

    @property
    def turns(self) -> int:
        return int(self.meta.get("turns", 0))

    @classmethod
    def of_row(cls, r: OwnerRow) -> Record:
        return cls(r.owner, r.kind, r.fingerprint, r.layer_kinds, r.tokens, r.meta, r.created, r.updated)


@dataclass(frozen=True)
class Lease:
    """The right to commit turns of `owner` until another lease (a higher epoch) is granted."""

    owner: str
    holder: str
    epoch: int
    takeover: bool = field(default=False, compare=False)  # the previous lease expired unreleased

    @property
    def value(self) -> str:
        return f"{self.holder} {self.epoch}"


class Catalogue(ABC):
    """Records and leases. Raises ClusterUnavailable when it cannot be reached."""

    name = ""

    @abstractmethod
    def get(self, owner: str) -> Record | None: ...

    @abstractmethod
    def create(self, rec: Record) -> None:
        """A new record with no tokens; ValueError if the owner exists."""

    @abstractmethod
    def acquire(self, owner: str, holder: str) -> Lease:
        """A lease with a new epoch; LeaseHeld while another is live, UnknownOwner without a record."""

    @abstractmethod
    def renew(self, lease: Lease) -> bool:
        """Extend a live lease; False when it expired or another replaced it."""

    @abstractmethod
    def release(self, lease: Lease) -> None: ...

    @abstractmethod
    def commit_turn(self, lease: Lease, tokens: list[int], meta: dict[str, Any]) -> None:
        """Atomically make a turn the record's; LeaseLost when the lease's epoch is no longer current."""

    @abstractmethod
    def delete(self, lease: Lease) -> None:
        """The record goes (and what the catalogue keeps for it); LeaseLost as commit_turn."""

    def problems(self) -> list[str]:
        """Why the catalogue cannot serve now (empty: it can)."""
        return []

    def close(self) -> None:
        return None


class LocalCatalogue(Catalogue):
    """The manifest of one process's store: its rows are the records. The store's file lock
    already makes this process the only writer, so leases only order this process's threads."""

    name = "local"

    def __init__(self, manifest: Manifest, ttl_ms: int = 10_000, drop: Callable[[str], None] | None = None):
        """`drop` deletes an owner (a live store's `delete`, which frees its slots too)."""
        self.manifest, self.ttl_ms = manifest, ttl_ms
        self.drop = drop or manifest.delete_owner
        self._lock = threading.Lock()
        self._leases: dict[str, tuple[Lease, float]] = {}
        self._epochs = itertools.count(1)

    def get(self, owner: str) -> Record | None:
        row = self.manifest.get_owner(owner)
        return Record.of_row(row) if row is not None else None

    def create(self, rec: Record) -> None:
        if self.manifest.get_owner(rec.owner) is not None:
            raise ValueError(f"owner {rec.owner} already exists")
        self.manifest.create_owner(rec.owner, rec.kind, rec.fingerprint, rec.layer_kinds, rec.meta)

    def acquire(self, owner: str, holder: str) -> Lease:
        if self.manifest.get_owner(owner) is None:
            raise UnknownOwner(f"unknown owner {owner}")
        now = time.monotonic()
        with self._lock:
            cur = self._leases.get(owner)
            if cur is not None and cur[1] > now:
                held = cur[0]
                raise LeaseHeld(owner, held.holder, held.epoch, int((cur[1] - now) * 1e3))
            lease = Lease(owner, holder, next(self._epochs), takeover=cur is not None)
            self._leases[owner] = (lease, now + self.ttl_ms / 1e3)
            return lease

    def renew(self, lease: Lease) -> bool:
        with self._lock:
            cur = self._leases.get(lease.owner)
            if cur is None or cur[0] != lease or cur[1] <= time.monotonic():
                return False
            self._leases[lease.owner] = (lease, time.monotonic() + self.ttl_ms / 1e3)
            return True

    def release(self, lease: Lease) -> None:
        with self._lock:
            cur = self._leases.get(lease.owner)
            if cur is not None and cur[0] == lease:
                del self._leases[lease.owner]

    def _current(self, lease: Lease) -> None:
        with self._lock:
            cur = self._leases.get(lease.owner)
            latest = cur[0].epoch if cur else lease.epoch
        if latest != lease.epoch:
            raise LeaseLost(f"session {lease.owner}: lease epoch {lease.epoch} was superseded by {latest}")

    def commit_turn(self, lease: Lease, tokens: list[int], meta: dict[str, Any]) -> None:
        self._current(lease)
        self.manifest.set_tokens(lease.owner, tokens, meta)

    def delete(self, lease: Lease) -> None:
        self._current(lease)
        self.drop(lease.owner)
        self.release(lease)
