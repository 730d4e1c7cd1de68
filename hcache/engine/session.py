"""A session: a conversation (or a context) whose state lives in the store. It holds what
the manifest keeps of it (its `SessionMeta`) beside its token ids and its in-memory state:
resident KV, whether a turn runs on it, the last restore."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hcache.engine.block_pool import PagedCache
from hcache.engine.records import SessionRow
from hcache.restore.plan import Plan
from hcache.restore.planning import Lineage
from hcache.storage.fetched import Fetched


@dataclass
class SessionMeta:
    """What the manifest keeps next to a session's token ids: enough to rebuild the session
    after a restart, or to take it back to its last durable turn."""

    prefix: list[int] = field(default_factory=list)  # token ids of the contexts placed before the conversation
    parent: str | None = None  # the context whose stored state covers tokens[:base]
    base: int = 0
    messages: list[dict[str, str]] = field(default_factory=list)
    mode: str = ""  # "" until the first turn, then "chat" or "tokens"
    pending: int | None = None  # the last sampled token (not fed yet), token mode
    labels: dict[str, str] = field(default_factory=dict)
    context_ids: list[str] = field(default_factory=list)
    turns: int = 0
    tenant: str | None = None
    # "blend" or "concat": its contexts' stored KV is placed, not prefilled, by its first
    # turn (with `fraction` of their tokens recomputed), and it stores KV only
    compose: str = ""
    fraction: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "prefix": list(self.prefix),
            "parent": self.parent,
            "base": self.base,
            "messages": [dict(m) for m in self.messages],
            "mode": self.mode,
            "pending": self.pending,
            "labels": dict(self.labels),
            "context_ids": list(self.context_ids),
            "turns": self.turns,
            "tenant": self.tenant,
            "compose": self.compose,
            "fraction": self.fraction,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SessionMeta:
        """Missing keys take their defaults."""
        return cls(
            prefix=list(d.get("prefix", [])),
            parent=d.get("parent"),
            base=int(d.get("base", 0)),
            messages=[dict(m) for m in d.get("messages", [])],
            mode=d.get("mode", ""),
            pending=d.get("pending"),
            labels=dict(d.get("labels", {})),
            context_ids=list(d.get("context_ids", [])),
            turns=int(d.get("turns", 0)),
            tenant=d.get("tenant"),
            compose=d.get("compose", ""),
            fraction=float(d.get("fraction", 0.0)),
        )


@dataclass(eq=False)
class Session:
    id: str
    kind: str  # "session" | "context"
    meta: SessionMeta  # as durable, but for the turn running on it
    tokens: list[int]  # every token whose state exists (prefix included), as durable
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    cache: PagedCache | None = None  # resident KV
    busy: bool = False
    releasing: bool = False  # the reclaimer is giving up its chunks or expiring it
    last_used: float = field(default_factory=time.monotonic)
    last_plan: Plan | None = None
    last_restore_ms: float = 0.0
    error: str | None = None  # why this session cannot be restored (e.g. another model's state)
    # the token ids of its last acknowledged turn when those run ahead of (or apart from) the
    # local state in `tokens`: another replica ran turns on it (cluster mode); None: `tokens`
    history: list[int] | None = None
    # rows of the tokens in `tokens` past the durable ones, fetched from the cluster for the
    # turn about to run (which restores from them and stages them); the session stays busy
    fetched: Fetched | None = None

    @property
    def resident(self) -> bool:
        return self.cache is not None

    @property
    def base(self) -> int:
        """Tokens of its context's stored state it starts with."""
        return self.meta.base

    @property
    def tenant(self) -> str | None:
        return self.meta.tenant

    @property
    def lineage(self) -> Lineage:
        return Lineage(self.id, self.kind, self.meta.parent, self.meta.base, kv_only=bool(self.meta.compose))

    def drop_fetched(self) -> None:
        """The turn that fetched rows did not start: back to the durable state, the record's
        tokens past it to be fetched or recomputed by the next turn."""
        f, self.fetched = self.fetched, None
        if f is not None:
            f.release()
            if self.history is None:
                self.history = list(self.tokens)
            del self.tokens[self.base + f.start :]

    @property
    def reads(self) -> list[str]:
        """The contexts whose stored state its next turn or restore reads: its parent's, or
        before the first turn of a blend, every context it places."""
        m = self.meta
        if m.compose and not self.tokens:
            return list(m.context_ids)
        return [m.parent] if m.parent is not None else []

    @property
    def own_tokens(self) -> list[int]:
        return self.tokens[self.base :]

    @property
    def index_as(self) -> str | None:
        """The namespace (its tenant's) under which its stored prefixes are found by resent
        conversations and compositions (`index_namespace`); None where they are not."""
        return index_namespace(self.kind, self.meta)

    @property
    def acknowledged(self) -> list[int]:
        """The token ids a new turn continues."""
        return self.history if self.history is not None else self.tokens

    def row(self) -> SessionRow:
        """As the dashboard lists it."""
        p = self.last_plan
        return SessionRow(
            self.id,
            self.kind,
            len(self.tokens),
            self.resident,
            self.busy,
            self.meta.turns,
            p.mix() if p else "",
            self.last_restore_ms if p else None,
        )


def index_namespace(kind: str, meta: SessionMeta) -> str | None:
    """Chat sessions of their own state, and exact compositions of contexts (their documents'
    tokens lead them) after their first turn, are found by what extends them."""
    if kind != "session" or meta.parent is not None or meta.compose:
        return None
    if meta.mode != "chat" and not (meta.prefix and meta.mode):
        return None
    return "tenant:" + meta.tenant if meta.tenant is not None else "-"
