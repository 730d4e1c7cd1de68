"""RESULTS.md's targets tables from a peers run: ratios at the largest context, and the
real-model goals at 4K where a run has that row too."""

from hcache.benchmarks.results_peers import _machine_line, _targets


def run(contexts: list[int]) -> dict:
    rows = []
    for n in contexts:
        rows.append({"system": "hcache", "tokens": n, "prefill_ms": n / 4, "ttft_after_eviction_ms": 30.0})
        rows.append({"system": "llama.cpp", "tokens": n, "prefill_ms": n, "ttft_after_eviction_ms": 100.0 * n / 4096})
    dec = {
        "hcache": {"tbt_b1_ms": 4.0, "tokens_per_s_b32": 900.0, "weights_mb": 96.0, "gguf_mb": 98.0},
        "llama.cpp": {"tbt_b1_ms": 5.0, "tokens_per_s_b32": 300.0},
    }
    return {"rows": rows, "decode": dec, "args": {"batches": [1, 32]}}


def table(lines: list[str]) -> dict[str, tuple[str, str]]:
    cells = (ln.strip("|").split("|") for ln in lines if ln.startswith("| ") and "---" not in ln)
    return {c[0].strip(): (c[1].strip(), c[2].strip()) for c in cells if c[0].strip() != "target"}


def test_the_largest_context_has_every_target_and_4k_the_real_model_goals():
    peers = run([4096, 8000])
    top = _targets(peers)
    assert top[0] == "### Targets at 8000 tokens"
    rows = table(top)
    assert rows["TTFT after eviction <= 0.4x llama.cpp load + turn"] == ("0.154", "yes")
    assert rows["batch-1 TBT <= 1.0x llama.cpp's"] == ("0.800", "yes")
    assert rows["batch-32 throughput >= 2x llama.cpp's (ratio)"] == ("3.000", "yes")
    at4k = _targets(peers, 1.5, 4096)
    assert at4k[0] == "### Targets at 4096 tokens"
    rows = table(at4k)
    assert rows["TTFT after eviction <= 0.4x llama.cpp load + turn"] == ("0.300", "yes")
    assert rows["prefill speed >= 1.5x llama.cpp's (ratio of speeds)"] == ("4.000", "yes")
    assert not any("TBT" in name for name in rows)  # decode is a run's, given once


def test_a_missed_target_says_no():
    peers = run([4096])
    peers["rows"][0]["ttft_after_eviction_ms"] = 50.0
    assert table(_targets(peers))["TTFT after eviction <= 0.4x llama.cpp load + turn"] == ("0.500", "no")


def test_the_machine_line_names_the_cpu_and_its_kind_once_each():
    m = {"cores": 2, "memory_gb": 25.3, "python": "3.11", "torch": "2.13", "llama-cpp-python": "0.3"}
    m |= {"transformers": "5", "date": "2026-11-29", "cpu_kind": "avx512_bf16"}
    line = _machine_line({"machine": m | {"cpu": "AMD EPYC", "cpu_family": "family 26 model 2"}})
    assert line.startswith("AMD EPYC (family 26 model 2; CPU kind avx512_bf16), 2 cores, 25 GB;")
    caps = {"ATEN_CPU_CAPABILITY": "avx2"}
    line = _machine_line({"machine": m | {"cpu": "Intel Xeon", "caps": caps}})
    assert line.startswith("Intel Xeon (CPU kind avx512_bf16, ATEN_CPU_CAPABILITY=avx2), 2 cores")
