"""Typed storage errors: callers map them to recompute (ChunkError) or to a clear status."""

from __future__ import annotations

import errno
from pathlib import Path


class StorageError(Exception):
    pass


class ChunkError(StorageError):
    """A chunk is missing or fails its checksum. The restorer recomputes the owner's layers from tokens."""

    def __init__(self, owner: str, layer: int, index: int, reason: str):
        super().__init__(f"owner {owner} layer {layer} chunk {index}: {reason}")
        self.owner, self.layer, self.index, self.reason = owner, layer, index, reason


class StorageFull(StorageError):
    pass


class FingerprintMismatch(StorageError):
    pass


class UnknownOwner(StorageError, KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


class StoreLocked(StorageError):
    pass


class ClusterUnavailable(StorageError):
    """The session catalogue (Redis) cannot be reached: what needs it is refused, nothing local is lost."""


class LeaseHeld(StorageError):
    """Another writer holds the session's lease: one turn at a time, cluster-wide."""

    def __init__(self, owner: str, holder: str, epoch: int, ttl_ms: int):
        super().__init__(
            f"session {owner} is leased by replica {holder!r} (epoch {epoch}), which is running a turn on it; "
            f"retry after it finishes (the lease expires in {max(ttl_ms, 0)} ms if that replica died)"
        )
        self.owner, self.holder, self.epoch, self.ttl_ms = owner, holder, epoch, ttl_ms


class LeaseLost(StorageError):
    """A commit whose lease epoch is no longer the session's: another replica took it over."""


def write_error(e: Exception, path: Path) -> StorageError:
    """What a failed write to directory `path` tells the caller: a full disk is `StorageFull`."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageFull(f"storage directory {path} is full: {e.strerror}")
    return e if isinstance(e, StorageError) else StorageError(f"write to {path} failed: {e}")
