"""The partitioner against brute force over a simulated pipeline, against the paper's
closed forms on multi-head two-method cases, and on the cases it must get right."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from hcache.model.loader import DEFAULT_GEOMETRY
from hcache.restore.partitioner import layer_costs, lower_bound, partition, simulate
from hcache.restore.plan import Method
from hcache.restore.profile import Geometry, Profile

MHA_7B = Geometry(num_layers=32, hidden=4096, kv_dim=4096, q_dim=4096, ffn=11008, elem_bytes=2)
SMOL = Geometry(num_layers=30, hidden=576, kv_dim=192, q_dim=576, ffn=1536, elem_bytes=2)


def brute_force(geom: Geometry, prof: Profile, n: int) -> float:
    costs = layer_costs(geom, prof, n)
    best = math.inf
    L = geom.num_layers
    for n_re in range(L + 1):
        for rest in itertools.product((Method.HIDDEN, Method.KV), repeat=L - n_re):
            best = min(best, simulate((Method.RECOMPUTE,) * n_re + rest, costs)[2])
    return best


def random_profile(rng: random.Random) -> Profile:
    return Profile(
        "random",
        read_gbps=rng.uniform(0.1, 20),
        read_latency_ms=rng.uniform(0, 2),
        h_ms_per_ktok=rng.uniform(0.01, 20),
        kv_ms_per_ktok=rng.uniform(0.001, 2),
        h_ms_fixed=rng.choice([0.0, rng.uniform(0, 3)]),
        kv_ms_fixed=rng.choice([0.0, rng.uniform(0, 1)]),
        read_cpu_ms_per_mb=rng.choice([0.0, rng.uniform(0, 1)]),
        read_setup_ms=rng.choice([0.0, rng.uniform(0, 30)]),
        re_points={256: rng.uniform(0.1, 10), 4096: rng.uniform(10, 400)},
        re_reading=rng.choice([{}, {1024: rng.uniform(1, 1.5), 4096: rng.uniform(1, 1.5)}]),
    )


def test_matches_brute_force_over_every_assignment() -> None:
    rng = random.Random(0)
    for _ in range(40):
        geom = Geometry(6, rng.choice([64, 256]), rng.choice([16, 64, 256]), 64, 256, 2)
        prof = random_profile(rng)
        n = rng.choice([1, 64, 1000, 8000])
        got = partition(geom, prof, n)
        assert got.makespan_ms == pytest.approx(brute_force(geom, prof, n), rel=1e-9)
        assert got.makespan_ms == pytest.approx(simulate(got.plan.methods, layer_costs(geom, prof, n))[2])


def _two_method_profile(io_h: float, io_kv: float, c_h: float, c_tok: float) -> Profile:
    """Per-layer times for 1000 tokens, as the paper's symbols (ms)."""
    gbps = MHA_7B.h_bytes(1000) / (io_h * 1e-3) / 1e9
    assert MHA_7B.kv_bytes(1000) / (gbps * 1e9) * 1e3 == pytest.approx(io_kv)
    return Profile("paper", gbps, 0.0, c_h, 0.0, {1000: c_tok, 2000: 2 * c_tok})


@pytest.mark.parametrize("c_h", [12.0, 20.0, 35.0])
def test_paper_closed_form_h_with_kv(c_h: float) -> None:
    """C_H > IO_H: L_H = ceil(N * IO_KV / (IO_KV + C_H - IO_H)), the rest KV."""
    io_h, io_kv = 8.0, 16.0  # MHA: KV is twice H
    prof = _two_method_profile(io_h, io_kv, c_h, c_tok=1e6)  # recompute out of the question
    got = partition(MHA_7B, prof, 1000, methods=(Method.HIDDEN, Method.KV))
    closed = math.ceil(MHA_7B.num_layers * io_kv / (io_kv + c_h - io_h))
    assert abs(got.plan.counts()["hidden"] - closed) <= 1
    assert got.plan.counts()["hidden"] + got.plan.counts()["kv"] == 32


@pytest.mark.parametrize("c_tok", [40.0, 80.0, 150.0])
def test_paper_closed_form_h_with_recompute(c_tok: float) -> None:
    """C_H <= IO_H: L_H = ceil(N * C_tok / (C_tok + IO_H - C_H)), the rest recomputed."""
    io_h, c_h = 30.0, 5.0
    prof = _two_method_profile(io_h, 2 * io_h, c_h, c_tok)
    got = partition(MHA_7B, prof, 1000, methods=(Method.RECOMPUTE, Method.HIDDEN))
    closed = math.ceil(MHA_7B.num_layers * c_tok / (c_tok + io_h - c_h))
    assert abs(got.plan.counts()["hidden"] - closed) <= 1


def test_three_way_mix_found_where_it_wins() -> None:
    prof = Profile.hypothetical(MHA_7B, tflops=312, io_gbps=8)
    n = 2048
    got = partition(MHA_7B, prof, n)
    assert all(got.plan.counts()[m] > 0 for m in ("recompute", "hidden", "kv"))
    for pair in itertools.combinations(Method, 2):  # strictly better than any one or two methods
        assert got.makespan_ms < partition(MHA_7B, prof, n, methods=pair).makespan_ms


def test_grouped_query_hidden_states_are_dominated() -> None:
    """SmolLM2: H (576 wide) is larger than K+V (384) and costs compute: never chosen."""
    for tflops, gbps in [(0.2, 1.0), (10, 0.5), (312, 8)]:
        for n in (64, 1024, 16384):
            assert partition(SMOL, Profile.hypothetical(SMOL, tflops, gbps), n).plan.counts()["hidden"] == 0


def test_tiny_context_prefers_recompute() -> None:
    prof = Profile.hypothetical(MHA_7B, tflops=312, io_gbps=8, latency_ms=1.0)  # a read costs more than 32 layers
    assert partition(MHA_7B, prof, 8).plan.counts()["recompute"] == 32


def test_bandwidth_cap_moves_work_to_compute() -> None:
    prof = Profile.hypothetical(MHA_7B, tflops=312, io_gbps=24)
    fast = partition(MHA_7B, prof, 4096)
    capped = partition(MHA_7B, prof, 4096, cap_gbps=2)
    assert capped.makespan_ms > fast.makespan_ms
    assert capped.bytes < fast.bytes
    assert capped.plan.counts()["recompute"] > fast.plan.counts()["recompute"]


def test_recompute_fit_is_quadratic_in_context() -> None:
    prof = Profile("p", 1, 0, 1, 1, {1000: 10.0, 2000: 24.0, 4000: 64.0})  # 0.008n + 2e-6 n^2
    assert prof.re_ms(8000) == pytest.approx(0.008 * 8000 + 2e-6 * 8000**2, rel=1e-6)


def test_recompute_fit_keeps_a_fixed_part() -> None:
    """A GPU runs a small model's layer in launch time whatever the length (measured on an H100:
    about 1 ms per layer from 256 to 4096 tokens); through the origin the fit made a 1K-token
    recompute look 3x cheaper than it is and the planner chose recompute-heavy mixes that lost."""
    flat = Profile("gpu", 1, 0, 1, 1, {256: 1.01, 1024: 1.05, 2048: 1.04, 4096: 1.10})
    assert flat.re_ms(1024) == pytest.approx(1.05, rel=0.03) and flat.re_ms(256) == pytest.approx(1.01, rel=0.03)
    growing = {n: 0.9 + 3e-4 * n + 2e-8 * n * n for n in (256, 1024, 2048, 4096)}
    fit = Profile("gpu", 1, 0, 1, 1, growing)
    assert fit.re_ms(16384) == pytest.approx(0.9 + 3e-4 * 16384 + 2e-8 * 16384**2, rel=1e-6)
    assert Profile("one point", 1, 0, 1, 1, {256: 2.0}).re_ms(1024) == pytest.approx(8.0)  # grows, no guess


def test_plan_decides_what_is_stored() -> None:
    from hcache.restore.partitioner import storage_kinds
    from hcache.restore.plan import Plan
    from hcache.storage.layout import Kind, encode_layer_kinds

    kinds = storage_kinds(Plan.split(6, 2, 3))
    assert kinds == [None, None, Kind.HIDDEN, Kind.HIDDEN, Kind.HIDDEN, Kind.KV]
    assert encode_layer_kinds(kinds) == "--HHHK"


def test_mix_margin_keeps_a_single_method_unless_the_mix_clearly_wins() -> None:
    from dataclasses import replace

    prof = _two_method_profile(io_h=10.0, io_kv=20.0, c_h=30.0, c_tok=1e6)  # H+KV mix beats both
    n = 1000
    mix = partition(MHA_7B, prof, n, methods=(Method.HIDDEN, Method.KV))
    assert len(set(mix.plan.methods)) == 2
    singles = {
        m: simulate((m,) * MHA_7B.num_layers, layer_costs(MHA_7B, prof, n))[2] for m in (Method.HIDDEN, Method.KV)
    }
    gain = min(singles.values()) / mix.makespan_ms - 1
    assert gain > 0.1
    keep = partition(MHA_7B, replace(prof, mix_margin=gain * 1.01), n, methods=(Method.HIDDEN, Method.KV))
    assert set(keep.plan.methods) == {min(singles, key=singles.get)}
    assert keep.makespan_ms == pytest.approx(min(singles.values()))
    still = partition(MHA_7B, replace(prof, mix_margin=gain * 0.99), n, methods=(Method.HIDDEN, Method.KV))
    assert still.plan == mix.plan


def test_read_cpu_is_charged_to_the_compute_stream() -> None:
    from dataclasses import replace

    prof = _two_method_profile(io_h=10.0, io_kv=20.0, c_h=30.0, c_tok=1e6)
    base = layer_costs(MHA_7B, prof, 1000)
    taxed = layer_costs(MHA_7B, replace(prof, read_cpu_ms_per_mb=2.0), 1000)
    for m, nbytes in ((Method.HIDDEN, MHA_7B.h_bytes(1000)), (Method.KV, MHA_7B.kv_bytes(1000))):
        assert taxed[m].io_ms == base[m].io_ms
        assert taxed[m].compute_ms == pytest.approx(base[m].compute_ms + 2.0 * nbytes / 1e6)
    # reads that cost CPU make the compute-heavy H layers dearer next to KV: fewer are chosen
    plain = partition(MHA_7B, prof, 1000, methods=(Method.HIDDEN, Method.KV))
    dear = partition(MHA_7B, replace(prof, read_cpu_ms_per_mb=2.0), 1000, methods=(Method.HIDDEN, Method.KV))
    assert dear.plan.counts()["hidden"] < plain.plan.counts()["hidden"]


def test_affine_fit_of_per_layer_costs() -> None:
    from hcache.restore.profiler import affine

    assert affine({1024: 3.0, 4096: 9.144}) == pytest.approx((0.952, 2.0))
    assert affine({1024: 3.0, 4096: 6.0}) == pytest.approx((2.0, 1000 / 1024))
    # a faster long run than short one (noise) cannot give a negative rate or fixed part
    fixed, rate = affine({1024: 3.0, 4096: 2.0})
    assert fixed >= 0 and rate >= 0
    prof = Profile("p", 1, 0, 2.0, 0.5, {1000: 1.0}, h_ms_fixed=1.5, kv_ms_fixed=0.25)
    assert prof.h_ms(2000) == pytest.approx(5.5) and prof.kv_ms(2000) == pytest.approx(1.25)
    assert prof.h_ms(0) == 0 and prof.kv_ms(0) == 0


def test_read_setup_is_paid_once_and_can_make_recompute_win() -> None:
    """A GPU recomputes a small model's layer in ~1 ms of launches; starting reads costs the
    compute thread a fixed time first (measured on an H100: plans that read a few layers
    lost 10-40 ms to all-recompute). With that cost known, the planner stays on recompute."""
    geom = Geometry.of(DEFAULT_GEOMETRY, 2)
    base = dict(
        read_gbps=1.2,
        read_latency_ms=0.3,
        h_ms_per_ktok=0.2,
        kv_ms_per_ktok=0.05,
        h_ms_fixed=0.6,
        kv_ms_fixed=0.4,
        re_points={256: 1.0, 1024: 1.0, 4096: 1.0},
    )
    free = partition(geom, Profile("gpu", **base), 1024)
    assert free.plan.counts()["kv"] > 0  # reads look free: a mix
    costly = Profile("gpu", **base, read_setup_ms=25.0)
    got = partition(geom, costly, 1024)
    assert got.plan.counts() == {"recompute": 30, "hidden": 0, "kv": 0}
    kv_only = simulate((Method.KV,) * 30, layer_costs(geom, costly, 1024))
    kv_free = simulate((Method.KV,) * 30, layer_costs(geom, Profile("gpu", **base), 1024))
    assert kv_only[2] == pytest.approx(kv_free[2] + 25.0) and kv_only[1] == pytest.approx(kv_free[1] + 25.0)
    assert simulate((Method.RECOMPUTE,) * 30, layer_costs(geom, costly, 1024))[2] == pytest.approx(30.0)


def test_recompute_beside_reads_costs_what_the_profile_measured() -> None:
    """A recompute layer costs `re_reading` times more in a plan that also reads (the readers
    share its cores), never in an all-recompute plan; the planner then recomputes fewer layers.
    Per layer at 1K tokens, as on the 2-core VM: H read 5.9 ms (200 MB/s), projected 3.2 ms,
    recompute 14 ms alone and 1.3x that beside reads."""
    geom = Geometry(30, 576, 576, 576, 1536, 2)
    base = dict(
        name="cpu",
        read_gbps=geom.h_bytes(1024) / 5.9e-3 / 1e9,
        read_latency_ms=0.0,
        h_ms_per_ktok=3.2 / 1.024,
        kv_ms_per_ktok=0.1,
        re_points={1024: 14.0, 4096: 56.0},
    )
    alone, beside = Profile(**base), Profile(**base, re_reading={1024: 1.3, 4096: 1.3})
    assert beside.re_reading_factor(2048) == pytest.approx(1.3) and beside.re_reading_factor(100) == 1.3
    re_only = (Method.RECOMPUTE,) * 30
    assert simulate(re_only, layer_costs(geom, beside, 1024)) == simulate(re_only, layer_costs(geom, alone, 1024))
    mix = (Method.RECOMPUTE,) * 4 + (Method.HIDDEN,) * 26
    assert simulate(mix, layer_costs(geom, beside, 1024))[1] == pytest.approx(
        simulate(mix, layer_costs(geom, alone, 1024))[1] + 4 * 14.0 * 0.3
    )
    a, b = partition(geom, alone, 1024).plan.n_recompute, partition(geom, beside, 1024).plan.n_recompute
    assert 0 < b < a


def test_reading_factor_is_interpolated_in_log_tokens() -> None:
    prof = Profile("p", 1, 0, 1, 1, {1000: 1.0}, re_reading={1024: 1.4, 4096: 1.2})
    assert prof.re_reading_factor(2048) == pytest.approx(1.3)
    assert prof.re_reading_factor(64) == 1.4 and prof.re_reading_factor(65536) == 1.2
    assert Profile("p", 1, 0, 1, 1, {1000: 1.0}).re_reading_factor(2048) == 1.0


def test_lower_bound_is_never_beaten_and_is_the_fractional_optimum() -> None:
    """No plan beats `lower_bound` (brute force over random machines); on the paper's H + KV
    case without fixed costs it is the fractional balance 2*L*h*p / (h + p), which bounds the
    gain of any mix over KV by 1 + h/p and over H by (h + p) / 2h (when p > h)."""
    rng = random.Random(3)
    for _ in range(40):
        geom = Geometry(6, rng.choice([64, 256]), rng.choice([16, 64, 256]), 64, 256, 2)
        prof, n = random_profile(rng), rng.choice([1, 64, 1000, 8000])
        assert lower_bound(geom, prof, n) <= brute_force(geom, prof, n) * (1 + 1e-9)
    h, p = 8.0, 20.0
    prof = _two_method_profile(h, 2 * h, p, c_tok=1e6)
    assert lower_bound(MHA_7B, prof, 1000) == pytest.approx(2 * 32 * h * p / (h + p))
    kv_only = simulate((Method.KV,) * 32, layer_costs(MHA_7B, prof, 1000))[2]
    assert kv_only / lower_bound(MHA_7B, prof, 1000) == pytest.approx(1 + h / p, rel=0.01)


# HCache paper, Table 3: A100s with PM9A3 SSDs (6.9 GB/s each); 4 SSDs on one A100 for the
# Llama-2 models, one SSD per A100 and tensor parallelism over 4 for OPT-30B
PAPER_TABLE_3 = [
    ("llama-2-7b", 1, {"recompute": 0, "hidden": 31, "kv": 1}),
    ("llama-2-13b", 1, {"recompute": 0, "hidden": 36, "kv": 4}),
    ("opt-30b", 4, {"recompute": 8, "hidden": 40, "kv": 0}),
]


@pytest.mark.parametrize("model,tp,want", PAPER_TABLE_3)
@pytest.mark.parametrize("tokens", [2048, 4096, 8192, 16384])
def test_device_presets_reproduce_the_papers_schedules(model: str, tp: int, want: dict, tokens: int) -> None:
    from hcache.restore.presets import DEVICES, EFFICIENCY, MODELS

    a100 = DEVICES["a100-40g"]
    geom = Geometry.of(MODELS[model], 2)
    prof = Profile.hypothetical(geom, a100.tflops, 4 * 6.9, a100.mem_gbps, tp=tp, efficiency=EFFICIENCY)
    got = partition(geom, prof, tokens).plan.counts()
    assert all(abs(got[m] - n) <= 2 for m, n in want.items()), (got, want)


@pytest.mark.parametrize("device", ["a100-40g", "h100-sxm", "h200", "l4"])
def test_grouped_query_models_store_no_hidden_states_on_any_device(device: str) -> None:
    from hcache.restore.presets import DEVICES, EFFICIENCY, MODELS

    d = DEVICES[device]
    geom = Geometry.of(MODELS["llama-3-8b"], 2)
    for gbps in (6.9, 27.6):
        for tokens in (1024, 16384):
            prof = Profile.hypothetical(geom, d.tflops, gbps, d.mem_gbps, efficiency=EFFICIENCY)
            assert partition(geom, prof, tokens).plan.counts()["hidden"] == 0


def test_stored_plans_are_the_greedy_over_whole_simulations() -> None:
    """`partition_stored` carries the pipeline along a layer at a time; it picks what
    choosing each layer by simulating the whole plan so far picks, at the same makespan."""
    from hcache.restore.partitioner import partition_stored
    from hcache.storage.layout import Kind

    rng = random.Random(5)
    kinds = [frozenset(), frozenset({Kind.KV}), frozenset({Kind.HIDDEN}), frozenset({Kind.HIDDEN, Kind.KV})]
    method = {Kind.HIDDEN: Method.HIDDEN, Kind.KV: Method.KV}
    for _ in range(60):
        prof, geom = random_profile(rng), rng.choice([SMOL, MHA_7B])
        n = rng.choice([64, 700, 4096, 8000])
        stored = [rng.choice(kinds[1:]) if rng.random() < 0.9 else kinds[0] for _ in range(geom.num_layers)]
        costs = layer_costs(geom, prof, n)
        first_re = max((i + 1 for i, ks in enumerate(stored) if not ks), default=0)
        want = None
        for n_re in range(first_re, geom.num_layers + 1):
            order = [Method.RECOMPUTE] * n_re
            for ks in stored[n_re:]:
                opts = [method[k] for k in sorted(ks)]
                order.append(min(opts, key=lambda m, o=tuple(order): simulate((*o, m), costs)[2]))
            key = (simulate(order, costs)[2], n_re)
            if want is None or key < want[0]:
                want = (key, order)
        got = partition_stored(geom, prof, n, stored)
        assert want is not None and list(got.plan.methods) == want[1]
        assert got.makespan_ms == want[0][0] == simulate(got.plan.methods, costs)[2]
