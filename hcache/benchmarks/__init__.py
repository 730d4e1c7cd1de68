"""Benchmarks behind `hcache bench` (bench/ holds the entry scripts and the results)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hcache.malloc import tune_allocator

# every benchmark measures the process the service runs as (bench/*.py skip the CLI)
tune_allocator()


def report(data: Any, out: str, as_json: bool, table: Callable[[], None]) -> int:
    """Write the JSON results to `out`; print them as JSON or as the benchmark's table."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(data, indent=2))
    if as_json:
        print(json.dumps(data, indent=2))
    else:
        table()
    return 0
