"""Where sessions live besides this process: the one seam between the engine and cluster
mode. The engine makes the same calls either way: `Solo` (the default) answers them with
nothing, this replica's store being every session's record; `ClusterSharing`
(`hcache/cluster/`, `--cluster`) shares records, leases and chunks through a Redis Cluster.
`hcache.cluster.sharing_for` is the one factory."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Protocol

from hcache.storage.catalogue import Lease

if TYPE_CHECKING:
    from hcache.engine.lock import EngineLock
    from hcache.engine.records import ClusterState
    from hcache.engine.registry import Registry
    from hcache.engine.sampler import SamplingParams
    from hcache.engine.scheduler import Scheduler
    from hcache.engine.sequence import Sequence
    from hcache.engine.session import Session
    from hcache.model.base import DecoderModel
    from hcache.restore.profile import Profile
    from hcache.storage.fetched import Fetched
    from hcache.storage.store import ChunkStore


class Settles(Protocol):
    def settle(self, session_id: str, tenant: str | None, kind: str = "session") -> Session:
        """The session once no storage release holds it (the reclaimer's)."""
        ...


class Host(Protocol):
    """What of the engine a `Sharing` works with (the engine is one)."""

    model: DecoderModel
    store: ChunkStore
    profile: Profile
    registry: Registry
    scheduler: Scheduler
    reclaimer: Settles
    lock: EngineLock

    def sequence(
        self, s: Session, new: list[int], keep: int, params: SamplingParams, stops: list[str], sample: bool
    ) -> Sequence: ...

    def compute(self, seq: Sequence) -> None: ...


class Sharing(ABC):
    """What the engine's calls do beyond this process. Network calls never run under the
    engine's lock: the engine calls these outside it, and implementations take it briefly."""

    def attach(self, engine: Host) -> None:  # noqa: B027 - optional: what serves needs the engine
        """Called once by the engine it serves, at the end of its construction."""

    @abstractmethod
    def before_create(self, context_ids: list[str], tenant: str | None) -> None:
        """A session is about to be created on these contexts: they are here after this."""

    @abstractmethod
    def created(self, s: Session) -> None:
        """A new session or context exists here: it exists for every replica after this (or
        this raises and it exists nowhere)."""

    @abstractmethod
    def lease_context(self, ctx: Session) -> Lease | None:
        """`created`, and the new context's lease for its precompute turn."""

    @abstractmethod
    def lease_turn(self, sid: str, tenant: str | None) -> Lease | None:
        """Before a turn is queued: the session's lease, the session brought up to its last
        acknowledged turn (and what this replica lacks of it fetched)."""

    @abstractmethod
    def turn_refused(self, sid: str, lease: Lease) -> None:
        """The turn `lease_turn` leased for was refused before it was queued."""

    @abstractmethod
    def turn_queued(self, s: Session, keep: int) -> None:
        """A turn was queued that keeps `keep` of the session's tokens (counted)."""

    @abstractmethod
    def commit(self, seq: Sequence, tokens: list[int], meta: dict[str, Any]) -> None:
        """The durable turn becomes the session's record; raising fails the turn."""

    @abstractmethod
    def release(self, lease: Lease) -> None:
        """A failed turn's lease goes back (best effort: one not given back expires)."""

    @abstractmethod
    def before_delete(self, sid: str, tenant: str | None) -> None:
        """The session or context is deleted everywhere, or this raises."""

    @abstractmethod
    def get(self, sid: str, tenant: str | None) -> Session | None:
        """The session as the record of its last turn says (None: the local one is)."""

    @abstractmethod
    def used(self, fetched: Fetched) -> None:
        """A turn restores from rows `lease_turn` fetched."""

    def problems(self) -> list[str]:
        """Why sessions cannot be served now (empty: they can)."""
        return []

    def state(self) -> ClusterState | None:
        return None

    def close(self) -> None:  # noqa: B027 - nothing to close by default
        """After the engine's loop stopped."""


class Solo(Sharing):
    """This replica alone: its store is the record; there is no lease to take."""

    def before_create(self, context_ids: list[str], tenant: str | None) -> None:
        return None

    def created(self, s: Session) -> None:
        return None

    def lease_context(self, ctx: Session) -> Lease | None:
        return None

    def lease_turn(self, sid: str, tenant: str | None) -> Lease | None:
        return None

    def turn_refused(self, sid: str, lease: Lease) -> None:
        return None

    def turn_queued(self, s: Session, keep: int) -> None:
        return None

    def commit(self, seq: Sequence, tokens: list[int], meta: dict[str, Any]) -> None:
        return None

    def release(self, lease: Lease) -> None:
        return None

    def before_delete(self, sid: str, tenant: str | None) -> None:
        return None

    def get(self, sid: str, tenant: str | None) -> Session | None:
        return None

    def used(self, fetched: Fetched) -> None:
        return None
