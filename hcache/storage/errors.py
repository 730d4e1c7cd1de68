"""Typed storage errors: callers map them to recompute (ChunkError) or to a clear status."""

from __future__ import annotations


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
