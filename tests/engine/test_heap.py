"""An engine keeps what existed when it started out of the cycle collector's full passes."""

from __future__ import annotations

import gc

from conftest import tload
from engine_helpers import make_engine, word_tokenizer


def _collected(obj: object) -> bool:
    """Would a full collection walk `obj`? (Frozen objects are in no generation.)"""
    return any(o is obj for o in gc.get_objects())


def test_what_the_engine_starts_with_is_frozen_until_it_closes(tmp_path, tiny_folder):
    model = tload(tiny_folder("llama_gqa"))
    before = [model]  # a tracked container made before the engine
    assert _collected(before)
    eng, store = make_engine(model, word_tokenizer(model.cfg.vocab_size), [tmp_path / "s"])
    try:
        assert not _collected(before) and not _collected(eng.lock)
        s = eng.create_session()  # made while serving: collected as usual
        assert _collected(s)
    finally:
        eng.close()
        store.close()
    assert _collected(before)  # closed: everything is collectable again
