"""Restore sources over the chunk store: a session's own chunks, and a session on a shared
context, whose tokens before `base` come from the context."""

from __future__ import annotations

import torch
from storage_helpers import GEOM, KINDS, h_rows, kv_rows, save

from hcache.config import StorageConfig
from hcache.restore.sources import SharedSource, StoreSource
from hcache.restore.state import StateUnavailable
from hcache.storage.layout import Kind
from hcache.storage.store import ChunkStore

BASE, OWN = 100, 80  # the context's tokens, the session's own after them


def _shared(store: ChunkStore) -> SharedSource:
    store.create_owner("ctx", KINDS, "fp", kind="context")
    save(store, "ctx", 0, BASE)
    store.mark_durable("ctx", list(range(BASE)))
    store.create_owner("s", KINDS, "fp")
    save(store, "s", 0, OWN, salt=0.5)  # own rows restart at index 0, marked by the salt
    store.mark_durable("s", list(range(OWN)))
    return SharedSource(StoreSource(store, "ctx", "fp"), StoreSource(store, "s", "fp"), BASE)


def test_shared_source_reads_only_the_asked_token_range(tmp_path) -> None:
    """A token range that straddles the context's end reads the context's rows up to `base`
    and the session's own from index 0, and nothing else (whole layers were returned)."""
    with ChunkStore(StorageConfig([str(tmp_path)]), GEOM, torch.float32) as store:
        src = _shared(store)
        lo, hi = 90, 130
        h = src.hidden(1, lo, hi)
        want = torch.cat([h_rows(1, lo, BASE - lo), h_rows(1, 0, hi - BASE, salt=0.5)])
        assert torch.equal(h, want)
        k, v = src.kv(2, lo, hi)
        want_kv = torch.cat([kv_rows(2, lo, BASE - lo), kv_rows(2, 0, hi - BASE, salt=0.5)])
        assert torch.equal(k.flatten(1), want_kv[:, 0]) and torch.equal(v.flatten(1), want_kv[:, 1])
        assert torch.equal(src.hidden(3, 10, 20), h_rows(3, 10, 10))  # within the context only
        assert torch.equal(src.hidden(3, 120, 150), h_rows(3, 20, 30, salt=0.5))  # within its own only
        assert len(src.tokens) == BASE + OWN


def test_shared_source_splits_a_tokenwise_restore_at_the_context_boundary(tmp_path) -> None:
    with ChunkStore(StorageConfig([str(tmp_path)]), GEOM, torch.float32) as store:
        src = _shared(store)
        src.prepare_split(120)  # H for tokens 0..119, KV from 120 on
        layer = next(i for i, k in enumerate(KINDS) if k == Kind.HIDDEN)
        assert torch.equal(src.hidden(layer, 0, 120), torch.cat([h_rows(layer, 0, BASE), h_rows(layer, 0, 20, 0.5)]))


def test_a_missing_kind_is_unavailable_not_a_storage_error(tmp_path) -> None:
    """The executor recomputes what a source cannot give; storage errors stay below it."""
    with ChunkStore(StorageConfig([str(tmp_path)]), GEOM, torch.float32) as store:
        src = _shared(store)
        try:
            src.kv(1)  # layer 1 stores H only
        except StateUnavailable as e:
            assert e.layer == 1
        else:
            raise AssertionError("reading a kind the layer does not store must fail")
