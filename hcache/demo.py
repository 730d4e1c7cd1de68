"""`hcache demo`: a multi-turn chat whose KV cache is dropped after every turn and
restored by each path (H, KV, RE and a mix); every restored reply must equal the
reply of a session that was never evicted."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from hcache.engine.generate import ChatSession
from hcache.engine.sampler import SamplingParams
from hcache.model.loader import load
from hcache.restore.plan import Method, Plan
from hcache.restore.projection import warm_up

SYSTEM = "You are a helpful assistant."
TURNS = [
    "What is the capital of France?",
    "What is it famous for?",
    "Give me one tip for visiting.",
]


def demo_plans(num_layers: int) -> dict[str, Plan]:
    """Single-method plans plus a mix: RE for the first eighth, H up to two thirds, KV for the rest."""
    n_re = max(1, num_layers * 2 // 15)
    n_h = max(1, num_layers * 2 // 3 - n_re)
    return {
        "H": Plan.uniform(num_layers, Method.HIDDEN),
        "KV": Plan.uniform(num_layers, Method.KV),
        "RE": Plan.uniform(num_layers, Method.RECOMPUTE),
        "mixed": Plan.split(num_layers, n_re, n_h),
    }


@dataclass
class Row:
    turn: int
    path: str
    plan: str
    tokens: int
    ms: float
    bytes_read: int
    kv_err: float
    identical: bool


def max_rel_err(session: ChatSession) -> float:
    """Largest |restored - prefill| / max|prefill| over every layer's K and V (the state keeps the prefill's)."""
    assert session.cache is not None
    worst = 0.0
    for layer in range(session.model.cfg.num_layers):
        for got, want in zip(session.cache.layer_kv(layer), session.state.kv(layer), strict=True):
            worst = max(worst, float((got.float() - want.float()).abs().max() / want.float().abs().max()))
    return worst


def run(
    model: str = "default",
    dtype: str = "float32",
    max_new_tokens: int = 48,
    console: Console | None = None,
    as_json: bool = False,
    device: str = "cpu",
) -> int:
    # A pipe gets a fixed width wide enough for the table; a terminal keeps its own.
    # With --json, progress goes to stderr so that stdout holds only the JSON document.
    out = sys.stderr if as_json else sys.stdout
    console = console or Console(file=out, width=None if out.isatty() else 150)
    with console.status(f"loading {model} ({dtype}, {device})"):
        lm = load(model, dtype, device)
        warm_up(lm.model)  # compile before the first turn, as `hcache serve` does
    if lm.tokenizer is None:
        console.print("[red]the model has no tokenizer; the demo needs one[/red]")
        return 2
    cfg = lm.model.cfg
    console.print(
        f"model {lm.source.name}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_heads} heads / {cfg.num_kv_heads} KV heads, {dtype}"
    )
    params = SamplingParams(max_new_tokens=max_new_tokens)
    reference = ChatSession(lm.model, lm.tokenizer, SYSTEM)
    plans = demo_plans(cfg.num_layers)
    rows: list[Row] = []
    replies: list[tuple[str, str]] = []
    for turn, message in enumerate(TURNS, 1):
        evicted = {name: reference.fork() for name in plans}  # state saved, KV dropped
        ref_text, ref_ids = reference.reply(message, params)
        replies.append((message, ref_text))
        for name, plan in plans.items():
            session = evicted[name]
            report = session.restore(plan)
            err = max_rel_err(session)
            _, ids = session.reply(message, params)
            rows.append(
                Row(turn, name, str(plan), report.num_tokens, report.ms, report.bytes_read, err, ids == ref_ids)
            )
    ok = all(r.identical for r in rows)
    if as_json:
        print(json.dumps(to_json(rows, replies), indent=2))
        return 0 if ok else 1
    console.print(_table(rows))
    for message, text in replies:
        console.print(f"[bold]user:[/bold] {message}\n[bold]assistant:[/bold] {text}\n")
    console.print("[green]all restored replies identical[/green]" if ok else "[red]restored replies differ[/red]")
    return 0 if ok else 1


def to_json(rows: list[Row], replies: list[tuple[str, str]]) -> dict:
    """The table as `hcache demo --json` prints it: one object per row, then the reference replies."""
    return {
        "rows": [
            {
                "turn": r.turn,
                "method": r.path,
                "plan": r.plan,
                "tokens": r.tokens,
                "restore_ms": r.ms,
                "bytes": r.bytes_read,
                "kv_max_rel_err": r.kv_err,
                "identical": r.identical,
            }
            for r in rows
        ],
        "replies": [{"user": m, "assistant": t} for m, t in replies],
        "identical": all(r.identical for r in rows),
    }


def _table(rows: list[Row]) -> Table:
    t = Table(title="KV dropped after each turn, restored, next turn generated")
    for col in (
        "turn",
        "path",
        "plan",
        "tokens",
        "restore ms",
        "bytes a store reads",
        "KV max rel err",
        "reply identical",
    ):
        t.add_column(col, justify="right" if col not in ("path", "plan") else "left")
    for r in rows:
        t.add_row(
            str(r.turn),
            r.path,
            r.plan,
            str(r.tokens),
            f"{r.ms:.1f}",
            f"{r.bytes_read:,}",
            f"{r.kv_err:.1e}",
            "yes" if r.identical else "[red]NO[/red]",
        )
    return t


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    raise SystemExit(run())
