"""The allocator settings keep large tensors' memory in the heap between uses."""

from __future__ import annotations

import subprocess
import sys

import pytest

# a restore's temporaries: RMSNorm of a layer's rows at 1K, 4K and 16K tokens, on a thread
# other than the main one (the engine's loop), counting the pages faulted in once warm
PROBE = """
import resource, sys, threading, torch
from hcache.malloc import tune_allocator
if sys.argv[1] == "tuned":
    assert tune_allocator()
w = torch.ones(576).bfloat16()
rows = [torch.randn(n, 576).bfloat16() for n in (4096, 1024, 16384)]
def norm(x):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)
def rounds():
    for i in range(8):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for x in rows:
            norm(x)
        print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
t = threading.Thread(target=rounds)
t.start()
t.join()
"""


def faults(mode: str) -> list[int]:
    """Pages faulted in by each round after the first three (the heap's growth to its peak)."""
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return [int(n) for n in out.stdout.split()[3:]]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_large_temporaries_stop_faulting_pages() -> None:
    # glibc's defaults: ~32000 pages (130 MB) faulted in and zeroed again every round
    assert min(faults("default")) > 10000
    # tuned, the heap may still grow by one temporary in a late round: the OpenMP workers'
    # frees interleave with the probe thread's, so which free block a request takes varies
    # (in CI the 4th round once faulted 9216 pages). Once grown, rounds fault nothing.
    assert min(faults("tuned")) < 1000


# what the engine loop's idle trim hands back after a restore's temporaries, against a plain malloc_trim
IDLE = """
import ctypes, os, sys, torch
import hcache.malloc as m
assert m.tune_allocator()
rows = torch.randn(16384, 576).bfloat16()
for _ in range(3):
    (rows.float() * 2).sum()
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
before = rss()
if sys.argv[1] == "idle":
    m._trimmed = float("-inf")
    m.trim_when_idle()
else:
    ctypes.CDLL(None).malloc_trim(0)
print(before - rss())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_idle_trim_keeps_the_tuned_heap() -> None:
    def released(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", IDLE, mode], capture_output=True, text=True, check=True)
        return int(out.stdout.split()[-1])

    assert released("trim") > 32 << 20  # a temporary's 37 MB at least
    assert released("idle") < 1 << 20
