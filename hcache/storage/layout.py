"""Chunk geometry and placement. A chunk holds 64 tokens of one layer in one
representation; chunk c of layer l lives in directory (l + c) mod N, so one
layer's chunks spread over every device."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

import torch
import xxhash

from hcache.model.geometry import ModelConfig

CHUNK_TOKENS = 64
ALIGN = 4096


class Kind(str, Enum):
    HIDDEN = "h"
    KV = "kv"

    @property
    def label(self) -> str:
        """H or KV: table columns, metric labels."""
        return "H" if self == Kind.HIDDEN else "KV"

    @property
    def letter(self) -> str:
        """H or K: a layer's letter in the manifest and in restore plans."""
        return self.label[0]


Stored = frozenset[Kind]  # what one layer keeps: nothing (recompute), H, KV, or both
StoredSpec = Kind | None | set[Kind] | frozenset[Kind]
# one letter per layer in the manifest: - (nothing), a kind's letter, B (both)
LAYER_CODES: dict[Stored, str] = {
    frozenset(): "-",
    **{frozenset({k}): k.letter for k in Kind},
    frozenset(Kind): "B",
}


def stored(spec: StoredSpec) -> Stored:
    if spec is None:
        return frozenset()
    return frozenset({spec}) if isinstance(spec, Kind) else frozenset(spec)


def encode_layer_kinds(kinds: list[StoredSpec]) -> str:
    return "".join(LAYER_CODES[stored(k)] for k in kinds)


def decode_layer_kinds(code: str) -> list[Stored]:
    return list(_decoded(code))


@functools.cache
def _decoded(code: str) -> tuple[Stored, ...]:  # a store's owners share a few codes
    back = {v: k for k, v in LAYER_CODES.items()}
    return tuple(back[c] for c in code)


LayerKinds = tuple[tuple[int, Stored], ...]  # ((layer, kinds), ...) by layer: hashable


def canonical(layers: Mapping[int, StoredSpec]) -> LayerKinds:
    return tuple(sorted((layer, stored(k)) for layer, k in layers.items()))


@functools.lru_cache(maxsize=1024)
def union_of(codes: frozenset[str]) -> LayerKinds:
    """What a batch of owners with these layer-kinds codes stores per layer (every step of
    a decode batch asks)."""
    union: dict[int, Stored] = {}
    for code in codes:
        for layer, ks in enumerate(_decoded(code)):
            union[layer] = union.get(layer, frozenset()) | ks
    return canonical(union)


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


# A KV chunk holds 64 token rows, each the token's K then its V (`[64, 2, kv_dim]`), as the
# staging ring and DESIGN.md lay KV out. Stores written with K rows then V rows
# (`[2, 64, kv_dim]`) cannot be read as this: the manifest records the layout.
KV_LAYOUT = "tokens,2,kv_dim"


@dataclass(frozen=True)
class ChunkShape:
    """Elements per token row and the chunk's tensor shape for one kind. Both kinds are
    token-major, so a run of a layer's chunks in consecutive slots is one run of token rows
    in memory: it is read in place as one segment, and a tail's valid rows come first."""

    kind: Kind
    width: int  # elements per token (hidden, or kv_dim for each of K and V)
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return (CHUNK_TOKENS, self.width) if self.kind == Kind.HIDDEN else (CHUNK_TOKENS, 2, self.width)

    @functools.cached_property  # asked once per chunk read
    def nbytes(self) -> int:
        n = CHUNK_TOKENS * self.width * (1 if self.kind == Kind.HIDDEN else 2)
        return n * (torch.finfo(self.dtype).bits // 8)

    @property
    def slot_bytes(self) -> int:
        return align_up(self.nbytes)

    @property
    def slab(self) -> str:
        """Slab file stem: chunks of equal size share a slab; the name alone gives fsck the geometry."""
        return slab_name(self.kind, self.nbytes)


def slab_name(kind: Kind, nbytes: int) -> str:
    return f"{kind.value}.{nbytes}"


def parse_slab(name: str) -> tuple[Kind, int, int]:
    """kind, chunk bytes, slot bytes."""
    kind, nbytes = name.split(".")
    return Kind(kind), int(nbytes), align_up(int(nbytes))


def chunk_shapes(cfg: ModelConfig, dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> dict[Kind, ChunkShape]:
    """H chunks in the activations' dtype; KV chunks in the resident KV's (default: the same)."""
    return {
        Kind.HIDDEN: ChunkShape(Kind.HIDDEN, cfg.hidden_size, dtype),
        Kind.KV: ChunkShape(Kind.KV, cfg.kv_dim, kv_dtype or dtype),
    }


def home_dir(layer: int, chunk: int, n_dirs: int) -> int:
    return (layer + chunk) % n_dirs


def num_chunks(n_tokens: int) -> int:
    return (n_tokens + CHUNK_TOKENS - 1) // CHUNK_TOKENS


def checksum(data: memoryview | bytes) -> int:
    """xxh3-64 of a chunk's bytes (xxh3 for speed), as SQLite's signed 64-bit integer."""
    v = xxhash.xxh3_64(data).intdigest()
    return v - (1 << 64) if v >= 1 << 63 else v


def digests(data: memoryview, at: int, stride: int, count: int, nbytes: int) -> list[int]:
    """xxh3-64 of `count` chunks of `nbytes` at `data[at + m * stride]` (unsigned: compare
    with `checksum & UNSIGNED`), for a run of chunks read in place. The hasher object, not
    the one-shot function: it lets go of the GIL for large chunks, so reader threads keep
    submitting while one is hashed."""
    h = xxhash.xxh3_64
    return [h(data[x : x + nbytes]).intdigest() for x in range(at, at + count * stride, stride)]


UNSIGNED = (1 << 64) - 1  # a stored (signed) checksum's bits as `digests` gives them
