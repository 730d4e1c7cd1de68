"""The manifest: SQLite in WAL mode with synchronous=FULL, so a committed row
survives a crash. Owners carry their token ids, model fingerprint and which
representation each layer stores; chunk rows point at slots whose bytes were
already durable when the row was committed. Several owners' rows may point at one
slot: a forked session shares its parent's chunks until it rewrites them."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from array import array
from dataclasses import dataclass
from pathlib import Path

from hcache.storage.errors import StorageError, UnknownOwner
from hcache.storage.layout import CHUNK_TOKENS, KV_LAYOUT, Kind

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS owners(
  owner TEXT PRIMARY KEY,
  kind TEXT NOT NULL,               -- session | context
  fingerprint TEXT NOT NULL,
  layer_kinds TEXT NOT NULL,        -- one letter per layer: H, K (KV) or - (recompute)
  num_tokens INTEGER NOT NULL,      -- durable tokens: a finished turn
  tokens BLOB NOT NULL,             -- int32 token ids
  meta TEXT NOT NULL DEFAULT '{}',
  created REAL NOT NULL,
  updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS chunks(
  owner TEXT NOT NULL,
  layer INTEGER NOT NULL,
  idx INTEGER NOT NULL,
  kind TEXT NOT NULL,
  dir INTEGER NOT NULL,
  slab TEXT NOT NULL,
  slot INTEGER NOT NULL,
  ntokens INTEGER NOT NULL,
  checksum INTEGER NOT NULL,
  PRIMARY KEY(owner, layer, idx, kind)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS prefixes(  -- chat sessions' token prefixes, one row per whole chunk
  hash BLOB NOT NULL,               -- prefixes.prefix_hashes: the tenant and every token before ntokens
  owner TEXT NOT NULL,
  ntokens INTEGER NOT NULL,
  PRIMARY KEY(owner, ntokens)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS prefixes_hash ON prefixes(hash);
CREATE TABLE IF NOT EXISTS expired(  -- owners deleted for being idle too long: asked for, they say so
  owner TEXT PRIMARY KEY,
  tenant TEXT,
  at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS expired_at ON expired(at);
"""


@dataclass(frozen=True)
class ChunkRow:
    owner: str
    layer: int
    idx: int
    kind: str
    dir: int
    slab: str
    slot: int
    ntokens: int
    checksum: int


@dataclass
class OwnerRow:
    owner: str
    kind: str
    fingerprint: str
    layer_kinds: str
    num_tokens: int
    tokens: list[int]
    meta: dict
    created: float
    updated: float


def _pack(tokens: list[int]) -> bytes:
    return array("i", tokens).tobytes()


def _unpack(blob: bytes) -> list[int]:
    a = array("i")
    a.frombytes(blob)
    return a.tolist()


class Manifest:
    def __init__(self, path: Path):
        self.path = path
        self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=30)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.executescript(SCHEMA)
        self.db.execute("DROP INDEX IF EXISTS chunks_slot")  # slots were unique before forks shared them
        self.lock = threading.Lock()
        self._kinds: dict[str, str] = {}  # owner -> layer-kinds code, as read (dropped where it changes)

    def close(self) -> None:
        with self.lock:
            self.db.close()

    # --- meta -----------------------------------------------------------------
    def get_meta(self, key: str) -> str | None:
        with self.lock:
            r = self.db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return r[0] if r else None

    def set_meta(self, key: str, value: str) -> None:
        with self.lock:
            self.db.execute("INSERT OR REPLACE INTO meta VALUES(?, ?)", (key, value))

    # --- owners ---------------------------------------------------------------
    def create_owner(self, owner: str, kind: str, fingerprint: str, layer_kinds: str, meta: dict | None = None) -> None:
        now = time.time()
        with self.lock:
            self.db.execute(
                "INSERT INTO owners VALUES(?, ?, ?, ?, 0, ?, ?, ?, ?)",
                (owner, kind, fingerprint, layer_kinds, _pack([]), json.dumps(meta or {}), now, now),
            )

    def get_owner(self, owner: str) -> OwnerRow | None:
        with self.lock:
            r = self.db.execute("SELECT * FROM owners WHERE owner=?", (owner,)).fetchone()
        return _owner(r) if r else None

    def owner_layer_kinds(self, owner: str) -> str:
        """The owner's layer-kinds code alone (what every decode step stages by), from memory
        after the first read: a query per step waited on the lock the packer's commits hold."""
        code = self._kinds.get(owner)
        if code is not None:
            return code
        with self.lock:
            r = self.db.execute("SELECT layer_kinds FROM owners WHERE owner=?", (owner,)).fetchone()
            if r is None:
                raise UnknownOwner(f"unknown owner {owner}")
            self._kinds[owner] = r[0]
        return r[0]

    def owner(self, owner: str) -> OwnerRow:
        row = self.get_owner(owner)
        if row is None:
            raise UnknownOwner(f"unknown owner {owner}")
        return row

    def owners(self) -> list[OwnerRow]:
        with self.lock:
            rows = self.db.execute("SELECT * FROM owners ORDER BY created").fetchall()
        return [_owner(r) for r in rows]

    def set_tokens(
        self, owner: str, tokens: list[int], meta: dict | None = None, prefixes: list[bytes] | None = None
    ) -> None:
        """Make a turn durable: its chunks were committed before this. `meta` (the session's
        conversation) changes in the same transaction, so tokens and messages never disagree;
        so do the owner's prefix hashes (`prefixes`: one per whole chunk of `tokens`; None
        leaves those still within `tokens` as they are)."""
        with self.lock, self.db:
            self.db.execute("BEGIN IMMEDIATE")
            if meta is None:
                self.db.execute(
                    "UPDATE owners SET tokens=?, num_tokens=?, updated=? WHERE owner=?",
                    (_pack(tokens), len(tokens), time.time(), owner),
                )
            else:
                self.db.execute(
                    "UPDATE owners SET tokens=?, num_tokens=?, meta=?, updated=? WHERE owner=?",
                    (_pack(tokens), len(tokens), json.dumps(meta), time.time(), owner),
                )
            self._index(owner, len(tokens), prefixes)

    def _index(self, owner: str, n: int, prefixes: list[bytes] | None) -> None:
        self.db.execute("DELETE FROM prefixes WHERE owner=? AND ntokens>?", (owner, n))
        if prefixes is not None:
            self.db.executemany(
                "INSERT OR REPLACE INTO prefixes VALUES(?, ?, ?)",
                [(h, owner, (k + 1) * CHUNK_TOKENS) for k, h in enumerate(prefixes)],
            )

    def find_prefixes(self, hashes: list[bytes]) -> list[tuple[str, int]]:
        """(owner, tokens) of every indexed prefix among `hashes`, longest first."""
        if not hashes:
            return []
        with self.lock:
            rows = self.db.execute(
                f"SELECT owner, ntokens FROM prefixes WHERE hash IN ({','.join('?' * len(hashes))}) "
                "ORDER BY ntokens DESC, owner",
                hashes,
            ).fetchall()
        return [(r[0], r[1]) for r in rows]

    def fork_owner(
        self,
        parent: str,
        child: str,
        meta: dict,
        n: int,
        prefixes: list[bytes] | None,
    ) -> tuple[OwnerRow, list[ChunkRow]]:
        """A new owner `child` whose first `n` tokens are the parent's: it gets the parent's
        fingerprint and layer kinds, and rows pointing at the parent's slots for the chunks
        those tokens touch, in one transaction (a partly shared chunk holds more rows than the
        child's tokens cover, as after a truncation). Returns the child's row and its chunk rows."""
        now = time.time()
        with self.lock, self.db:
            self.db.execute("BEGIN IMMEDIATE")
            r = self.db.execute("SELECT * FROM owners WHERE owner=?", (parent,)).fetchone()
            if r is None:
                raise UnknownOwner(f"unknown owner {parent}")
            par = _owner(r)
            if par.num_tokens < n:
                raise ValueError(f"owner {parent} has {par.num_tokens} durable tokens, cannot share {n}")
            tokens = par.tokens[:n]
            self.db.execute(
                "INSERT INTO owners VALUES(?, 'session', ?, ?, ?, ?, ?, ?, ?)",
                (child, par.fingerprint, par.layer_kinds, n, _pack(tokens), json.dumps(meta), now, now),
            )
            self.db.execute(
                "INSERT INTO chunks SELECT ?, layer, idx, kind, dir, slab, slot, ntokens, checksum "
                "FROM chunks WHERE owner=? AND idx<?",
                (child, parent, -(-n // CHUNK_TOKENS)),
            )
            rows = self.db.execute("SELECT * FROM chunks WHERE owner=?", (child,)).fetchall()
            self._index(child, n, prefixes)
        row = OwnerRow(child, "session", par.fingerprint, par.layer_kinds, n, tokens, meta, now, now)
        return row, [ChunkRow(*c) for c in rows]

    def delete_owner(self, owner: str, expired: bool = False) -> list[ChunkRow]:
        """Delete the owner and its chunk rows; `expired` leaves a tombstone in the same transaction."""
        with self.lock, self.db:
            self.db.execute("BEGIN IMMEDIATE")
            rows = self.db.execute("SELECT * FROM chunks WHERE owner=?", (owner,)).fetchall()
            if expired:
                r = self.db.execute("SELECT meta FROM owners WHERE owner=?", (owner,)).fetchone()
                tenant = json.loads(r[0]).get("tenant") if r else None
                self.db.execute("INSERT OR REPLACE INTO expired VALUES(?, ?, ?)", (owner, tenant, time.time()))
            self.db.execute("DELETE FROM chunks WHERE owner=?", (owner,))
            self.db.execute("DELETE FROM prefixes WHERE owner=?", (owner,))
            self.db.execute("DELETE FROM owners WHERE owner=?", (owner,))
            self._kinds.pop(owner, None)
        return [ChunkRow(*r) for r in rows]

    def expired(self, owner: str) -> tuple[str | None, float] | None:
        """(tenant, Unix time) of an owner deleted for being idle, or None."""
        with self.lock:
            r = self.db.execute("SELECT tenant, at FROM expired WHERE owner=?", (owner,)).fetchone()
        return (r[0], r[1]) if r else None

    def prune_expired(self, before: float) -> int:
        """Forget the tombstones of owners expired before `before` (Unix time); how many."""
        with self.lock:
            return self.db.execute("DELETE FROM expired WHERE at < ?", (before,)).rowcount

    def release_layers(self, owner: str, layer_kinds: str, rows: list[ChunkRow]) -> None:
        """The owner now stores `layer_kinds`; `rows` (the chunks of what it no longer stores)
        go in the same transaction, so a crash leaves either both or neither."""
        with self.lock, self.db:
            self.db.execute("BEGIN IMMEDIATE")
            self.db.execute("UPDATE owners SET layer_kinds=? WHERE owner=?", (layer_kinds, owner))
            self._kinds.pop(owner, None)
            self.db.executemany(
                "DELETE FROM chunks WHERE owner=? AND layer=? AND idx=? AND kind=?",
                [(r.owner, r.layer, r.idx, r.kind) for r in rows],
            )

    # --- chunks ---------------------------------------------------------------
    def commit_chunks(self, rows: list[ChunkRow]) -> list[ChunkRow]:
        """Insert or replace rows in one transaction; returns the rows they replaced (their slots are now free)."""
        with self.lock, self.db:
            self.db.execute("BEGIN IMMEDIATE")
            old = []
            for r in rows:
                prev = self.db.execute(
                    "SELECT * FROM chunks WHERE owner=? AND layer=? AND idx=? AND kind=?",
                    (r.owner, r.layer, r.idx, r.kind),
                ).fetchone()
                if prev:
                    old.append(ChunkRow(*prev))
                    self.db.execute(
                        "DELETE FROM chunks WHERE owner=? AND layer=? AND idx=? AND kind=?",
                        (r.owner, r.layer, r.idx, r.kind),
                    )
            self.db.executemany(
                "INSERT INTO chunks VALUES(?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [(r.owner, r.layer, r.idx, r.kind, r.dir, r.slab, r.slot, r.ntokens, r.checksum) for r in rows],
            )
        return old

    def chunks(self, owner: str | None = None) -> list[ChunkRow]:
        with self.lock:
            if owner is None:
                rows = self.db.execute("SELECT * FROM chunks").fetchall()
            else:
                rows = self.db.execute("SELECT * FROM chunks WHERE owner=? ORDER BY layer, idx", (owner,)).fetchall()
        return [ChunkRow(*r) for r in rows]

    def has_chunks(self, kind: str) -> bool:
        with self.lock:
            return self.db.execute("SELECT 1 FROM chunks WHERE kind=? LIMIT 1", (kind,)).fetchone() is not None

    def delete_chunks(self, rows: list[ChunkRow]) -> None:
        with self.lock, self.db:
            self.db.execute("BEGIN IMMEDIATE")
            self.db.executemany(
                "DELETE FROM chunks WHERE owner=? AND layer=? AND idx=? AND kind=?",
                [(r.owner, r.layer, r.idx, r.kind) for r in rows],
            )


def _owner(r: tuple) -> OwnerRow:
    return OwnerRow(r[0], r[1], r[2], r[3], r[4], _unpack(r[5]), json.loads(r[6]), r[7], r[8])


def open_manifest(path: Path, dirs: list[Path]) -> Manifest:
    """The store's manifest. Refuses directories listed otherwise than at creation (chunks are
    placed by directory position) and KV chunks in another layout than this hcache reads."""
    man = Manifest(path)
    try:
        known = man.get_meta("dirs")
        listed = "\n".join(map(str, dirs))
        if known is not None and known != listed:
            raise StorageError(
                f"storage directories differ from the ones this store was created with:\n{known}\n"
                "chunks are placed by directory position; start with the same list, in the same order"
            )
        man.set_meta("dirs", listed)
        layout = man.get_meta("kv_layout")
        if layout != KV_LAYOUT and (layout is not None or man.has_chunks(Kind.KV.value)):
            raise StorageError(
                f"{dirs[0]}: its KV chunks are laid out as {layout or '[2, 64, kv_dim] (K rows, then V rows)'}; "
                f"this hcache reads [64, 2, kv_dim] ({KV_LAYOUT}). Serve them with the hcache that wrote them, "
                "or start this one on empty directories"
            )
        man.set_meta("kv_layout", KV_LAYOUT)
    except BaseException:
        man.close()
        raise
    return man
