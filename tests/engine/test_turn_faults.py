"""Faults the engine meets in production, each with the output checked against a
never-evicted reference: a full storage directory, a saturated staging ring, a throttled
slow directory and a corrupt chunk (tiny model); kill -9 of a server process during
prefill, during flushing and during restore, then a restart (default model)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import grpc
import pytest
from conftest import tload
from engine_helpers import SERVER_START_S, free_port, make_engine, profile_for, reference, turn, word_tokenizer

from hcache.client import Client, wait_for_server
from hcache.engine.errors import ResourceExhausted
from hcache.engine.generate import ChatSession
from hcache.engine.sampler import SamplingParams
from hcache.restore.plan import Method
from hcache.storage.errors import StorageFull


def rand_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(300) for _ in range(n)]


# --- kill -9 of a server process -------------------------------------------------------------
SYSTEM = "You are a helpful assistant."
TURNS = ["Name three colors.", "Which one is the color of the sky?"]
LONG = "Here are my notes: " + " ".join(f"item {i} is a small blue stone." for i in range(120))


def expected(m, tok, acked: list[str], msg: str, p: SamplingParams) -> str:
    """What a never-interrupted session answers to `msg` after the acknowledged turns."""
    ref = ChatSession(m, tok, SYSTEM)
    for t in acked:
        ref.reply(t, p)
    return ref.reply(msg, p)[0]


@pytest.fixture
def tiny(tiny_folder):
    return tload(tiny_folder("llama_gqa"))


def test_full_directory_refuses_the_turn_and_keeps_state(default_model, tmp_path, monkeypatch):
    m, tok = default_model.model, default_model.tokenizer
    eng, store = make_engine(m, tok, [tmp_path / "s"], store_kinds="kv", kv_budget_bytes=256 << 20)
    try:
        p = SamplingParams(max_new_tokens=6)
        s = eng.create_session(SYSTEM)
        _, _ = turn(eng, s.id, message=TURNS[0], params=p)
        before = store.owner_row(s.id)
        store.set_quota(store.usage()[0].slab_bytes)  # the directory is now full
        with pytest.raises(ResourceExhausted, match="capacity"):  # refused before it starts
            turn(eng, s.id, message=LONG[:3000], params=p)  # more than the whole store holds
        after = store.owner_row(s.id)
        assert (after.tokens, after.meta) == (before.tokens, before.meta)
        assert not eng.get(s.id).busy
        store.set_quota(0)  # the operator makes room

        # a disk that fills under a running turn: the session goes back to its last durable turn
        def disk_full(*_args: object, **_kw: object) -> None:
            raise StorageFull("disk full")

        with monkeypatch.context() as mp:
            mp.setattr(store, "mark_durable", disk_full)
            with pytest.raises(ResourceExhausted, match="full"):
                turn(eng, s.id, message=TURNS[1], params=p)
        after = store.owner_row(s.id)
        assert (after.tokens, after.meta) == (before.tokens, before.meta)
        assert not eng.get(s.id).busy and not eng.get(s.id).resident
        # the session goes on from its last durable turn, exactly
        got2, _ = turn(eng, s.id, message=TURNS[1], params=p)
        assert tok.decode(got2) == expected(m, tok, TURNS[:1], TURNS[1], p)
    finally:
        eng.close()
        store.close()


def test_saturated_staging_ring_blocks_and_loses_nothing(tiny, tmp_path):
    eng, store = make_engine(
        tiny, word_tokenizer(300), [tmp_path / "s"], storage={"staging_bytes": 96 << 10}, piece_tokens=64
    )
    try:
        slow = store.packer._pack  # a packer that falls behind (a stalled disk upstream): the ring fills

        def lagging(batch):
            time.sleep(0.03)
            slow(batch)

        store.packer._pack = lagging
        rng = random.Random(2)
        p = SamplingParams(max_new_tokens=30)
        sessions = [eng.create_session() for _ in range(4)]
        prompts = [rand_ids(rng, 200) for _ in sessions]
        seqs = [eng.generate(s.id, token_ids=ids, params=p) for s, ids in zip(sessions, prompts, strict=True)]
        outs = [[t for ev in eng.stream(q) for t in ev.token_ids] for q in seqs]
        assert store.ring.waits > 0  # the producer was blocked, counted
        for s, ids, out in zip(sessions, prompts, outs, strict=True):
            assert out == reference(tiny, ids, p, set())
            eng.evict(s.id)
            eng.restore(s.id, Method.KV)  # everything staged reached storage intact
            new = rand_ids(rng, 5)
            got, _ = turn(eng, s.id, token_ids=new, params=SamplingParams(max_new_tokens=3))
            assert got == reference(tiny, ids + out + new, SamplingParams(max_new_tokens=3), set())
    finally:
        eng.close()
        store.close()


def test_throttled_directory_is_slow_but_exact(tiny, tmp_path):
    eng, store = make_engine(tiny, word_tokenizer(300), [tmp_path / "s"], store_kinds="kv")
    try:
        rng = random.Random(3)
        p = SamplingParams(max_new_tokens=4)
        s = eng.create_session()
        ids = rand_ids(rng, 200)
        got, _ = turn(eng, s.id, token_ids=ids, params=p)
        nbytes = 3 * 200 * 2 * tiny.cfg.kv_dim * 4
        eng.evict(s.id)
        store.set_read_cap(nbytes / 0.5 / 1e9)  # half a second for the whole state
        r = eng.restore(s.id, Method.KV)
        assert r.restore_ms > 300
        store.set_read_cap(0)
        new = rand_ids(rng, 6)
        got2, _ = turn(eng, s.id, token_ids=new, params=p)
        assert got2 == reference(tiny, ids + got + new, p, set())
    finally:
        eng.close()
        store.close()


class Server:
    def __init__(self, tmp_path, profile, method: str = "auto"):
        self.port = free_port()
        cmd = [sys.executable, "-m", "hcache.cli", "serve", "--port", str(self.port), "--http-port", "-1"]
        cmd += ["--dirs", str(tmp_path / "d0"), str(tmp_path / "d1"), "--profile", str(profile)]
        cmd += ["--restore-method", method, "--kv-budget-mb", "512", "--weights", "float"]  # the reference's
        env = {**os.environ, "HCACHE_HOME": str(tmp_path / "home")}
        self.log = tmp_path / f"server-{self.port}.log"
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.target = f"127.0.0.1:{self.port}"
        try:
            wait_for_server(self.target, SERVER_START_S, alive=lambda: self.proc.poll() is None)
        except RuntimeError:
            self.kill()
            raise RuntimeError(f"server did not start:\n{self.log.read_text()}") from None
        except BaseException:
            self.kill()
            raise

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


@pytest.mark.model
def test_kill9_during_prefill_flush_and_restore_loses_no_acknowledged_turn(default_model, tmp_path):
    m, tok = default_model.model, default_model.tokenizer
    prof = tmp_path / "profile.json"
    profile_for(m).save(prof)
    p = SamplingParams(max_new_tokens=12)
    last = "Thanks. And the color of grass?"

    def session(srv: Server, turns: list[str]) -> tuple[str, int]:
        with Client(srv.target) as c:
            sid = c.create_session(SYSTEM).session_id
            for t in turns:
                c.reply(sid, t, max_new_tokens=12)
            return sid, c.get(sid).num_tokens

    started: list[Server] = []  # every server is killed at the end, whatever failed

    def start() -> Server:  # every restore recomputes: case 3 kills one
        started.append(Server(tmp_path, prof, "recompute"))
        return started[-1]

    def continues(sid: str, acked: list[str], n_tokens: int) -> Server:
        """After a restart: the session is exactly its acknowledged turns, and goes on exactly.
        Returns the restarted server, still serving (the next case runs on it: every start
        loads and warms the model)."""
        srv = start()
        with Client(srv.target) as c:
            s = c.get(sid)
            assert (s.num_tokens, s.turns, s.resident) == (n_tokens, len(acked), False)
            assert c.reply(sid, last, max_new_tokens=12).text == expected(m, tok, acked, last, p)
            c.delete(sid)
        return srv

    def busy(c: Client, sid: str) -> None:
        """Until the session's turn (or restore) has started, however loaded the machine."""
        deadline = time.monotonic() + 120
        while not c.get(sid).busy:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.02)

    try:
        # 1. killed while prefilling a long message
        srv = start()
        sid, n = session(srv, TURNS)
        with Client(srv.target) as c:
            stream = c.generate(sid, LONG, max_new_tokens=12)
            busy(c, sid)
            srv.kill()
            with pytest.raises(grpc.RpcError):
                list(stream)
        srv = continues(sid, TURNS, n)

        # 2. killed while a long reply is decoded and its rows are being flushed
        sid, n = session(srv, TURNS)
        with Client(srv.target) as c:
            stream = c.generate(sid, "Write a long poem about the sea.", max_new_tokens=300)
            for _ in range(10):
                next(stream)
            srv.kill()
        srv = continues(sid, TURNS, n)

        # 3. killed while restoring a long session by recompute (seconds: the whole context)
        acked = [TURNS[0], LONG]
        sid, n = session(srv, acked)
        with Client(srv.target) as c:
            c.evict(sid)
            stream = c.generate(sid, last, max_new_tokens=12)  # restored by recompute first
            busy(c, sid)
            srv.kill()
            with pytest.raises(grpc.RpcError):
                list(stream)
        continues(sid, acked, n)
    finally:
        for srv in started:
            srv.kill()
