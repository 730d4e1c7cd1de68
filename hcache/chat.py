"""`hcache chat`: a terminal client. Streams replies; /restore [method], /evict,
/stats, /session and /quit are commands."""

from __future__ import annotations

import sys
from typing import TextIO

import grpc
from rich.console import Console
from rich.table import Table

from hcache.client import METHODS, Client
from hcache.v1 import hcache_pb2 as pb

HELP = "commands: /restore [auto|hidden|kv|recompute]  /evict  /session  /stats  /help  /quit"


def run(
    target: str,  # one replica, or several separated by commas
    session_id: str | None,
    system_prompt: str,
    max_new_tokens: int,
    api_key: str | None = None,
    root_cert: bytes | None = None,
    out: TextIO = sys.stdout,
) -> int:
    with Client(target, api_key=api_key, root_cert=root_cert) as c:
        try:
            sid = session_id or c.create_session(system_prompt).session_id
        except grpc.RpcError as e:
            print(f"hcache: error: {e.details()} ({e.code().name})", file=sys.stderr)
            return 2
        print(f"session {sid}  ({HELP})", file=out, flush=True)
        for line in sys.stdin:
            line = line.strip()
            if not line:
                continue
            try:
                if not _command(c, sid, line, max_new_tokens, out):
                    return 0
            except grpc.RpcError as e:
                print(f"error: {e.details()} ({e.code().name})", file=out, flush=True)
    return 0


def _command(c: Client, sid: str, line: str, max_new_tokens: int, out: TextIO) -> bool:
    word, _, arg = line.partition(" ")
    if word in ("/quit", "/exit"):
        return False
    if word == "/help":
        print(HELP, file=out)
    elif word == "/restore":
        method = arg.strip() or "auto"
        if method not in METHODS:
            print(f"unknown method {method!r}; one of {', '.join(METHODS)}", file=out)
            return True
        r = c.restore(sid, method)
        if r.already_resident:
            print("already resident", file=out)
        else:
            p = r.plan
            print(
                f"restored {r.num_tokens} tokens in {r.restore_ms:.1f} ms by RE {p.recompute} / H {p.hidden} / "
                f"KV {p.kv} ({r.bytes_read / 1e6:.1f} MB read)",
                file=out,
            )
    elif word == "/evict":
        s = c.evict(sid)
        print(f"evicted; {s.num_tokens} tokens stay in storage", file=out)
    elif word == "/session":
        print(c.get(sid), file=out)
    elif word == "/stats":
        Console(file=out, width=120).print(stats_table(c.stats()))
    elif word.startswith("/"):
        print(f"unknown command {word}; {HELP}", file=out)
    else:
        last = None
        for r in c.generate(sid, line, max_new_tokens=max_new_tokens):
            if r.finished:
                last = r
            else:
                print(r.text, end="", file=out, flush=True)
        if last is not None:
            st = last.stats
            how = f"restored in {st.restore_ms:.0f} ms, " if st.restore_ms else ""
            print(f"\n  [{how}ttft {st.ttft_ms:.0f} ms, {st.completion_tokens} tokens]", file=out, flush=True)
    return True


def stats_table(stats: pb.Stats) -> Table:
    """The server's figures, one row per field (zeros included, so the table's shape never changes)."""
    t = Table(title=f"server stats ({stats.model})" if stats.model else "server stats")
    t.add_column("figure")
    t.add_column("value", justify="right")
    for f in stats.DESCRIPTOR.fields:
        value = getattr(stats, f.name)
        if f.name == "dirs":
            for i, d in enumerate(value):
                t.add_row(
                    f"dirs[{i}]",
                    f"{d.path}: used {d.used_bytes:,}, free {d.free_bytes:,}, "
                    f"written {d.bytes_written:,} bytes, {d.chunks:,} chunks",
                )
        elif f.name == "queue_depth":
            t.add_row(f.name, ", ".join(f"{k} {v}" for k, v in sorted(value.items())) or "-")
        elif isinstance(value, bool):
            t.add_row(f.name, "yes" if value else "no")
        elif isinstance(value, int):
            t.add_row(f.name, f"{value:,}")
        else:
            t.add_row(f.name, str(value))
    return t
