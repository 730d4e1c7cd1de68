"""The probe's choice per CPU kind (hcache/kernels/cpu.py): each kind's hot paths by name, as
`hcache serve` logs them and `/metrics` exports them. The kinds are built, not probed, so
every kind's choice is checked on any machine; the kernels themselves are tested where they
run (test_int4_gemm.py, test_int8_gemm.py, test_native.py)."""

import pytest

from hcache.kernels import cpu as probe
from hcache.kernels.cpu import Cpu

ZEN3 = Cpu("x86_64", "AVX2", avx512=False, bf16=False, amx=False, int8_vnni=False, vnni=False, avx2=True)
SKYLAKE = Cpu("x86_64", "AVX512", avx512=True, bf16=False, amx=False, int8_vnni=False, vnni=False, avx2=True)
ICE_LAKE = Cpu("x86_64", "AVX512", avx512=True, bf16=False, amx=False, int8_vnni=True, vnni=True, avx2=True)
ZEN4 = Cpu("x86_64", "AVX512", avx512=True, bf16=True, amx=False, int8_vnni=True, vnni=True, avx2=True)
SAPPHIRE = Cpu("x86_64", "AVX512", avx512=True, bf16=True, amx=True, int8_vnni=True, vnni=True, avx2=True)
OLD_X86 = Cpu("x86_64", "DEFAULT", avx512=False, bf16=False, amx=False, int8_vnni=False)
ARM = Cpu("aarch64", "DEFAULT", avx512=False, bf16=False, amx=False, int8_vnni=False)


@pytest.mark.parametrize(
    "c,kind,int4,int8,attention,decode",
    [
        (ZEN3, "avx2", "native-avx2", "native-avx2", "native-avx2", "native-avx2"),
        (SKYLAKE, "avx512", "native-avx2", "native-avx2", "native-avx512f", "native-avx512"),
        (ICE_LAKE, "avx512_vnni", "native-vnni", "native-vnni", "native-avx512f", "native-avx512"),
        (ZEN4, "avx512_bf16", "native-vnni", "native-vnni", "native-bf16", "native-avx512"),
        (SAPPHIRE, "amx", "native-vnni", "native-vnni", "flash", "native-avx512"),
        (OLD_X86, "baseline", "int4pack-default", "onednn-int8-a7", "float32", "inductor-float32"),
        (ARM, "aarch64", "int4pack-default", "onednn-int8-a7", "float32", "inductor-float32"),
    ],
)
def test_each_kind_takes_its_kernels(c, kind, int4, int8, attention, decode, monkeypatch):
    monkeypatch.setattr(probe.torch.backends.mkldnn, "is_available", lambda: True)
    paths = c.paths()
    assert (paths["cpu"], paths["int4_linear"], paths["int8_linear"]) == (kind, int4, int8)
    head = int8 if int8.endswith("-a7") else f"{int8}-a7"  # an LM head's activations are of 7 bits on every path
    assert (paths["lm_head"], paths["attention"], paths["decode_attention"]) == (head, attention, decode)
    assert c.describe().startswith(f"CPU kind {kind}: ")


def test_without_a_compiler_every_kind_takes_the_library_paths(monkeypatch):
    monkeypatch.setattr(probe, "COMPILE", False)
    monkeypatch.setattr(probe.torch.backends.mkldnn, "is_available", lambda: True)
    zen3, ice = ZEN3.paths(), ICE_LAKE.paths()
    assert (zen3["int4_linear"], zen3["int8_linear"]) == ("int4pack-avx2", "onednn-int8-a7")
    assert zen3["attention"] == ice["attention"] == "float32"
    assert zen3["decode_attention"] == ice["decode_attention"] == "inductor-float32"
    # oneDNN sums VNNI's byte products in 32 bits: 8-bit activations there, 7 without; an LM
    # head's are of 7 bits everywhere
    assert (ice["int4_linear"], ice["int8_linear"]) == ("int4pack-avx512", "onednn-int8-a8")
    assert zen3["lm_head"] == ice["lm_head"] == "onednn-int8-a7"


def test_this_machine_probes_as_a_known_kind():
    c = probe.cpu()
    assert c.kind in {"amx", "avx512_bf16", "avx512_vnni", "avx512", "avx2", "baseline"} or c.arch not in probe._X86
    assert not c.vnni or c.avx512  # our VNNI forms are AVX-512 code
    assert c.avx2 or not c.avx512  # every AVX-512 CPU runs the AVX2 forms too
