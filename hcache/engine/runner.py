"""The model steps of the engine's loop: restore+prefill jobs advanced a layer at a
time within a time slice, the first token of a prefilled turn, and one batched decode
step whose hidden states and new K/V go to the store's saver as they are made."""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hcache import omp
from hcache.config import EngineConfig
from hcache.engine.block_pool import BatchCache, BlockPool, PagedCache, warm_decode
from hcache.engine.compose import BlendJob
from hcache.engine.errors import EngineError
from hcache.engine.prefill import PrefillJob
from hcache.engine.sampler import Sampler
from hcache.engine.saver import Saver, finish_decode
from hcache.engine.sequence import Phase, Sequence
from hcache.model.attention import key_width
from hcache.model.base import DecoderModel
from hcache.model.decode import BLOCK_TOKENS, DecodeGraph, StepOut
from hcache.restore.blend import Document
from hcache.restore.plan import Plan
from hcache.restore.state import StateSource
from hcache.storage.fetched import Fetched
from hcache.storage.store import ChunkStore

log = logging.getLogger(__name__)
COMPILING_SWITCH_S = 0.00002  # the GIL's switch interval while the decode step compiles in the background


@dataclass
class Progress:
    """What a prefill slice did: jobs whose restore is done, jobs that ended (with the error
    of those that failed), and whether anything ran."""

    restored: list[Sequence] = field(default_factory=list)
    ended: list[tuple[Sequence, Exception | None]] = field(default_factory=list)
    worked: bool = False


class Runner:
    def __init__(self, model: DecoderModel, store: ChunkStore, cfg: EngineConfig):
        self.model, self.store, self.cfg = model, store, cfg
        # the compiled step, once `warm` compiled it; until then (and under `--decode eager`)
        # steps run eager: the same arithmetic, op by op
        self.graph: DecodeGraph | None = None
        self.compiled = threading.Event()  # the compiled step serves, or never will
        self._after: list[Callable[[], None]] = []
        self._after_lock = threading.Lock()
        # recent decode steps: (whole step, the compiled graph's call) in ms; the difference
        # is the host's Python work around it (tables, staging, sampling)
        self.step_ms: deque[tuple[float, float]] = deque(maxlen=512)

    def warm(self, pool: BlockPool) -> None:
        """Compile what eager steps run for `pool`'s dtype now, so that no request waits for
        it, then the compiled decode step: now, or (`compile_in_background`, on a CPU) on a
        thread of its own while eager steps serve (on CUDA the step's graphs are also
        recorded over the pool's rows). `after_compiled` hooks run once it serves."""
        model, kv_dtype = self.model, pool.dtype
        omp.on_worker(lambda: warm_decode(model, kv_dtype))
        if self.cfg.decode != "compiled":
            self._done()
            return
        graph = DecodeGraph(model)

        def compile_step() -> None:
            try:
                graph.warm(kv_dtype)
                if model.device.type == "cuda":  # before any session holds blocks (see `capture`)
                    blocks = min(pool.num_blocks, key_width(model.cfg.max_position) // BLOCK_TOKENS)
                    graph.capture(pool.kv, self.cfg.max_batch, blocks)
                self.graph = graph
            finally:
                self._done()

        if self.cfg.compile_in_background and model.device.type == "cpu":
            # with the compute thread count: inductor writes its kernels' parallel loops for
            # the count of the thread that compiles (a serial thread's kernels stay serial)
            def background() -> None:
                omp.use_compute_threads()
                # compiling is Python for minutes, and every op of an eager step lets go of
                # the GIL and waits up to a switch interval to take it back: shorter turns
                # while it compiles, or a step of a few hundred ops waits seconds
                interval = sys.getswitchinterval()
                sys.setswitchinterval(COMPILING_SWITCH_S)
                try:
                    compile_step()
                except Exception:
                    log.exception("compiling the decode step failed; decode steps stay eager")
                finally:
                    sys.setswitchinterval(interval)

            log.info("compiling the decode step in the background; eager steps serve meanwhile")
            threading.Thread(target=background, name="hcache-compile", daemon=True).start()
        else:
            omp.on_worker(compile_step)

    def after_compiled(self, fn: Callable[[], None]) -> None:
        """Run `fn` once the decode step is compiled (now, if it is)."""
        with self._after_lock:
            if not self.compiled.is_set():
                self._after.append(fn)
                return
        fn()

    def _done(self) -> None:
        with self._after_lock:
            self.compiled.set()
            hooks, self._after = self._after, []
        for fn in hooks:
            fn()

    def start(self, seq: Sequence, plan: Plan | None, source: StateSource | None, fetched: Fetched | None) -> None:
        """The turn's job: restore by `plan` from `source` (when not resident), then prefill.
        Rows `fetched` from the cluster (read by the restore) are staged ahead of the turn's."""
        s = seq.session
        assert s.cache is not None
        assert fetched is None or seq.new_tokens, "rows are fetched for turns, which feed a token"
        saver = Saver(self.store, s.id, s.base, fetched) if seq.new_tokens else None
        seq.job = PrefillJob(
            self.model,
            s.cache,
            s.tokens[: seq.keep],
            seq.new_tokens,
            plan,
            source,
            saver,
            self.cfg.piece_tokens,
            self.cfg.fused,
        )
        if plan is not None:
            s.cache.length = 0
        seq.steps = seq.job.run()
        seq.sampler = Sampler(seq.params)

    def start_blend(self, seq: Sequence, docs: list[Document]) -> None:
        """The first turn of a blended session: its contexts placed from `docs`, then the rest."""
        s = seq.session
        assert s.cache is not None and seq.keep == 0
        n = len(s.meta.prefix)
        assert seq.new_tokens[:n] == s.meta.prefix, "a blend's first turn starts with its contexts"
        saver = Saver(self.store, s.id)
        suffix = seq.new_tokens[n:]
        seq.job = BlendJob(self.model, s.cache, docs, suffix, s.meta.fraction, saver, self.cfg.piece_tokens)
        s.cache.length = 0
        seq.steps = seq.job.run()
        seq.sampler = Sampler(seq.params)

    def prefill(self, jobs: list[Sequence], decoding: list[Sequence]) -> Progress:
        """Restore+prefill work, a layer at a time. While others decode, a time slice per step
        (their TBT grows by at most about the slice plus one layer); otherwise until every
        job waits on storage."""
        out = Progress()
        deadline = time.perf_counter() + self.cfg.prefill_slice_ms / 1e3 if decoding else math.inf
        for seq in list(jobs):
            while time.perf_counter() < deadline:
                try:
                    did = next(seq.steps)
                except StopIteration:
                    out.ended.append((seq, None))
                    out.worked = True
                    break
                except Exception as e:
                    log.exception("prefill of %s failed", seq.session.id)
                    out.ended.append((seq, e if isinstance(e, EngineError) else EngineError(f"prefill failed: {e}")))
                    out.worked = True
                    break
                if not did:  # storage is behind: let the next job or a decode step run
                    if not decoding and seq.job is not None:
                        seq.job.wait_storage(0.005)  # nothing else to run: block on the read a moment
                        out.worked = True
                    break
                out.worked = True
                restored = seq.job is not None and seq.job.report.restore_ms
                if restored and seq.phase == Phase.RESTORING and seq not in out.restored:
                    out.restored.append(seq)
            if time.perf_counter() >= deadline:
                break
        return out

    def first_token(self, seq: Sequence) -> int:
        assert seq.job is not None and seq.job.last_hidden is not None and seq.sampler is not None
        return seq.sampler(self.model.logits(seq.job.last_hidden)[0])

    def decode(self, batch: list[Sequence]) -> list[int]:
        """Feed each sequence's last sampled token; returns the next one of each."""
        m = self.model
        t0 = time.perf_counter()
        graph_ms = 0.0
        caches: list[PagedCache] = []
        for q in batch:
            assert q.session.cache is not None  # a decoding sequence's session is resident
            caches.append(q.session.cache)
        positions = [q.position for q in batch]
        staged = self.store.acquire([(q.session.id, q.position - q.session.base, 1) for q in batch])
        step: StepOut | None = None
        if self.graph is not None:
            t1 = time.perf_counter()
            step = self._graph_step(batch, caches, positions)
            graph_ms = (time.perf_counter() - t1) * 1e3
            logits = step.logits
        else:
            tokens = torch.tensor([q.generated[-1] for q in batch], device=m.device)
            h = m(tokens, torch.tensor(positions, device=m.device), BatchCache(caches), staged.hidden)
            logits = m.logits(h)
        finish_decode(self.store, staged, caches, positions, step)
        # a greedy choice is the graph's argmax: cheaper there than in an op of its own after it
        greedy = [None] * len(batch) if step is None else step.greedy.tolist()
        out = []
        for i, q in enumerate(batch):
            q.session.tokens.append(q.generated[-1])
            assert q.sampler is not None
            out.append(q.sampler(logits[i], greedy[i]))
        self.step_ms.append(((time.perf_counter() - t0) * 1e3, graph_ms))
        return out

    def _graph_step(self, batch: list[Sequence], caches: list[PagedCache], positions: list[int]) -> StepOut:
        assert self.graph is not None
        for c in caches:
            c.reserve(1)
        pool = caches[0].pool
        tokens = [q.generated[-1] for q in batch]
        out = self.graph(tokens, positions, [c.length for c in caches], [c.blocks for c in caches], pool.kv)
        for c in caches:
            c.length += 1
        return out
