"""Rows of an owner's chunks fetched from outside the local store (the cluster's, in
cluster mode) into memory, as a restore reads them and a batch stages them, layer by layer
as they arrive."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from hcache.storage.buffers import FetchBuffers


@dataclass(eq=False)
class Progress:
    """Which layers' rows are in, shared by a fetch and the views cut from it."""

    layers: dict[int, threading.Event]
    bad: dict[int, int] = field(default_factory=dict)  # layer -> first token whose chunk failed its checksum
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None  # the fetch itself failed (every layer not in is bad)


@dataclass
class Fetched:
    """Rows of an owner's tokens `start:start+tokens` from the cluster, per layer and kind,
    each stream one contiguous tensor (as a restore reads it and a batch stages it). Layer
    `l`'s rows are there once `ready(l)`; a layer in `bad` must not be used."""

    start: int
    tokens: int = 0
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [tokens, hidden]
    kv: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [tokens, 2, kv_dim]
    bytes: int = 0  # chunk bytes to fetch
    missing: int = 0  # 1 if the chunks stop short of the owner's tokens (missing or of other tokens)
    memory: torch.Tensor | None = None  # what the rows are views of, from `pool`
    pool: FetchBuffers | None = None
    progress: Progress = field(default_factory=lambda: finished({}))

    def head(self, n: int) -> Fetched:
        """The first `n` of these rows (views of the same memory, filled by the same fetch)."""
        n = min(n, self.tokens)
        cut = {layer: t[:n] for layer, t in self.hidden.items()}, {layer: t[:n] for layer, t in self.kv.items()}
        return Fetched(self.start, n, *cut, self.bytes, self.missing, self.memory, self.pool, self.progress)

    def ready(self, layer: int) -> bool:
        ev = self.progress.layers.get(layer)
        return ev is None or ev.is_set()

    def wait(self, layer: int, timeout: float | None = None) -> bool:
        ev = self.progress.layers.get(layer)
        return ev is None or ev.wait(timeout)

    def usable(self, layer: int) -> bool:
        """Layer `layer`'s rows are in and intact (call after `ready`)."""
        return layer not in self.progress.bad

    def intact(self) -> bool:
        """Every layer is in and intact: the rows may be staged (waits for the fetch)."""
        self.progress.done.wait()
        return not self.progress.bad

    def release(self) -> None:
        """Nothing reads the rows any more: their memory serves the next fetch (once the
        fetch has stopped writing it)."""
        self.progress.done.wait()
        if self.memory is not None and self.pool is not None:
            self.pool.give(self.memory)
        self.memory = None


def finished(layers: dict[int, threading.Event]) -> Progress:
    p = Progress(layers)
    p.done.set()
    return p
