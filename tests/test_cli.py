"""The command line gives clear errors, never a traceback."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from hcache.cli import main
from hcache.model.geometry import ModelConfig


def test_missing_model_is_a_clear_error(tmp_path, capsys) -> None:
    assert main(["demo", "--model", str(tmp_path / "nope.gguf")]) == 2
    err = capsys.readouterr().err
    assert "model not found" in err and "Traceback" not in err


def test_bad_token_budget(capsys) -> None:
    assert main(["demo", "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens" in capsys.readouterr().err


def test_not_a_model_file(tmp_path, capsys) -> None:
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    assert main(["demo", "--model", str(f)]) == 2
    assert "neither a .gguf file nor a Hugging Face folder" in capsys.readouterr().err


def test_console_script_usage_error() -> None:
    r = subprocess.run([sys.executable, "-m", "hcache.cli", "demo", "--dtype", "int3"], capture_output=True, text=True)
    assert r.returncode == 2 and "invalid choice" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "cfg, msg",
    [
        ({"model_type": "gpt2"}, "unsupported model_type"),
        ({"model_type": "mistral", "sliding_window": 4096, "num_attention_heads": 4}, "sliding-window"),
        (
            {
                "model_type": "llama",
                "num_attention_heads": 4,
                "hidden_size": 8,
                "vocab_size": 8,
                "intermediate_size": 8,
                "num_hidden_layers": 1,
                "rope_scaling": {"rope_type": "yarn", "factor": 2.0},
            },
            "rope scaling",
        ),
    ],
)
def test_unsupported_configs(cfg: dict, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        ModelConfig.from_hf(cfg)


def test_fsck_command(tmp_path, capsys) -> None:
    import torch
    from storage_helpers import GEOM, KINDS, save

    from hcache.config import StorageConfig
    from hcache.storage.store import ChunkStore

    with ChunkStore(StorageConfig([str(tmp_path)]), GEOM, torch.float32) as st:
        st.create_owner("s", KINDS, "fp")
        save(st, "s", 0, 100)
        st.mark_durable("s", list(range(100)))
    assert main(["fsck", "--dirs", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "1 owners" in out and out.strip().endswith("clean")
    assert main(["fsck", "--dirs", str(tmp_path / "missing")]) == 2
    assert "storage directory missing" in capsys.readouterr().err
    assert not (tmp_path / "missing").exists()  # fsck verifies; it never creates a store's directory


def test_bench_storage_creates_missing_dirs(tmp_path, capsys) -> None:
    d = tmp_path / "not" / "yet"
    argv = ["bench", "storage", "--dirs", str(d), "--model", "default-geometry", "--dtype", "float32"]
    argv += ["--tokens", "64", "--repeats", "1", "--json", "--out", str(tmp_path / "out.json")]
    assert main(argv) == 0
    assert d.is_dir()


@pytest.mark.parametrize("command", [["bench", "storage", "--dirs"], ["profile", "--dirs"], ["fsck", "--dirs"]])
def test_uncreatable_storage_dir(tmp_path, capsys, command: list[str]) -> None:
    (tmp_path / "file").write_text("")
    bad = tmp_path / "file" / "store"
    assert main([*command, str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "Traceback" not in err


@pytest.mark.model
def test_demo_json(default_model, monkeypatch, capsys) -> None:
    import json

    from hcache import demo

    monkeypatch.setattr(demo, "load", lambda *a, **k: default_model)
    assert main(["demo", "--json", "--max-new-tokens", "4"]) == 0
    doc = json.loads(capsys.readouterr().out)  # stdout holds only the JSON document
    assert {r["method"] for r in doc["rows"]} == {"H", "KV", "RE", "mixed"}
    for r in doc["rows"]:
        assert {"turn", "method", "restore_ms", "bytes", "identical"} <= r.keys()
        assert r["identical"] is True
    assert len(doc["replies"]) == len(demo.TURNS) and all(x["assistant"] for x in doc["replies"])


def test_chat_stats_table() -> None:
    from rich.console import Console

    from hcache.chat import stats_table
    from hcache.v1 import hcache_pb2 as pb

    s = pb.Stats(sessions=3, resident_bytes=123456, model="tiny", queue_depth={"prefill": 2}, draining=True)
    s.dirs.add(path="/d0", used_bytes=10, chunks=4)
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(stats_table(s))
    text = console.export_text()
    for want in ("sessions", "3", "resident_bytes", "123,456", "queue_depth", "prefill 2", "draining", "yes"):
        assert want in text
    assert "/d0" in text and "tiny" in text and "{" not in text
