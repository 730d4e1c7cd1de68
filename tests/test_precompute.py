"""`hcache precompute` and `hcache contexts` against a running server: a corpus stored once,
a rerun after a kill resuming where it stopped, lookup and deletion by the caller's id."""

from __future__ import annotations

import json

import pytest
from engine_helpers import profile_for

from hcache import precompute
from hcache.cli import main
from hcache.client import Client
from hcache.config import Config, EngineConfig, ServerConfig, StorageConfig
from hcache.server.app import start

pytestmark = pytest.mark.model
DOCS = [
    {"id": "owls", "text": "Owls hunt at night. The barn owl hears a mouse under snow."},
    {"id": "bees", "text": "Bees dance to tell where flowers are. A hive keeps one queen."},
    {"id": "eels", "text": "Eels cross the ocean to spawn in the Sargasso Sea."},
    {"id": "moss", "text": "Moss grows where it is damp and shaded, often on north sides."},
]


@pytest.fixture(scope="module")
def target(default_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("store")
    cfg = Config(
        storage=StorageConfig([str(d / "a")]),
        engine=EngineConfig(store_kinds="both", kv_budget_bytes=64 << 20),
        server=ServerConfig(port=0, http_port=-1, drain_seconds=10),
    )
    run = start(cfg, profile_for(default_model.model), default_model)
    yield f"127.0.0.1:{run.port}"
    run.stop(1)


def jsonl(path, docs) -> None:
    path.write_text("".join(json.dumps(d) + "\n\n" for d in docs))


def test_a_corpus_is_stored_once_and_a_rerun_resumes(target, default_model, tmp_path):
    part, whole = tmp_path / "part.jsonl", tmp_path / "whole.jsonl"
    jsonl(part, DOCS[:2])  # a run killed after two documents
    jsonl(whole, DOCS)
    tok = default_model.tokenizer
    with Client(target) as c:
        first = precompute.precompute(c, part, {"set": "animals"}, quiet=True)
        assert (first.stored, first.reused) == (2, 0)
        assert first.tokens == sum(len(tok.encode(d["text"])) for d in DOCS[:2])
        resumed = precompute.precompute(c, whole, {"set": "animals"}, quiet=True)
        assert (resumed.stored, resumed.reused) == (2, 2)
        again = precompute.precompute(c, whole, {"set": "animals"}, quiet=True)
        assert (again.stored, again.reused, again.tokens) == (0, 4, 0)
        (eels,) = precompute.find(c, "eels")
        assert dict(eels.labels) == {"id": "eels", "set": "animals"}
        assert eels.num_tokens == len(tok.encode(DOCS[2]["text"]))
        assert sorted(x.labels["id"] for x in c.contexts({"set": "animals"})) == sorted(d["id"] for d in DOCS)
        s = c.create_session(context_ids=[eels.context_id])  # a stored document serves sessions
        assert s.num_tokens == eels.num_tokens
        c.delete(s.session_id)


def test_contexts_are_found_and_deleted_by_document_id(target, tmp_path, capsys):
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("Granite is an igneous rock rich in quartz.")
    (folder / "sub" / "b.txt").write_text("Basalt forms when lava cools fast.")
    (folder / "notes.md").write_text("not a document")
    assert main(["precompute", str(folder), "--target", target, "--quiet"]) == 0
    assert "stored 2 documents" in capsys.readouterr().out
    assert main(["contexts", "--target", target, "--id", "sub/b.txt"]) == 0
    assert capsys.readouterr().out.strip().endswith("\tsub/b.txt")
    assert main(["contexts", "--target", target, "--id", "sub/b.txt", "--delete"]) == 0
    assert main(["contexts", "--target", target, "--id", "sub/b.txt"]) == 1
    assert main(["precompute", str(folder), "--target", target, "--quiet"]) == 0
    assert "stored 1 documents" in capsys.readouterr().out.splitlines()[-1]  # only the deleted one again


def test_a_bad_corpus_is_refused_before_anything_is_sent(target, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "x", "text": "fine"}) + "\n" + '{"text": "no id"}\n')
    assert main(["precompute", str(bad), "--target", target, "--quiet"]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err
    dup = tmp_path / "dup.jsonl"
    jsonl(dup, [{"id": "x", "text": "one"}, {"id": "x", "text": "two"}])
    assert main(["precompute", str(dup), "--target", target, "--quiet"]) == 2
    assert "repeat" in capsys.readouterr().err
    with Client(target) as c:
        assert precompute.find(c, "x") == []
    assert main(["contexts", "--target", target, "--delete"]) == 2  # --delete needs --id
