"""Incremental detokenization for a reply's stream."""

from __future__ import annotations

from typing import Any


class TextStream:
    """Incremental detokenization with stop strings: emits only text that is final (no
    half of a multi-byte character, nothing that could still turn into a stop string)."""

    def __init__(self, decode: Any, stops: list[str]):
        self.decode, self.stops = decode, [s for s in stops if s]
        self.ids: list[int] = []
        self.sent = 0  # characters of the full text already emitted
        self.text = ""
        self.stopped = False

    def push(self, token: int) -> str:
        self.ids.append(token)
        self.text = self.decode(self.ids)
        for s in self.stops:
            at = self.text.find(s)
            if at >= 0:
                self.text = self.text[:at]
                self.stopped = True
        if self.stopped:
            return self.flush()
        safe = len(self.text)
        if self.text.endswith("\ufffd"):
            safe = len(self.text.rstrip("\ufffd"))
        for s in self.stops:  # hold back a tail that is a prefix of a stop string
            for k in range(min(len(s) - 1, safe), 0, -1):
                if self.text[:safe].endswith(s[:k]):
                    safe -= k
                    break
        out = self.text[self.sent : max(self.sent, safe)]
        self.sent = max(self.sent, safe)
        return out

    def flush(self) -> str:
        out = self.text[self.sent :]
        self.sent = len(self.text)
        return out
