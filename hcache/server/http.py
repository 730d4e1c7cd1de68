"""The HTTP side port: /metrics (Prometheus), /healthz (live), /readyz (model loaded,
every storage directory writable, not draining), /dashboard and its JSON feed."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from hcache.server.metrics import Metrics

log = logging.getLogger(__name__)
STATIC = Path(__file__).parent / "static"
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript", ".css": "text/css", ".txt": "text/plain"}


def readiness(metrics: Metrics) -> tuple[bool, list[str]]:
    e = metrics.engine
    if e is None:
        return False, ["model not loaded"]
    problems = ["draining"] if e.draining else []
    for d in e.store.dirs:
        try:
            fd, name = tempfile.mkstemp(dir=d, prefix=".ready-")
            os.close(fd)
            os.unlink(name)
        except OSError as err:
            problems.append(f"{d} not writable: {err.strerror}")
    return not problems, problems


class _Handler(BaseHTTPRequestHandler):
    metrics: Metrics  # set on the subclass made per server

    def log_message(self, fmt: str, *args: object) -> None:
        log.debug("http: " + fmt, *args)

    def _send(self, status: int, body: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        try:
            if path == "/metrics":
                self._send(200, generate_latest(self.metrics.registry), CONTENT_TYPE_LATEST)
            elif path == "/healthz":
                self._send(200, b"ok\n", "text/plain")
            elif path == "/readyz":
                ok, problems = readiness(self.metrics)
                body = json.dumps({"ready": ok, "problems": problems}).encode()
                self._send(200 if ok else 503, body, "application/json")
            elif path in ("/", "/dashboard"):
                self._file(STATIC / "dashboard.html")
            elif path == "/api/dashboard":
                self._send(200, json.dumps(self.metrics.dashboard()).encode(), "application/json")
            elif path.startswith("/static/"):
                target = (STATIC / path[len("/static/") :]).resolve()
                if STATIC.resolve() not in target.parents:
                    self._send(404, b"not found\n", "text/plain")
                else:
                    self._file(target)
            else:
                self._send(404, b"not found\n", "text/plain")
        except BrokenPipeError:
            pass
        except Exception:
            log.exception("http %s", path)
            self._send(500, b"internal error\n", "text/plain")

    def _file(self, p: Path) -> None:
        if not p.is_file():
            self._send(404, b"not found\n", "text/plain")
            return
        self._send(200, p.read_bytes(), TYPES.get(p.suffix, "application/octet-stream"))


class SidePort:
    def __init__(self, metrics: Metrics, host: str, port: int):
        handler = type("Handler", (_Handler,), {"metrics": metrics})
        self.server = ThreadingHTTPServer((host, port), handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.metrics = metrics
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self.server.serve_forever, name="hcache-http", daemon=True),
            threading.Thread(target=self._sample, name="hcache-rates", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _sample(self) -> None:
        while not self._stop.wait(2.0):
            try:
                self.metrics.sample_rates()
            except Exception:
                log.exception("sampling storage rates")

    def close(self) -> None:
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()
