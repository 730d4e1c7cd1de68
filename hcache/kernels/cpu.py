"""The CPU this process runs on, and the kernel each hot path takes there.

One probe, read once: what the hardware has, capped by what torch and oneDNN were told
to use (`ATEN_CPU_CAPABILITY`, `ONEDNN_MAX_CPU_ISA`), so that a path is chosen for the
instructions that will really run and a lesser ISA's paths can be tried on a better
machine. The callers (model/quant.py, model/attention.py, kernels/native.py) ask
`cpu()` rather than torch's flags; `cpu().paths()` is what `hcache serve` logs and
`/metrics` exports.

AVX2's paths on an AVX-512 machine: `ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
MKL_ENABLE_INSTRUCTIONS=AVX2 TORCHINDUCTOR_CPP_MARCH=znver3` (inductor builds its C++
`-march=native` whatever torch's cap says; our kernels take their ISA's flags alone)."""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

import torch

# oneDNN's ISA levels, lowest first (its `ONEDNN_MAX_CPU_ISA` values)
_ONEDNN_LEVELS = (
    "SSE41",
    "AVX",
    "AVX2",
    "AVX2_VNNI",
    "AVX2_VNNI_2",
    "AVX512_CORE",
    "AVX512_CORE_VNNI",
    "AVX512_CORE_BF16",
    "AVX10_1_512",
    "AVX512_CORE_FP16",
    "AVX512_CORE_AMX",
    "AVX10_1_512_AMX",
    "AVX512_CORE_AMX_FP16",
    "AVX10_1_512_AMX_FP16",
    "ALL",
)
_X86 = ("x86_64", "AMD64", "i686", "i386")

# HCACHE_COMPILE=0: no kernel is compiled (inductor's or ours); every op runs its eager or library form
COMPILE = os.environ.get("HCACHE_COMPILE", "1") != "0"


def _onednn_allows(level: str) -> bool:
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "ALL")).upper()
    if cap not in _ONEDNN_LEVELS:
        return True  # oneDNN ignores a value it does not know
    return _ONEDNN_LEVELS.index(level) <= _ONEDNN_LEVELS.index(cap)


LM_HEAD_BITS = 7  # an int8 LM head's activation passes: AVX2 sums them without moving signs


@dataclass(frozen=True)
class Cpu:
    arch: str  # platform.machine()
    aten: str  # torch's kernel level: AVX2, AVX512, DEFAULT, SVE256, ...
    avx512: bool  # torch's and inductor's kernels use AVX-512
    bf16: bool  # AVX512-BF16 dot products, for our own kernels
    amx: bool  # AMX tiles (torch's flash kernel and oneDNN use them)
    int8_vnni: bool  # oneDNN's int8 GEMM sums byte products in 32 bits (VNNI or AMX)
    vnni: bool = False  # AVX512-VNNI, for our own int8 kernel
    avx2: bool = False  # AVX2 and FMA (torch's AVX2 kernels or better), for our kernels' AVX2 forms

    @property
    def kind(self) -> str:
        """A short name for logs and metrics: amx, avx512_bf16, avx512_vnni, avx512, avx2,
        or the architecture where it is not x86."""
        if self.arch not in _X86:
            return self.arch
        if self.amx:
            return "amx"
        if self.avx512:
            return "avx512_bf16" if self.bf16 else "avx512_vnni" if self.int8_vnni else "avx512"
        return "avx2" if self.aten == "AVX2" else "baseline"

    @property
    def onednn_activation_bits(self) -> int:
        """Bits of the activations oneDNN's int8 GEMM sums exactly here, sign included. Without
        VNNI it sums pairs of byte products in saturating 16-bit lanes (`vpmaddubsw`): unsigned
        activations must stay at or below 128 for a pair of them times 127 to fit."""
        return 8 if self.int8_vnni else 7

    @property
    def attention(self) -> str:
        """How a turn attends over a bfloat16 cache: `native` (our kernel: its AVX512-BF16
        form, its AVX-512F one on AVX-512 without BF16, its AVX2 one below), `flash` (torch's bfloat16 flash
        kernel: AMX tiles), or `float32` (K/V widened and the float32 kernels: without
        bfloat16 hardware torch's bfloat16 GEMMs run a reference loop)."""
        if self.amx:
            return "flash"
        if self.bf16 or (self.avx2 and COMPILE):
            return "native"
        return "float32"

    def _attention_form(self) -> str:
        if self.attention != "native":
            return self.attention
        return "native-bf16" if self.bf16 else "native-avx512f" if self.avx512 else "native-avx2"

    def describe(self) -> str:
        return f"CPU kind {self.kind}: " + ", ".join(f"{k} {v}" for k, v in self.paths().items() if k != "cpu")

    def paths(self) -> dict[str, str]:
        """The kernel each hot path runs here, by name."""
        library = "onednn-int8" if torch.backends.mkldnn.is_available() else "int8pack"
        int8, int4 = f"{library}-a{self.onednn_activation_bits}", f"int4pack-{self.aten.lower()}"
        head = f"{library}-a{LM_HEAD_BITS}"
        decode = "inductor-float32"
        if COMPILE and (self.vnni or self.avx2):  # our kernels' forms
            int8 = int4 = "native-vnni" if self.vnni else "native-avx2"
            head = f"{int8}-a{LM_HEAD_BITS}"
            decode = "native-avx512" if self.avx512 else "native-avx2"
        return {
            "cpu": self.kind,
            "aten": self.aten.lower(),
            "int4_linear": int4,
            "int8_linear": int8,
            "lm_head": head,
            "attention": self._attention_form(),
            "decode_attention": decode,
        }


@functools.cache
def cpu() -> Cpu:
    arch = platform.machine()
    aten = torch.backends.cpu.get_cpu_capability()
    x86 = arch in _X86
    avx512 = x86 and aten.startswith("AVX512")
    amx = avx512 and torch.cpu._is_amx_tile_supported() and _onednn_allows("AVX512_CORE_AMX")
    bf16 = avx512 and torch.cpu._is_avx512_bf16_supported()
    vnni_hw = torch.cpu._is_vnni_supported() or amx
    vnni_dnn = _onednn_allows("AVX512_CORE_VNNI" if avx512 else "AVX2_VNNI")
    vnni = avx512 and torch.cpu._is_vnni_supported()
    avx2 = x86 and (avx512 or aten == "AVX2")
    return Cpu(arch, aten, avx512, bf16, amx, x86 and vnni_hw and vnni_dnn, vnni, avx2)
