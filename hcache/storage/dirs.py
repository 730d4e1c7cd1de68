"""Storage directories given on a command line: every command that takes them creates the
missing ones (or only checks, for fsck) here, so they all fail alike with a message naming the path."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from hcache.storage.errors import StorageError


class StorageDirError(StorageError):
    """A storage directory is missing (and not to be created) or cannot be created; the CLI exits 2."""


def ensure_dirs(dirs: Iterable[str | Path], create: bool = True) -> list[Path]:
    """The directories as Paths, each created with its parents when `create` (else required to exist)."""
    paths = [Path(d) for d in dirs]
    for p in paths:
        if not create:
            if not p.is_dir():
                raise StorageDirError(f"storage directory missing: {p}")
            continue
        try:
            p.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a parent that is a file, no permission, read-only file system, ...
            raise StorageDirError(f"cannot create storage directory {p}: {e.strerror or e}") from None
    return paths
