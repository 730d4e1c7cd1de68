"""Synthetic rows whose values encode (layer, position, feature), so any misplaced,
stale or corrupt row is visible when read back."""

from __future__ import annotations

from pathlib import Path

import torch

from hcache.config import StorageConfig
from hcache.model.geometry import ModelConfig
from hcache.storage.layout import Kind, stored
from hcache.storage.manifest import ChunkRow
from hcache.storage.store import ChunkStore

GEOM = ModelConfig(
    arch="llama",
    vocab_size=100,
    hidden_size=64,
    intermediate_size=128,
    num_layers=5,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position=4096,
)
KINDS = [None, Kind.HIDDEN, Kind.KV, Kind.HIDDEN, Kind.KV]


def open_store(dirs: list[Path], **kw) -> ChunkStore:
    return ChunkStore(StorageConfig([str(d) for d in dirs], **kw), GEOM, torch.float32)


def flip_byte(st: ChunkStore, row: ChunkRow) -> None:
    """Corrupt the stored chunk `row`: one byte of its slot, inverted on disk."""
    path = st.dirs[row.dir] / f"{row.slab}.slab"
    with open(path, "r+b") as f:
        f.seek(row.slot * st.placement.slab(row.dir, row.slab).slot_bytes + 100)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))


def dirs_in(tmp_path: Path, n: int = 3) -> list[Path]:
    out = [tmp_path / f"d{i}" for i in range(n)]
    for d in out:
        d.mkdir()
    return out


def h_rows(layer: int, start: int, n: int, salt: float = 0.0) -> torch.Tensor:
    pos = torch.arange(start, start + n, dtype=torch.float32)[:, None]
    return layer * 10000 + pos + torch.arange(GEOM.hidden_size) * 1e-3 + salt


def kv_rows(layer: int, start: int, n: int, salt: float = 0.0) -> torch.Tensor:
    pos = torch.arange(start, start + n, dtype=torch.float32)[:, None, None]
    base = layer * 10000 + pos + torch.arange(GEOM.kv_dim) * 1e-3 + salt
    return torch.cat([base, -base], dim=1)  # [n, 2, kv_dim]: K then V


def save(store: ChunkStore, owner: str, start: int, n: int, kinds=KINDS, salt: float = 0.0) -> None:
    store.save_rows(
        owner,
        start,
        {i: h_rows(i, start, n, salt) for i, k in enumerate(kinds) if Kind.HIDDEN in stored(k)},
        {i: kv_rows(i, start, n, salt) for i, k in enumerate(kinds) if Kind.KV in stored(k)},
    )


def expected(layer: int, kind: Kind, n: int, salt_from: int | None = None, salt: float = 0.0) -> torch.Tensor:
    """What a layer reads back as: H `[n, hidden]`, KV `[n, 2, kv_dim]`; rows from `salt_from` on carry `salt`."""
    rows = h_rows(layer, 0, n) if kind == Kind.HIDDEN else kv_rows(layer, 0, n)
    if salt_from is not None:
        rows[salt_from:] += salt if kind == Kind.HIDDEN else torch.tensor([salt, -salt])[:, None]
    return rows


def check_all(store: ChunkStore, owner: str, n: int, kinds=KINDS, **kw) -> None:
    r = store.reader(owner, [i for i, k in enumerate(kinds) if k is not None])
    for i, k in enumerate(kinds):
        if k is not None:
            got = r.get(i)
            assert got.shape[0] == n
            assert torch.equal(got, expected(i, k, n, **kw)), f"layer {i} differs"
