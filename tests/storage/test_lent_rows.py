"""Reads that land in memory the caller lends (a cache's rows, `OwnerReader(into=...)`):
no copy follows them, and nothing lands once the reader has settled."""

from __future__ import annotations

import os

import pytest
import torch
from storage_helpers import GEOM, KINDS, dirs_in, expected, flip_byte, open_store, save

from hcache.model.cache import zeros_for_reads
from hcache.storage.errors import ChunkError
from hcache.storage.layout import Kind
from hcache.storage.reader import Want

KV_LAYERS = [i for i, k in enumerate(KINDS) if k == Kind.KV]
N = 200  # three whole chunks and a tail of 8 tokens


@pytest.fixture
def dirs(tmp_path):
    return dirs_in(tmp_path)


def _rows() -> dict[tuple[int, Kind], torch.Tensor]:
    """Each KV layer's rows, page-aligned as a cache lends them."""
    return {(i, Kind.KV): zeros_for_reads((N, 2, GEOM.kv_dim), torch.float32, torch.device("cpu")) for i in KV_LAYERS}


def _stored(st) -> None:
    st.create_owner("s", KINDS, "fp")
    save(st, "s", 0, N, KINDS)
    st.mark_durable("s", list(range(N)))


def test_kv_lands_in_the_rows_lent(dirs) -> None:
    with open_store(dirs) as st:
        _stored(st)
        rows = _rows()
        r = st.reader("s", wants=[Want(i, Kind.KV, 0, N) for i in KV_LAYERS], into=rows)
        for i in KV_LAYERS:
            got = r.get(i)
            assert got.data_ptr() == rows[(i, Kind.KV)].data_ptr()  # the lent rows themselves
            assert torch.equal(rows[(i, Kind.KV)], expected(i, Kind.KV, N))  # the tail's rows too
            r.release(i)
        # released, the rows stay the caller's: the reader's own buffers are others
        again = st.reader("s", wants=[Want(i, Kind.KV, 0, N) for i in KV_LAYERS])
        for i in KV_LAYERS:
            assert torch.equal(again.get(i), expected(i, Kind.KV, N))
            assert all(again.get(i).data_ptr() != t.data_ptr() for t in rows.values())


def test_rows_made_in_inference_mode_take_the_tail_too(dirs) -> None:
    """A cache made inside the engine's loop holds inference tensors; the tail, copied in by
    a reader thread, lands in them all the same."""
    with open_store(dirs) as st:
        _stored(st)
        with torch.inference_mode():
            rows = _rows()
        r = st.reader("s", wants=[Want(i, Kind.KV, 0, N) for i in KV_LAYERS], into=rows)
        for i in KV_LAYERS:
            assert torch.equal(r.get(i), expected(i, Kind.KV, N))


def test_rows_of_another_shape_are_refused(dirs) -> None:
    with open_store(dirs) as st:
        _stored(st)
        rows = _rows()
        rows[(KV_LAYERS[0], Kind.KV)] = rows[(KV_LAYERS[0], Kind.KV)][:-1]
        with pytest.raises(ValueError, match="contiguous"):
            st.reader("s", wants=[Want(i, Kind.KV, 0, N) for i in KV_LAYERS], into=rows)


def test_nothing_lands_after_settle(dirs) -> None:
    """Read ahead one layer at a time, a request per layer: at `settle` the first layer's
    reads are queued, in flight or done (a queued one is dropped), and the last's were never
    asked of the disk. The last's rows stay as they were, and asking for it fails naming the
    drop, never waits."""
    with open_store(dirs, prefetch_bytes=1, request_layers=1) as st:
        _stored(st)
        rows = _rows()
        r = st.reader("s", window=1, wants=[Want(i, Kind.KV, 0, N) for i in KV_LAYERS], into=rows)
        r.settle()
        first, last = KV_LAYERS[0], KV_LAYERS[-1]
        r.ready(last)  # moves the read-ahead window over the last layer: issues nothing now
        r.settle()  # (would wait out what it issued)
        try:
            assert torch.equal(r.get(first), expected(first, Kind.KV, N))
        except ChunkError as e:
            assert e.reason == "read dropped"
        assert not rows[(last, Kind.KV)].any()
        with pytest.raises(ChunkError, match="read dropped"):
            r.get(last)


def test_a_bad_chunk_inside_a_run_fails_alone(tmp_path) -> None:
    """One directory: each layer's chunks lie in consecutive slots and are read, and checked,
    as one run. A flipped byte in the middle one fails that chunk by name; the run's other
    chunks land whole, and every other layer is untouched."""
    n = 5 * 64
    with open_store(dirs_in(tmp_path, 1)) as st:
        st.create_owner("s", KINDS, "fp")
        save(st, "s", 0, n, KINDS)
        st.mark_durable("s", list(range(n)))
        layer = KV_LAYERS[0]
        chunks = sorted(
            (r for r in st.manifest.chunks("s") if (r.layer, r.kind) == (layer, Kind.KV.value)), key=lambda r: r.idx
        )
        assert [r.slot - chunks[0].slot for r in chunks[:4]] == list(range(4))  # one run of four, at least
        flip_byte(st, chunks[2])
        rows = {k: zeros_for_reads((n, 2, GEOM.kv_dim), torch.float32, torch.device("cpu")) for k in _rows()}
        r = st.reader("s", wants=[Want(i, Kind.KV, 0, n) for i in KV_LAYERS], into=rows)
        with pytest.raises(ChunkError, match=f"layer {layer} chunk 2: checksum mismatch"):
            r.get(layer)
        got, want = rows[(layer, Kind.KV)], expected(layer, Kind.KV, n)
        assert torch.equal(got[:128], want[:128]) and torch.equal(got[192:], want[192:])
        assert not torch.equal(got[128:192], want[128:192])
        for i in KV_LAYERS[1:]:
            assert torch.equal(r.get(i), expected(i, Kind.KV, n))
        assert st.stats.checksum_failures == 1
        r.settle()


def test_a_slab_cut_short_fails_the_chunks_past_its_end_only(dirs) -> None:
    """A slab file shorter than its slots (a lost tail, or a hand's `truncate`): the chunks
    whose slots it no longer holds whole fail by name, never read as zeros, and every other
    part still lands."""
    with open_store(dirs) as st:
        _stored(st)
        kv = [r for r in st.manifest.chunks("s") if r.kind == Kind.KV.value]
        cut = max(kv, key=lambda r: (r.dir, r.slab, r.slot))  # the last slot of a KV slab
        same = [r for r in st.manifest.chunks("s") if (r.dir, r.slab) == (cut.dir, cut.slab)]
        assert max(r.slot for r in same) == cut.slot  # nothing else lies past the cut
        slot_bytes = st.placement.slab(cut.dir, cut.slab).slot_bytes
        os.truncate(st.dirs[cut.dir] / f"{cut.slab}.slab", cut.slot * slot_bytes + slot_bytes // 2)
        rows = _rows()
        r = st.reader("s", wants=[Want(i, Kind.KV, 0, N) for i in KV_LAYERS], into=rows)
        for i in KV_LAYERS:
            if i == cut.layer:
                with pytest.raises(ChunkError, match=f"chunk {cut.idx}.*beyond the end of its slab"):
                    r.get(i)
            else:
                assert torch.equal(r.get(i), expected(i, Kind.KV, N))
        r.settle()
