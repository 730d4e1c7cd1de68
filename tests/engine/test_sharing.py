"""The engine's one seam to cluster mode (`engine/sharing.py`): every public call that
reaches beyond this process goes through its `Sharing`, in order, and a refusal there is
the caller's error, the lease going back. `Solo` is the default."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import tload
from engine_helpers import make_engine, wait_until, word_tokenizer

from hcache.engine.engine import Engine
from hcache.engine.sampler import SamplingParams
from hcache.engine.sharing import Solo
from hcache.storage.catalogue import Lease
from hcache.storage.errors import ClusterUnavailable


class Spy(Solo):
    """Solo's answers, with every call recorded; `refuse` names a call that raises."""

    def __init__(self, refuse: str = ""):
        self.calls: list[tuple[str, Any]] = []
        self.refuse = refuse
        self.attached: Any = None

    def _note(self, name: str, arg: Any) -> None:
        self.calls.append((name, arg))
        if name == self.refuse:
            raise ClusterUnavailable(f"{name} refused")

    def attach(self, engine: Any) -> None:
        self.attached = engine

    def before_create(self, context_ids: list[str], tenant: str | None) -> None:
        self._note("before_create", tuple(context_ids))

    def created(self, s: Any) -> None:
        self._note("created", s.id)

    def lease_turn(self, sid: str, tenant: str | None) -> Lease | None:
        self._note("lease_turn", sid)
        return Lease(sid, "spy", 1)

    def turn_refused(self, sid: str, lease: Lease) -> None:
        self._note("turn_refused", sid)

    def turn_queued(self, s: Any, keep: int) -> None:
        self._note("turn_queued", s.id)

    def commit(self, seq: Any, tokens: list[int], meta: dict[str, Any]) -> None:
        self._note("commit", seq.session.id)
        seq.lease = None

    def release(self, lease: Lease) -> None:
        self._note("release", lease.owner)

    def before_delete(self, sid: str, tenant: str | None) -> None:
        self._note("before_delete", sid)

    def get(self, sid: str, tenant: str | None) -> Any:
        self._note("get", sid)
        return None


@pytest.fixture
def tiny(tiny_folder):
    return tload(tiny_folder("llama_gqa"))


def engine(tiny, tmp_path, spy: Spy) -> tuple[Engine, Any]:
    return make_engine(tiny, word_tokenizer(tiny.cfg.vocab_size), [tmp_path / "s"], sharing=spy)


def test_a_turn_goes_through_the_seam_in_order(tiny, tmp_path):
    default, store = make_engine(tiny, word_tokenizer(tiny.cfg.vocab_size), [tmp_path / "d"])
    assert isinstance(default.sharing, Solo)
    default.close()
    store.close()
    spy = Spy()
    eng, store = engine(tiny, tmp_path, spy)
    try:
        assert spy.attached is eng
        s = eng.create_session()
        list(eng.stream(eng.generate(s.id, token_ids=[5, 6, 7], params=SamplingParams(max_new_tokens=3))))
        eng.get(s.id)
        eng.delete(s.id)
        order = ["before_create", "created", "lease_turn", "turn_queued", "commit", "get", "before_delete"]
        assert [c for c, _ in spy.calls] == order
        assert all(arg in ((), s.id) for _, arg in spy.calls)
    finally:
        eng.close()
        store.close()


def test_a_refusal_at_the_seam_fails_the_call_and_gives_the_lease_back(tiny, tmp_path):
    spy = Spy(refuse="commit")
    eng, store = engine(tiny, tmp_path, spy)
    try:
        s = eng.create_session()
        with pytest.raises(ClusterUnavailable):
            list(eng.stream(eng.generate(s.id, token_ids=[5, 6, 7], params=SamplingParams(max_new_tokens=3))))
        wait_until(lambda: ("release", s.id) in spy.calls, "the refused turn's lease to go back")
        # not acknowledged (the stream raised); the session takes requests again, and its next
        # lease brings it to the record's last turn (the cluster's word, not this store's)
        wait_until(lambda: not eng.get(s.id).busy, "the session to take requests again")
        spy.refuse = "before_delete"
        with pytest.raises(ClusterUnavailable):
            eng.delete(s.id)
        assert eng.get(s.id).id == s.id  # refused there: still here
    finally:
        eng.close()
        store.close()
