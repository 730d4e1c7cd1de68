"""`hcache serve` as a process: `hcache chat` against it, and SIGTERM draining (a running
turn finishes and is durable, new requests get UNAVAILABLE, the process exits 0)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
from engine_helpers import SERVER_START_S, free_port, profile_for

from hcache.client import Client, wait_for_server

pytestmark = pytest.mark.model


@pytest.fixture
def served(tmp_path, default_model):
    prof = tmp_path / "profile.json"
    profile_for(default_model.model).save(prof)
    port = free_port()
    env = {**os.environ, "HCACHE_HOME": str(tmp_path / "home")}
    cmd = [sys.executable, "-m", "hcache.cli", "serve", "--port", str(port), "--profile", str(prof)]
    cmd += ["--dirs", str(tmp_path / "d0"), str(tmp_path / "d1"), "--kv-budget-mb", "256", "--http-port", "0"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    target = f"127.0.0.1:{port}"
    try:
        wait_for_server(target, SERVER_START_S, alive=lambda: proc.poll() is None)
    except RuntimeError:
        proc.kill()
        raise RuntimeError(f"server did not start:\n{proc.communicate()[0]}") from None
    yield proc, target
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def test_chat_client_streams_and_restores(served):
    _, target = served
    script = "What is 2+2?\n/evict\n/restore kv\n/restore recompute\nAnd 3+3?\n/bogus\n/quit\n"
    out = subprocess.run(
        [sys.executable, "-m", "hcache.cli", "chat", "--target", target, "--max-new-tokens", "12"],
        input=script,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "evicted" in out.stdout and "by RE 0 / H 0 / KV 30" in out.stdout and "by RE 30 / H 0 / KV 0" in out.stdout
    assert "unknown command /bogus" in out.stdout and out.stdout.count("ttft") == 2


def test_chat_client_reports_unreachable_server():
    out = subprocess.run(
        [sys.executable, "-m", "hcache.cli", "chat", "--target", f"127.0.0.1:{free_port()}"],
        input="",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "hcache: error:" in out.stderr and "Traceback" not in out.stderr


WAIT_FOR_SIGNAL = """
import signal, sys, threading, time
from hcache.server.app import wait_until_set
done = threading.Event()
signal.signal(signal.SIGUSR1, lambda *_: done.set())
def elsewhere():  # the signal lands on this thread, not the main one
    time.sleep(0.3)
    signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)
    time.sleep(30)
threading.Thread(target=elsewhere, daemon=True).start()
wait_until_set(done)
print("stopped")
"""


def test_a_signal_delivered_to_another_thread_stops_the_wait():
    """The kernel may deliver SIGTERM to any thread; the main thread's wait must still see it
    (a plain Event.wait() never returned: test_sigterm_drains failed once that way)."""
    out = subprocess.run([sys.executable, "-c", WAIT_FOR_SIGNAL], capture_output=True, text=True, timeout=20)
    assert out.returncode == 0 and out.stdout.strip() == "stopped", out.stderr


def test_sigterm_drains(served):
    proc, target = served
    with Client(target) as c:
        sid = c.create_session().session_id
        stream = c.generate(sid, "Count from one to fifty in words.", max_new_tokens=200)
        first = next(stream)
        assert first.token_ids
        proc.send_signal(signal.SIGTERM)
        refused = None
        for _ in range(600):  # a loaded machine may take seconds to run the signal handler
            try:
                c.create_session()
            except grpc.RpcError as e:
                refused = e.code()
                break
            time.sleep(0.05)
        assert refused == grpc.StatusCode.UNAVAILABLE
        rest = list(stream)  # the running turn completes
        assert rest[-1].finished and rest[-1].finish_reason in ("stop", "length")
        n = len(first.token_ids) + sum(len(r.token_ids) for r in rest)
        assert n == rest[-1].stats.completion_tokens
    assert proc.wait(timeout=60) == 0
