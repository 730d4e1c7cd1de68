"""One config tree, set by `hcache serve` flags and a TOML file (--config): flags given win over
the file, the file over the dataclasses' defaults, which are the flags' defaults too."""

from __future__ import annotations

from dataclasses import fields

import pytest
from engine_helpers import profile_for

from hcache.cli import configure, main, parser
from hcache.config import MB, Config, EngineConfig, ServerConfig, StorageConfig, hcache_home
from hcache.flags import PREFIX, SECTIONS, to_config
from hcache.server.app import build_engine

TOML = """
model = "default"
profile_dir = "{d}/profiles"

[storage]
dirs = ["{d}/a", "{d}/b"]
staging_bytes = 16_777_216
read_depth = 3
prefetch_layers = 5
direct_io = false
read_cap_gbps = 0.25

[engine]
kv_budget_bytes = 134_217_728
max_batch = 7
store_kinds = "kv"

[server]
port = 0
http_port = -1
"""


@pytest.fixture
def toml(tmp_path):
    path = tmp_path / "hcache.toml"
    path.write_text(TOML.format(d=tmp_path))
    return path


def leaf_fields(cfg: Config):
    """(namespace dest, dataclass default) of every setting."""
    for f in fields(cfg):
        if f.name not in SECTIONS:
            yield PREFIX + f.name, getattr(cfg, f.name)
    for section in SECTIONS:
        obj = getattr(cfg, section)
        for f in fields(obj):
            yield f"{PREFIX}{section}.{f.name}", getattr(obj, f.name)


def test_every_setting_is_a_serve_flag_whose_default_is_the_field_default() -> None:
    """Fails if a flag restates a default that drifts from its field, or a field has no flag."""
    ns = vars(parser().parse_args(["serve"]))
    for dest, default in leaf_fields(Config()):
        assert dest in ns, f"no flag for {dest}"
        assert ns[dest] == default, dest
    assert to_config(parser().parse_args(["serve"])) == Config()
    for sub in ("demo", "profile"):
        ns = vars(parser().parse_args([sub]))
        assert (ns[PREFIX + "model"], ns[PREFIX + "dtype"]) == (Config().model, Config().dtype)


def test_defaults() -> None:
    cfg = Config()
    assert cfg.storage.dirs == [str(hcache_home() / "store")]
    assert not hasattr(cfg, "threads") and not hasattr(cfg, "storage_dirs")
    assert not hasattr(EngineConfig(), "read_cap_mbps") and StorageConfig().read_cap_gbps == 0.0
    assert StorageConfig(["x"]).dirs == ["x"]  # positional, as the storage code and benchmarks build it


def test_flags_set_the_tree() -> None:
    storage = ["--dirs", "a", "b", "--read-cap-gbps", "0.5", "--no-direct-io", "--staging-mb", "8"]
    engine = ["--kv-budget-mb", "512", "--sequential", "--max-storage-mb-per-key", "3"]
    _, cfg = configure(["serve", *storage, *engine, "--api-keys", "k", "--port", "9"])
    # MB flags are parsed into the fields' bytes
    assert cfg.storage == StorageConfig(["a", "b"], staging_bytes=8 * MB, direct_io=False, read_cap_gbps=0.5)
    assert cfg.engine == EngineConfig(kv_budget_bytes=512 * MB, fused=False, max_storage_bytes_per_tenant=3 * MB)
    assert cfg.server == ServerConfig(port=9, api_keys_file="k")
    assert configure(["serve", "--storage-dirs", "c"])[1].storage.dirs == ["c"]


def test_the_file_sets_values_and_flags_given_win(toml, tmp_path) -> None:
    _, cfg = configure(["serve", "--config", str(toml)])
    assert cfg.storage.dirs == [f"{tmp_path}/a", f"{tmp_path}/b"] and cfg.storage.read_depth == 3
    assert cfg.storage.direct_io is False and cfg.storage.read_cap_gbps == 0.25
    assert cfg.storage.quota_bytes == 0  # not in the file: the default
    assert (cfg.engine.max_batch, cfg.engine.store_kinds, cfg.engine.kv_budget_bytes) == (7, "kv", 128 * MB)
    assert cfg.profile_dir == f"{tmp_path}/profiles" and cfg.server.http_port == -1
    args = ["serve", "--read-cap-gbps", "2", "--config", str(toml), "--max-batch", "9", "--direct-io"]
    _, cfg = configure([*args, "--kv-budget-mb", "64", "--dirs", "z"])
    assert (cfg.storage.read_cap_gbps, cfg.engine.max_batch, cfg.storage.direct_io) == (2.0, 9, True)
    assert cfg.engine.kv_budget_bytes == 64 * MB and cfg.storage.dirs == ["z"]
    assert cfg.storage.read_depth == 3 and cfg.engine.store_kinds == "kv"  # the file's, where no flag was given


@pytest.mark.model
def test_file_and_flag_values_reach_the_store_and_engine(toml, tmp_path, default_model) -> None:
    _, cfg = configure(["serve", "--config", str(toml), "--read-cap-gbps", "0.5", "--max-batch", "5"])
    engine, store = build_engine(cfg, profile_for(default_model.model), default_model)
    try:
        assert store.cfg is cfg.storage and engine.cfg is cfg.engine  # one config object, passed down
        assert [str(d) for d in store.dirs] == [str((tmp_path / x).resolve()) for x in "ab"]
        assert store.throttle.rate == 0.5e9  # the flag over the file's 0.25 GB/s, in bytes per second
        assert store.ring.capacity == 16 * MB
        assert engine.cfg.max_batch == 5 and engine.cfg.store_kinds == "kv"
        per_block = engine.pool.bytes_per_block(default_model.model.cfg, default_model.model.dtype)
        assert engine.pool.num_blocks == 128 * MB // per_block
    finally:
        engine.close()
        store.close()


@pytest.mark.parametrize(
    "text, msg",
    [
        ("modle = 'x'\n", "unknown key 'modle'"),
        ("[storage]\nread_cap_mbps = 100\n", "unknown key 'storage.read_cap_mbps'"),
        ("[cache]\nx = 1\n", "unknown key 'cache'"),
        ("[engine]\nmax_batch = '32'\n", "engine.max_batch must be an integer, not '32'"),
        ("[engine]\nmax_batch = true\n", "engine.max_batch must be an integer, not True"),
        ("[storage]\ndirs = '/d'\n", "storage.dirs must be a non-empty list of strings"),
        ("[storage]\ndirs = []\n", "storage.dirs must be a non-empty list of strings"),
        ("[storage]\ndirect_io = 1\n", "storage.direct_io must be true or false"),
        ("[engine]\nstore_kinds = 'all'\n", "engine.store_kinds must be one of auto, kv, hidden, both"),
        ("storage = 3\n", "storage must be a table"),
        ("[server\n", "not valid TOML"),
    ],
)
def test_a_bad_file_is_a_clear_error(tmp_path, capsys, text: str, msg: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hcache: error: ") and msg in err and "Traceback" not in err


def test_a_missing_file_is_a_clear_error(tmp_path, capsys) -> None:
    assert main(["serve", "--config", str(tmp_path / "none.toml")]) == 2
    assert "cannot read config file" in capsys.readouterr().err


def test_float_fields_take_integers(tmp_path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[storage]\nread_cap_gbps = 2\n[server]\ndrain_seconds = 5\n")
    cfg = configure(["serve", "--config", str(path)])[1]
    assert cfg.storage.read_cap_gbps == 2.0 and isinstance(cfg.storage.read_cap_gbps, float)
    assert cfg.server.drain_seconds == 5.0
