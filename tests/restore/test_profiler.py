"""Profiler, `hcache plan` / `hcache profile`, and the multi-head expansion the restore
benchmark relies on."""

from __future__ import annotations

import json
import time

import pytest
import torch
from conftest import tload

from hcache.benchmarks.models import expand_to_mha
from hcache.cli import main
from hcache.model import KVCache
from hcache.restore import profiler
from hcache.restore.profile import Profile


def test_mha_expansion_is_the_same_function(tiny_folder) -> None:
    gqa = tload(tiny_folder("llama_gqa"))
    mha = expand_to_mha(gqa)
    assert mha.cfg.num_kv_heads == mha.cfg.num_heads and gqa.cfg.num_kv_heads < gqa.cfg.num_heads
    dev = gqa.device
    ids, pos = torch.arange(1, 50, device=dev), torch.arange(49, device=dev)
    a = gqa.logits(gqa(ids, pos, KVCache(gqa.cfg, gqa.dtype, dev)))
    b = mha.logits(mha(ids, pos, KVCache(mha.cfg, mha.dtype, dev)))
    assert (a - b).abs().max() < 1e-4


def test_profile_measures_and_is_cached(tiny_folder, tmp_path) -> None:
    model = tload(tiny_folder("llama_gqa"))
    store = tmp_path / "store"
    store.mkdir()
    prof = profiler.load_or_run(model, [store], tmp_path / "profiles")
    assert prof.read_gbps > 0 and prof.h_ms(1024) > 0 and prof.kv_ms(1024) > 0
    assert prof.per_dir_gbps == [prof.read_gbps]  # one directory: measured once
    if model.device.type == "cpu":  # readers and compute share the cores only there
        assert prof.read_cpu_ms_per_mb > 0 and prof.mix_margin == profiler.CPU_MIX_MARGIN
    assert prof.h_ms(4096) >= prof.h_ms(1024)
    assert sorted(prof.re_points) == [256]  # contexts past the model's 256 positions are skipped
    assert prof.re_ms(8192) > prof.re_ms(1024) > 0
    path = profiler.profile_path(tmp_path / "profiles", model)
    assert path.exists() and not (store / profiler.SCRATCH).exists()
    path.write_text(path.read_text().replace(str(prof.read_gbps), "123.0", 1))
    assert profiler.load_or_run(model, [store], tmp_path / "profiles").read_gbps == 123.0  # reused
    assert Profile.load(path).re_points == prof.re_points


def slow_clock(monkeypatch: pytest.MonkeyPatch, source: type, seconds: float) -> None:
    """Each read plan's preparation costs `seconds` more, on a clock the test moves: every
    `time.perf_counter` reading after it is that much later (no sleep, so the cost is exact)."""
    real, shift = time.perf_counter, [0.0]
    prepare = source.prepare

    def slower(self, plan, into=None) -> None:
        shift[0] += seconds
        prepare(self, plan, into)

    monkeypatch.setattr(time, "perf_counter", lambda: real() + shift[0])
    monkeypatch.setattr(source, "prepare", slower)


def test_profile_measures_what_reads_take_from_compute(tiny_folder, tmp_path, monkeypatch) -> None:
    """Planning reads on the compute thread is a cost the mixed-restore measurement must see:
    slowed by 80 ms here, it is found as a fixed setup cost, not spread per MB."""
    from hcache.restore.sources import StoreSource

    model = tload(tiny_folder("llama_gqa"))
    plain = profiler.run(model, [tmp_path], show=False, re_contexts=(256,), reads_vs_compute=True)
    assert set(plain.meta["reads_vs_compute"]) and len(plain.meta["reads_vs_compute"]) == 2
    slow_clock(monkeypatch, StoreSource, 0.08)
    slow = profiler.run(model, [tmp_path], show=False, re_contexts=(256,), reads_vs_compute=True)
    assert 50 <= slow.read_setup_ms - plain.read_setup_ms <= 120


@pytest.mark.parametrize("runs", ["three", "one at a long context"])
def test_profile_measures_recompute_beside_reads(tiny_folder, tmp_path, monkeypatch, runs) -> None:
    """On a CPU the profile measures how much slower a recompute prefix runs inside a restore
    that reads the other layers; a prefix slowed there by 40 ms per restore is seen, also in
    the single run a long context gets."""
    from hcache.restore.sources import StoreSource

    model = tload(tiny_folder("llama_gqa"))
    if model.device.type != "cpu":
        pytest.skip("measured on CPUs only")
    if runs != "three":
        monkeypatch.setattr(profiler, "LONG_CONTEXT", 256)
    plain = profiler._io(model, [tmp_path], 256, compute=(256,)).re_reading[256]
    slow_clock(monkeypatch, StoreSource, 0.04)
    slowed = profiler._io(model, [tmp_path], 256, compute=(256,)).re_reading[256]
    assert plain >= 1.0 and slowed > plain + 0.5


def test_plan_cli_json(capsys) -> None:
    args = ["plan", "--layers", "32", "--hidden", "4096", "--heads", "32", "--ffn", "11008", "--tokens", "4096"]
    assert main([*args, "--tflops", "312", "--io-gbps", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert sum(out["counts"].values()) == 32 and len(out["layers"]) == 32 and out["predicted_ms"] > 0
    assert main([*args, "--tflops", "312", "--io-gbps", "8", "--cap-gbps", "0.5", "--json"]) == 0
    capped = json.loads(capsys.readouterr().out)
    assert capped["predicted_ms"] > out["predicted_ms"]


def test_plan_cli_errors(capsys, default_model) -> None:
    assert main(["plan", "--tokens", "10", "--layers", "2"]) == 2
    assert "--hidden" in capsys.readouterr().err
    assert main(["plan", "--model", "default", "--tokens", "0", "--tflops", "1", "--io-gbps", "1"]) == 2
    assert "nothing to restore" in capsys.readouterr().err


def test_plan_cli_device_presets(capsys) -> None:
    args = ["plan", "--model", "opt-30b", "--device", "a100-40g", "--tp", "4", "--io-gbps", "27.6"]
    assert main([*args, "--tokens", "4096", "--json"]) == 0
    counts = json.loads(capsys.readouterr().out)["counts"]
    assert abs(counts["hidden"] - 40) <= 2 and abs(counts["recompute"] - 8) <= 2
    assert main(["plan", "--model", "llama-2-7b", "--device", "h100-sxm", "--io-gbps", "27.6", "--tokens", "4096"]) == 0
    assert "h100-sxm: 989 TFLOPS, 3350 GB/s memory" in capsys.readouterr().out
    assert main(["plan", "--model", "llama-2-7b", "--device", "nope", "--io-gbps", "1", "--tokens", "9"]) == 2
    assert "unknown --device 'nope'" in capsys.readouterr().err
    assert main(["plan", "--model", "llama-2-7b", "--device", "l4", "--tokens", "9"]) == 2
    assert "--io-gbps" in capsys.readouterr().err
    assert (
        main(["plan", "--model", "llama-2-7b", "--device", "l4", "--io-gbps", "1", "--tp", "0", "--tokens", "9"]) == 2
    )
    assert "positive" in capsys.readouterr().err
