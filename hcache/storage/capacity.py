"""The store's capacity policy, as pure functions: how full it is against its quotas, how
much a release must free, and in which order an owner's stored layers are given up. The
chunks are only an accelerator (token ids rebuild them exactly), so giving them up loses
restore speed, never state."""

from __future__ import annotations

from dataclasses import dataclass

from hcache.storage.layout import Kind, Stored


@dataclass(frozen=True)
class Space:
    capacity: int  # bytes the store may hold: quotas, or what the filesystems have
    used: int  # bytes new chunks cannot take (slots in use or reserved)

    @property
    def free(self) -> int:
        return max(0, self.capacity - self.used)

    def to_release(self, low: float, high: float) -> int:
        """Bytes to free: none while the free fraction is at least `low`, else up to `high`."""
        if self.capacity <= 0 or self.free >= low * self.capacity:
            return 0
        return int(max(high, low) * self.capacity) - self.free


def dir_quota(quota_bytes: int, max_bytes: int, dirs: int) -> int:
    """Each directory's quota: `quota_bytes`, and a total `max_bytes` split evenly (0: none)."""
    return min((q for q in (quota_bytes, max_bytes // dirs) if q > 0), default=0)


def release_order(kinds: list[Stored]) -> list[tuple[int, Kind]]:
    """The order an owner's stored (layer, kind) pairs are given up, cheapest loss first.
    H where the layer also keeps KV (the layer is still read, as a copy); then layers from the
    bottom, H before KV: a layer that stores nothing must be recomputed with every layer below
    it, so giving up layer l only adds layer l to the recompute prefix when the ones below are
    already gone, and the layers above stay readable."""
    order = [(layer, Kind.HIDDEN) for layer, ks in enumerate(kinds) if ks == frozenset(Kind)]
    for layer, ks in enumerate(kinds):
        for kind in (Kind.HIDDEN, Kind.KV):
            if kind in ks and (layer, kind) not in order:
                order.append((layer, kind))
    return order


def to_release(held: dict[tuple[int, Kind], int], nbytes: int) -> set[tuple[int, Kind]]:
    """The first pairs of `held` (bytes per (layer, kind), in `release_order`) whose bytes
    reach `nbytes`; pairs holding nothing are skipped: giving one up frees nothing and
    demotes the layer for good."""
    drop: set[tuple[int, Kind]] = set()
    freed = 0
    for pair, size in held.items():
        if freed >= nbytes:
            break
        if size:
            drop.add(pair)
            freed += size
    return drop
