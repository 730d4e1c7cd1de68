"""A real Redis Cluster on loopback for the scale-out tests: three masters started the way an
operator starts them (`redis-server` with `cluster-enabled yes` and an append-only file in a
temporary directory, then `redis-cli --cluster create`), stopped and restarted one at a time."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_ports(n: int) -> list[int]:
    """`n` ports whose cluster-bus port (port + 10000) is free too, both below the kernel's
    ephemeral range (from 32768): a port in it can be taken by any outgoing connection
    between this check and redis binding it (a bus port 37320 was, in a CI run)."""
    rng = random.Random()
    out: list[int] = []
    while len(out) < n:
        p = rng.randrange(10000, 22000)
        if p not in out and _free(p) and _free(p + 10000):
            out.append(p)
    return out


class RedisCluster:
    def __init__(self, root: Path, masters: int = 3, maxmemory_mb: int = 0):
        for tool in ("redis-server", "redis-cli"):
            if shutil.which(tool) is None:
                pytest.skip(f"{tool} is not installed (`make test` installs Debian's redis-server)")
        self.root, self.maxmemory_mb = root, maxmemory_mb
        self.ports = cluster_ports(masters)
        self.procs: dict[int, subprocess.Popen] = {}
        try:  # a node that failed leaves none running (a failed CI run left two)
            for p in self.ports:
                self.start_node(p)
            nodes = [f"127.0.0.1:{p}" for p in self.ports]
            out = subprocess.run(
                ["redis-cli", "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            if out.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed:\n{out.stdout}\n{out.stderr}")
            self.wait_ok()
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return "redis://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start_node(self, port: int) -> None:
        d = self.root / str(port)
        d.mkdir(parents=True, exist_ok=True)
        args = ["--port", str(port), "--bind", "127.0.0.1", "--dir", str(d), "--daemonize", "no"]
        args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000"]
        # every write on disk before the reply: a killed master loses no acknowledged turn
        args += ["--appendonly", "yes", "--appendfsync", "always", "--save", ""]
        if self.maxmemory_mb:
            args += ["--maxmemory", f"{self.maxmemory_mb}mb", "--maxmemory-policy", "volatile-lru"]
        log = open(d / "redis.log", "ab")  # noqa: SIM115 - the process keeps it
        self.procs[port] = subprocess.Popen(["redis-server", *args], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while not self._cli(port, "PING").startswith("PONG"):
            if time.monotonic() > deadline or self.procs[port].poll() is not None:
                raise RuntimeError(f"redis-server on {port} did not start: {(d / 'redis.log').read_text()[-2000:]}")
            time.sleep(0.05)

    def _cli(self, port: int, *cmd: str) -> str:
        out = subprocess.run(["redis-cli", "-p", str(port), *cmd], capture_output=True, text=True, timeout=10)
        return out.stdout

    def wait_ok(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if all("cluster_state:ok" in self._cli(p, "CLUSTER", "INFO") for p in self.ports):
                return
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis Cluster did not reach cluster_state:ok")
            time.sleep(0.1)

    def kill(self, port: int) -> None:
        """kill -9 of one master."""
        proc = self.procs.pop(port)
        proc.kill()
        proc.wait()

    def restart(self, port: int) -> None:
        """The same master again, from its append-only file and nodes.conf."""
        self.start_node(port)
        self.wait_ok()

    def stop(self) -> None:
        for port in list(self.procs):
            self.kill(port)


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    c = RedisCluster(tmp_path_factory.mktemp("redis"))
    yield c
    c.stop()


class RedisServer:
    """One plain redis-server (no cluster): `--cluster redis://HOST:PORT` works with it too."""

    def __init__(self, root: Path):
        if shutil.which("redis-server") is None:
            pytest.skip("redis-server is not installed (`make test` installs Debian's redis-server)")
        self.port = cluster_ports(1)[0]
        root.mkdir(parents=True, exist_ok=True)
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(root), "--save", ""]
        self.proc = subprocess.Popen(["redis-server", *args], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while _free(self.port):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@contextmanager
def two_replicas(make: Callable[[str, Path], tuple[Any, Any]], root: Path) -> Iterator[tuple[Any, Any]]:
    """Engines `replica-a` and `replica-b`, each `make(name, directory)` -> (engine, store),
    closed after."""
    made = []
    try:
        for n in "ab":
            made.append(make(f"replica-{n}", root / n))
        yield made[0][0], made[1][0]
    finally:
        for eng, store in made:
            eng.close()
            store.close()
