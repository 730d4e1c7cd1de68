"""Session chunks in the cluster: a second, shared tier behind the local store. A chunk is
one layer's rows of one kind for 64 tokens of an owner, under the owner's hash tag so that
one MGET brings a layer's chunks from one server:

  hc:{id}:c:{layer}:{kind}:{index}   header + the chunk's valid rows, with a TTL

The header carries the rows' checksum and a hash of the owner's token ids up to the chunk's
last row. H and KV of a token depend on every token before it, so a chunk is used only for
the exact token prefix it was computed from: a chunk left by a rewritten or failed turn, or
cut short, or flipped in transit, reads as missing. Keys have a TTL, so Redis's
`volatile-lru` evicts chunks under memory pressure and never the records (which have none):
a missing chunk costs recompute, never correctness."""

from __future__ import annotations

import secrets
import struct
import time
from typing import Any

import xxhash

from hcache.storage.catalogue import pack_tokens
from hcache.storage.layout import CHUNK_TOKENS, Kind, checksum

HEADER = struct.Struct("<qqI")  # checksum of the rows, hash of the token prefix, rows


# GETRANGE of every key server-side: a pipeline of thousands of small commands costs more
# in redis-py's cluster pipeline than the fetch's own MGETs
HEADERS_LUA = """
local out = {}
for i, k in ipairs(KEYS) do out[i] = redis.call('GETRANGE', k, 0, ARGV[1]) end
return out
"""


def chunk_key(owner: str, layer: int, kind: Kind, idx: int) -> str:
    return f"hc:{{{owner}}}:c:{layer}:{kind.value}:{idx}"


def prefix_hash(tokens: list[int]) -> int:
    """xxh3-64 of the token ids as int32, signed like `checksum`."""
    v = xxhash.xxh3_64_intdigest(pack_tokens(tokens))
    return v - (1 << 64) if v >= 1 << 63 else v


def chunk_rows(n_tokens: int, idx: int) -> int:
    """Valid rows of chunk `idx` of an owner with `n_tokens` tokens."""
    return max(0, min(CHUNK_TOKENS, n_tokens - idx * CHUNK_TOKENS))


def pack(rows: bytes | memoryview, n_rows: int, prefix: int) -> bytes:
    """The value of a chunk holding `n_rows` rows computed from the token prefix whose
    `prefix_hash` is `prefix` (the owner's tokens up to and including the chunk's last row;
    one hash serves every layer's chunk of those tokens)."""
    return HEADER.pack(checksum(rows), prefix, n_rows) + bytes(rows)


def unpack(value: bytes | None, prefix: int, n_rows: int, row_bytes: int) -> memoryview | None:
    """The rows if `value` is the chunk of exactly the token prefix hashed to `prefix`, intact;
    else None."""
    if value is None or len(value) != HEADER.size + n_rows * row_bytes:
        return None
    crc, pre, rows = HEADER.unpack_from(value)
    body = memoryview(value)[HEADER.size :]
    if rows != n_rows or pre != prefix or crc != checksum(body):
        return None
    return body


def read_header(head: bytes | None) -> tuple[int, int, int] | None:
    """(checksum, prefix hash, rows) from a value's first `HEADER.size` bytes; None for none."""
    return HEADER.unpack(head) if head is not None and len(head) == HEADER.size else None


class ChunkTier:
    """Chunk bytes in Redis (a Redis Cluster or one server), through a redis-py client."""

    def __init__(self, client: Any, url: str, ttl_s: int = 86_400):
        self.r, self.url, self.ttl_s = client, url, ttl_s
        self._headers: Any = None

    def put(self, items: list[tuple[str, bytes]]) -> None:
        """One pipeline of SET EX: on a cluster it groups the commands per server."""
        pipe = self.r.pipeline(transaction=False)
        for k, v in items:
            pipe.set(k, v, ex=self.ttl_s)
        pipe.execute()

    def get(self, keys: list[str]) -> list[bytes | None]:
        """Keys of one owner (one hash slot): one MGET."""
        return list(self.r.mget(keys)) if keys else []

    def drop(self, keys: list[str]) -> None:
        """Delete chunks found damaged: a later fetch stops before them and recomputes."""
        pipe = self.r.pipeline(transaction=False)
        for k in keys:
            pipe.delete(k)
        pipe.execute()

    def headers(self, keys: list[str]) -> list[bytes]:
        """The first `HEADER.size` bytes of each key's value (b"" where there is none), to see
        what a fetch would find: keys of one owner (one hash slot), one script call."""
        if not keys:
            return []
        if self._headers is None:
            self._headers = self.r.register_script(HEADERS_LUA)
        return list(self._headers(keys=keys, args=[HEADER.size - 1]))

    def measure_gbps(self, nbytes: int = 4 << 20, rounds: int = 3) -> float:
        """Read bandwidth of one large GET (the best of `rounds`), as a restore's MGET of a
        layer's chunks sees it; the probe key expires by itself."""
        key = f"hc:{{probe-{secrets.token_hex(4)}}}:bw"
        self.r.set(key, secrets.token_bytes(1024) * (nbytes // 1024), ex=60)
        try:
            best = float("inf")
            for _ in range(rounds):
                t0 = time.perf_counter()
                self.r.get(key)
                best = min(best, time.perf_counter() - t0)
        finally:
            self.r.delete(key)
        return nbytes / best / 1e9
