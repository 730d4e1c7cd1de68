import os
import subprocess
import sys

import pytest
import torch

import hcache
from hcache import omp
from hcache.benchmarks.llamacpp import users_env


def test_on_worker_returns_and_raises_in_the_caller():
    seen = omp.on_worker(lambda: (torch.get_num_threads(), torch.ones(3).sum().item()))
    assert seen == (omp.compute_threads(), 3.0)
    with pytest.raises(ValueError, match="bad"):
        omp.on_worker(lambda: (_ for _ in ()).throw(ValueError("bad")))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_copy_serial_copies_rows_of_any_float_dtype(dtype):
    src = torch.randn(64, 2, 192).to(dtype)
    dst = torch.zeros(100, 2, 192, dtype=dtype)
    omp.copy_serial(dst[10:74], src)
    assert torch.equal(dst[10:74], src) and not dst[:10].any() and not dst[74:].any()
    wide = torch.zeros(64, 2, 192)  # another dtype: torch's copy converts
    omp.copy_serial(wide, src)
    assert torch.equal(wide, src.float())


def _env_after_import(**env: str) -> tuple[str, str]:
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    code = "import os, hcache; print(os.environ.get('GOMP_SPINCOUNT'), sorted(hcache.OWN_ENV))"
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, check=True)
    spin, own = out.stdout.split(" ", 1)
    return spin, own.strip()


def test_import_sets_a_short_openmp_spin_unless_the_user_chose_one():
    spin, own = _env_after_import()
    assert spin == hcache._SETTINGS["GOMP_SPINCOUNT"] and "GOMP_SPINCOUNT" in own
    spin, own = _env_after_import(GOMP_SPINCOUNT="77")
    assert spin == "77" and "GOMP_SPINCOUNT" not in own
    spin, own = _env_after_import(OMP_WAIT_POLICY="passive")
    assert spin == "None" and "GOMP_SPINCOUNT" not in own


def test_a_peer_starts_with_the_users_environment(monkeypatch):
    monkeypatch.setattr(hcache, "OWN_ENV", {"HCACHE_TEST_OURS": "1", "HCACHE_TEST_THEIRS": "1"})
    monkeypatch.setenv("HCACHE_TEST_OURS", "1")
    monkeypatch.setenv("HCACHE_TEST_THEIRS", "2")  # the user changed it since: theirs now
    with users_env():
        assert "HCACHE_TEST_OURS" not in os.environ and os.environ["HCACHE_TEST_THEIRS"] == "2"
    assert os.environ["HCACHE_TEST_OURS"] == "1"
