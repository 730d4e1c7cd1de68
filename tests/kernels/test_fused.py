"""RMSNorm and RoPE: the compiled one-pass forms against the reference formulas."""

from __future__ import annotations

import pytest
import torch

from hcache.kernels import fused


def reference_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def reference_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def tables(n: int, hd: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    f = torch.arange(n).float()[:, None] * inv[None]
    emb = torch.cat((f, f), -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [3, 300])  # eager below MIN_ROWS, compiled above
def test_rope_is_the_reference_bit_for_bit(dtype, rows) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 6, 64, generator=g).to(dtype)
    cos, sin = tables(rows, 64, dtype)
    want = reference_rope(x, cos, sin)
    assert torch.equal(fused.rope(x, cos, sin), want)
    out = torch.empty(rows + 5, 6, 64, dtype=dtype)[2 : rows + 2]  # rows inside a larger cache
    assert fused.rope(x, cos, sin, out).data_ptr() == out.data_ptr()
    assert torch.equal(out, want)
    assert torch.equal(fused.rope_eager(x, cos, sin, None), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [3, 300])
def test_rms_norm_keeps_the_reference_roundings(dtype, rows) -> None:
    g = torch.Generator().manual_seed(rows)
    x = (3 * torch.randn(rows, 576, generator=g)).to(dtype)
    w = (torch.rand(576, generator=g) + 0.5).to(dtype)
    want = reference_norm(x, w, 1e-5)
    assert torch.equal(fused.rms_norm_eager(x, w, 1e-5), want)
    got = fused.rms_norm(x, w, 1e-5)
    # compiled: the float32 sum of squares may add up in another order, which moves a row's
    # scale by a unit in its last place (float32 rows then land a few units off)
    ulp = 4 * torch.finfo(dtype).eps * want.float().abs()
    assert ((got.float() - want.float()).abs() <= ulp).all()
    x_before = x.clone()
    fused.rms_norm(x.float(), w.float(), 1e-5)  # float32 input: in place on a copy, never on x
    assert torch.equal(x, x_before)


def test_many_rows_on_a_cpu_run_compiled(monkeypatch) -> None:
    """The fused forms are what runs for many rows; the eager ones for a decode step's few."""
    if not fused.compiled():
        pytest.skip("HCACHE_COMPILE=0 or no compiler here")
    for k in (fused._norm, fused._rope):  # as if timed faster here
        monkeypatch.setattr(k, "faster", {})
        monkeypatch.setattr(k, "_time", lambda fn, args, key, k=k: k.faster.__setitem__(key, True))
    calls = []
    monkeypatch.setattr(fused, "rope_eager", lambda *a: calls.append("rope") or reference_rope(*a[:3]))
    monkeypatch.setattr(fused, "rms_norm_eager", lambda *a: calls.append("norm") or reference_norm(*a))
    for rows in (256, 2):
        x = torch.randn(rows, 8, 32)
        cos, sin = tables(rows, 32, torch.float32)
        fused.rope(x, cos, sin)
        fused.rms_norm(x.view(rows, -1), torch.ones(256), 1e-6)
    assert fused.compiled()  # compiling did not fail
    assert calls == ["rope", "norm"]  # only the 2-row calls


@pytest.mark.parametrize("compiled_wins", [True, False])
def test_each_kernel_runs_the_form_timed_faster(monkeypatch, compiled_wins) -> None:
    """The compiled form is timed against the eager one on first use and the faster runs
    from then on (inductor's RoPE was 3.6x slower than eager on a Xeon, RMSNorm 2.3x faster)."""
    import time

    k = fused._Compiled(lambda x: x * 2, lambda x: x * 2, "double")
    slow = lambda x: time.sleep(0.002) or x * 2  # noqa: E731
    fast = lambda x: x * 2  # noqa: E731
    monkeypatch.setattr(k, "get", lambda args: fast if compiled_wins else slow)
    k.eager = slow if compiled_wins else fast
    x = torch.ones(300, 8)
    first = k(x)
    key = fused._shape_class((x,))
    assert k.faster == {key: compiled_wins} and set(k.timings[key]) == {"compiled_ms", "eager_ms"}
    assert (first is not None) == compiled_wins
    assert (k(x) is not None) == compiled_wins  # decided once
    assert k(torch.ones(300, 16)) is not None or not compiled_wins  # another shape: timed again
    assert len(k.faster) == 2


def test_kernel_choice_is_reported() -> None:
    if not fused.compiled():
        pytest.skip("HCACHE_COMPILE=0 or no compiler here")
    x = torch.randn(300, 576)
    fused.rms_norm(x, torch.ones(576), 1e-5)
    c = fused.choices()["RMSNorm"]["float32_576__float32"]
    assert c["runs"] in ("compiled", "eager") and c["compiled_ms"] > 0 and c["eager_ms"] > 0
    assert (c["runs"] == "compiled") == (c["compiled_ms"] < 0.95 * c["eager_ms"])


def test_a_call_with_as_many_rows_as_features_is_timed(monkeypatch) -> None:
    """Timing gives row-shaped inputs `CAL_ROWS` rows, not a weight vector that has as many
    elements as the call has rows (64 rows of a 64-wide norm): that failed the timing call
    and turned compiling off for the whole process."""
    if not fused.compiled():
        pytest.skip("HCACHE_COMPILE=0 or no compiler here")
    monkeypatch.setattr(fused._Compiled, "failed", False)
    k = fused._Compiled(fused._rms_norm_ref, fused.rms_norm_eager, "norm")
    x = torch.randn(64, 64)
    k(x, torch.ones(64), 1e-5)
    assert not fused._Compiled.failed and len(k.timings) == 1


def test_copies_of_a_kernel_are_named_apart() -> None:
    """Dynamo records which input sizes varied per file, line and name (its code state, kept
    on disk too): copies for other shape classes must not share it, or a small model compiled
    first makes a later model's kernel compile differently, and round differently."""
    a, b = fused.own_code(fused._rms_norm_ref, "x"), fused.own_code(fused._rms_norm_ref, "y")
    assert a.__code__ is not b.__code__ and a.__code__.co_name != b.__code__.co_name
    assert a.__code__.co_name.startswith("_rms_norm_ref")
