"""Token-prefix hashes: one per 64-token chunk boundary of a conversation, chained, so the
hash at a boundary names every token before it. A resent conversation finds the longest
stored one it extends by looking its own boundaries' hashes up in the manifest. The
namespace (the tenant) is hashed in first, so prefixes never match across namespaces."""

from __future__ import annotations

import hashlib
from array import array

from hcache.storage.layout import CHUNK_TOKENS


def prefix_hashes(tokens: list[int], namespace: str) -> list[bytes]:
    """`out[k]` hashes the namespace and `tokens[: (k + 1) * 64]`; one per whole chunk."""
    h = hashlib.blake2b(namespace.encode(), digest_size=16, person=b"hcache-prefix").digest()
    out = []
    for end in range(CHUNK_TOKENS, len(tokens) + 1, CHUNK_TOKENS):
        h = hashlib.blake2b(h + array("i", tokens[end - CHUNK_TOKENS : end]).tobytes(), digest_size=16).digest()
        out.append(h)
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
