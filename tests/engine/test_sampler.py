from __future__ import annotations

import pytest
import torch

from hcache.engine.sampler import Sampler, SamplingParams


def test_greedy_and_degenerate_filters_pick_argmax() -> None:
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert Sampler(SamplingParams())(logits) == 1
    assert Sampler(SamplingParams(temperature=1.0, top_k=1, seed=0))(logits) == 1
    assert Sampler(SamplingParams(temperature=1.0, top_p=1e-6, seed=0))(logits) == 1


def test_seed_repeats_and_differs() -> None:
    logits = torch.zeros(1000)

    def draw(seed: int) -> list[int]:
        s = Sampler(SamplingParams(temperature=1.0, seed=seed))
        return [s(logits) for _ in range(20)]

    assert draw(1) == draw(1)
    assert draw(1) != draw(2)


def test_top_k_and_top_p_restrict_support() -> None:
    logits = torch.tensor([5.0, 4.0, 3.0, -10.0, -10.0])
    s = Sampler(SamplingParams(temperature=2.0, top_k=2, seed=0))
    assert {s(logits) for _ in range(200)} == {0, 1}
    probs = torch.softmax(logits, -1)  # top_p just over p0 keeps exactly tokens 0 and 1
    s = Sampler(SamplingParams(temperature=1.0, top_p=float(probs[0]) + 1e-3, seed=0))
    assert {s(logits) for _ in range(300)} == {0, 1}


@pytest.mark.parametrize(
    "bad",
    [
        dict(max_new_tokens=0),
        dict(temperature=-1),
        dict(temperature=float("nan")),
        dict(top_p=0),
        dict(top_p=1.5),
        dict(top_k=-1),
    ],
)
def test_invalid_params_rejected(bad: dict) -> None:
    with pytest.raises(ValueError):
        Sampler(SamplingParams(**bad))


def test_a_tiny_temperature_samples_the_top_token_instead_of_failing() -> None:
    """The smallest normal float32 as temperature overflowed logits / T to inf (softmax: NaN)."""
    logits = torch.tensor([3.0, 9.5, -2.0, 9.0])
    for top_p in (1.0, 1.1754943508222875e-38):
        s = Sampler(SamplingParams(temperature=1.1754943508222875e-38, top_p=top_p, top_k=65, seed=241))
        assert s(logits) == 1


def test_tiny_temperature_samples_the_max_instead_of_nan() -> None:
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])  # 3.0 / 1.2e-38 overflows float32
    assert Sampler(SamplingParams(temperature=1.1754943508222875e-38, seed=0))(logits) == 1
