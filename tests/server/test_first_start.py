"""The first start on a machine with no compile cache: `hcache serve` answers within a bound
that a return to compiling the decode step before serving (minutes) misses, logs each
start-up step with its time, names the CPU kind first, and serves turns with eager steps
while the decode step compiles in the background, which /readyz and /metrics say."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from engine_helpers import free_port, http_get, profile_for

from hcache.client import Client, wait_for_server
from hcache.kernels import COMPILE, native
from hcache.kernels.cpu import cpu

pytestmark = pytest.mark.model

# generous for CI's slowest CPU kind; the decode step's compile alone, cold, takes minutes
FIRST_START_S = 150


def test_a_first_start_serves_while_the_decode_step_compiles(tmp_path, default_model):
    prof = tmp_path / "profile.json"  # measuring the machine is not what this test times
    profile_for(default_model.model).save(prof)
    port, http = free_port(), free_port()
    env = {
        **os.environ,
        "HCACHE_HOME": str(tmp_path / "home"),
        "HCACHE_DECODE": "compiled",
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),  # nothing compiled yet
        "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions"),
    }
    cmd = [sys.executable, "-m", "hcache.cli", "serve", "--port", str(port), "--http-port", str(http)]
    # the default start: the decode step compiles in the background
    cmd += ["--profile", str(prof), "--dirs", str(tmp_path / "d0"), "--kv-budget-mb", "128"]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    target = f"127.0.0.1:{port}"
    try:
        wait_for_server(target, timeout=FIRST_START_S, alive=lambda: proc.poll() is None)
        took = time.monotonic() - t0
        _, metrics = http_get(f"http://127.0.0.1:{http}/metrics")
        status, ready = http_get(f"http://127.0.0.1:{http}/readyz")
        with Client(target) as c:
            sid = c.create_session().session_id
            reply = c.reply(sid, "What is 2+2?", max_new_tokens=8)
    finally:
        proc.kill()
        log = proc.communicate()[0]
    assert took < FIRST_START_S, log
    assert reply.token_ids and reply.stats.completion_tokens == len(reply.token_ids)
    # the compiled step came after SERVING, if at all by now: never before it
    serving = log.index("hcache serving")
    assert log.find("decode step compiled") in (-1, *range(serving, len(log))), log
    compiled = "hcache_decode_compiled 1.0" in metrics
    assert compiled or "hcache_decode_compiled 0.0" in metrics
    problems = json.loads(ready)["problems"]
    assert ("compiling the decode step" in problems) == (not compiled) and (status == 503) == bool(problems)
    # each step says what it prepares and how long it took, the CPU kind first of all
    steps = [line.split(": ", 1)[1] for line in log.splitlines() if " INFO hcache.server.app: " in line]
    assert steps[0] == cpu().describe(), log
    for what in ("loading default", "compiling the prefill and restore kernels", "starting the engine"):
        assert any(s.startswith(what) and "done in" in s for s in steps), (what, log)
    assert "compiling the decode step in the background" in log
    # our kernels build together on threads of their own while the model loads, each logged
    for k in native.KERNELS:
        assert (f"kernel {k.name} ready in" in log) == (COMPILE and k.runs_here()), (k.name, log)
    assert f'cpu="{cpu().kind}"' in metrics and "hcache_cpu_info" in metrics
