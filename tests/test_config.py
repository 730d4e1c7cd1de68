"""One config tree, set by `hcache serve` flags whose defaults are the dataclasses' defaults."""

from __future__ import annotations

from dataclasses import fields

from hcache.cli import configure, parser
from hcache.config import MB, Config, EngineConfig, ServerConfig, StorageConfig, hcache_home
from hcache.flags import PREFIX, SECTIONS, to_config


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
