"""Command-line flags made from the Config dataclasses' fields (hcache/config.py), so that a
setting's default, help and allowed values are written once, in its field. A flag's value is
parsed into its field's unit (`--kv-budget-mb 512` gives bytes), so the parsed namespace maps
onto a Config one to one."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from dataclasses import Field, fields, is_dataclass
from typing import Any, get_origin, get_type_hints

from hcache.config import GB, MB, Config

SECTIONS = ("storage", "engine", "server")
PREFIX = "cfg."  # the namespace's config values, apart from a subcommand's other flags


def add_config_flags(p: argparse.ArgumentParser, base: Config, only: Iterable[str] | None = None) -> None:
    """A flag for each of Config's own fields (or those in `only`) and, unless `only` is given,
    for every field of its sections, in one help group per section. Defaults come from `base`."""
    types = get_type_hints(Config)
    for f in fields(base):
        if (only is None or f.name in only) and not is_dataclass(types[f.name]):
            _add(p, f, types[f.name], getattr(base, f.name), PREFIX + f.name)
    if only is not None:
        return
    for section in SECTIONS:
        obj = getattr(base, section)
        group = p.add_argument_group(f"{section} (TOML table [{section}])")
        types = get_type_hints(type(obj))
        for f in fields(obj):
            _add(group, f, types[f.name], getattr(obj, f.name), f"{PREFIX}{section}.{f.name}")


def to_config(args: argparse.Namespace) -> Config:
    """The Config a parsed namespace describes; fields it has no flag for keep their defaults."""
    cfg = Config()
    for dest, value in vars(args).items():
        if dest.startswith(PREFIX):
            *section, name = dest.removeprefix(PREFIX).split(".")
            obj = getattr(cfg, section[0]) if section else cfg
            setattr(obj, name, list(value) if isinstance(value, list) else value)
    return cfg


def _add(p: Any, f: Field, typ: Any, default: Any, dest: str) -> None:
    meta = f.metadata
    name = meta["flag"] or "--" + f.name.replace("_", "-")
    unit, doc, aliases = meta["unit"], meta["doc"], meta["aliases"]
    if typ is bool:
        p.add_argument(
            name, dest=dest, action="store_true", default=default, help=_help(doc, "on" if default else "off")
        )
        off = ["--no-" + name.removeprefix("--"), *aliases]
        p.add_argument(*off, dest=dest, action="store_false", default=default, help=f"turn {name} off")
    elif get_origin(typ) is list:
        p.add_argument(name, *aliases, dest=dest, nargs="+", default=default, metavar="DIR", help=_help(doc, *default))
    elif meta["choices"]:
        p.add_argument(name, *aliases, dest=dest, choices=meta["choices"], default=default, help=_help(doc, default))
    else:
        metavar = {MB: "MB", GB: "GB"}.get(unit) or {int: "N", float: "NUM"}.get(typ, name.rpartition("-")[2].upper())
        shown = f"{default / unit:g}" if unit != 1 else repr(default) if default == "" else default
        typ = _in_unit(typ, unit)
        p.add_argument(name, *aliases, dest=dest, type=typ, default=default, metavar=metavar, help=_help(doc, shown))


def _help(doc: str, *default: Any) -> str:
    return f"{doc} (default: {' '.join(map(str, default))})".replace("%", "%%")


def _in_unit(typ: type, unit: int) -> Callable[[str], Any]:
    if unit == 1:
        return typ

    def parse(text: str) -> Any:
        return typ(float(text) * unit) if typ is int and unit >= GB else typ(text) * unit

    parse.__name__ = typ.__name__  # argparse names the type in "invalid int value"
    return parse
