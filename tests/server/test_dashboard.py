"""The HTTP side port: Prometheus metrics, health and readiness, and the dashboard driven by
Debian's Chromium through Playwright against a live server on loopback."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import time
from pathlib import Path

import pytest
from engine_helpers import http_get, profile_for

from hcache.client import Client
from hcache.config import Config, EngineConfig, ServerConfig, StorageConfig
from hcache.server.app import start

pytestmark = pytest.mark.model
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"


@pytest.fixture(scope="module")
def live(default_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("dash")
    cfg = Config(
        storage=StorageConfig([str(d / "a"), str(d / "b")]),
        engine=EngineConfig(store_kinds="both", kv_budget_bytes=256 << 20),
        server=ServerConfig(port=0, http_port=0),
    )
    run = start(cfg, profile_for(default_model.model), default_model)
    yield run
    run.stop(1)


def test_metrics_health_readiness(live):
    base = f"http://127.0.0.1:{live.http_port}"
    with Client(f"127.0.0.1:{live.port}") as c:
        sid = c.create_session().session_id
        c.reply(sid, "Hello!", max_new_tokens=4)
        c.evict(sid)
        c.restore(sid, "kv")
        c.reply(sid, "Bye!", max_new_tokens=4)
        with contextlib.suppress(Exception):
            c.get("nope")
    status, text = http_get(f"{base}/metrics")
    assert status == 200
    for name in (
        'hcache_restore_seconds_count{methods="KV",plan="RE 0 / H 0 / KV 30"}',
        "hcache_storage_read_bytes_total{dir=",
        "hcache_storage_written_bytes_total{dir=",
        "hcache_checksum_failures_total",
        "hcache_recompute_fallback_layers_total",
        "hcache_staging_ring_used_bytes",
        "hcache_staging_producer_waits_total",
        "hcache_flush_seconds_bucket{dir=",
        "hcache_resident_sessions",
        "hcache_resident_bytes",
        "hcache_evictions_total",
        "hcache_storage_released_bytes_total",
        "hcache_sessions_demoted_total",
        "hcache_sessions_expired_total",
        "hcache_storage_capacity_bytes",
        "hcache_storage_occupied_bytes",
        "hcache_ttft_seconds_bucket",
        "hcache_tbt_seconds_bucket",
        'hcache_queue_depth{phase="decode"}',
        'hcache_requests_total{code="OK",rpc="Generate"}',
        'hcache_requests_total{code="NOT_FOUND",rpc="GetSession"}',
        'hcache_threads{pool="hcache-engine"} 1.0',
        'hcache_threads{pool="hcache-reader"}',
    ):
        assert name in text, name
    assert http_get(f"{base}/healthz") == (200, "ok\n")
    status, body = http_get(f"{base}/readyz")
    assert status == 200 and json.loads(body)["ready"]
    dirs = live.engine.store.dirs
    live.engine.store.dirs = [*dirs, Path("/nonexistent/hcache")]
    try:
        status, body = http_get(f"{base}/readyz")
        assert status == 503 and "/nonexistent/hcache not writable" in body
    finally:
        live.engine.store.dirs = dirs
    assert http_get(f"{base}/static/../app.py")[0] == 404


def test_dashboard_in_chromium(live):
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.fail("Debian's chromium is not installed (make test installs it)")
    from playwright.sync_api import expect, sync_playwright

    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"http://127.0.0.1:{live.http_port}/dashboard")
        tile = page.locator('.tile[data-key="tokens generated"] b')
        tile.wait_for(timeout=15000)
        before = int(tile.inner_text())
        with Client(f"127.0.0.1:{live.port}") as c:
            sid = c.create_session().session_id
            c.reply(sid, "Tell me a fact about owls.", max_new_tokens=8)
            c.evict(sid)
            c.reply(sid, "Another one?", max_new_tokens=8)  # restored by the planner's choice
        deadline = time.monotonic() + 15
        while int(tile.inner_text()) == before and time.monotonic() < deadline:
            page.wait_for_timeout(250)
        assert int(tile.inner_text()) > before
        page.locator(f"#sessions td code:text('{sid}')").wait_for(timeout=10000)
        row = page.locator("#sessions tr", has=page.locator(f"code:text('{sid}')"))
        # the row may first show the session as its first turn left it: wait for the restore's
        expect(row).to_contain_text("RE ", timeout=10000)
        expect(row).to_contain_text("/ KV")
        assert page.locator("#storage tbody tr").count() == 2
        assert " / " in page.locator('.tile[data-key="store"] b').inner_text()  # occupied / capacity
        assert "demotions" in page.locator('.tile[data-key="released"] b').inner_text()
        assert page.locator("#mix canvas").count() == 1 and page.locator("#lat canvas").count() == 1
        # the mix chart names the mix the restore used, not the empty chart's placeholder
        page.wait_for_function(
            "() => /\\b(RE|H|KV)\\b/.test(document.querySelector('#mix .u-legend').innerText)", timeout=5000
        )
        # time axes: the time of day over a sliding window of the last minutes, never dates
        now = page.evaluate("new Date().getHours() * 60 + new Date().getMinutes()")
        for chart in ("mix", "lat"):
            labels = page.locator(f"#{chart}").get_attribute("data-x-labels").split("|")
            assert len(labels) >= 3, labels
            assert all(re.fullmatch(r"\d\d:\d\d(:\d\d)?", x) for x in labels), labels
            minutes = [int(x[:2]) * 60 + int(x[3:5]) for x in labels]
            assert all((now - m) % 1440 <= 6 for m in minutes), (labels, now)
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
        browser.close()
    assert not errors, errors
