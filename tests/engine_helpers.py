"""An engine over a tiny random model (token turns) or the default model, on a temp store,
and the single-sequence reference it must match."""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

from hcache.cluster.link import ClusterLink
from hcache.cluster.sharing import ClusterSharing
from hcache.config import EngineConfig, StorageConfig
from hcache.engine.block_pool import resident_kv_dtype
from hcache.engine.engine import Engine
from hcache.engine.generate import generate
from hcache.engine.sampler import SamplingParams
from hcache.engine.sharing import Sharing
from hcache.model.base import DecoderModel
from hcache.model.cache import KVCache
from hcache.model.tokenizer import Tokenizer
from hcache.restore.profile import Geometry, Profile
from hcache.storage.store import ChunkStore


def word_tokenizer(vocab: int) -> Tokenizer:
    """Token i is the word `t<i>`; no chat template (token turns only)."""
    backend = Backend(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(backend, None, None, None, stop_ids=set())


def profile_for(model: DecoderModel) -> Profile:
    return Profile.hypothetical(Geometry.of(model.cfg, torch.finfo(model.dtype).bits // 8), 0.2, 1.0)


def make_engine(
    model: DecoderModel,
    tok: Tokenizer,
    dirs: list[Path],
    storage: dict | None = None,
    cluster: ClusterLink | None = None,
    sharing: Sharing | None = None,
    **cfg: object,
) -> tuple[Engine, ChunkStore]:
    """An engine on a fresh store in `dirs`; `cluster`: shared through that link, or `sharing`."""
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
    kv_dtype = resident_kv_dtype(str(cfg.get("kv_dtype", "auto")), model)
    store = ChunkStore(
        StorageConfig([str(d) for d in dirs], **(storage or {})), model.cfg, model.dtype, str(model.device), kv_dtype
    )
    # tests' many small engines fault their pools in on use (tests/engine/test_pool_prefault.py tests the prefault)
    base = {"store_kinds": "both", "kv_budget_bytes": 64 << 20, "compile_in_background": False, "prefault_pool": False}
    ecfg = EngineConfig(**{**base, **cfg})  # type: ignore[arg-type]
    sharing = ClusterSharing(cluster) if cluster is not None else sharing
    return Engine(model, tok, store, profile_for(model), ecfg, sharing=sharing), store


def reference(
    model: DecoderModel, ids: list[int], params: SamplingParams, stop_ids: set[int], kv_dtype: torch.dtype | None = None
) -> list[int]:
    """Never-evicted single-sequence generation over the whole history `ids`."""
    cache = KVCache(model.cfg, kv_dtype or model.dtype, model.device)
    return list(generate(model, cache, ids, params, stop_ids))


def agrees_up_to_ties(
    model: DecoderModel, ids: list[int], got: list[int], params: SamplingParams, kv_dtype: torch.dtype, tie: float
) -> None:
    """Assert that `got` is the greedy continuation of `ids` (`reference`), except where the
    reference's two best logits lie within `tie` of each other and `got` took the second:
    a cache that holds the same K/V rounded differently (pieces against one pass, H
    projected apart from the forward) may break such a tie either way. After a tie the
    check goes on from `got`'s choice."""
    done = 0
    while done < len(got):
        rest = SamplingParams(max_new_tokens=len(got) - done)
        ref = reference(model, [*ids, *got[:done]], rest, set(), kv_dtype)
        i = next((j for j in range(len(ref)) if ref[j] != got[done + j]), None)
        if i is None:
            assert len(ref) == len(got) - done
            return
        cache = KVCache(model.cfg, kv_dtype, model.device)
        prefix = [*ids, *got[: done + i]]
        with torch.no_grad():
            h = model(torch.tensor(prefix, device=model.device), torch.arange(len(prefix), device=model.device), cache)
            top = model.logits(h[-1]).float().topk(2)
        first, second = top.indices.tolist()
        gap = (top.values[0] - top.values[1]).item()
        # a near-tie: the one-pass forward may order the two either way too
        assert {first, second} == {ref[i], got[done + i]} and gap <= tie, (
            f"token {done + i}: got {got[done + i]}, greedy {ref[i]} by a logit gap of {gap:.4f}"
        )
        done += i + 1


def turn(engine: Engine, sid: str, **kw: object) -> tuple[list[int], dict]:
    seq = engine.generate(sid, **kw)  # type: ignore[arg-type]
    ids: list[int] = []
    stats: dict = {}
    for ev in engine.stream(seq):
        ids += ev.token_ids
        if ev.finished:
            stats = asdict(ev.stats) if ev.stats else {}
    return ids, stats


def http_get(url: str, timeout: float = 30) -> tuple[int, str]:
    """(status, body) of a GET, errors included."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


# A served process's start, awaited by tests that do not time it (test_first_start does): on a
# fresh machine the first one compiles every kernel cold, sharing 2 CPUs with another test's.
SERVER_START_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(cond: Callable[[], object], what: str, timeout: float = 60, every: float = 0.01) -> None:
    """Poll `cond` until it holds; fail naming `what` after `timeout` seconds (generous: a
    bound on a hang, never a claim about speed)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every)
