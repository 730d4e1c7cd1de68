"""Choose, per layer, how to restore: recompute (a prefix), hidden states or KV.

A pure function of (geometry, profile, tokens). The cost model is the restorer's
pipeline: one storage stream reads the H/KV layers in order while one compute
stream first recomputes the RE prefix, then handles each layer once its bytes
are in. For fixed counts the best order is Johnson's rule for a two-machine flow
shop, so searching every (n_RE, n_H, n_KV) split (L^2 cases) finds the optimum;
the tests check that against brute force over every per-layer assignment."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from hcache.restore.plan import Method, Plan
from hcache.restore.profile import Geometry, Profile
from hcache.storage.layout import CHUNK_TOKENS, Kind


@dataclass(frozen=True)
class LayerCost:
    io_ms: float
    compute_ms: float
    first_io_ms: float = 0.0  # paid once, by the first layer that reads: later requests are already in flight
    setup_ms: float = 0.0  # paid once on both streams before anything starts, by a plan that reads
    reading_factor: float = 1.0  # compute x this in a plan that reads (recompute beside the readers)


@dataclass
class PlannedRestore:
    plan: Plan
    tokens: int
    io_ms: float  # total storage time
    compute_ms: float  # total compute time (RE prefix included)
    makespan_ms: float  # predicted restore time with both streams overlapped
    bytes: int

    def to_json(self) -> dict:
        return {
            "counts": self.plan.counts(),
            "layers": [m.value for m in self.plan.methods],
            "plan": str(self.plan),
            "tokens": self.tokens,
            "predicted_ms": self.makespan_ms,
            "io_ms": self.io_ms,
            "compute_ms": self.compute_ms,
            "bytes": self.bytes,
        }


def storage_kinds(plan: Plan) -> list[Kind | None]:
    """What to store per layer so that `plan` can run later: nothing for the recomputed prefix."""
    return [m.kind for m in plan.methods]


def layer_costs(geom: Geometry, prof: Profile, n: int, cap_gbps: float | None = None) -> dict[Method, LayerCost]:
    gbps = min(prof.read_gbps, cap_gbps) if cap_gbps else prof.read_gbps
    if gbps <= 0:
        raise ValueError("read bandwidth must be positive")

    def io(nbytes: int) -> float:
        return nbytes / (gbps * 1e9) * 1e3

    def tax(nbytes: int) -> float:
        return prof.read_cpu_ms_per_mb * nbytes / 1e6

    h, kv = geom.h_bytes(n), geom.kv_bytes(n)
    return {
        Method.RECOMPUTE: LayerCost(0.0, prof.re_ms(n), reading_factor=prof.re_reading_factor(n)),
        Method.HIDDEN: LayerCost(io(h), prof.h_ms(n) + tax(h), prof.read_latency_ms, prof.read_setup_ms),
        Method.KV: LayerCost(io(kv), prof.kv_ms(n) + tax(kv), prof.read_latency_ms, prof.read_setup_ms),
    }


# the two streams after some layers: (io_done, compute_done, io_total, compute_total) in ms
Streams = tuple[float, float, float, float]


def simulate(methods: list[Method] | tuple[Method, ...], costs: dict[Method, LayerCost]) -> tuple[float, float, float]:
    """(io_ms, compute_ms, makespan_ms) of executing layers in index order on the two streams."""
    reads = any(m != Method.RECOMPUTE for m in methods)
    s = _start(methods, costs)
    for m in methods:
        s = _advance(s, m, costs, reads)
    return s[2], s[3], max(s[0], s[1])


def _start(methods: list[Method] | tuple[Method, ...], costs: dict[Method, LayerCost]) -> Streams:
    # the restorer plans and issues a plan's reads on the compute thread before anything else
    setup = max((costs[m].setup_ms for m in methods if m != Method.RECOMPUTE), default=0.0)
    return setup, setup, 0.0, setup


def _advance(s: Streams, m: Method, costs: dict[Method, LayerCost], reads: bool) -> Streams:
    """`s` after one more layer restored by `m` (`reads`: the plan reads any layer)."""
    io_done, compute_done, io_total, compute_total = s
    c = costs[m]
    if m == Method.RECOMPUTE:  # needs only token ids: starts as soon as compute is free
        ms = c.compute_ms * (c.reading_factor if reads else 1.0)
        return io_done, compute_done + ms, io_total, compute_total + ms
    first = c.first_io_ms if not io_total else 0.0
    io_done += first + c.io_ms
    compute_done = max(compute_done, io_done) + c.compute_ms
    return io_done, compute_done, io_total + first + c.io_ms, compute_total + c.compute_ms


def johnson_order(n_h: int, n_kv: int, costs: dict[Method, LayerCost]) -> list[Method]:
    """Jobs whose read is shorter than their compute first (shortest read first), then the
    rest (longest compute first): optimal for two stages in series."""
    jobs = [Method.HIDDEN] * n_h + [Method.KV] * n_kv
    front = sorted((j for j in jobs if costs[j].io_ms < costs[j].compute_ms), key=lambda j: costs[j].io_ms)
    back = sorted((j for j in jobs if costs[j].io_ms >= costs[j].compute_ms), key=lambda j: -costs[j].compute_ms)
    return front + back


def partition(
    geom: Geometry,
    prof: Profile,
    n_tokens: int,
    cap_gbps: float | None = None,
    methods: tuple[Method, ...] = (Method.RECOMPUTE, Method.HIDDEN, Method.KV),
) -> PlannedRestore:
    """The fastest plan using only `methods` (e.g. only what a session stored)."""
    if n_tokens < 1:
        raise ValueError("nothing to restore")
    L = geom.num_layers
    costs = layer_costs(geom, prof, n_tokens, cap_gbps)
    best: tuple[tuple[float, int], tuple[Method, ...], tuple[float, float, float]] | None = None
    re_range = range(L + 1) if Method.RECOMPUTE in methods else range(1)
    for n_re in re_range:
        for n_h in range(L - n_re + 1) if Method.HIDDEN in methods else range(1):
            n_kv = L - n_re - n_h
            if n_kv and Method.KV not in methods:
                continue
            order = (Method.RECOMPUTE,) * n_re + tuple(johnson_order(n_h, n_kv, costs))
            sim = simulate(order, costs)
            key = (sim[2], n_h * geom.hidden + n_kv * 2 * geom.kv_dim)  # ties: fewer bytes to read
            if best is None or key < best[0]:
                best = (key, order, sim)
    if best is None:
        raise ValueError(f"no plan can be made from {methods}")
    if prof.mix_margin and len(set(best[1])) > 1:
        singles = [(m,) * L for m in methods]
        sims = [(simulate(o, costs), o) for o in singles]
        sim, order = min(sims, key=lambda x: x[0][2])
        if sim[2] <= best[2][2] * (1 + prof.mix_margin):
            best = ((sim[2], 0), order, sim)
    plan = Plan(best[1])
    io_ms, compute_ms, makespan = best[2]
    nbytes = plan.bytes_to_read_geom(geom.hidden, geom.kv_dim, n_tokens, geom.elem_bytes, geom.kv_elem)
    return PlannedRestore(plan, n_tokens, io_ms, compute_ms, makespan, nbytes)


def lower_bound(geom: Geometry, prof: Profile, n_tokens: int, cap_gbps: float | None = None) -> float:
    """A time no plan can beat under the cost model: layers shared out between the methods in
    any fractions, each stream charged only its total, as if the two overlapped perfectly.
    Ratios of single-method times to it bound what any mix can gain on this machine. Each
    stream is linear in the shares, so the floor lies at a single method or where the two
    streams balance on the line between two methods."""
    costs = layer_costs(geom, prof, n_tokens, cap_gbps)
    L = geom.num_layers
    re = costs[Method.RECOMPUTE]

    def streams(share: dict[Method, float]) -> tuple[float, float]:
        io = sum(k * costs[m].io_ms for m, k in share.items())
        compute = sum(k * costs[m].compute_ms for m, k in share.items())
        if any(k > 0 for m, k in share.items() if m != Method.RECOMPUTE):  # a plan that reads
            io += costs[Method.HIDDEN].first_io_ms
            compute += costs[Method.HIDDEN].setup_ms + share.get(Method.RECOMPUTE, 0.0) * re.compute_ms * (
                re.reading_factor - 1
            )
        return io, compute

    best = min(max(streams({m: float(L)})) for m in costs)
    for a, b in itertools.combinations(costs, 2):
        lo, hi = 1e-9, L - 1e-9  # both methods present: the reading costs are paid
        d_lo, d_hi = (io - c for io, c in (streams({a: lo, b: L - lo}), streams({a: hi, b: L - hi})))
        if d_lo * d_hi < 0:
            t = lo + (hi - lo) * d_lo / (d_lo - d_hi)
            best = min(best, max(streams({a: t, b: L - t})))
    return best


def partition_stored(
    geom: Geometry, prof: Profile, n_tokens: int, stored: list[frozenset[Kind]], cap_gbps: float | None = None
) -> PlannedRestore:
    """The fastest plan that reads only what each layer stored: any recompute prefix, then per
    layer its stored kind (the cheaper one in the pipeline where it kept both). A layer that
    stored nothing can only be recomputed, so the prefix covers it."""
    if n_tokens < 1:
        raise ValueError("nothing to restore")
    if len(stored) != geom.num_layers:
        raise ValueError(f"{len(stored)} stored layers for a {geom.num_layers}-layer model")
    costs = layer_costs(geom, prof, n_tokens, cap_gbps)
    kind_method = {Kind.HIDDEN: Method.HIDDEN, Kind.KV: Method.KV}
    first_re = max((i + 1 for i, ks in enumerate(stored) if not ks), default=0)
    best: tuple[tuple[float, int], list[Method], tuple[float, float, float]] | None = None
    for n_re in range(first_re, geom.num_layers + 1):
        # every layer past the prefix reads (`first_re` covers those that stored nothing);
        # the pipeline is carried along a layer at a time, not simulated again per choice
        order = [Method.RECOMPUTE] * n_re
        reads = n_re < geom.num_layers
        s = _start([kind_method[k] for k in stored[n_re]] if reads else [], costs)
        for m in order:
            s = _advance(s, m, costs, reads)
        for ks in stored[n_re:]:
            # one layer's choice: the one that leaves the pipeline earliest from here
            options = [(m, _advance(s, m, costs, True)) for m in (kind_method[k] for k in sorted(ks))]
            m, s = min(options, key=lambda o: max(o[1][0], o[1][1]))
            order.append(m)
        sim = (s[2], s[3], max(s[0], s[1]))
        key = (sim[2], n_re)
        if best is None or key < best[0]:
            best = (key, order, sim)
    assert best is not None
    plan = Plan(tuple(best[1]))
    nbytes = plan.bytes_to_read_geom(geom.hidden, geom.kv_dim, n_tokens, geom.elem_bytes, geom.kv_elem)
    return PlannedRestore(plan, n_tokens, *best[2], nbytes)


@dataclass
class TokenwisePlan:
    """KVPR-style split inside every layer: tokens before `split` from H, the rest from KV."""

    split: int
    tokens: int
    io_ms: float
    compute_ms: float
    makespan_ms: float
    bytes: int


def partition_tokenwise(geom: Geometry, prof: Profile, n_tokens: int, cap_gbps: float | None = None) -> TokenwisePlan:
    """The best chunk-aligned split under the same pipeline model (every layer alike)."""
    gbps = min(prof.read_gbps, cap_gbps) if cap_gbps else prof.read_gbps
    best: TokenwisePlan | None = None
    for split in sorted({*range(0, n_tokens, CHUNK_TOKENS), n_tokens}):
        h, kv = split, n_tokens - split
        nbytes = geom.h_bytes(h) + geom.kv_bytes(kv)
        io = nbytes / (gbps * 1e9) * 1e3
        compute = prof.h_ms(h) + prof.kv_ms(kv) + prof.read_cpu_ms_per_mb * nbytes / 1e6
        costs = {Method.HIDDEN: LayerCost(io, compute, prof.read_latency_ms, prof.read_setup_ms)}
        io_ms, compute_ms, makespan = simulate([Method.HIDDEN] * geom.num_layers, costs)
        if best is None or makespan < best.makespan_ms:
            best = TokenwisePlan(split, n_tokens, io_ms, compute_ms, makespan, nbytes * geom.num_layers)
    assert best is not None
    return best
