"""llama.cpp, the peer in `bench/peers.py`, through llama-cpp-python on the benchmark's GGUF
file (the default model's unless told): prefill, a sequence's state saved to a file and
loaded back from the disk (not the page cache), the TTFT of a new turn after the load, and
batched decode; in a process of its own (`Peer`)."""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hcache
from hcache.model.loader import resolve_model_path

TURN = 32
REPEATS = 5  # rounds of each measure the two systems take turns in: medians (disks and VMs jitter)
# rounds of the TTFT after an eviction, the closest ratio and a cheap one (a round is about a
# second): with 5, one run's medians of the same code moved by 15%
EVICTION_ROUNDS = 11


def llama(n_ctx: int, threads: int, logits_all: bool = False, model: str = "default") -> Any:
    """`model`'s GGUF file (a name or a path) in llama.cpp, on `threads` threads."""
    import llama_cpp

    base = llama_cpp.llama_model_default_params

    def without_extra_bufts() -> Any:  # its AMX repacking kernels crash on this CPU
        p = base()
        p.use_extra_bufts = False
        return p

    llama_cpp.llama_model_default_params = without_extra_bufts
    try:
        return llama_cpp.Llama(
            model_path=str(resolve_model_path(model)),
            n_ctx=n_ctx,
            n_batch=512,
            n_threads=threads,
            n_threads_batch=threads,
            logits_all=logits_all,
            verbose=False,
        )
    finally:
        llama_cpp.llama_model_default_params = base


def _drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def llama_cpp_rows(
    doc: list[int], turn: list[int], contexts: list[int], scratch: Path, threads: int, model: str = "default"
) -> list[dict]:
    """llama.cpp's rows alone, in this process (the peers benchmark with hcache skipped)."""
    me = _Llama(max(contexts) + 2 * TURN, threads, scratch, model)
    rows = []
    for n in contexts:
        row = {"system": "llama.cpp", "tokens": n} | me.prepare(doc[:n])
        loads, turns = zip(*(me.load_turn(doc[:n], turn) for _ in range(EVICTION_ROUNDS)), strict=True)
        rows.append(row | eviction_row(list(loads), list(turns)))
        me.forget(n)
        print(f"llama.cpp {n}: {rows[-1]}", flush=True)
    return rows


def eviction_row(loads: list[float], turns: list[float]) -> dict[str, float]:
    """Medians of the load, the turn and their sum over the rounds (ms)."""
    return {
        "load_ms": statistics.median(loads),
        "turn_ms": statistics.median(turns),
        "ttft_after_eviction_ms": statistics.median(a + b for a, b in zip(loads, turns, strict=True)),
        "ttft_rounds_ms": [a + b for a, b in zip(loads, turns, strict=True)],
    }


class Peer:
    """llama.cpp in a child process of its own, driven a call at a time (the caller waits,
    so the two systems never run at once). hcache's measurements and llama.cpp's take turns
    round by round: this VM's speed drifts by up to 15% over minutes, and measuring one
    system after the other put that drift into their ratio. In its own process llama.cpp's
    OpenMP teams never meet torch's, and its environment is the user's, without hcache's
    own settings (`hcache.OWN_ENV`: its libgomp reads them too)."""

    def __init__(self, n_ctx: int, threads: int, scratch: Path, model: str = "default"):
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, n_ctx, threads, str(scratch), model), daemon=True)
        with users_env():
            self._proc.start()

    def call(self, name: str, *args: Any) -> Any:
        self._conn.send((name, args))
        ok, value = self._conn.recv()
        if not ok:
            raise RuntimeError(f"llama.cpp ({name}): {value}")
        return value

    def close(self) -> None:
        if self._proc.is_alive():
            self._conn.send(None)
            self._proc.join(30)
        self._conn.close()


@contextlib.contextmanager
def users_env() -> Iterator[None]:
    """The environment without the settings hcache made itself, while a child starts."""
    own = {k: os.environ.pop(k) for k in hcache.OWN_ENV if os.environ.get(k) == hcache.OWN_ENV[k]}
    try:
        yield
    finally:
        os.environ.update(own)


def _serve(conn: Any, n_ctx: int, threads: int, scratch: str, model: str) -> None:
    """The child: a `_Llama` answering `Peer.call`s until told to stop."""
    me = _Llama(n_ctx, threads, Path(scratch), model)
    while (msg := conn.recv()) is not None:
        name, args = msg
        try:
            conn.send((True, getattr(me, name)(*args)))
        except Exception as e:  # the parent raises it
            conn.send((False, f"{type(e).__name__}: {e}"))


class _Llama:
    def __init__(self, n_ctx: int, threads: int, scratch: Path, model: str = "default"):
        self.threads, self.scratch, self.model = threads, scratch, model
        self.llm = llama(n_ctx, threads, model=model)

    def _path(self, n: int) -> Path:
        return self.scratch / f"llama-seq-{n}.bin"

    def prepare(self, ids: list[int]) -> dict[str, float]:
        """Prefill `ids` (token recompute) and save the sequence's state to a file."""
        import llama_cpp

        n = len(ids)
        self.llm.reset()
        t = time.perf_counter()
        self.llm.eval(ids)
        prefill = time.perf_counter() - t
        arr = (llama_cpp.llama_token * n)(*ids)
        t = time.perf_counter()
        nbytes = llama_cpp.llama_state_seq_save_file(self.llm.ctx, str(self._path(n)).encode(), 0, arr, n)
        return {"prefill_ms": prefill * 1e3, "save_ms": (time.perf_counter() - t) * 1e3, "state_bytes": nbytes}

    def load_turn(self, ids: list[int], turn: list[int]) -> tuple[float, float]:
        """One eviction: the state file of `ids` loaded from the disk (not the page cache), then
        a new turn to its first token; (load ms, turn ms)."""
        import llama_cpp
        import numpy as np

        n = len(ids)
        path = self._path(n)
        _drop_from_page_cache(path)
        self.llm.reset()
        out = (llama_cpp.llama_token * (n + 1))()
        got = ctypes.c_size_t(0)
        t = time.perf_counter()
        ok = llama_cpp.llama_state_seq_load_file(self.llm.ctx, str(path).encode(), 0, out, n + 1, ctypes.byref(got))
        load = time.perf_counter() - t
        if not ok or got.value != n:
            raise RuntimeError(f"llama.cpp could not load its state back ({got.value} of {n} tokens)")
        self.llm.n_tokens = n
        self.llm.input_ids[:n] = ids
        t = time.perf_counter()
        self.llm.eval(turn)
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.llm.n_vocab(),))
        int(logits.argmax())  # the first token of the reply
        return load * 1e3, (time.perf_counter() - t) * 1e3

    def ttft(self, ids: list[int]) -> float:
        """A prefill of `ids` from nothing to the first token of its reply (ms)."""
        import llama_cpp
        import numpy as np

        self.llm.reset()
        t = time.perf_counter()
        self.llm.eval(ids)
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.llm.n_vocab(),))
        int(logits.argmax())
        return (time.perf_counter() - t) * 1e3

    def forget(self, n: int) -> None:
        self._path(n).unlink(missing_ok=True)

    def decode(self, doc: list[int], batches: list[int], prompt: int, steps: int) -> dict[str, float]:
        return llama_cpp_decode(doc, batches, prompt, steps, self.threads, self.model)


def _fill(batch: Any, items: list[tuple[int, int, int, bool]]) -> None:
    """(token, position, sequence, wants logits) per row of a llama_batch."""
    batch.n_tokens = len(items)
    for k, (tok, pos, seq, logits) in enumerate(items):
        batch.token[k], batch.pos[k], batch.n_seq_id[k] = tok, pos, 1
        batch.seq_id[k][0], batch.logits[k] = seq, logits


def llama_cpp_decode(
    doc: list[int], batches: list[int], prompt: int, steps: int, threads: int, model: str = "default"
) -> dict[str, float]:
    """Batch 1 through the high-level API; batch B with B sequences in one llama_batch per step."""
    import llama_cpp
    import numpy as np

    out: dict[str, float] = {}
    llm = llama(max(batches) * (prompt + steps + 8), threads, model=model)
    if 1 in batches:
        llm.eval(doc[:prompt])
        tbt = []
        for i in range(steps):
            t = time.perf_counter()
            llm.eval([doc[prompt + i]])
            tbt.append(time.perf_counter() - t)
        out["tbt_b1_ms"] = statistics.median(tbt) * 1e3
    for b in [x for x in batches if x > 1]:
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = b * (prompt + steps + 8), 512, 512
        params.n_seq_max, params.n_threads, params.n_threads_batch = b, threads, threads
        ctx = llama_cpp.llama_init_from_model(llm._model.model, params)
        batch = llama_cpp.llama_batch_init(max(prompt, b), 0, 1)
        vocab = llm.n_vocab()

        try:
            for s in range(b):
                _fill(batch, [(doc[(s * 7 + j) % len(doc)], j, s, j == prompt - 1) for j in range(prompt)])
                if llama_cpp.llama_decode(ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed")
            nxt = [0] * b
            times = []
            for step in range(steps):
                _fill(batch, [(nxt[s], prompt + step, s, True) for s in range(b)])
                t = time.perf_counter()
                if llama_cpp.llama_decode(ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed")
                for s in range(b):
                    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, s), shape=(vocab,))
                    nxt[s] = int(logits.argmax())
                times.append(time.perf_counter() - t)
            out[f"tokens_per_s_b{b}"] = b / statistics.median(times)
        finally:
            llama_cpp.llama_batch_free(batch)
            llama_cpp.llama_free(ctx)
    return out
