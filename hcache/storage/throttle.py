"""A token bucket on read bytes: emulates a slower tier (network storage) and leaves
bandwidth to other tenants. Zero rate means no limit."""

from __future__ import annotations

import threading
import time


class TokenBucket:
    def __init__(self, rate_bytes_per_s: float = 0.0, burst_bytes: int = 1 << 20):
        self.lock = threading.Lock()
        self.set_rate(rate_bytes_per_s, burst_bytes)

    def set_rate(self, rate_bytes_per_s: float, burst_bytes: int = 1 << 20) -> None:
        # starts empty: a capped read never gets more than the rate, not even at first
        with self.lock:
            self.rate, self.burst = rate_bytes_per_s, burst_bytes
            self.tokens = 0.0
            self.stamp = time.monotonic()

    def reserve(self, n: int) -> float:
        """Book `n` bytes now; returns the `time.monotonic()` at which they may go. Requests
        larger than the burst go into debt, so the long-run rate holds for any request size;
        bookings are served in the order they are made."""
        if self.rate <= 0:
            return 0.0
        with self.lock:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            self.tokens -= n
            return now + (-self.tokens / self.rate if self.tokens < 0 else 0.0)


def wait_until(when: float) -> float:
    delay = when - time.monotonic()
    if delay > 0:
        time.sleep(delay)
        return delay
    return 0.0
