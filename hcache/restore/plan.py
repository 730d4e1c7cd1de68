"""A restore plan: one method per layer. Recompute must be a prefix (layer l's
recompute needs layer l-1's output); hidden-state and KV layers may be mixed freely.

One vocabulary: a method's name (`recompute`, `hidden`, `kv`), its short label (RE, H,
KV), its letter in a plan's layer string (R, H, K) and the stored kind it reads are all
defined by `Method`; the stored kinds and their letters by `storage.layout.Kind`."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from hcache.model.geometry import ModelConfig
from hcache.storage.layout import Kind

TOKEN_ID_BYTES = 4


class Method(str, Enum):
    RECOMPUTE = "recompute"
    HIDDEN = "hidden"
    KV = "kv"

    @property
    def kind(self) -> Kind | None:
        """The stored kind this method reads (recompute reads only token ids)."""
        return {Method.HIDDEN: Kind.HIDDEN, Method.KV: Kind.KV}.get(self)

    @property
    def short(self) -> str:
        """RE, H or KV: table columns, metric labels."""
        return "RE" if self.kind is None else self.kind.label

    @property
    def letter(self) -> str:
        """R, H or K: one per layer in a plan's layer string."""
        return "R" if self.kind is None else self.kind.letter

    @classmethod
    def parse(cls, name: str) -> Method:
        """From any of its spellings: recompute / RE / R, hidden / H, kv / KV / K."""
        for m in cls:
            if name.lower() in (m.value, m.short.lower(), m.letter.lower()):
                return m
        raise ValueError(f"unknown restore method {name!r}: recompute (RE), hidden (H) or kv (KV)")


@dataclass(frozen=True)
class Plan:
    methods: tuple[Method, ...]

    def __post_init__(self) -> None:
        n_re = self.n_recompute
        if any(m == Method.RECOMPUTE for m in self.methods[n_re:]):
            raise ValueError("recompute layers must form a prefix 0..k-1 of the model")

    @classmethod
    def uniform(cls, num_layers: int, method: Method) -> Plan:
        return cls((method,) * num_layers)

    @classmethod
    def split(cls, num_layers: int, n_recompute: int, n_hidden: int) -> Plan:
        """RE for the first `n_recompute` layers, H for the next `n_hidden`, KV for the rest."""
        if n_recompute < 0 or n_hidden < 0 or n_recompute + n_hidden > num_layers:
            raise ValueError(f"bad split ({n_recompute}, {n_hidden}) of {num_layers} layers")
        n_kv = num_layers - n_recompute - n_hidden
        return cls((Method.RECOMPUTE,) * n_recompute + (Method.HIDDEN,) * n_hidden + (Method.KV,) * n_kv)

    @classmethod
    def from_letters(cls, letters: str) -> Plan:
        """The inverse of `letters`, e.g. "RRHHKK"."""
        return cls(tuple(Method.parse(c) for c in letters))

    @property
    def n_recompute(self) -> int:
        n = 0
        while n < len(self.methods) and self.methods[n] == Method.RECOMPUTE:
            n += 1
        return n

    def layers(self, method: Method) -> list[int]:
        return [i for i, m in enumerate(self.methods) if m == method]

    def counts(self) -> dict[str, int]:
        return {m.value: len(self.layers(m)) for m in Method}

    def bytes_to_read(self, cfg: ModelConfig, n_tokens: int, elem_bytes: int, kv_elem_bytes: int = 0) -> int:
        """What a store must read to run this plan: H rows, K and V rows, and token ids for recompute."""
        return self.bytes_to_read_geom(cfg.hidden_size, cfg.kv_dim, n_tokens, elem_bytes, kv_elem_bytes)

    def bytes_to_read_geom(
        self, hidden: int, kv_dim: int, n_tokens: int, elem_bytes: int, kv_elem_bytes: int = 0
    ) -> int:
        """H rows of `elem_bytes` elements, KV rows of `kv_elem_bytes` ones (0: the same)."""
        per_layer = {
            Method.HIDDEN: n_tokens * hidden * elem_bytes,
            Method.KV: n_tokens * 2 * kv_dim * (kv_elem_bytes or elem_bytes),
            Method.RECOMPUTE: 0,
        }
        total = sum(per_layer[m] for m in self.methods)
        return total + (n_tokens * TOKEN_ID_BYTES if self.n_recompute else 0)

    @property
    def letters(self) -> str:
        """One letter per layer: R, H or K."""
        return "".join(m.letter for m in self.methods)

    def mix(self) -> str:
        """Counts per method, e.g. "RE 2 / H 0 / KV 28" (a metric label, a dashboard cell)."""
        c = self.counts()
        return f"RE {c['recompute']} / H {c['hidden']} / KV {c['kv']}"

    def __str__(self) -> str:
        parts, start = [], 0
        for i in range(1, len(self.methods) + 1):
            if i == len(self.methods) or self.methods[i] != self.methods[start]:
                span = f"{start}" if i - 1 == start else f"{start}-{i - 1}"
                parts.append(f"{self.methods[start].short} {span}")
                start = i
        return ", ".join(parts)
