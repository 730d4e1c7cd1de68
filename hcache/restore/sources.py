"""The chunk store as a restore source: the plan's H and KV layers (or, token-wise,
each layer's H head and KV tail) stream in through one prefetching reader while the
executor works layer by layer. A session on a shared context reads the context's
chunks for the tokens before its own. These adapters sit above storage: a bad chunk
(`ChunkError`) becomes `StateUnavailable`, which the executor recomputes."""

from __future__ import annotations

import torch

from hcache.restore.plan import Plan
from hcache.restore.state import Landing, StateSource, StateUnavailable
from hcache.storage.errors import ChunkError
from hcache.storage.fetched import Fetched
from hcache.storage.layout import CHUNK_TOKENS, Kind
from hcache.storage.reader import OwnerReader, Want
from hcache.storage.store import ChunkStore


class StoreSource(StateSource):
    def __init__(self, store: ChunkStore, owner: str, fingerprint: str):
        self.store, self.owner = store, owner
        self.row = store.check_fingerprint(owner, fingerprint)
        self.stored = store.layer_kinds(self.row)
        self.reader: OwnerReader | None = None
        self._ranges: dict[tuple[int, Kind], tuple[int, int]] = {}
        self._kinds: dict[int, list[Kind]] = {}  # layer -> the kinds read for it
        cfg = store.model
        self._kv_shape = (cfg.num_kv_heads, cfg.head_dim)

    @property
    def tokens(self) -> list[int]:
        return self.row.tokens

    def _start(self, wants: list[Want], into: Landing | None = None) -> None:
        """Read `wants` from the chunks that hold them (a range may start inside a chunk)."""
        self.settle()  # a reader before this one lands nothing more
        self._ranges = {(w.layer, w.kind): (w.lo, w.hi) for w in wants}
        self._kinds = {}
        for w in wants:
            self._kinds.setdefault(w.layer, []).append(w.kind)
        whole = [Want(w.layer, w.kind, w.lo - w.lo % CHUNK_TOKENS, w.hi) for w in wants]
        rows = {}
        for w in whole if into is not None else ():
            dest = into(w.layer, w.lo, w.hi) if w.kind == Kind.KV else None
            if dest is not None and dest.dtype == self.store.shapes[Kind.KV].dtype:
                rows[(w.layer, w.kind)] = dest.flatten(2)  # [n, 2, kv_dim], as the reader gives KV
        self.reader = self.store.reader(self.owner, wants=whole, into=rows)

    def prepare(self, plan: Plan, into: Landing | None = None) -> None:
        """Fetch what the plan reads where the layer stores it; the rest fails over to recompute."""
        n = self.row.num_tokens
        self._start(
            [
                Want(layer, m.kind, 0, n)
                for layer, m in enumerate(plan.methods)
                if m.kind is not None and m.kind in self.stored[layer]
            ],
            into,
        )

    def settle(self) -> None:
        if self.reader is not None:
            self.reader.settle()

    def prepare_split(self, split: int) -> None:
        """Token-wise: tokens before `split` from H, the rest from KV, in every layer."""
        n = self.row.num_tokens
        wants = []
        for layer in range(len(self.stored)):
            if split:
                wants.append(Want(layer, Kind.HIDDEN, 0, split))
            if split < n:
                wants.append(Want(layer, Kind.KV, split, n))
        self._start([w for w in wants if w.kind in self.stored[w.layer]])

    def _get(self, layer: int, kind: Kind, lo: int, hi: int | None) -> torch.Tensor:
        hi = self.row.num_tokens if hi is None else hi
        if kind not in self.stored[layer]:
            raise StateUnavailable(layer, f"owner {self.owner} layer {layer} does not store {kind.value}")
        if self.reader is None or self._ranges.get((layer, kind)) != (lo, hi):
            self._start([Want(layer, kind, lo, hi)])  # not prepared: fetch it now
        assert self.reader is not None
        try:
            return self.reader.get(layer, kind)[lo % CHUNK_TOKENS :]
        except ChunkError as e:
            raise StateUnavailable(layer, str(e)) from e

    def hidden(self, layer: int, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        return self._get(layer, Kind.HIDDEN, lo, hi)

    def kv(self, layer: int, lo: int = 0, hi: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        both = self._get(layer, Kind.KV, lo, hi)  # [n, 2, kv_dim]: K and V are strided views of it
        return both[:, 0].unflatten(1, self._kv_shape), both[:, 1].unflatten(1, self._kv_shape)

    def ready(self, layer: int) -> bool:
        if self.reader is None:
            return True
        return all(self.reader.ready(layer, k) for k in self._kinds.get(layer, ()))

    def wait(self, layer: int, timeout: float) -> bool:
        if self.reader is not None:
            for k in self._kinds.get(layer, ()):
                self.reader.wait(layer, k, timeout)
        return self.ready(layer)

    def release(self, layer: int) -> None:
        if self.reader is not None:
            self.reader.release(layer)

    @property
    def bytes_read(self) -> int:
        return self.reader.bytes_read if self.reader is not None else 0


class RowsSource(StateSource):
    """Rows fetched from the cluster into memory, read as they come: layer by layer, once
    `fetched.ready(layer)`; a layer whose chunks were damaged is recomputed."""

    def __init__(self, tokens: list[int], fetched: Fetched, kv_shape: tuple[int, int]):
        self._tokens, self.fetched, self._kv_shape = tokens, fetched, kv_shape

    @property
    def tokens(self) -> list[int]:
        return self._tokens

    def ready(self, layer: int) -> bool:
        return self.fetched.ready(layer)

    def wait(self, layer: int, timeout: float) -> bool:
        return self.fetched.wait(layer, timeout)

    def _rows(self, rows: dict[int, torch.Tensor], layer: int, what: str, lo: int, hi: int | None) -> torch.Tensor:
        t = rows.get(layer)
        self.fetched.wait(layer)
        if t is None or not self.fetched.usable(layer):
            raise StateUnavailable(layer, f"layer {layer}: no intact {what} rows came from the cluster")
        return t[lo:hi]

    def hidden(self, layer: int, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        return self._rows(self.fetched.hidden, layer, "hidden", lo, hi)

    def kv(self, layer: int, lo: int = 0, hi: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        both = self._rows(self.fetched.kv, layer, "KV", lo, hi)
        return both[:, 0].unflatten(1, self._kv_shape), both[:, 1].unflatten(1, self._kv_shape)


class SharedSource(StateSource):
    """Tokens before `base` from one source, the rest from another (whose token 0 is token
    `base`): a session on a shared context (the context's chunks, then its own), or a
    session's stored turns followed by rows fetched from the cluster."""

    def __init__(self, parent: StateSource, own: StateSource | None, base: int):
        self.parent, self.own, self.base = parent, own, base
        self._n = base + (len(own.tokens) if own else 0)

    @property
    def tokens(self) -> list[int]:
        return self.parent.tokens[: self.base] + (self.own.tokens if self.own else [])

    def _parts(self) -> list[StateSource]:
        return [self.parent] + ([self.own] if self.own else [])

    def prepare(self, plan: Plan, into: Landing | None = None) -> None:
        base = self.base

        def parent_rows(layer: int, lo: int, hi: int) -> torch.Tensor | None:
            return into(layer, lo, hi) if into is not None and hi <= base else None

        def own_rows(layer: int, lo: int, hi: int) -> torch.Tensor | None:
            return into(layer, base + lo, base + hi) if into is not None else None

        self.parent.prepare(plan, parent_rows)
        if self.own is not None:
            self.own.prepare(plan, own_rows)

    def settle(self) -> None:
        for s in self._parts():
            s.settle()

    def prepare_split(self, split: int) -> None:
        self.parent.prepare_split(min(split, self.base))
        if self.own is not None:
            self.own.prepare_split(max(0, split - self.base))

    def ready(self, layer: int) -> bool:
        return all(s.ready(layer) for s in self._parts())

    def wait(self, layer: int, timeout: float) -> bool:
        return all(s.wait(layer, timeout) for s in self._parts())

    def _pieces(self, lo: int, hi: int | None) -> list[tuple[StateSource, int, int]]:
        """(source, lo, hi) in that source's own token indices, covering `lo:hi`."""
        hi = self._n if hi is None else hi  # the parts' tokens are fixed: counted once, not joined per layer
        out = []
        if lo < self.base:
            out.append((self.parent, lo, min(hi, self.base)))
        if hi > self.base:
            if self.own is None:
                raise ValueError(f"tokens {lo}:{hi} reach past the context's {self.base}, and there are no own ones")
            out.append((self.own, max(lo, self.base) - self.base, hi - self.base))
        return out

    def hidden(self, layer: int, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        parts = [s.hidden(layer, a, b) for s, a, b in self._pieces(lo, hi)]
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def kv(self, layer: int, lo: int = 0, hi: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [s.kv(layer, a, b) for s, a, b in self._pieces(lo, hi)]
        if len(parts) == 1:
            return parts[0]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    def release(self, layer: int) -> None:
        for s in self._parts():
            s.release(layer)

    @property
    def bytes_read(self) -> int:
        return sum(s.bytes_read for s in self._parts())
