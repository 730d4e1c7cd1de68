"""One decode step for a batch of sequences, compiled whole: a token per sequence
through every layer and the LM head in one graph.

K/V live in per-layer pools of 64-token blocks, token-major `[rows, kv_heads, head_dim]`;
a sequence's blocks are a row of a block table. Inside the graph each layer writes the
new token's K/V to its pool row and attends over every sequence's rows, whole key blocks
as a row of pool rows (padded to the longest; no sequence attends past its own), in one
call (`decode_attention`: a sequence's bits do not depend on its batch), a KV head's query
heads as that head's query rows so K/V are never repeated. Eager, the same step is about 450 small ops and
their Python dispatch; compiled, inductor fuses the elementwise chains around the
matmul kernels and the step pays one guard check.

Shapes are dynamic: one graph serves a single sequence and one every larger batch, at
any context length, so a request never waits for a compile once `warm` ran. On CUDA the
batch graph is also recorded as CUDA graphs (`capture`), one per bucket of batch size and
key blocks (powers of two), so that a step is one replay rather than hundreds of launches."""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hcache.kernels import native
from hcache.kernels.fused import own_code
from hcache.model.attention import KEY_BLOCK, decode_attention, key_width
from hcache.model.base import DecoderModel
from hcache.model.cache import zeros_for_reads

log = logging.getLogger(__name__)

BLOCK_TOKENS = KEY_BLOCK  # tokens per block of the engine's pool (engine/block_pool.py)


@dataclass
class StepOut:
    logits: torch.Tensor  # [B, vocab] float32
    greedy: torch.Tensor  # [B] int64: each row's argmax, the greedy choice, taken inside the graph
    hidden: torch.Tensor  # [L, B, hidden]: each layer's input (what the H store keeps)
    kv: torch.Tensor  # [L, B, 2, kv_dim]: each layer's new K then V as the pool holds them (the KV store's rows)


class Paged:
    """The cache contract (model/cache.py) for one decode step over per-layer pools `kv`
    `[rows, 2, kv_heads, head_dim]`, each row a token's K then its V (eager, or inside the
    traced step: one tensor a layer, as compiled graphs take no inputs that alias another's
    memory): `rows` `[B]` is where each sequence's new K/V go,
    `keys` `[B, width]` its K/V's pool rows (whole key blocks, the new token's included) and
    `lengths` `[B]` how many of them it attends to (`decode_attention`)."""

    def __init__(
        self,
        kv: list[torch.Tensor],
        rows: torch.Tensor,
        keys: torch.Tensor,
        lengths: torch.Tensor,
    ):
        self.kv, self.rows, self.keys, self.lengths = kv, rows, keys, lengths
        self.new: list[torch.Tensor] = []  # per layer, the rows written: [B, 2, kv_dim]

    def begin(self, n: int, start: int | None = None) -> None:
        pass

    def commit(self) -> None:
        pass

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
    ) -> torch.Tensor:
        pool = self.kv[layer]
        new = torch.stack((k.to(pool.dtype), v.to(pool.dtype)), 1)
        pool.index_copy_(0, self.rows, new)
        self.new.append(new.flatten(2))
        return decode_attention(q, pool[:, 0], pool[:, 1], self.keys, self.lengths, scale)


def _forward(
    model: DecoderModel, tokens: torch.Tensor, positions: torch.Tensor, cache: Paged
) -> tuple[torch.Tensor, ...]:
    h = model.embed(tokens, positions)
    pos = model.pos_context(positions)
    hidden = []
    for i, layer in enumerate(model.layers):
        hidden.append(h)
        h = layer(h, pos, cache, i)
    logits = model.lm_head(model.head_norm(h)).float()
    return logits, logits.argmax(-1), torch.stack(hidden), torch.stack(cache.new)


def _step_one(
    model: DecoderModel,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    kv: list[torch.Tensor],
    start: int,
    length: int,
    width: int,
) -> tuple[torch.Tensor, ...]:
    """One sequence whose rows are pool rows `start..start+width` (whole key blocks), of
    which the first `length` are held and the next takes the new token's K/V: attention
    reads them where they lie."""
    rows = torch.full((1,), start + length, dtype=torch.long, device=tokens.device)
    keys = (torch.arange(width, device=tokens.device) + start)[None]
    cache = Paged(kv, rows, keys, torch.full((1,), length + 1, device=tokens.device))
    return _forward(model, tokens, positions, cache)


def _step_batch(
    model: DecoderModel,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    lengths: torch.Tensor,
    table: torch.Tensor,
    kv: list[torch.Tensor],
) -> tuple[torch.Tensor, ...]:
    """Sequences of `lengths` `[B]` rows before this token, their blocks a row of `table`
    `[B, blocks]` (as many blocks as the longest needs with its new token, shorter rows
    padded with any valid block). Each layer attends over every sequence's rows, the table's
    whole width, none past each sequence's own."""
    b, dev = tokens.shape[0], tokens.device
    all_rows = (table[:, :, None] * BLOCK_TOKENS + torch.arange(BLOCK_TOKENS, device=dev)).view(b, -1)
    rows = all_rows.gather(1, lengths[:, None]).view(b)
    cache = Paged(kv, rows, all_rows, lengths + 1)
    return _forward(model, tokens, positions, cache)


_STEPS: weakref.WeakKeyDictionary[DecoderModel, tuple[Callable, Callable]] = weakref.WeakKeyDictionary()


def _not_inside_model(guards: Sequence) -> list[bool]:
    # the model's insides (its modules' attributes, its weights' shapes and dtypes) are
    # fixed for its life and these graphs are its own (`_compiled_steps`): a step checks
    # the guards on its inputs and globals, not one per weight and module
    return [not g.name.startswith("model.") for g in guards]


def _compiled_steps(model: DecoderModel) -> tuple[Callable, Callable]:
    """The model's two compiled step functions, made once per model and shared by its
    `DecodeGraph`s. Each compiles a copy of the step function of its own, so that no other
    model can reach its graphs and their guards need not check the model's insides."""
    if model not in _STEPS:
        # both steps' kernels called from C++, not Python: the Python calls were a share of
        # every step (the larger the smaller the step). Built apart from its kernels, the
        # wrapper compiles at the wrapper's optimisation level and the kernels in parallel:
        # one file of both took gcc minutes
        opts: dict = {
            "cpp_wrapper": model.device.type == "cpu",
            "cpp_wrapper_build_separate": True,
            "guard_filter_fn": _not_inside_model,
        }
        c = model.cfg
        geometry = (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, model.dtype, model.weights)
        one = torch.compile(own_code(_step_one, *geometry), dynamic=True, fullgraph=True, options=opts)
        batch = torch.compile(own_code(_step_batch, *geometry), dynamic=True, fullgraph=True, options=opts)
        _STEPS[model] = (one, batch)
    return _STEPS[model]


def _key_blocks(lengths: list[int]) -> int:
    """Key blocks the longest sequence reads, its new token's row included."""
    return key_width(max(lengths) + 1) // BLOCK_TOKENS


def bucket(n: int) -> int:
    """The power of two at or above `n`, at least 2: a recorded graph's batch size or width."""
    return max(2, 1 << (n - 1).bit_length())


@dataclass
class _Recorded:
    graph: torch.cuda.CUDAGraph
    ins: torch.Tensor  # [b, 3 + cols] int64: token, position, length, then the block table
    out: StepOut
    pool: int  # the address of the pool the graph writes (layer 0's K)


class DecodeGraph:
    """The decode step of one model, compiled: one graph for a single sequence whose
    blocks are one run, one for every other batch (a lone fragmented sequence runs as a
    batch of two copies of itself: both write the same K/V to the same rows)."""

    def __init__(self, model: DecoderModel):
        import torch._dynamo.config
        import torch._inductor.config
        import torch._inductor.inductor_prims  # registers the prim decode_attention realizes q with

        torch._inductor.config.emulate_precision_casts = True  # the eager forms' roundings
        if model.device.type == "cpu":
            native.decode_attention()  # built before a trace reaches it: dynamo cannot enter its lock
        self.model = model
        self._one, self._batch = _compiled_steps(model)
        # the model's float attributes (an epsilon per norm) traced as constants, not as
        # scalar inputs converted to tensors and read back on every step
        self._floats_fixed = torch._dynamo.config.patch(specialize_float=True)
        self._recorded: dict[tuple[int, int], _Recorded] = {}
        self.replays = 0  # steps served by a recorded CUDA graph

    def graphs(self) -> int:
        """Graphs compiled so far for this model's steps."""
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        codes = (f._torchdynamo_orig_callable.__code__ for f in (self._one, self._batch))
        return sum(len(_debug_get_cache_entry_list(c)) for c in codes)

    def __call__(
        self,
        tokens: list[int],
        positions: list[int],
        lengths: list[int],
        blocks: list[list[int]],
        kv: list[torch.Tensor],
    ) -> StepOut:
        """Sequence i feeds `tokens[i]` at `positions[i]`; it holds `lengths[i]` rows in the
        pools `kv` (`Paged`'s), in `blocks[i]`, which already has room for one more."""
        dev = kv[0].device
        n = len(tokens)
        if self._recorded:
            out = self._replay(tokens, positions, lengths, blocks, kv)
            if out is not None:
                return out
        with torch.inference_mode(), self._floats_fixed:
            if n == 1 and blocks[0][-1] - blocks[0][0] == len(blocks[0]) - 1:
                t, pos = torch.tensor(tokens, device=dev), torch.tensor(positions, device=dev)
                start, width = blocks[0][0] * BLOCK_TOKENS, key_width(lengths[0] + 1)
                return StepOut(*self._one(self.model, t, pos, kv, start, lengths[0], width))
            if n == 1:
                tokens, positions, lengths, blocks = tokens * 2, positions * 2, lengths * 2, blocks * 2
            # never 1 column: that size would get a graph of its own (a masked block is free of effect)
            cols = max(2, _key_blocks(lengths))
            table = torch.tensor([(b + b[-1:] * cols)[:cols] for b in blocks], device=dev)
            logits, greedy, hidden, new = self._batch(
                self.model,
                torch.tensor(tokens, device=dev),
                torch.tensor(positions, device=dev),
                torch.tensor(lengths, device=dev),
                table,
                kv,
            )
        return StepOut(logits[:n], greedy[:n], hidden[:, :n], new[:, :n])

    def _replay(
        self,
        tokens: list[int],
        positions: list[int],
        lengths: list[int],
        blocks: list[list[int]],
        kv: list[torch.Tensor],
    ) -> StepOut | None:
        """The step as the recorded graph of its bucket, None where none was recorded (on
        other pools, or past the buckets). Batches are padded with copies of their last
        sequence, which write the same K/V to the same rows."""
        n = len(tokens)
        cols = bucket(_key_blocks(lengths))
        rec = self._recorded.get((bucket(n), cols))
        if rec is None or rec.pool != kv[0].data_ptr():
            return None
        rows = [
            [t, p, n_, *(b + b[-1:] * cols)[:cols]]
            for t, p, n_, b in zip(tokens, positions, lengths, blocks, strict=True)
        ]
        rows += rows[-1:] * (rec.ins.shape[0] - n)
        with torch.inference_mode():  # `ins` is an inference tensor, whatever the caller's mode
            rec.ins.copy_(torch.tensor(rows))
        rec.graph.replay()
        self.replays += 1
        o = rec.out
        return StepOut(o.logits[:n], o.greedy[:n], o.hidden[:, :n], o.kv[:, :n])

    def capture(self, kv: list[torch.Tensor], max_batch: int, max_blocks: int) -> float:
        """Record the batch step as CUDA graphs on the serving pools `kv` (a graph holds
        their addresses): one per power-of-two batch size up to `max_batch` and number of key
        blocks up to `max_blocks`. Recording writes K/V rows of block 0, so it runs before any
        sequence holds blocks. Returns the seconds it took."""
        t0 = time.perf_counter()
        dev = kv[0].device
        mempool = torch.cuda.graph_pool_handle()  # the graphs replay one at a time: one pool
        side = torch.cuda.Stream(dev)
        sizes = [(b, c) for b in _powers(max_batch) for c in _powers(max_blocks)]
        with torch.inference_mode(), self._floats_fixed, torch.compiler.set_stance("default"):
            for b, cols in sizes:
                ins = torch.zeros(b, 3 + cols, dtype=torch.long, device=dev)
                args = (self.model, ins[:, 0], ins[:, 1], ins[:, 2], ins[:, 3:], kv)
                side.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(side):  # compiles and tunes outside the recording
                    self._batch(*args)
                torch.cuda.current_stream(dev).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=mempool, capture_error_mode="thread_local"):
                    out = StepOut(*self._batch(*args))
                self._recorded[(b, cols)] = _Recorded(graph, ins, out, kv[0].data_ptr())
        took = time.perf_counter() - t0
        log.info("decode step recorded as %d CUDA graphs in %.1f s", len(sizes), took)
        return took

    def warm(self, kv_dtype: torch.dtype) -> float:
        """Compile both graphs now, on a scratch pool of `kv_dtype` (the serving pool's
        rows are not touched). Returns the seconds it took."""
        t0 = time.perf_counter()
        cfg, dev = self.model.cfg, self.model.device
        shape = (11 * BLOCK_TOKENS, 2, cfg.num_kv_heads, cfg.head_dim)
        kv = [zeros_for_reads(shape, kv_dtype, dev) for _ in range(cfg.num_layers)]  # as the pool's
        # compile even where serving already refuses to (`serve_compiled_only`: a later engine)
        with torch.compiler.set_stance("default"):
            # two values of each size, none equal to another (nor 0 or 1, nor a pool's
            # dimension), so that none is compiled as a constant or assumed equal to another:
            # a batch of 2 over 2 key blocks would compile a graph for batches of as many
            # sequences as blocks, and serving would meet no other again; a batch as large
            # as a pool dimension (its K/V axis of 2) compiles that size alone, then again
            for first, length in ((5, 100), (7, 130)):
                self([0], [length], [length], [list(range(first, first + 3))], kv)
            n1, n2, c1, c2 = _sizes_apart(set(shape), 4)
            for n, cols in ((n1, c1), (n2, c2)):
                length = cols * BLOCK_TOKENS - 20  # its new token's row in the last block
                # (positions apart from lengths: a learned position table may be shorter)
                self([0] * n, [length // 2] * n, [length] * n, [list(range(1, 1 + cols))] * n, kv)
        took = time.perf_counter() - t0
        log.info("decode step compiled in %.1f s", took)
        return took


def _sizes_apart(taken: set[int], k: int) -> list[int]:
    """The `k` smallest sizes from 3 up that are not in `taken`."""
    out: list[int] = []
    n = 3
    while len(out) < k:
        if n not in taken:
            out.append(n)
        n += 1
    return out


def _powers(most: int) -> list[int]:
    """2, 4, ... up to the bucket that holds `most`."""
    return [1 << i for i in range(1, bucket(most).bit_length())]
