import pytest
import torch

from hcache import omp


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
