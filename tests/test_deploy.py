"""deploy/ cannot drift from the code: every flag, port, path and config key the container
build, the Kubernetes manifests and the Docker Compose file name exists in `hcache serve` and
its HTTP app, and Kubernetes runs compose's Redis settings and init script at pod addresses.
Compose's Redis masters and its init script run for real (slow; needs redis-server)."""

from __future__ import annotations

import re
import secrets
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from cluster_helpers import RedisCluster, cluster_ports

from hcache import config
from hcache.cli import parser
from hcache.cluster.catalogue import RedisCatalogue, parse_url
from hcache.server.http import build_app
from hcache.server.metrics import Metrics
from hcache.storage.catalogue import Record

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
COMPOSE = DEPLOY / "compose.yaml"


def docs() -> list[dict]:
    out = []
    for f in sorted((DEPLOY / "k8s").glob("*.yaml")):
        out += [d for d in yaml.safe_load_all(f.read_text()) if d]
    return out


def one(kind: str, name: str) -> dict:
    (d,) = [d for d in docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    return d


def hcache_set() -> dict:
    return one("StatefulSet", "hcache")


def redis_set() -> dict:
    return one("StatefulSet", "redis")


def serve_flags() -> set[str]:
    sub = next(a for a in parser()._actions if a.dest == "command")
    return {s for a in sub.choices["serve"]._actions for s in a.option_strings}


@pytest.fixture(scope="module")
def toml(tmp_path_factory) -> config.Config:
    f = tmp_path_factory.mktemp("deploy") / "hcache.toml"
    f.write_text(one("ConfigMap", "hcache-config")["data"]["hcache.toml"])
    return config.load(f)  # unknown keys or wrong types raise


def container() -> dict:
    (c,) = hcache_set()["spec"]["template"]["spec"]["containers"]
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
    selector = hcache_set()["spec"]["selector"]["matchLabels"]
    for svc in (d for d in docs() if d["kind"] == "Service" and d["spec"]["selector"] == selector):
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= set(ports), svc["metadata"]["name"]
    # the config file, keys and TLS files sit where the volumes put them
    mounts = {m["name"]: m["mountPath"] for m in container()["volumeMounts"]}
    config_arg = container()["args"][container()["args"].index("--config") + 1]
    assert mounts["config"] == config_arg and config_arg in (DEPLOY / "Dockerfile").read_text()
    assert s.api_keys_file.startswith(mounts["keys"] + "/")
    assert s.tls_cert_file.startswith(mounts["tls"] + "/") and s.tls_key_file.startswith(mounts["tls"] + "/")
    assert all(d.startswith(mounts["store"] + "/") for d in toml.storage.dirs)
    assert toml.profile_dir.startswith(mounts["store"] + "/")
    volumes = {v["name"]: v for v in hcache_set()["spec"]["template"]["spec"]["volumes"]}
    assert "secret" in volumes["keys"] and "secret" in volumes["tls"]
    assert volumes["config"]["configMap"]["name"] == one("ConfigMap", "hcache-config")["metadata"]["name"]
    claims = [c["metadata"]["name"] for c in hcache_set()["spec"]["volumeClaimTemplates"]]
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
    spec = hcache_set()["spec"]["template"]["spec"]
    args = container()["args"]
    drain = float(args[args.index("--drain-seconds") + 1]) if "--drain-seconds" in args else toml.server.drain_seconds
    assert drain == toml.server.drain_seconds
    pre = container()["lifecycle"]["preStop"]["exec"]["command"]
    assert pre[0] == "sleep"
    assert spec["terminationGracePeriodSeconds"] > float(pre[1]) + drain
    assert one("PodDisruptionBudget", "hcache")["spec"]["selector"] == hcache_set()["spec"]["selector"]
    assert hcache_set()["spec"]["serviceName"] in {d["metadata"]["name"] for d in docs() if d["kind"] == "Service"}


def test_example_config_is_the_configmaps():
    assert (DEPLOY / "hcache.toml").read_text() == one("ConfigMap", "hcache-config")["data"]["hcache.toml"]


# --- Docker Compose (deploy/compose.yaml) ----------------------------------------------------


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def argv(service: dict) -> list[str]:
    cmd = service["command"]
    return shlex.split(cmd) if isinstance(cmd, str) else cmd


def opt(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def masters() -> dict[str, dict]:
    return {n: s for n, s in compose()["services"].items() if argv(s)[0] == "redis-server"}


def replicas() -> dict[str, dict]:
    return {n: s for n, s in compose()["services"].items() if "build" in s}


def init() -> tuple[str, dict]:
    (name,) = set(compose()["services"]) - set(masters()) - set(replicas())
    return name, compose()["services"][name]


def init_script() -> str:
    args = argv(init()[1])
    assert args[:2] == ["sh", "-c"] and len(args) == 3
    return args[2].replace("$$", "$")  # what compose hands the shell


def strings(node: object) -> list[str]:
    if isinstance(node, dict):
        return [s for v in node.values() for s in strings(v)]
    if isinstance(node, list):
        return [s for v in node for s in strings(v)]
    return [node] if isinstance(node, str) else []


def test_compose_passes_the_shell_its_dollars():
    # compose fills $NAME and ${NAME} from its own environment (empty when unset): the shell's are $$
    assert all("$" not in s.replace("$$", "") for s in strings(compose()))


def test_compose_replicas_run_hcache_serve(toml):
    c, flags = compose(), serve_flags()
    init_name, _ = init()
    assert len(replicas()) == 2
    for name, s in replicas().items():
        args = argv(s)
        assert all(isinstance(a, str) for a in args), args
        assert {a for a in args if a.startswith("--")} <= flags, set(args) - flags
        build = s["build"]
        assert (COMPOSE.parent / build["context"]).resolve() / build["dockerfile"] == DEPLOY / "Dockerfile"
        assert s["depends_on"] == {init_name: {"condition": "service_completed_successfully"}}
        assert opt(args, "--replica-name") == name
        assert int(opt(args, "--threads")) >= 1  # two replicas on one host: not every core each
        # the config file, keys and TLS files sit where the config says
        source = {x["target"]: x["source"] for x in s["configs"]}[opt(args, "--config")]
        assert (COMPOSE.parent / c["configs"][source]["file"]).resolve() == DEPLOY / "hcache.toml"
        assert {x["source"] for x in s["secrets"]} <= set(c["secrets"])
        srv = toml.server
        assert {srv.api_keys_file, srv.tls_cert_file, srv.tls_key_file} <= {x["target"] for x in s["secrets"]}
        # its own named volume holds the store and the measured profiles
        ((volume, mount),) = [v.split(":") for v in s["volumes"]]
        assert volume in c["volumes"] and volume not in masters()
        assert all(d.startswith(mount + "/") for d in toml.storage.dirs) and toml.profile_dir.startswith(mount + "/")
        drain = float(opt(args, "--drain-seconds")) if "--drain-seconds" in args else srv.drain_seconds
        assert float(s["stop_grace_period"].removesuffix("s")) > drain
    volumes = [v for s in replicas().values() for v in s["volumes"]]
    assert len(set(volumes)) == len(volumes)


def test_compose_ports_match_the_config(toml):
    published = []
    for s in replicas().values():
        assert all(isinstance(p, str) for p in s["ports"])  # unquoted, YAML may read HOST:PORT in base 60
        host, container = zip(*(p.rsplit(":", 1) for p in s["ports"]), strict=True)  # [IP:]HOST:CONTAINER
        assert sorted(map(int, container)) == sorted([toml.server.port, toml.server.http_port])
        published += host
    assert len(set(published)) == len(published)  # distinct per replica on the host


def test_compose_healthchecks_name_routes_of_the_app(toml):
    routes = {getattr(r, "path", None) for r in build_app(Metrics()).routes}
    for s in replicas().values():
        test = s["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python", "-c"] and len(test) == 4
        compile(test[3], "healthcheck", "exec")
        ((scheme, port, path),) = re.findall(r"(https?)://[\w.]+:(\d+)(/[\w/]*)", test[3])
        assert scheme == ("https" if toml.server.tls_cert_file else "http")
        assert int(port) == toml.server.http_port
        assert path == "/readyz" and path in routes
    for s in masters().values():
        assert s["healthcheck"]["test"] == ["CMD", "redis-cli", "-p", opt(argv(s), "--port"), "ping"]


def test_compose_cluster_names_the_redis_masters():
    nodes = [(name, int(opt(argv(s), "--port"))) for name, s in masters().items()]
    assert len(nodes) == 3 and len({p for _, p in nodes}) == 3
    for s in replicas().values():
        assert parse_url(opt(argv(s), "--cluster")) == nodes
    _, init_svc = init()
    assert init_svc["depends_on"] == {name: {"condition": "service_healthy"} for name, _ in nodes}
    assert init_svc["restart"] == "no"
    script = init_script()
    create = re.search(r"redis-cli --cluster create (.+)", script).group(1).split()
    assert create == [f"{n}:{p}" for n, p in nodes] + ["--cluster-replicas", "0", "--cluster-yes"]
    # every address the script names is a master's
    named = set(re.findall(r"\b(redis-\d+):(\d+)", script)) | set(re.findall(r"-h (redis-\d+) -p (\d+)", script))
    assert {(n, int(p)) for n, p in named} == set(nodes)
    for name, s in masters().items():
        args = argv(s)
        assert all(isinstance(a, str) for a in args), args  # unquoted, YAML reads yes as true
        assert len(args) % 2 == 1
        settings = dict(zip(args[1::2], args[2::2], strict=True))
        assert all(k.startswith("--") for k in settings)
        assert settings["--cluster-enabled"] == "yes" and settings["--appendonly"] == "yes"
        assert settings.get("--cluster-announce-hostname", name) == name
        assert settings["--maxmemory-policy"] == "volatile-lru"  # chunks (with a TTL) go first, records never
        assert "--dir" not in settings and s["volumes"] == [f"{name}:/data"]  # the image's working directory
        assert s["image"] == init_svc["image"]


# --- the Kubernetes Redis Cluster (deploy/k8s/redis.yaml): compose's, at pod addresses ----------


def k8s_nodes() -> list[tuple[str, int]]:
    """Each Redis pod's stable name under its headless Service, and its port."""
    rs = redis_set()
    (c,) = rs["spec"]["template"]["spec"]["containers"]
    (port,) = [p["containerPort"] for p in c["ports"] if p["name"] == "redis"]
    return [(f"{rs['metadata']['name']}-{i}.{rs['spec']['serviceName']}", port) for i in range(rs["spec"]["replicas"])]


def test_k8s_redis_runs_composes_masters():
    rs = redis_set()
    (c,) = rs["spec"]["template"]["spec"]["containers"]
    assert c["image"] == next(iter(masters().values()))["image"]
    assert rs["spec"]["replicas"] == len(masters())
    svc = one("Service", rs["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["selector"] == rs["spec"]["selector"]["matchLabels"]
    assert {p["targetPort"] for p in svc["spec"]["ports"]} == {p["name"] for p in c["ports"]}
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["bus"] == ports["redis"] + 10000  # Redis Cluster's bus port
    settings = dict(zip(c["command"][1::2], c["command"][2::2], strict=True))
    assert c["command"][0] == "redis-server" and int(settings.pop("--port")) == ports["redis"]
    # its own name under the headless Service, from the pod's name
    assert settings.pop("--cluster-announce-hostname") == f"$(POD_NAME).{rs['spec']['serviceName']}"
    assert {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"]} == {"POD_NAME": "metadata.name"}
    for name, m in masters().items():  # every other setting is compose's
        want = dict(zip(argv(m)[1::2], argv(m)[2::2], strict=True))
        del want["--port"], want["--cluster-announce-hostname"]
        assert settings == want, name
    assert c["readinessProbe"]["exec"]["command"] == ["redis-cli", "-p", str(ports["redis"]), "ping"]
    assert c["volumeMounts"] == [{"name": "data", "mountPath": "/data"}]
    assert [t["metadata"]["name"] for t in rs["spec"]["volumeClaimTemplates"]] == ["data"]


def test_k8s_replicas_join_the_redis_pods():
    args, flags = container()["args"], serve_flags()
    assert {"--cluster", "--replica-name"} <= flags
    assert parse_url(opt(args, "--cluster")) == k8s_nodes()
    assert opt(args, "--replica-name") == "$(POD_NAME)"
    env = {e["name"]: e for e in container()["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    spec = hcache_set()["spec"]
    assert spec["podManagementPolicy"] == "OrderedReady"  # one init container creates the cluster
    (init_c,) = spec["template"]["spec"]["initContainers"]
    assert init_c["image"] == init()[1]["image"]
    (mount,) = init_c["volumeMounts"]
    volumes = {v["name"]: v for v in spec["template"]["spec"]["volumes"]}
    cm = one("ConfigMap", volumes[mount["name"]]["configMap"]["name"])
    (key,) = cm["data"]
    assert init_c["command"] == ["sh", f"{mount['mountPath']}/{key}"]


def test_k8s_init_script_is_composes_at_pod_addresses():
    """The same script, each compose master's name and port replaced by a Redis pod's."""
    to: dict[str, str] = {}
    for (name, m), (pod, port) in zip(masters().items(), k8s_nodes(), strict=True):
        to[name], to[opt(argv(m), "--port")] = pod, str(port)
    script = re.sub(r"\b(" + "|".join(map(re.escape, to)) + r")\b", lambda g: to[g.group(1)], init_script())
    (text,) = one("ConfigMap", "redis-init")["data"].values()
    assert text == script


class ComposeRedis(RedisCluster):
    """The compose file's masters on loopback, each started with exactly the arguments its service
    gives redis-server (plus --bind 127.0.0.1), in a directory of its own as its volume; a service's
    name becomes 127.0.0.1 and its port a free one, here and in the init script."""

    def __init__(self, root: Path):  # RedisCluster's own creates the cluster its way; this one does not
        for tool in ("redis-server", "redis-cli", "getent"):
            if shutil.which(tool) is None:
                pytest.skip(f"{tool} is not installed (`make test` installs Debian's redis-server)")
        self.root, self.maxmemory_mb, self.procs = root, 0, {}
        self.services = masters()
        self.readdress()

    def readdress(self) -> None:
        """Every master at a new port, as a recreated container comes back at a new address."""
        self.ports = cluster_ports(len(self.services))
        self.name_of = dict(zip(self.ports, self.services, strict=True))
        for p in self.ports:
            self.start_node(p)

    def local(self, text: str) -> str:
        for port, name in self.name_of.items():
            text = re.sub(rf"\b{re.escape(name)}\b", "127.0.0.1", text)
            text = re.sub(rf"\b{opt(argv(self.services[name]), '--port')}\b", str(port), text)
        return text

    def start_node(self, port: int) -> None:
        name = self.name_of[port]
        d = self.root / name
        d.mkdir(exist_ok=True)
        args = [self.local(a) for a in argv(self.services[name])] + ["--bind", "127.0.0.1"]
        log = open(d / "redis.log", "ab")  # noqa: SIM115 - the process keeps it
        self.procs[port] = subprocess.Popen(args, cwd=d, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while not self._cli(port, "PING").startswith("PONG"):
            if time.monotonic() > deadline or self.procs[port].poll() is not None:
                raise RuntimeError(f"{name} did not start: {(d / 'redis.log').read_text()[-2000:]}")
            time.sleep(0.05)

    def run_init(self) -> str:
        out = subprocess.run(["sh", "-c", self.local(init_script())], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout


@pytest.mark.model
def test_compose_redis_cluster_forms_and_comes_back(tmp_path):
    c = ComposeRedis(tmp_path)
    try:
        assert "All 16384 slots covered" in c.run_init()
        c.wait_ok()
        (url,) = {opt(argv(s), "--cluster") for s in replicas().values()}
        cat = RedisCatalogue(c.local(url))  # what each replica connects to
        assert cat.cluster and cat.problems() == []
        owners = [secrets.token_hex(16) for _ in range(12)]  # spread over the three masters' slots
        for i, o in enumerate(owners):
            cat.create(Record(o, "session", "fp", "K", [i, i + 1]))
        cat.close()
        c.run_init()  # a second `docker compose up`: the cluster exists; init succeeds and changes nothing
        c.wait_ok()
        # `docker compose down` and `up`: the same volumes, every master at a new address
        c.stop()
        c.readdress()
        assert "16384 slots" not in c.run_init()  # met again, not created again
        c.wait_ok()
        cat = RedisCatalogue(c.local(url))
        assert [cat.get(o).tokens for o in owners] == [[i, i + 1] for i in range(len(owners))]
        cat.close()
    finally:
        c.stop()
