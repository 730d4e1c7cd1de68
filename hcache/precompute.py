"""`hcache precompute` and `hcache contexts`: a corpus stored as contexts through a running
server, and the contexts listed, found by the caller's document id, or deleted.

A corpus is a folder of text files (each file's path under it is its id) or a JSONL file of
`{"id": ..., "text": ...}` lines. Each document is sent to PrecomputeContext with the label
`id`; the server returns a document it already stores without computing it, so a run killed
halfway resumes where it stopped, and a second run over the same corpus computes nothing."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from hcache.client import Client

ID_LABEL = "id"


@dataclass
class Tally:
    stored: int = 0  # computed now
    reused: int = 0  # already stored: skipped
    tokens: int = 0  # computed now
    seconds: float = 0.0


def documents(path: Path) -> Iterator[tuple[str, str]]:
    """(id, text) of every document: a folder's `*.txt` files (recursively, sorted), or the
    lines of a JSONL file."""
    if path.is_dir():
        for f in sorted(path.rglob("*.txt")):
            yield f.relative_to(path).as_posix(), f.read_text(encoding="utf-8")
        return
    with path.open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
                doc_id, text = doc["id"], doc["text"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f'{path}:{n}: expected a JSON object with "id" and "text"') from None
            if not isinstance(text, str) or not text:
                raise ValueError(f"{path}:{n}: the text of {doc_id!r} is empty or not a string")
            yield str(doc_id), text


def precompute(client: Client, path: Path, labels: dict[str, str], quiet: bool = False) -> Tally:
    """Store every document of the corpus at `path` (checked whole before the first is sent)."""
    docs = list(documents(path))
    dupes = sorted(d for d, n in Counter(d for d, _ in docs).items() if n > 1)
    if dupes:
        raise ValueError(f"document ids repeat in {path}: {', '.join(dupes[:5])}")
    tally = Tally()
    t0 = time.perf_counter()
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]} tokens/s"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, disable=quiet) as bar:
        task = bar.add_task("precompute", total=len(docs), rate="-")
        for doc_id, text in docs:
            c = client.precompute_context(text, labels={**labels, ID_LABEL: doc_id})
            if c.reused:
                tally.reused += 1
            else:
                tally.stored += 1
                tally.tokens += c.num_tokens
            tally.seconds = time.perf_counter() - t0
            rate = f"{tally.tokens / tally.seconds:,.0f}" if tally.seconds else "-"
            bar.update(task, advance=1, rate=rate)
    return tally


def find(client: Client, doc_id: str | None) -> list:
    """The contexts, or the one stored for the caller's document id."""
    return list(client.contexts({ID_LABEL: doc_id} if doc_id is not None else None))


def delete(client: Client, doc_id: str) -> int:
    """Delete the context stored for the caller's document id; how many were deleted."""
    found = find(client, doc_id)
    for c in found:
        client.delete(c.context_id)
    return len(found)
