"""The committed gRPC stubs are what the proto generates (run `make proto` after editing it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_stubs_match_the_proto(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-Iproto",
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            "proto/hcache/v1/hcache.proto",
        ],
        cwd=ROOT,
        check=True,
    )
    for name in ("hcache_pb2.py", "hcache_pb2.pyi", "hcache_pb2_grpc.py"):
        assert (tmp_path / "hcache/v1" / name).read_text() == (ROOT / "hcache/v1" / name).read_text(), name
