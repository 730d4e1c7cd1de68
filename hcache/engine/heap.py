"""Python's cycle collector, kept off the serving path. A full collection walks every
object the collector tracks, with every thread stopped, and once the model is loaded and
its steps compiled those are hundreds of thousands: a decode step that meets one waits it
out. What exists when an engine starts lives as long as the engine does, so it is moved
out of the collector's sight (`gc.freeze`), and collections walk only what came after."""

from __future__ import annotations

import gc


def freeze() -> int:
    """Freeze every tracked object, after collecting the young generations (the start's
    own garbage: compiling leaves much; a full collection would walk everything, and what
    older garbage is frozen with the rest goes at the thaw of a `close`). Returns how many
    objects are frozen."""
    gc.collect(1)
    gc.freeze()
    return gc.get_freeze_count()


def thaw() -> None:
    """Give the frozen objects back to the collector (an engine closed: what only it used
    can be collected again)."""
    gc.unfreeze()
