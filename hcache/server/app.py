"""`hcache serve`: model, store, profile and engine behind a gRPC server with
standard health checking and reflection. SIGTERM (or SIGINT) drains: health goes
NOT_SERVING, new requests get UNAVAILABLE, running turns finish (and become
durable), then the server stops."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from hcache import omp
from hcache.cluster import sharing_for
from hcache.config import Config
from hcache.engine.block_pool import resident_kv_dtype
from hcache.engine.engine import Engine
from hcache.engine.telemetry import Telemetry
from hcache.kernels import native
from hcache.kernels.cpu import cpu
from hcache.model.loader import LoadedModel, load
from hcache.restore import profiler
from hcache.restore.profile import Profile
from hcache.restore.projection import serve_compiled_only, warm_up
from hcache.server.auth import AuthInterceptor, load_keys
from hcache.server.http import SidePort
from hcache.server.interceptors import CountingInterceptor, ErrorsInterceptor, ParsingInterceptor
from hcache.server.metrics import Metrics
from hcache.server.servicer import Servicer
from hcache.storage.dirs import ensure_dirs
from hcache.storage.store import ChunkStore
from hcache.v1 import hcache_pb2 as pb
from hcache.v1 import hcache_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
SERVICE = pb.DESCRIPTOR.services_by_name["HCache"].full_name


@dataclass
class Running:
    server: grpc.Server
    engine: Engine
    store: ChunkStore
    health: health.HealthServicer
    port: int
    cfg: Config
    stopped: threading.Event
    side: SidePort | None = None

    @property
    def http_port(self) -> int | None:
        return self.side.port if self.side else None

    def stop(self, drain_seconds: float | None = None) -> None:
        """Drain, then shut everything down (idempotent)."""
        if self.stopped.is_set():
            return
        grace = self.cfg.server.drain_seconds if drain_seconds is None else drain_seconds
        self.health.enter_graceful_shutdown()
        finished = self.engine.drain(grace)
        if not finished:
            log.warning("drain timed out after %.0f s; stopping with turns still running", grace)
        self.server.stop(grace=1.0).wait()
        if self.side is not None:
            self.side.close()
        self.engine.close()
        self.store.close()
        self.stopped.set()


def build_engine(
    cfg: Config, profile: Profile | None = None, loaded: LoadedModel | None = None, telemetry: Telemetry | None = None
) -> tuple[Engine, ChunkStore]:
    if profile is None and cfg.profile:
        profile = Profile.load(Path(cfg.profile))  # before the model: a bad path fails at once
    log.info(cpu().describe())
    native.build_all()  # our kernels compile (first start only) while the model loads
    if loaded is None:
        with _step(f"loading {cfg.model} ({cfg.dtype}, weights {cfg.weights})"):
            loaded = load(cfg.model, cfg.dtype, cfg.device, cfg.weights)
    if loaded.tokenizer is None:
        raise ValueError(f"{loaded.source} has no tokenizer; hcache serve needs one")
    dirs = ensure_dirs(cfg.storage.dirs)
    with _step("compiling the prefill and restore kernels (cached after the first start)"):
        warm_up(loaded.model)
    if profile is None:
        path = profiler.profile_path(Path(cfg.profile_dir), loaded.model)
        with _step(f"{'reading' if path.exists() else 'measuring this machine for'} the restore planner's profile"):
            profile = profiler.load_or_run(loaded.model, dirs, Path(cfg.profile_dir))
    sharing = sharing_for(cfg)  # before the store: an unreachable cluster fails the start at once
    try:
        m = loaded.model
        store = ChunkStore(cfg.storage, m.cfg, m.dtype, cfg.device, resident_kv_dtype(cfg.engine.kv_dtype, m))
    except BaseException:
        sharing.close()
        raise
    try:
        name = str(loaded.source.name)
        with _step("starting the engine"):
            engine = Engine(loaded.model, loaded.tokenizer, store, profile, cfg.engine, name, telemetry, sharing)
    except Exception:
        store.close()
        sharing.close()
        raise
    engine.runner.after_compiled(serve_compiled_only)
    return engine, store


@contextlib.contextmanager
def _step(what: str) -> Iterator[None]:
    """A start-up step in the log: what is being prepared, then how long it took."""
    log.info("%s ...", what)
    t0 = time.perf_counter()
    yield
    log.info("%s: done in %.1f s", what, time.perf_counter() - t0)


def start(cfg: Config, profile: Profile | None = None, loaded: LoadedModel | None = None) -> Running:
    metrics = Metrics()
    engine, store = omp.on_worker(lambda: build_engine(cfg, profile, loaded, metrics))
    metrics.attach(engine)
    s = cfg.server
    opts = [
        ("grpc.max_receive_message_length", s.max_message_bytes),
        ("grpc.max_send_message_length", s.max_message_bytes),
    ]
    interceptors: list[grpc.ServerInterceptor] = [
        CountingInterceptor(lambda rpc, code: metrics.requests.labels(rpc, code).inc())
    ]
    keys = load_keys(s.api_keys_file) if s.api_keys_file else None
    if keys:
        interceptors.append(AuthInterceptor(keys))
    interceptors += [ParsingInterceptor(), ErrorsInterceptor()]
    handlers = futures.ThreadPoolExecutor(max_workers=s.workers, thread_name_prefix="hcache-grpc")
    server = grpc.server(handlers, interceptors=interceptors, options=opts)
    pb_grpc.add_HCacheServicer_to_server(Servicer(engine), server)
    hs = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    reflection.enable_server_reflection((SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    if bool(s.tls_cert_file) != bool(s.tls_key_file):
        raise ValueError("TLS needs both a certificate and a key file")
    if s.tls_cert_file:
        creds = grpc.ssl_server_credentials([(Path(s.tls_key_file).read_bytes(), Path(s.tls_cert_file).read_bytes())])
        port = server.add_secure_port(f"{s.host}:{s.port}", creds)
    else:
        port = server.add_insecure_port(f"{s.host}:{s.port}")
    if port == 0:
        engine.close()
        store.close()
        raise OSError(f"cannot listen on {s.host}:{s.port}")
    side = None
    if s.http_port >= 0:
        try:
            tls = (s.tls_cert_file, s.tls_key_file) if s.tls_cert_file else None
            side = SidePort(metrics, s.host, s.http_port, keys, tls)
        except OSError as e:
            engine.close()
            store.close()
            raise OSError(f"cannot listen on {s.host}:{s.http_port} (HTTP side port): {e.strerror}") from None
    server.start()
    for name in ("", SERVICE):
        hs.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("hcache serving %s on %s:%d (HTTP %s)", engine.model_name, s.host, port, side.port if side else "off")
    return Running(server, engine, store, hs, port, cfg, threading.Event(), side)


def wait_until_set(done: threading.Event, poll_s: float = 0.2) -> None:
    """Block the main thread until a signal handler sets `done`. The kernel may deliver a
    process-directed SIGTERM to any thread (gRPC's, torch's, the engine's); CPython then runs
    the Python handler only when the main thread next runs bytecode, which a wait without a
    timeout never does: the server would ignore the signal."""
    while not done.wait(poll_s):
        pass


def serve(cfg: Config, profile: Profile | None = None) -> int:
    omp.isolate_main()  # the engine's loop computes; this thread waits for signals
    run = start(cfg, profile)
    done = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal %d: draining", signum)
        run.engine.draining = True  # refuse new work at once; stop() does the rest
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    http = f", dashboard http://{cfg.server.host}:{run.http_port}/dashboard" if run.http_port else ""
    print(f"hcache: serving {run.engine.model_name} on {cfg.server.host}:{run.port}{http}", flush=True)
    wait_until_set(done)
    run.stop()
    print("hcache: stopped", flush=True)
    return 0
