"""Load: 64 concurrent multi-turn sessions against a server process on loopback, bounded
in time. No errors, the server's resident memory flat after the warm-up, and every reply
identical to a one-session-at-a-time reference run with the same seeds."""

from __future__ import annotations

import argparse
import shutil

import pytest
from engine_helpers import profile_for

from hcache.benchmarks.serve import start_server
from hcache.benchmarks.soak import rss_bytes, run_load

pytestmark = pytest.mark.slow
SESSIONS, TURNS, MAX_NEW = 64, 2, 6


def test_64_concurrent_sessions(default_model, tmp_path):
    prof = tmp_path / "profile.json"
    profile_for(default_model.model).save(prof)
    args = argparse.Namespace(dirs=2, dtype="float32", budget_mb=128, profile=str(prof))
    proc, target = start_server(args, "auto", tmp_path)
    try:
        ref = run_load(target, SESSIONS, TURNS, MAX_NEW, seed=7, concurrency=1)
        assert not ref["errors"]
        rss = []
        for _ in range(2):  # the first concurrent round is the warm-up (KV pool, thread arenas)
            got = run_load(target, SESSIONS, TURNS, MAX_NEW, seed=7, concurrency=SESSIONS)
            assert not got["errors"], got["errors"][:3]
            mismatched = [i for i in range(SESSIONS) if got["replies"][i] != ref["replies"][i]]
            assert not mismatched, mismatched
            rss.append(rss_bytes(proc.pid))
        assert rss[1] - rss[0] < 32 << 20, rss  # flat: under 32 MB of drift after the warm-up
    finally:
        proc.terminate()
        proc.wait(timeout=120)
        shutil.rmtree(tmp_path / "d0", ignore_errors=True)
