"""Resident KV memory: one pool of 64-token blocks per layer, shared by every
session, and a per-sequence block table. `PagedCache` is one sequence's view
of the pool with the same contract as the contiguous `KVCache` (begin / attend /
commit / write / layer_kv / truncate: model/cache.py), so the model and the restore executor run on it
unchanged. Blocks are handed out lowest-first and a sequence's blocks are taken
as one run where possible: a contiguous table is read as a view, not gathered."""

from __future__ import annotations

import bisect
import threading

import torch

from hcache.memory import populate
from hcache.model.attention import causal_attention, key_width
from hcache.model.base import DecoderModel
from hcache.model.cache import Lender, landed, zeros_for_reads
from hcache.model.decode import BLOCK_TOKENS, Paged
from hcache.model.geometry import ModelConfig


def resident_kv_dtype(choice: str, model: DecoderModel) -> torch.dtype:
    """`EngineConfig.kv_dtype` as a dtype: "model" is the activations'; "auto" is bfloat16
    under packed weights, whose linears already give K and V in bfloat16 (so the pool loses
    only RoPE's rounding of K, and restores read half the bytes), else the activations'."""
    if choice == "auto":
        return torch.bfloat16 if model.weights == "packed" else model.dtype
    return model.dtype if choice == "model" else getattr(torch, choice)


POPULATE_SLICE = 32 << 20  # bytes of each layer's rows faulted in before the next layer's


class OutOfBlocks(Exception):
    """The pool has fewer free blocks than asked for."""


class BlockPool:
    def __init__(
        self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str, num_blocks: int, prefault: bool = False
    ):
        if num_blocks < 1:
            raise ValueError("the block pool needs at least one block")
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.num_blocks = num_blocks
        shape = (num_blocks * BLOCK_TOKENS, 2, cfg.num_kv_heads, cfg.head_dim)
        # token-major per layer, each token's K row then its V row, as a stored chunk holds
        # them: a block is rows b*64 .. b*64+63, and a chunk read lands in it as it is
        self.kv = [zeros_for_reads(shape, dtype, self.device) for _ in range(cfg.num_layers)]
        self.populated = threading.Event()  # set once the pages are in (or can't be put in)
        if prefault and self.device.type == "cpu":
            threading.Thread(target=self._populate, name="hcache-pool", daemon=True).start()
        else:
            self.populated.set()
        self.k = [kv[:, 0] for kv in self.kv]
        self.v = [kv[:, 1] for kv in self.kv]
        self._free: list[int] = list(range(num_blocks))  # sorted

    def _populate(self) -> None:
        """Fault the pool's pages in, every layer's lowest rows first (blocks are handed out
        lowest-first), beside the engine: else a turn's first write into a fresh huge page
        zeroes it, and compacts memory first, inside the turn."""
        try:
            n = self.kv[0].numel() * self.kv[0].element_size()
            for start in range(0, n, POPULATE_SLICE):
                for kv in self.kv:
                    if not populate(kv.data_ptr() + start, min(POPULATE_SLICE, n - start)):
                        return
        finally:
            self.populated.set()

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, dtype: torch.dtype) -> int:
        return 2 * cfg.num_layers * BLOCK_TOKENS * cfg.kv_dim * (torch.finfo(dtype).bits // 8)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """`n` blocks, continuing the run that ends at `after` if those blocks are free,
        else the first free run long enough, else the lowest free blocks."""
        if n > len(self._free):
            raise OutOfBlocks(f"{n} blocks asked, {len(self._free)} free")
        if n == 0:
            return []
        start = self._run_start(n, after)
        if start is not None:
            i = bisect.bisect_left(self._free, start)
            out = self._free[i : i + n]
            del self._free[i : i + n]
            return out
        out, self._free = self._free[:n], self._free[n:]
        return out

    def _run_start(self, n: int, after: int | None) -> int | None:
        free = self._free
        if after is not None:
            i = bisect.bisect_left(free, after + 1)
            if i + n <= len(free) and free[i] == after + 1 and free[i + n - 1] == after + n:
                return after + 1
        run = 1
        for i in range(1, len(free) + 1):
            if run >= n:
                return free[i - n]
            if i < len(free) and free[i] == free[i - 1] + 1:
                run += 1
            else:
                run = 1
        return None

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            bisect.insort(self._free, b)


class PagedCache(Lender):
    """One sequence's KV in the pool. `length` tokens are committed in every layer."""

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.cfg = pool.cfg
        self.blocks: list[int] = []
        self.length = 0
        self._pending = 0
        self._rows = torch.empty(0, dtype=torch.long, device=pool.device)  # token position -> pool row
        self._one: Paged | None = None  # a one-token forward's attention, for its layers

    @property
    def capacity(self) -> int:
        return len(self.blocks) * BLOCK_TOKENS

    @property
    def dtype(self) -> torch.dtype:
        return self.pool.dtype

    @property
    def contiguous(self) -> bool:
        return not self.blocks or self.blocks[-1] - self.blocks[0] == len(self.blocks) - 1

    def reserve(self, n: int) -> None:
        """Blocks for `n` more tokens past `length` (raises OutOfBlocks, taking nothing)."""
        need = -(-(self.length + n) // BLOCK_TOKENS) - len(self.blocks)
        if need > 0:
            self.blocks += self.pool.allocate(need, self.blocks[-1] if self.blocks else None)
            b = torch.tensor(self.blocks, dtype=torch.long, device=self.pool.device)
            self._rows = (b[:, None] * BLOCK_TOKENS + torch.arange(BLOCK_TOKENS, device=b.device)).reshape(-1)

    def begin(self, n: int, start: int | None = None) -> None:
        if start is not None:
            self.length = start
        self.reserve(n)
        self._pending = n
        self._one = None

    def commit(self) -> None:
        self.length += self._pending
        self._pending = 0
        self._one = None

    def _span(self, start: int, n: int) -> slice | torch.Tensor:
        if self.contiguous:
            base = self.blocks[0] * BLOCK_TOKENS + start if self.blocks else 0
            return slice(base, base + n)
        return self._rows[start : start + n]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int | None = None) -> None:
        s = self.length if start is None else start
        rows = self._span(s, k.shape[0])
        if isinstance(rows, slice):
            if landed(self.pool.k[layer][rows], k) and landed(self.pool.v[layer][rows], v):
                return
            self.pool.k[layer][rows] = k
            self.pool.v[layer][rows] = v
        else:
            self.pool.k[layer].index_copy_(0, rows, k.to(self.pool.dtype))
            self.pool.v[layer].index_copy_(0, rows, v.to(self.pool.dtype))

    def write_at(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        rows = self._rows[positions]
        self.pool.k[layer].index_copy_(0, rows, k.to(self.pool.dtype))
        self.pool.v[layer].index_copy_(0, rows, v.to(self.pool.dtype))

    def dest(self, layer: int, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer `layer`'s K and V rows for positions `start..start+n` as views to write in
        place, when the sequence's blocks are one run; None otherwise (use `write`)."""
        rows = self._span(start, n)
        if not isinstance(rows, slice) or start + n > self.capacity:
            return None
        return self.pool.k[layer][rows], self.pool.v[layer][rows]

    def landing(self, layer: int, start: int, n: int) -> torch.Tensor | None:
        """The rows as the pool holds them (`[n, 2, kv_heads, head_dim]`), when they are one
        run of blocks in host memory (O_DIRECT reads land in them)."""
        rows = self._span(start, n)
        if not isinstance(rows, slice) or start + n > self.capacity or self.pool.device.type != "cpu":
            return None
        return self.pool.kv[layer][rows]

    def layer_kv(self, layer: int, n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self._kv(layer, 0, self.length if n is None else n)

    def kv_rows(self, layer: int, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s K and V of positions start..start+n, `[n, kv_dim]` each."""
        k, v = self._kv(layer, start, n)
        return k.view(n, -1), v.view(n, -1)

    def _kv(self, layer: int, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions start..start+n: views of the pool where its blocks lie in a
        row (no gather per layer of a turn), else copies."""
        rows = self._span(start, n)
        if isinstance(rows, slice):
            return self.pool.k[layer][rows], self.pool.v[layer][rows]
        return self.pool.k[layer].index_select(0, rows), self.pool.v[layer].index_select(0, rows)

    def rows(self, start: int, n: int) -> torch.Tensor:
        """Pool rows of positions start..start+n (where a decode step's new K/V go, and the
        keys it gathers)."""
        span = self._span(start, n)
        if isinstance(span, slice):
            return torch.arange(span.start, span.stop, device=self.pool.device)
        return span

    def truncate(self, n: int) -> None:
        self.length = min(self.length, n)
        keep = -(-self.length // BLOCK_TOKENS)
        if keep < len(self.blocks):
            self._let_go()
            self.pool.release(self.blocks[keep:])
            del self.blocks[keep:]
            self._rows = self._rows[: keep * BLOCK_TOKENS]

    def free(self) -> None:
        self._let_go()
        self.pool.release(self.blocks)
        self.blocks, self.length, self._pending = [], 0, 0
        self._rows = self._rows[:0]

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
    ) -> torch.Tensor:
        if k.shape[0] == 1:  # as a decode step attends (`decode_attention`), set up once per forward
            if self._one is None:
                self._one = _decode_step([self])
            return self._one.attend(layer, q, k, v, scale)
        self.write(layer, k, v)
        keys, values = self.layer_kv(layer, self.length + k.shape[0])
        return causal_attention(q, keys, values, scale)


class BatchCache:
    """A decode step of several sequences in one forward: a row (new token) per sequence.
    Projections and MLPs run once over all rows; attention runs in one call per layer over
    the sequences' rows in whole key blocks, gathered into a padded batch (one sequence
    whose blocks are one run: read in place), the same call the compiled step makes."""

    def __init__(self, caches: list[PagedCache]):
        if any(c.pool is not caches[0].pool for c in caches):
            raise ValueError("a batch's sequences share one pool")
        self.caches = caches
        self._step: Paged | None = None

    def begin(self, n: int, start: int | None = None) -> None:
        if start is not None:
            raise ValueError("a batch's sequences start after their own committed tokens")
        if n != len(self.caches):
            raise ValueError(f"{n} rows for {len(self.caches)} sequences")
        for c in self.caches:
            c.begin(1)
        self._step = _decode_step(self.caches)

    def commit(self) -> None:
        for c in self.caches:
            c.commit()
        self._step = None

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
    ) -> torch.Tensor:
        assert self._step is not None, "attend outside begin/commit"
        return self._step.attend(layer, q, k, v, scale)


def _decode_step(caches: list[PagedCache]) -> Paged:
    """Where each sequence's new token goes in the pool, and its rows (whole key blocks,
    none past its own attended) as the attention's keys."""
    pool, dev = caches[0].pool, caches[0].pool.device
    lengths = [c.length + 1 for c in caches]
    width = key_width(max(lengths))
    write_rows = torch.cat([c.rows(c.length, 1) for c in caches])
    attended = torch.tensor(lengths, device=dev)
    one = caches[0]
    if len(caches) == 1 and one.contiguous:
        start = one.blocks[0] * BLOCK_TOKENS
        return Paged(pool.kv, write_rows, torch.arange(start, start + width, device=dev)[None], attended)
    gathered = []
    for c, n in zip(caches, lengths, strict=True):
        rows = c.rows(0, key_width(n))
        gathered.append(torch.cat([rows, rows[-1:].expand(width - rows.shape[0])]) if rows.shape[0] < width else rows)
    return Paged(pool.kv, write_rows, torch.cat(gathered).view(len(caches), width), attended)


def warm_decode(model: DecoderModel, kv_dtype: torch.dtype) -> None:
    """Compile the decode attention that eager forwards run (a one-token turn; every step
    under `--decode eager`) as they call it: one sequence read in place, one gathered, and
    batches, on a scratch pool of `kv_dtype`. No request waits for inductor, and none falls
    back to eager ops (`serve_compiled_only`), which would sum in another order."""
    if model.device.type != "cpu":
        return
    cfg = model.cfg
    pool = BlockPool(cfg, kv_dtype, model.device, 12)
    caches = []
    for n in (70, 130, 100):
        c = PagedCache(pool)
        c.begin(n)
        c.commit()
        caches.append(c)
    gap = pool.allocate(1)
    caches[2].reserve(BLOCK_TOKENS)  # blocks not one run: gathered, not read in place
    pool.release(gap)
    with torch.compiler.set_stance("default"), torch.inference_mode():
        for group in ([caches[0]], [caches[2]], caches[:2], caches):
            for c in group:
                c.begin(1)
            b = len(group)
            q = torch.zeros(b, cfg.num_heads, cfg.head_dim, dtype=model.dtype, device=model.device)
            kv = torch.zeros(b, cfg.num_kv_heads, cfg.head_dim, dtype=model.dtype, device=model.device)
            _decode_step(group).attend(0, q, kv, kv.clone())
    for c in caches:
        c.free()
