"""What the partitioner knows about a machine: read bandwidth and per-layer compute
rates, measured by the profiler or derived from a hypothetical machine's peak numbers."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hcache.config import ModelConfig


@dataclass(frozen=True)
class Geometry:
    """Per-layer sizes that restore costs depend on."""

    num_layers: int
    hidden: int
    kv_dim: int
    q_dim: int
    ffn: int
    elem_bytes: int

    @classmethod
    def of(cls, cfg: ModelConfig, elem_bytes: int) -> Geometry:
        return cls(cfg.num_layers, cfg.hidden_size, cfg.kv_dim, cfg.q_dim, cfg.intermediate_size, elem_bytes)

    def h_bytes(self, n: int) -> int:
        return n * self.hidden * self.elem_bytes

    def kv_bytes(self, n: int) -> int:
        return n * 2 * self.kv_dim * self.elem_bytes

    def h_flops(self, n: int) -> float:
        """K and V projections from hidden states (norm and RoPE are small change)."""
        return 2.0 * n * self.hidden * 2 * self.kv_dim

    def layer_flops(self, n: int) -> float:
        """One decoder layer's forward over n tokens from position 0 (causal attention)."""
        proj = 2.0 * n * self.hidden * (self.q_dim + 2 * self.kv_dim + self.q_dim)
        mlp = 2.0 * n * 3 * self.hidden * self.ffn
        attn = 2.0 * n * n * self.q_dim  # QK^T and PV, half of the n x n scores on average
        return proj + mlp + attn


@dataclass
class Profile:
    """Costs of one layer's restore on one machine."""

    name: str
    read_gbps: float  # aggregate restore-shaped read bandwidth over all storage directories
    read_latency_ms: float  # fixed cost of one layer's reads (issue, first byte)
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

    def h_ms(self, n: int) -> float:
        return self.h_ms_fixed + self.h_ms_per_ktok * n / 1000 if n else 0.0

    def kv_ms(self, n: int) -> float:
        return self.kv_ms_fixed + self.kv_ms_per_ktok * n / 1000 if n else 0.0

    def re_ms(self, n: int) -> float:
        """One layer's recompute at context n: a least-squares fit of a*n + b*n^2 (b >= 0)."""
        pts = sorted(self.re_points.items())
        if not pts:
            raise ValueError("profile has no recompute measurements")
        s11 = sum(x * x for x, _ in pts)
        s12 = sum(x**3 for x, _ in pts)
        s22 = sum(x**4 for x, _ in pts)
        t1 = sum(x * y for x, y in pts)
        t2 = sum(x * x * y for x, y in pts)
        det = s11 * s22 - s12 * s12
        if len(pts) >= 2 and det > 0:
            a = (t1 * s22 - t2 * s12) / det
            b = (s11 * t2 - s12 * t1) / det
            if b >= 0 and a >= 0:
                return a * n + b * n * n
        return t1 / s11 * n  # linear through the origin

    @classmethod
    def hypothetical(
        cls, geom: Geometry, tflops: float, io_gbps: float, mem_gbps: float = 100.0, latency_ms: float = 0.1
    ) -> Profile:
        """A machine given by peak compute and storage bandwidth ("what would hcache do on X")."""
        flops = tflops * 1e12
        ktok_h = geom.h_flops(1000) / flops * 1e3 + geom.kv_bytes(1000) / (mem_gbps * 1e9) * 1e3
        ktok_kv = geom.kv_bytes(1000) / (mem_gbps * 1e9) * 1e3
        re = {n: geom.layer_flops(n) / flops * 1e3 for n in (256, 1024, 4096, 16384)}
        return cls(f"hypothetical {tflops} TFLOPS, {io_gbps} GB/s", io_gbps, latency_ms, ktok_h, ktok_kv, re)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: Path) -> Profile:
        d = json.loads(Path(path).read_text())
        d["re_points"] = {int(k): float(v) for k, v in d["re_points"].items()}
        return cls(**d)
