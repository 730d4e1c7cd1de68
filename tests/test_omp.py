import pytest
import torch

from hcache import omp


def test_on_worker_returns_and_raises_in_the_caller():
    seen = omp.on_worker(lambda: (torch.get_num_threads(), torch.ones(3).sum().item()))
    assert seen == (omp.compute_threads(), 3.0)
    with pytest.raises(ValueError, match="bad"):
        omp.on_worker(lambda: (_ for _ in ()).throw(ValueError("bad")))
