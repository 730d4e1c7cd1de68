"""The configuration the service runs with: one tree (`Config`) of storage, engine and
server settings, read from a TOML file, environment variables and flags. The model's own
geometry is `hcache.model.geometry`."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

if sys.version_info >= (3, 11):
    import tomllib
else:  # the same parser, before it joined the standard library
    import tomli as tomllib


def hcache_home() -> Path:
    return Path(os.environ.get("HCACHE_HOME", Path.home() / ".cache" / "hcache"))


MB = 1 << 20
GB = 1 << 30


def setting(
    default: Any = None,
    doc: str = "",
    *,
    factory: Callable[[], Any] | None = None,
    flag: str = "",
    unit: int = 1,
    choices: tuple[str, ...] = (),
    aliases: tuple[str, ...] = (),
) -> Any:
    """A field of the service's config, with what its `hcache serve` flag needs (hcache/flags.py):
    help text, the flag's name when it is not the field's, the flag's unit (MB for a field in
    bytes), the allowed values and other names for the flag (for a bool: for its `--no-` form)."""
    meta = {"doc": doc, "flag": flag, "unit": unit, "choices": choices, "aliases": aliases}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class StorageConfig:
    dirs: list[str] = setting(  # noqa: RUF009 - setting() is field(): a fresh list per instance
        doc="storage directories, one per device; chunks are placed by their order",
        factory=lambda: [str(hcache_home() / "store")],
        aliases=("--storage-dirs",),
    )
    quota_bytes: int = setting(0, "per directory (0: the filesystem's free space)", flag="--quota-mb", unit=MB)
    staging_bytes: int = setting(
        64 << 20, "staging ring between the forward and the writers", flag="--staging-mb", unit=MB
    )
    direct_io: bool = setting(True, "O_DIRECT reads and writes (off: through the page cache)")
    max_request_bytes: int = setting(
        32 << 20, "largest read request; an owner's later requests double up to it", flag="--max-request-mb", unit=MB
    )
    first_request_bytes: int = setting(
        2 << 20,
        "an owner's first read request per slab, so its first layer arrives soon",
        flag="--first-request-mb",
        unit=MB,
    )
    request_layers: int = setting(3, "a read request takes chunks of at most this many layers")
    read_depth: int = setting(8, "read requests in flight per directory")
    prefetch_layers: int = setting(12, "restore read-ahead in layers (or more while they hold less than --prefetch-mb)")
    prefetch_bytes: int = setting(128 << 20, "restore read-ahead in bytes", flag="--prefetch-mb", unit=MB)
    fsync_group_bytes: int = setting(
        16 << 20, "bytes written per directory between fsyncs", flag="--fsync-group-mb", unit=MB
    )
    read_cap_gbps: float = setting(0.0, "restore reads capped by a token bucket, in GB/s (0: no cap)")
    max_bytes: int = setting(
        0, "all directories together, split evenly over them (0: only --quota-mb)", flag="--store-max-gb", unit=GB
    )
    low_watermark: float = setting(0.1, "free fraction of the capacity under which idle sessions' chunks are released")
    high_watermark: float = setting(0.2, "free fraction the releases bring the store back to")


@dataclass
class EngineConfig:
    kv_budget_bytes: int = setting(
        2 << 30, "resident KV of all sessions (the block pool)", flag="--kv-budget-mb", unit=MB
    )
    max_batch: int = setting(32, "sequences per decode step")
    decode: str = setting(
        os.environ.get("HCACHE_DECODE", "compiled"),
        "compiled: the decode step is one torch.compile graph (compiled at start; cached after); eager: op by op",
        choices=("compiled", "eager"),
    )
    compile_in_background: bool = setting(
        True,
        "on a CPU, serve with eager decode steps while the compiled step compiles on a thread of its own "
        "(/readyz is 503 until it serves); off: compile before serving",
    )
    prefault_pool: bool = setting(
        True, "fault the KV pool's pages in at start, on a thread beside serving; off: each on its first use"
    )
    piece_tokens: int = setting(512, "prefill runs in pieces of this many tokens")
    prefill_slice_ms: float = setting(25.0, "restore/prefill time per engine step while others decode")
    default_max_new_tokens: int = setting(256, "max_new_tokens of a request that gives none")
    fused: bool = setting(True, "prefill layer l as soon as layer l's KV is restored", aliases=("--sequential",))
    store_kinds: str = setting(
        "auto",
        "what is stored per layer (auto: the planner's choice; none: nothing, sessions restore by recompute)",
        choices=("auto", "kv", "hidden", "both", "none"),
    )
    kv_dtype: str = setting(
        "auto",
        "the resident KV's dtype (model: the activations'; bfloat16: half the bytes of float32, attended in "
        "bfloat16; auto: bfloat16 under packed weights, else model)",
        choices=("auto", "model", "bfloat16"),
    )
    plan_tokens: int = setting(4096, "the session length the storage choice is planned for")
    max_sessions_per_tenant: int = setting(0, "sessions per API key (0: no limit)", flag="--max-sessions-per-key")
    max_storage_bytes_per_tenant: int = setting(
        0, "stored state per API key (0: no limit)", flag="--max-storage-mb-per-key", unit=MB
    )
    session_ttl_s: float = setting(
        0.0, "delete sessions idle longer than this many seconds, records included (0: keep)", flag="--session-ttl"
    )
    restore_method: str = setting(
        "auto",
        "force how Generate restores evicted sessions (benchmarks)",
        choices=("auto", "kv", "hidden", "recompute"),
    )
    context_mode: str = setting(
        "exact",
        "how a session on several contexts places them, unless its request says (exact: as a prefill in that "
        "order would; blend: their stored KV placed, a fraction of their tokens recomputed; concat: placed only)",
        choices=("exact", "blend", "concat"),
    )
    blend_fraction: float = setting(0.15, "of the contexts' tokens, the share a blend recomputes (0..1)")


@dataclass
class ServerConfig:
    host: str = setting("127.0.0.1", "address the gRPC and HTTP ports listen on")
    port: int = setting(50051, "gRPC port")
    http_port: int = setting(8000, "OpenAI API, metrics, health and dashboard (-1: off; 0: any free port)")
    workers: int = setting(64, "gRPC handler threads (one per open stream)")
    max_message_bytes: int = setting(4 << 20, "largest request accepted", flag="--max-message-mb", unit=MB)
    drain_seconds: float = setting(30.0, "on SIGTERM, how long running turns may take to finish")
    api_keys_file: str = setting(
        "", "file of 'tenant key' lines: every RPC needs a key; keys own sessions (empty: none)", flag="--api-keys"
    )
    tls_cert_file: str = setting("", "PEM certificate chain (with --tls-key: serve TLS)", flag="--tls-cert")
    tls_key_file: str = setting("", "PEM private key", flag="--tls-key")
    cluster: str = setting(
        "", "redis://HOST:PORT[,HOST:PORT...]: share sessions with other replicas through Redis (empty: none)"
    )
    lease_ms: int = setting(10_000, "cluster mode: a turn's lease on its session; a dead replica's expires after this")
    replica_name: str = setting("", "cluster mode: this replica's name in lease messages (empty: host/pid/random)")
    cluster_chunks: str = setting(
        "auto",
        "cluster mode: sessions' chunks go to the cluster too; a replica lacking a session fetches them "
        "when cheaper than recomputing (auto), always, or they stay local (off)",
        choices=("auto", "always", "off"),
    )
    chunk_ttl_s: int = setting(86_400, "cluster mode: chunks expire after this (records never do)")


@dataclass
class Config:
    """What `hcache` runs with: defaults here, then a TOML file (`hcache serve --config`), then flags."""

    model: str = setting("default", "'default' (SmolLM2-135M-Instruct), 'qwen2.5-0.5b', a .gguf file or an HF folder")
    dtype: str = setting("float32", "weights and activations", choices=("float32", "bfloat16"))
    weights: str = setting(
        "auto",
        "float: dequantized (the oracle); packed: GGUF blocks on packed int4/int8 kernels (float "
        "weights quantized to int4) and int8 embedding/head, on CPUs; auto: packed on a CPU for a GGUF "
        "file whose linears are all Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K, else float",
        choices=("auto", "float", "packed"),
    )
    device: str = setting("cpu", "torch device the model runs on")
    profile: str = setting("", "a profile JSON (empty: measure this machine once, then reuse it)")
    profile_dir: str = setting(
        doc="where measured profiles are cached", factory=lambda: str(hcache_home() / "profiles")
    )
    storage: StorageConfig = field(default_factory=StorageConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)


class ConfigError(ValueError):
    """A config file that cannot be read, or has an unknown key or a value of the wrong type."""


def load(path: str | Path) -> Config:
    """A Config from a TOML file: top-level keys for Config's own fields, tables [storage],
    [engine] and [server] for the sections; what the file leaves out keeps its default."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    cfg = Config()
    _fill(cfg, data, str(path), "")
    return cfg


def _fill(obj: Any, data: dict[str, Any], where: str, prefix: str) -> None:
    known = {f.name: f for f in fields(obj)}
    types = get_type_hints(type(obj))
    for key, value in data.items():
        name = prefix + key
        if key not in known:
            raise ConfigError(f"{where}: unknown key {name!r} (known here: {', '.join(known)})")
        if is_dataclass(types[key]):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: {name} must be a table ([{name}])")
            _fill(getattr(obj, key), value, where, f"{name}.")
        else:
            setattr(obj, key, _checked(value, types[key], known[key].metadata.get("choices", ()), f"{where}: {name}"))


_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _checked(value: Any, typ: Any, choices: tuple[str, ...], what: str) -> Any:
    if typ is float and type(value) is int:
        value = float(value)
    if get_origin(typ) is list:
        (item,) = get_args(typ)
        ok = isinstance(value, list) and len(value) > 0 and all(type(v) is item for v in value)
        want = f"a non-empty list of {_TYPE_NAMES[item].removeprefix('a ')}s"  # as its flag's nargs="+"
    else:
        ok, want = type(value) is typ, _TYPE_NAMES[typ]  # `is`: TOML's true is no integer here
    if not ok:
        raise ConfigError(f"{what} must be {want}, not {value!r}")
    if choices and value not in choices:
        raise ConfigError(f"{what} must be one of {', '.join(choices)}, not {value!r}")
    return value
