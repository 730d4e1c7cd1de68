"""deploy/ cannot drift from the code: every flag, port, path and config key the container
build and the Kubernetes manifests name exists in `hcache serve` and its HTTP app."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from hcache import config
from hcache.cli import parser
from hcache.server.http import build_app
from hcache.server.metrics import Metrics

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def docs() -> list[dict]:
    out = []
    for f in sorted((DEPLOY / "k8s").glob("*.yaml")):
        out += [d for d in yaml.safe_load_all(f.read_text()) if d]
    return out


def one(kind: str) -> dict:
    (d,) = [d for d in docs() if d["kind"] == kind]
    return d


def serve_flags() -> set[str]:
    sub = next(a for a in parser()._actions if a.dest == "command")
    return {s for a in sub.choices["serve"]._actions for s in a.option_strings}


@pytest.fixture(scope="module")
def toml(tmp_path_factory) -> config.Config:
    f = tmp_path_factory.mktemp("deploy") / "hcache.toml"
    f.write_text(one("ConfigMap")["data"]["hcache.toml"])
    return config.load(f)  # unknown keys or wrong types raise


def container() -> dict:
    (c,) = one("StatefulSet")["spec"]["template"]["spec"]["containers"]
    return c


def test_flags_exist():
    flags = serve_flags()
    named = [a for a in container()["args"] if a.startswith("--")]
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    named += re.findall(r'"(--[a-z0-9-]+)"', dockerfile)
    assert named and set(named) <= flags, set(named) - flags
    assert 'ENTRYPOINT ["hcache", "serve"]' in dockerfile


def test_config_ports_and_paths_match(toml):
    s = toml.server
    assert s.host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in container()["ports"]}
    assert ports == {"grpc": s.port, "http": s.http_port}
    expose = re.search(r"^EXPOSE (.+)$", (DEPLOY / "Dockerfile").read_text(), re.M).group(1).split()
    assert sorted(map(int, expose)) == sorted(ports.values())
    for svc in (d for d in docs() if d["kind"] == "Service"):
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= set(ports), svc["metadata"]["name"]
    # the config file, keys and TLS files sit where the volumes put them
    mounts = {m["name"]: m["mountPath"] for m in container()["volumeMounts"]}
    config_arg = container()["args"][container()["args"].index("--config") + 1]
    assert mounts["config"] == config_arg and config_arg in (DEPLOY / "Dockerfile").read_text()
    assert s.api_keys_file.startswith(mounts["keys"] + "/")
    assert s.tls_cert_file.startswith(mounts["tls"] + "/") and s.tls_key_file.startswith(mounts["tls"] + "/")
    assert all(d.startswith(mounts["store"] + "/") for d in toml.storage.dirs)
    assert toml.profile_dir.startswith(mounts["store"] + "/")
    volumes = {v["name"]: v for v in one("StatefulSet")["spec"]["template"]["spec"]["volumes"]}
    assert "secret" in volumes["keys"] and "secret" in volumes["tls"]
    assert volumes["config"]["configMap"]["name"] == one("ConfigMap")["metadata"]["name"]
    claims = [c["metadata"]["name"] for c in one("StatefulSet")["spec"]["volumeClaimTemplates"]]
    assert claims == ["store"]


def test_probes_name_routes_of_the_app():
    routes = {getattr(r, "path", None) for r in build_app(Metrics()).routes}
    c = container()
    probes = [c[k]["httpGet"] for k in ("livenessProbe", "readinessProbe", "startupProbe")]
    assert {p["path"] for p in probes} <= routes
    assert {"/healthz", "/readyz"} <= {p["path"] for p in probes}
    assert all(p["port"] == "http" for p in probes)
    assert all(p["scheme"] == "HTTPS" for p in probes)  # the config serves TLS on both ports


def test_drain_fits_the_grace_period(toml):
    spec = one("StatefulSet")["spec"]["template"]["spec"]
    args = container()["args"]
    drain = float(args[args.index("--drain-seconds") + 1]) if "--drain-seconds" in args else toml.server.drain_seconds
    assert drain == toml.server.drain_seconds
    pre = container()["lifecycle"]["preStop"]["exec"]["command"]
    assert pre[0] == "sleep"
    assert spec["terminationGracePeriodSeconds"] > float(pre[1]) + drain
    assert one("PodDisruptionBudget")["spec"]["selector"] == one("StatefulSet")["spec"]["selector"]
    assert one("StatefulSet")["spec"]["serviceName"] in {
        d["metadata"]["name"] for d in docs() if d["kind"] == "Service"
    }


def test_example_config_is_the_configmaps():
    assert (DEPLOY / "hcache.toml").read_text() == one("ConfigMap")["data"]["hcache.toml"]
