"""The engine's loop thread: continuous batching. Each step admits waiting sequences
(scheduler), runs one batched decode step and advances restore+prefill jobs a layer at a
time (runner), so a restoring session never stalls the others. A step runs under the
engine's lock; the public calls (engine.py) only queue work and wake the loop."""

from __future__ import annotations

import logging
import threading
import time

import torch

from hcache import omp
from hcache.engine.compose import documents
from hcache.engine.errors import EngineError, FailedPrecondition, ResourceExhausted
from hcache.engine.finisher import Finisher
from hcache.engine.parts import Parts
from hcache.engine.reclaimer import Reclaimer
from hcache.engine.runner import Runner
from hcache.engine.sequence import Sequence
from hcache.malloc import trim_when_idle
from hcache.restore.plan import Method
from hcache.restore.planning import RestorePlanner
from hcache.storage.errors import StorageError

log = logging.getLogger(__name__)
INTERNAL = "internal error in the engine; see the server log"


class Loop:
    def __init__(self, parts: Parts, planner: RestorePlanner, runner: Runner, finisher: Finisher, reclaimer: Reclaimer):
        self.parts, self.scheduler, self.planner = parts, parts.scheduler, planner
        self.runner, self.finisher, self.reclaimer = runner, finisher, reclaimer
        self._stop = False
        self._threads = omp.compute_threads()
        self._thread = threading.Thread(target=self._run, name="hcache-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self.parts.work.set()
        self._thread.join()

    def _run(self) -> None:
        p = self.parts
        if self.runner.model.device.type == "cpu":
            torch.set_grad_enabled(False)
            omp.use_compute_threads(self._threads)
        with torch.inference_mode():
            while not self._stop:
                try:
                    with p.lock.step():
                        worked = self._step()
                except Exception:  # a bug must not kill the loop silently: fail what was running
                    log.exception("engine step failed")
                    with p.lock:
                        for seq in [*self.scheduler.prefilling, *self.scheduler.decoding]:
                            self.finisher.fail(seq, EngineError(INTERNAL))
                    worked = True
                if not worked:
                    p.store.send_held()  # the decode steps' last rows go on to disk
                    trim_when_idle()
                    p.work.wait(0.05)
                    p.work.clear()

    def _step(self) -> bool:
        """Admit what fits, one decode step over the batch, restore+prefill in the time left."""
        worked = self._admit()
        if self.scheduler.decoding:
            self._decode()
            worked = True
        return self._prefill() or worked

    def _admit(self) -> bool:
        worked = False
        for seq, refused in self.scheduler.admit():
            if refused is None:
                try:
                    if not self.reclaimer.has_room(seq):
                        self.scheduler.waiting.appendleft(seq)  # no blocks taken yet: it keeps its place
                        return worked
                except ResourceExhausted as e:  # more than the whole store holds
                    refused = e
            worked = True
            if refused is not None:
                self.finisher.fail(seq, refused)
                continue
            try:
                self._start(seq)
            except EngineError as e:
                self.finisher.fail(seq, e)
            except StorageError as e:
                self.finisher.fail(seq, FailedPrecondition(str(e)))
            except Exception:  # it left the queue: failing the step would not fail it
                log.exception("starting a turn of %s failed", seq.session.id)
                self.finisher.fail(seq, EngineError(INTERNAL))
        return worked

    def _start(self, seq: Sequence) -> None:
        s, p = seq.session, self.parts
        store, cap = p.store, p.store.cfg.read_cap_gbps or None  # the store's token bucket holds reads to it
        seq.t_start = time.perf_counter()
        plan = source = None
        fetched = s.fetched  # cleared once the job holds it: until then a failure drops it
        if fetched is not None and seq.keep - s.base <= fetched.start:
            fetched = None  # the conversation was re-rendered before them: they are not used
        if fetched is not None:
            fetched = fetched.head(seq.keep - s.base - fetched.start)
        if s.cache is None and seq.keep:
            if s.error:
                raise FailedPrecondition(s.error)
            plan, seq.predicted_ms = self.planner.plan(s.lineage, seq.keep, seq.restore_method, cap, fetched)
        if seq.keep < len(s.tokens):  # the conversation was re-rendered differently: drop the rest
            if s.cache is not None:
                s.cache.truncate(seq.keep)
            if fetched is None:
                store.truncate(s.id, seq.keep - s.base)
            del s.tokens[seq.keep :]
        if fetched is not None:
            p.sharing.used(fetched)
        if plan is not None:
            source = self.planner.source(s.lineage, s.tokens, seq.keep, fetched)
            seq.plan = plan
        blend = None
        if s.meta.compose and not s.tokens:
            blend = documents(p.registry, self.planner, s, seq.restore_method, cap)
        self.scheduler.allocate(seq)
        if blend is not None:
            self.runner.start_blend(seq, blend)
        else:
            self.runner.start(seq, plan, source, fetched)
        s.fetched = None
        s.last_used = time.monotonic()
        self.scheduler.to_prefill(seq, restoring=plan is not None)

    def _prefill(self) -> bool:
        progress = self.runner.prefill(self.scheduler.prefilling, self.scheduler.decoding)
        for seq in progress.restored:
            self.scheduler.restored(seq)
        for seq, error in progress.ended:
            if error is not None:
                self.finisher.fail(seq, error)
            else:
                self._prefilled(seq)
        return progress.worked

    def _prefilled(self, seq: Sequence) -> None:
        s, job, p = seq.session, seq.job, self.parts
        assert job is not None
        rep = job.report
        s.tokens[seq.keep :] = seq.new_tokens
        if seq.plan is not None:
            p.counters.restores += 1
            p.counters.fallback_layers += rep.fallback_layers
            s.last_plan, s.last_restore_ms = seq.plan, rep.restore_ms
            counts = seq.plan.counts()
            mix = "+".join(m.short for m in Method if counts[m.value])
            p.telemetry.on_restore(mix, seq.plan.mix(), rep.restore_ms)
        if seq.restore_only:
            seq.restored = seq.restore_result()
        if seq.restore_only or not seq.sample:
            self.finisher.finish(seq, "restored" if seq.restore_only else "stored")
            return
        token = self.runner.first_token(seq)
        seq.t_first = time.perf_counter()
        p.telemetry.on_ttft((seq.t_first - seq.t_submit) * 1e3)
        self.scheduler.to_decode(seq)
        self._emit(seq, token)

    def _decode(self) -> None:
        batch = self.scheduler.decode_batch()
        tokens = self.runner.decode(batch)
        now = time.perf_counter()
        for seq, token in zip(batch, tokens, strict=True):
            seq.tbt_ms.append((now - seq.t_last) * 1e3)
            self.parts.telemetry.on_tbt(seq.tbt_ms[-1])
            self._emit(seq, token)
        self.scheduler.rotate(batch)

    def _emit(self, seq: Sequence, token: int) -> None:
        event, reason = seq.push(token)
        self.parts.counters.generated_tokens += 1
        seq.events.put(event)
        if reason:
            self.finisher.finish(seq, reason)
