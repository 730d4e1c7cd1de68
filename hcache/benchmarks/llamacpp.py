"""llama.cpp, the peer in `bench/peers.py`, through llama-cpp-python on the default GGUF
file: prefill, a sequence's state saved to a file and loaded back from the disk (not the
page cache), the TTFT of a new turn after the load, and batched decode."""

from __future__ import annotations

import ctypes
import os
import statistics
import time
from pathlib import Path
from typing import Any

from hcache.model.loader import default_model_path

TURN = 32
REPEATS = 3  # evictions and turns per context for the TTFT rows: medians (disks and VMs jitter)


def llama(n_ctx: int, threads: int, logits_all: bool = False) -> Any:
    """The default GGUF file in llama.cpp, on `threads` threads."""
    import llama_cpp

    base = llama_cpp.llama_model_default_params

    def without_extra_bufts() -> Any:  # its AMX repacking kernels crash on this CPU
        p = base()
        p.use_extra_bufts = False
        return p

    llama_cpp.llama_model_default_params = without_extra_bufts
    try:
        return llama_cpp.Llama(
            model_path=str(default_model_path()),
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


def llama_cpp_rows(doc: list[int], turn: list[int], contexts: list[int], scratch: Path, threads: int) -> list[dict]:
    import llama_cpp
    import numpy as np

    llm = llama(max(contexts) + 2 * TURN, threads)
    rows = []
    for n in contexts:
        ids = doc[:n]
        llm.reset()
        t = time.perf_counter()
        llm.eval(ids)
        prefill = time.perf_counter() - t
        path = scratch / f"llama-seq-{n}.bin"
        arr = (llama_cpp.llama_token * n)(*ids)
        t = time.perf_counter()
        nbytes = llama_cpp.llama_state_seq_save_file(llm.ctx, str(path).encode(), 0, arr, n)
        save = time.perf_counter() - t
        loads, turns = [], []
        for _ in range(REPEATS):
            _drop_from_page_cache(path)
            llm.reset()
            out = (llama_cpp.llama_token * (n + 1))()
            got = ctypes.c_size_t(0)
            t = time.perf_counter()
            ok = llama_cpp.llama_state_seq_load_file(llm.ctx, str(path).encode(), 0, out, n + 1, ctypes.byref(got))
            loads.append(time.perf_counter() - t)
            if not ok or got.value != n:
                raise RuntimeError(f"llama.cpp could not load its state back ({got.value} of {n} tokens)")
            llm.n_tokens = n
            llm.input_ids[:n] = ids
            t = time.perf_counter()
            llm.eval(turn)
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
            int(logits.argmax())  # the first token of the reply
            turns.append(time.perf_counter() - t)
        load_s, turn_s = statistics.median(loads), statistics.median(turns)
        rows.append(
            {
                "system": "llama.cpp",
                "tokens": n,
                "prefill_ms": prefill * 1e3,
                "save_ms": save * 1e3,
                "state_bytes": nbytes,
                "load_ms": load_s * 1e3,
                "turn_ms": turn_s * 1e3,
                "ttft_after_eviction_ms": statistics.median(a + b for a, b in zip(loads, turns, strict=True)) * 1e3,
            }
        )
        path.unlink()
        print(f"llama.cpp {n}: {rows[-1]}", flush=True)
    return rows


def _fill(batch: Any, items: list[tuple[int, int, int, bool]]) -> None:
    """(token, position, sequence, wants logits) per row of a llama_batch."""
    batch.n_tokens = len(items)
    for k, (tok, pos, seq, logits) in enumerate(items):
        batch.token[k], batch.pos[k], batch.n_seq_id[k] = tok, pos, 1
        batch.seq_id[k][0], batch.logits[k] = seq, logits


def llama_cpp_decode(doc: list[int], batches: list[int], prompt: int, steps: int, threads: int) -> dict[str, float]:
    """Batch 1 through the high-level API; batch B with B sequences in one llama_batch per step."""
    import llama_cpp
    import numpy as np

    out: dict[str, float] = {}
    llm = llama(max(batches) * (prompt + steps + 8), threads)
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
