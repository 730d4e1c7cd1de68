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


def write_error(e: Exception, path: Path) -> StorageError:
    """What a failed write to directory `path` tells the caller: a full disk is `StorageFull`."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageFull(f"storage directory {path} is full: {e.strerror}")
    return e if isinstance(e, StorageError) else StorageError(f"write to {path} failed: {e}")
