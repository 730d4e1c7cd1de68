"""Hooks through which the engine reports events; the server's metrics implement them.
The base class does nothing, so the engine runs the same without a server."""

from __future__ import annotations


class Telemetry:
    def on_restore(self, methods: str, plan: str, ms: float) -> None:
        """A restore finished: its method mix (e.g. "RE+KV"), plan counts and time."""

    def on_ttft(self, ms: float) -> None:
        """A turn's first token went out."""

    def on_tbt(self, ms: float) -> None:
        """A later token went out, `ms` after the previous one."""
