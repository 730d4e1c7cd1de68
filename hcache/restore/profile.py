"""What the partitioner knows about a machine: read bandwidth and per-layer compute
rates, measured by the profiler or derived from a hypothetical machine's peak numbers."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from hcache.model.geometry import ARCH_OPT, ModelConfig


@dataclass(frozen=True)
class Geometry:
    """Per-layer sizes that restore costs depend on."""

    num_layers: int
    hidden: int
    kv_dim: int
    q_dim: int
    ffn: int
    elem_bytes: int  # of stored H (the activations' dtype)
    mlp_mats: int = 3  # gate, up and down (Llama); OPT's MLP has two
    kv_elem_bytes: int = 0  # of stored KV (the resident KV's dtype); 0: elem_bytes

    @classmethod
    def of(cls, cfg: ModelConfig, elem_bytes: int, kv_elem_bytes: int = 0) -> Geometry:
        mats = 2 if cfg.arch == ARCH_OPT else 3
        c = cfg
        return cls(c.num_layers, c.hidden_size, c.kv_dim, c.q_dim, c.intermediate_size, elem_bytes, mats, kv_elem_bytes)

    @property
    def kv_elem(self) -> int:
        return self.kv_elem_bytes or self.elem_bytes

    def h_bytes(self, n: int) -> int:
        return n * self.hidden * self.elem_bytes

    def kv_bytes(self, n: int) -> int:
        return n * 2 * self.kv_dim * self.kv_elem

    def h_flops(self, n: int) -> float:
        """K and V projections from hidden states (norm and RoPE are small change)."""
        return 2.0 * n * self.hidden * 2 * self.kv_dim

    def layer_flops(self, n: int) -> float:
        """One decoder layer's forward over n tokens from position 0 (causal attention)."""
        proj = 2.0 * n * self.hidden * (self.q_dim + 2 * self.kv_dim + self.q_dim)
        mlp = 2.0 * n * self.mlp_mats * self.hidden * self.ffn
        attn = 2.0 * n * n * self.q_dim  # QK^T and PV, half of the n x n scores on average
        return proj + mlp + attn


@dataclass
class Profile:
    """Costs of one layer's restore on one machine."""

    name: str
    read_gbps: float  # restore-shaped read rate over all storage directories, past the fixed part
    read_latency_ms: float  # a restore's fixed read cost (planning, first request, request ramp), paid once
    h_ms_per_ktok: float  # H -> K,V (norm, projection, RoPE, into the cache), per 1K tokens
    kv_ms_per_ktok: float  # placing stored K,V into the cache, per 1K tokens
    re_points: dict[int, float]  # context tokens -> ms for one layer's full forward
    per_dir_gbps: list[float] = field(default_factory=list)
    meta: dict = field(default_factory=dict)
    # CPU that reading takes (checksums, placement, the kernel's O_DIRECT work), charged to the
    # compute stream where readers and compute share the cores (CPU devices); 0 on a GPU
    read_cpu_ms_per_mb: float = 0.0
    # a mixed plan must be predicted this much faster than the best single-method plan: mixes
    # are where the two-stream model errs most on a machine whose streams contend
    mix_margin: float = 0.0
    h_ms_fixed: float = 0.0  # per layer, whatever the length (launches, norms, small copies)
    kv_ms_fixed: float = 0.0
    # compute-side cost of a restore that reads at all (planning the reads, starting readers),
    # paid once before its first layer; with `read_cpu_ms_per_mb`, what reads take from compute
    read_setup_ms: float = 0.0
    # context tokens -> a recompute layer's time beside a restore's readers over its time alone:
    # on a small CPU the readers' wake-ups and checksums land on the cores a layer's threads
    # run on, and all of them wait for the one interrupted
    re_reading: dict[int, float] = field(default_factory=dict)

    def re_reading_factor(self, n: int) -> float:
        """`re_reading` at n: linear in log n between the measured lengths, flat past them."""
        if not self.re_reading or n < 1:
            return 1.0
        pts = sorted(self.re_reading.items())
        return float(np.interp(math.log(n), [math.log(k) for k, _ in pts], [f for _, f in pts]))

    def h_ms(self, n: int) -> float:
        return self.h_ms_fixed + self.h_ms_per_ktok * n / 1000 if n else 0.0

    def kv_ms(self, n: int) -> float:
        return self.kv_ms_fixed + self.kv_ms_per_ktok * n / 1000 if n else 0.0

    def re_ms(self, n: int) -> float:
        """One layer's recompute at context n, from the fit of c + a*n + b*n^2 (all >= 0)."""
        c, a, b = _fit_re(tuple(sorted(self.re_points.items())))
        return c + a * n + b * n * n

    @classmethod
    def hypothetical(
        cls,
        geom: Geometry,
        tflops: float,
        io_gbps: float,
        mem_gbps: float = 100.0,
        latency_ms: float = 0.1,
        *,
        tp: int = 1,
        efficiency: float = 1.0,
        name: str = "",
    ) -> Profile:
        """A machine given by peak compute, memory and storage bandwidth ("what would hcache do
        on X"). `tp` devices split each layer's heads (tensor parallelism): compute and memory
        scale by `tp`, and `io_gbps` is what all their drives read together. `efficiency` is the
        fraction of the compute and memory peaks a restore reaches."""
        if min(tflops, io_gbps, mem_gbps, efficiency) <= 0 or tp < 1:
            raise ValueError("compute, bandwidths, efficiency and --tp must be positive")
        flops = tflops * 1e12 * tp * efficiency
        mem = mem_gbps * 1e9 * tp * efficiency
        ktok_kv = geom.kv_bytes(1000) / mem * 1e3
        ktok_h = geom.h_flops(1000) / flops * 1e3 + ktok_kv
        re = {n: geom.layer_flops(n) / flops * 1e3 for n in (256, 1024, 4096, 16384)}
        name = name or f"hypothetical {tflops:g} TFLOPS, {mem_gbps:g} GB/s memory"
        if tp > 1:
            name += f", x{tp} tensor-parallel"
        if efficiency != 1.0:
            name += f", at {efficiency:.0%} of peak"
        name += f"; {io_gbps:g} GB/s storage"
        return cls(name, io_gbps, latency_ms, ktok_h, ktok_kv, re)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: Path) -> Profile:
        d = json.loads(Path(path).read_text())
        d["re_points"] = {int(k): float(v) for k, v in d["re_points"].items()}
        d["re_reading"] = {int(k): float(v) for k, v in d.get("re_reading", {}).items()}
        return cls(**d)


# basis subsets tried by the recompute fit, in order of preference on ties: a GPU's small
# layers cost a fixed launch time whatever the length (c), a CPU's grow from zero (a, b)
_RE_BASES = (("a", "b"), ("c", "a", "b"), ("c", "a"), ("a",), ("c", "b"), ("b",), ("c",))


@functools.lru_cache(maxsize=64)
def _fit_re(pts: tuple[tuple[int, float], ...]) -> tuple[float, float, float]:
    """Least squares with non-negative coefficients, by trying every subset of the basis
    (three unknowns: cheaper and clearer than a general NNLS)."""
    if not pts:
        raise ValueError("profile has no recompute measurements")
    k = np.array([x for x, _ in pts], dtype=np.float64) / 1000  # per 1K tokens: better conditioned
    y = np.array([t for _, t in pts], dtype=np.float64)
    cols = {"c": np.ones_like(k), "a": k, "b": k * k}
    best: tuple[float, dict[str, float]] | None = None
    for basis in _RE_BASES:
        if len(basis) > len(pts):
            continue
        a = np.stack([cols[v] for v in basis], 1)
        coef, *_ = np.linalg.lstsq(a, y, rcond=None)
        if (coef < 0).any():
            continue
        sse = float(((a @ coef - y) ** 2).sum())
        if best is None or sse < best[0] - 1e-12 * max(1.0, float((y**2).sum())):
            best = (sse, dict(zip(basis, coef.tolist(), strict=True)))
    assert best is not None  # ("a",) always fits: the points are positive
    f = best[1]
    return f.get("c", 0.0), f.get("a", 0.0) / 1000, f.get("b", 0.0) / 1e6
