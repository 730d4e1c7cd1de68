import pytest
import torch

from hcache import omp


def test_on_worker_returns_and_raises_in_the_caller():
    seen = omp.on_worker(lambda: (torch.get_num_threads(), torch.ones(3).sum().item()))
    assert seen == (omp.compute_threads(), 3.0)
    with pytest.raises(ValueError, match="bad"):
        omp.on_worker(lambda: (_ for _ in ()).throw(ValueError("bad")))


COPY_IN_A_STORAGE_THREAD = """
import os, sys, threading, torch
from hcache import omp
torch.set_num_threads(2)
torch.ones(1 << 20).add_(1)  # the compute thread's team
def tasks():
    return len(os.listdir("/proc/self/task"))
before = tasks()
dst, src = torch.empty(64, 576), torch.randn(64, 576)  # over torch's parallel grain
def store():
    omp.serial()
    (omp.copy_serial if sys.argv[1] == "serial" else torch.Tensor.copy_)(dst, src)
t = threading.Thread(target=store)
t.start()
t.join()
assert torch.equal(dst, src)
print(tasks() - before)
"""


def test_a_storage_threads_copy_starts_no_openmp_team():
    import subprocess
    import sys

    def extra_threads(how: str) -> int:
        out = subprocess.run([sys.executable, "-c", COPY_IN_A_STORAGE_THREAD, how], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return int(out.stdout.strip())

    assert extra_threads("serial") == 0
    if torch.get_num_threads() > 1:  # what copy_serial avoids: torch's copy starts a team of its own
        assert extra_threads("torch") > 0
