"""`hcache fsck`: verify every chunk's checksum, reconcile slots with the manifest,
and with `repair` free orphans, drop unusable rows and, after naming them, owners
whose state cannot be recovered. Needs no model: slab names carry the geometry."""

from __future__ import annotations

import fcntl
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from hcache.memory import aligned_buffer
from hcache.storage.dirs import ensure_dirs
from hcache.storage.errors import StoreLocked
from hcache.storage.layout import CHUNK_TOKENS, checksum, decode_layer_kinds, num_chunks, parse_slab
from hcache.storage.manifest import ChunkRow, Manifest
from hcache.storage.slab import SlabFile
from hcache.storage.store import LOCK, MANIFEST

READ_BYTES = 8 << 20


@dataclass
class FsckReport:
    owners: int = 0
    chunks: int = 0
    bad_chunks: list[tuple[ChunkRow, str]] = field(default_factory=list)
    stale_chunks: list[ChunkRow] = field(default_factory=list)
    gaps: list[str] = field(default_factory=list)  # stored layers missing chunks: restored by recompute
    bad_owners: list[tuple[str, str]] = field(default_factory=list)
    orphan_slots: int = 0  # unreferenced: free for reuse; trailing ones are cut off by repair
    orphan_bytes: int = 0
    actions: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (self.bad_chunks or self.stale_chunks or self.gaps or self.bad_owners)

    def lines(self) -> list[str]:
        out = [f"{self.owners} owners, {self.chunks} chunks checked"]
        out += [f"bad chunk: owner {r.owner} layer {r.layer} chunk {r.idx} ({reason})" for r, reason in self.bad_chunks]
        out += [
            f"stale chunk past durable tokens: owner {r.owner} layer {r.layer} chunk {r.idx}" for r in self.stale_chunks
        ]
        out += [f"gap: {g}" for g in self.gaps]
        out += [f"unrecoverable owner {o}: {why}" for o, why in self.bad_owners]
        if self.orphan_slots:
            out.append(f"{self.orphan_slots} unreferenced (free) slots, {self.orphan_bytes} bytes")
        out += self.actions
        out.append("clean" if self.clean else ("repaired" if self.actions else "problems found (run with --repair)"))
        return out


def fsck(dirs: list[str], repair: bool = False) -> FsckReport:
    # fsck verifies an existing store, so a missing directory is an error, never created
    paths = [p.resolve() for p in ensure_dirs(dirs, create=False)]
    if not (paths[0] / MANIFEST).exists():
        raise FileNotFoundError(f"no manifest in {paths[0]}: not an hcache store")
    lock = os.open(paths[0] / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock)
        raise StoreLocked(f"{paths[0]} is in use by a running hcache; stop it first") from None
    man = Manifest(paths[0] / MANIFEST)
    try:
        return _check(man, paths, repair)
    finally:
        man.close()
        os.close(lock)


def _check(man: Manifest, paths: list[Path], repair: bool) -> FsckReport:
    rep = FsckReport()
    known = man.get_meta("dirs")
    if known is not None and known != "\n".join(map(str, paths)):
        raise ValueError(f"these directories are not the store's; it was created with:\n{known}")
    owners = {o.owner: o for o in man.owners()}
    rep.owners = len(owners)
    for o in owners.values():
        if len(o.tokens) != o.num_tokens:
            rep.bad_owners.append((o.owner, f"{len(o.tokens)} token ids for {o.num_tokens} durable tokens"))
    rows = man.chunks()
    rep.chunks = len(rows)
    live: list[ChunkRow] = []
    for r in rows:
        o = owners.get(r.owner)
        if o is None or r.idx * CHUNK_TOKENS >= o.num_tokens:
            rep.stale_chunks.append(r)
        else:
            live.append(r)
    by_slab: dict[tuple[int, str], list[ChunkRow]] = defaultdict(list)
    for r in live:
        if r.dir >= len(paths):
            rep.bad_chunks.append((r, f"directory #{r.dir} is not configured"))
        else:
            by_slab[(r.dir, r.slab)].append(r)
    slab_files = {(d, p.name[: -len(".slab")]) for d, path in enumerate(paths) for p in path.glob("*.slab")}
    for key in sorted(slab_files | set(by_slab)):
        _check_slab(paths, key, by_slab.get(key, []), rep, repair)
    bad = {(r.owner, r.layer, r.idx, r.kind) for r, _ in rep.bad_chunks}
    have = {(r.owner, r.layer, r.idx, r.kind): r for r in live}
    for o in owners.values():
        for layer, kind in ((la, k) for la, ks in enumerate(decode_layer_kinds(o.layer_kinds)) for k in ks):
            for idx in range(num_chunks(o.num_tokens)):
                r = have.get((o.owner, layer, idx, kind.value))
                want = min(CHUNK_TOKENS, o.num_tokens - idx * CHUNK_TOKENS)
                if (r is None or r.ntokens < want) and (o.owner, layer, idx, kind.value) not in bad:
                    rep.gaps.append(f"owner {o.owner} layer {layer} chunk {idx} missing (recompute covers it)")
    if repair:
        _repair(man, rep)
    return rep


def _check_slab(paths: list[Path], key: tuple[int, str], rows: list[ChunkRow], rep: FsckReport, repair: bool) -> None:
    d, name = key
    _, nbytes, slot_bytes = parse_slab(name)
    path = paths[d] / f"{name}.slab"
    if not path.exists():
        rep.bad_chunks += [(r, f"slab file {path} missing") for r in rows]
        return
    slab = SlabFile(path, slot_bytes)
    try:
        n_slots = slab.num_slots
        want = {r.slot: r for r in rows}
        buf = aligned_buffer(READ_BYTES)
        per_read = max(1, READ_BYTES // slot_bytes)
        for first in range(0, n_slots, per_read):
            count = min(per_read, n_slots - first)
            if not any(s in want for s in range(first, first + count)):
                continue
            got = slab.read(first, count, buf)
            for s in range(first, first + count):
                r = want.get(s)
                if r is not None and checksum(got[(s - first) * slot_bytes :][:nbytes]) != r.checksum:
                    rep.bad_chunks.append((r, "checksum mismatch"))
        rep.bad_chunks += [(r, f"slot {r.slot} past the end of {path}") for r in rows if r.slot >= n_slots]
        orphans = n_slots - len([s for s in want if s < n_slots])
        rep.orphan_slots += orphans
        rep.orphan_bytes += orphans * slot_bytes
        keep = max(want) + 1 if want else 0
        if repair and n_slots > keep:
            slab.truncate(keep)
            rep.actions.append(f"truncated {path} from {n_slots} to {keep} slots")
    finally:
        slab.close()


def _repair(man: Manifest, rep: FsckReport) -> None:
    drop = [r for r, _ in rep.bad_chunks] + rep.stale_chunks
    if drop:
        man.delete_chunks(drop)
        rep.actions.append(f"removed {len(drop)} unusable chunk rows (those layers restore by recompute)")
    for owner, why in rep.bad_owners:
        man.delete_owner(owner)
        rep.actions.append(f"dropped owner {owner}: {why}")
