"""The engine benchmark's I/O-only reader process (hcache/benchmarks/ioload.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hcache.benchmarks.ioload import pieces, read_all

MB = 1 << 20


def _file(path: Path, nbytes: int) -> str:
    path.write_bytes(os.urandom(nbytes))
    return str(path)


def test_requests_cover_the_bytes_asked_for_over_the_files_in_turn(tmp_path: Path) -> None:
    a, b = _file(tmp_path / "a", 3 * MB), _file(tmp_path / "b", 2 * MB + 4096)
    assert pieces([a, b], 5 * MB, 2 * MB) == [(0, 0), (0, 2 * MB), (1, 0)]  # 2 + 1 + 2 MB
    assert pieces([a, b], 5 * MB + 1, 2 * MB) == [(0, 0), (0, 2 * MB), (1, 0), (1, 2 * MB)]
    assert pieces([a, b], 1, 2 * MB) == [(0, 0)]
    assert pieces([a, b], 100 * MB, 2 * MB)[-1] == (1, 2 * MB)  # never past the last file


def _direct_ok(path: str) -> bool:
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except OSError:  # tmpfs and some overlays refuse O_DIRECT
        return False
    return True


def test_the_reader_process_reads_with_o_direct_when_told_to(tmp_path: Path) -> None:
    f = _file(tmp_path / "slab", 6 * MB)
    if not _direct_ok(f):
        pytest.skip("this filesystem refuses O_DIRECT")
    assert read_all([f], 5 * MB, 3, MB) == 5 * MB
    cmd = [sys.executable, "-m", "hcache.benchmarks.ioload", "--bytes", str(6 * MB), "--threads", "2", f]
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    out, _ = p.communicate("go\n", timeout=60)
    ready, result = out.splitlines()
    nbytes, ms = result.split()
    assert (ready, int(nbytes), p.returncode) == ("ready", 6 * MB, 0)
    assert float(ms) > 0
