"""A KV restore reads the stored chunks straight into the session's pool rows (no copy
after the read), and the session continues as if it had never been evicted."""

from __future__ import annotations

import random

import pytest
from conftest import DEVICE, tload
from engine_helpers import make_engine, reference, turn, word_tokenizer

from hcache.engine.sampler import SamplingParams
from hcache.restore.plan import Method
from hcache.storage import reader
from hcache.storage.layout import Kind


def test_a_kv_restore_reads_into_the_pool_rows(tiny_folder, tmp_path, monkeypatch) -> None:
    if DEVICE != "cpu":
        pytest.skip("reads land in the pool's own rows only where the pool is host memory")
    lent: list[dict] = []
    made = reader.OwnerReader.__init__

    def watched(self, owner, wants, window, index, parts, into=None) -> None:
        lent.append(dict(into or {}))
        made(self, owner, wants, window, index, parts, into)

    monkeypatch.setattr(reader.OwnerReader, "__init__", watched)
    tiny = tload(tiny_folder("llama_gqa"))
    eng, store = make_engine(tiny, word_tokenizer(tiny.cfg.vocab_size), [tmp_path / "a", tmp_path / "b"])
    try:
        rng = random.Random(3)
        p = SamplingParams(max_new_tokens=5)
        s = eng.create_session()
        first = [rng.randrange(300) for _ in range(150)]  # two whole chunks and a tail
        got, _ = turn(eng, s.id, token_ids=first, params=p)
        history = [*first, *got]
        eng.evict(s.id)
        lent.clear()
        r = eng.restore(s.id, Method.KV)
        assert not r.fallback_layers
        (rows,) = lent
        assert sorted(rows) == [(layer, Kind.KV) for layer in range(tiny.cfg.num_layers)]
        for (layer, _), t in rows.items():
            pool = eng.pool.kv[layer]
            start = pool.data_ptr()
            assert start <= t.data_ptr() < start + pool.numel() * pool.element_size()  # the pool's own rows
        new = [rng.randrange(300) for _ in range(20)]
        got, _ = turn(eng, s.id, token_ids=new, params=p)
        assert got == reference(tiny, [*history, *new], p, set())
    finally:
        eng.close()
        store.close()
