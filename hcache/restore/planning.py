"""What a session's restore reads and how: the layer kinds a new owner stores, what every
layer of its first `n` tokens can be read as (its context's chunks, then its own), the
source that reads them, and the plan the partitioner picks for them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hcache.model.base import DecoderModel
from hcache.restore.partitioner import PlannedRestore, partition, partition_stored, storage_kinds
from hcache.restore.plan import Method, Plan
from hcache.restore.profile import Geometry, Profile
from hcache.restore.sources import RowsSource, SharedSource, StoreSource
from hcache.restore.state import StateSource
from hcache.storage.errors import StorageError
from hcache.storage.fetched import Fetched
from hcache.storage.layout import Kind, Stored, encode_layer_kinds
from hcache.storage.store import ChunkStore

PLANS_KEPT = 256  # planned restores remembered by the planner


class NotStored(StorageError):
    """A forced restore method reads state the owner does not store."""


@dataclass(frozen=True)
class Lineage:
    """Whose chunks hold a session's state: its context's (`parent`) for the first `base`
    tokens, then its own."""

    owner: str
    kind: str  # "session" | "context"
    parent: str | None
    base: int
    kv_only: bool = False  # its KV is not what a forward gives (a blend): only KV restores it


def layer_kinds_for(
    policy: str, model: DecoderModel, profile: Profile, plan_tokens: int, kv_dtype: torch.dtype | None = None
) -> list[Stored]:
    """What every new owner stores per layer (KV stored in `kv_dtype`, default the model's)."""
    n = model.cfg.num_layers
    fixed = {"kv": {Kind.KV}, "hidden": {Kind.HIDDEN}, "both": {Kind.HIDDEN, Kind.KV}, "none": set()}
    if policy in fixed:
        return [frozenset(fixed[policy])] * n
    if policy != "auto":
        raise ValueError(f"store_kinds must be auto, kv, hidden, both or none, not {policy!r}")
    geom = Geometry.of(model.cfg, model.dtype.itemsize, (kv_dtype or model.dtype).itemsize)
    plan = partition(geom, profile, plan_tokens).plan
    return [frozenset({k}) if k else frozenset() for k in storage_kinds(plan)]


class RestorePlanner:
    def __init__(self, store: ChunkStore, model: DecoderModel, fingerprint: str, profile: Profile):
        self.store, self.model, self.fingerprint, self.profile = store, model, fingerprint, profile
        # plans by (tokens, stored kinds, read cap): every session on one context asks the same
        self._plans: dict[tuple[int, tuple[Stored, ...], float | None], tuple[Plan, float]] = {}

    def stored(self, who: Lineage, n: int) -> list[Stored]:
        """What every layer can be read as, for the first `n` tokens."""
        own = self.store.layer_kinds(self.store.owner_row(who.owner))
        if who.parent is None:
            return own
        par = self.store.layer_kinds(self.store.owner_row(who.parent))
        return par if n <= who.base else [a & b for a, b in zip(par, own, strict=True)]

    def source(self, who: Lineage, tokens: list[int], n: int, fetched: Fetched | None = None) -> StateSource:
        """Where the first `n` of `tokens` are read from: the context's chunks, then the
        owner's, then the rows `fetched` from the cluster past those (the first
        `fetched.tokens` of them)."""
        stored = n > who.base and (fetched is None or fetched.start > 0)
        own: StateSource | None = StoreSource(self.store, who.owner, self.fingerprint) if stored else None
        if fetched is not None:
            lo = who.base + fetched.start
            heads = (self.model.cfg.num_kv_heads, self.model.cfg.head_dim)
            rows = RowsSource(tokens[lo : lo + fetched.tokens], fetched, heads)
            own = SharedSource(own, rows, fetched.start) if fetched.start else rows
        if who.parent is None:
            assert own is not None
            return own
        return SharedSource(StoreSource(self.store, who.parent, self.fingerprint), own, who.base)

    def plan(
        self, who: Lineage, n: int, method: Method | None, cap_gbps: float | None, fetched: Fetched | None = None
    ) -> tuple[Plan, float | None]:
        """The plan for restoring `n` tokens, and its predicted ms (auto only). With rows
        `fetched` into memory, every layer reads them (KV where stored: a copy beats a projection)."""
        L = self.model.cfg.num_layers
        stored = self.stored(who, n)
        if who.kv_only:
            if method not in (None, Method.KV):
                raise NotStored(f"{who.kind} {who.owner} holds blended state, which only its stored KV restores")
            method = Method.KV
        if method == Method.RECOMPUTE:
            return Plan.uniform(L, method), None
        if method is not None:
            kind = Kind.HIDDEN if method == Method.HIDDEN else Kind.KV
            missing = [i for i, ks in enumerate(stored) if kind not in ks]
            if missing:
                raise NotStored(
                    f"{who.kind} {who.owner} does not store {method.value} state for layers {missing[:8]}"
                    f"{'...' if len(missing) > 8 else ''}; it stores per layer {encode_layer_kinds(list(stored))}"
                )
            return Plan.uniform(L, method), None
        if fetched is not None and all(stored):
            return Plan(tuple(Method.KV if Kind.KV in ks else Method.HIDDEN for ks in stored)), None
        key = (n, tuple(stored), cap_gbps)
        if (got := self._plans.get(key)) is not None:
            return got
        geom = Geometry.of(self.model.cfg, self.model.dtype.itemsize, self.store.kv_dtype.itemsize)
        res: PlannedRestore = partition_stored(geom, self.profile, n, stored, cap_gbps)
        if len(self._plans) >= PLANS_KEPT:
            self._plans.clear()
        self._plans[key] = res.plan, res.makespan_ms
        return res.plan, res.makespan_ms
