"""Kernels of our own in C++, built on first use by torch's extension builder (g++ and
ninja; cached under `TORCH_EXTENSIONS_DIR`, rebuilt when the source changes).

`attention_bf16`: a turn's causal attention over a bfloat16 cache with AVX512-BF16 dot
products (`attention_bf16.cpp`). No library kernel reaches that rate on a CPU without
AMX: torch's flash kernel multiplies through MKL's bfloat16 GEMM, inductor's templates
widen to float32, oneDNN's fused graph rounds the scores to bfloat16 (bench/RESULTS.md).
On AVX-512 without BF16 the same source builds the same arithmetic from AVX-512F FMAs,
which beats torch's float32 flash kernel over widened K/V there; `attention_avx2.cpp` is
that arithmetic in AVX2, for CPUs without AVX-512.
`int8_gemm`: few rows of uint8 activations times int8 weight rows with AVX512-VNNI
(`int8_gemm.cpp`): oneDNN's u8s8 GEMM streams a decode step's weights at about half the
machine's read rate. Without VNNI the same source builds for AVX2 (the same integers):
there oneDNN's AVX2 GEMM took 5.5 ms for the default model's head at one row, ours 1.2.
`decode_attention`: a decode step's attention over the pool's rows where they lie, with
float32 dot products in an AVX-512 and an AVX2 form (`decode_attention.cpp`): inductor's
fused reductions over the gathered rows sum each key's products across lanes one at a
time, far below the FMA rate at a batch's sizes.
`int4_gemm`: the same for 4-bit weight groups (`int4_gemm.cpp`), in a VNNI and an AVX2
form: torch's int4 kernel widens the weights to float32, which is FMA-bound at a batch's
rows and streams at under half the read rate at one.

Every AVX2 form gives its AVX-512 form's bits, so replicas of either kind share sessions.

Each is None when the CPU lacks its instructions (`Cpu.bf16`, `Cpu.vnni`, `Cpu.avx512`, `Cpu.avx2`), when building
fails (logged once), or with `HCACHE_COMPILE=0`: callers keep their library path."""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hcache.kernels import COMPILE, source_digest
from hcache.kernels.cpu import cpu

log = logging.getLogger(__name__)

_FLAGS = ["-O3", "-mfma", "-fopenmp"]
_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl"]
# the turn attention's forms run faster with the short loops around their FMA loops unrolled,
# which -O3 alone does not do; no operation changes, so neither do their bits
_UNROLL = ["-funroll-loops"]
DECODE_HEAD_DIMS = (16, 32, 64, 128, 256)


class _Kernel:
    """One source file's ops, built on the first `get` (or by `build_all`), once."""

    def __init__(self, name: str, isa: list[str], op: str, runs_here: Callable[[], bool], source: str | None = None):
        self.name, self.isa, self.op, self.runs_here = name, isa, op, runs_here
        self.source = source or name
        self.library = op.split(".")[0]  # its ops' namespace under torch.ops
        self._lock = threading.Lock()
        self._done = False
        self._op: Callable[..., torch.Tensor] | None = None

    def ops(self) -> Any:
        """Its library of ops (`torch.ops.<namespace>`), built first; only where `get` is not None."""
        self.get()
        return getattr(torch.ops, self.library)

    def get(self) -> Callable[..., torch.Tensor] | None:
        if not self._done:  # every layer of every forward asks: the lock only until built
            with self._lock:
                if not self._done:
                    ok = COMPILE and self.runs_here()
                    self._op = _build(self.name, self.source, self.isa, self.op) if ok else None
                    self._done = True
        return self._op


_ATTENTION = _Kernel(
    "attention_bf16", [*_AVX512, "-mavx512bf16", *_UNROLL], "hcache_kernels.causal_attention_bf16", lambda: cpu().bf16
)
# the same source without AVX512-BF16: its arithmetic from AVX-512F FMAs
_ATTENTION_F = _Kernel(
    "attention_avx512",
    [*_AVX512, "-mavx512dq", *_UNROLL],
    "hcache_kernels_avx512.causal_attention_bf16",
    lambda: cpu().avx512,
    source="attention_bf16",
)
# the same arithmetic in vectors of 8 (attention_avx2.cpp), on any x86 with AVX2 and FMA
_ATTENTION_AVX2 = _Kernel(
    "attention_avx2", ["-mavx2", *_UNROLL], "hcache_kernels_avx2.causal_attention_bf16", lambda: cpu().avx2
)
_INT8 = _Kernel("int8_gemm", [*_AVX512, "-mavx512vnni"], "hcache_int8.int8_mm", lambda: cpu().vnni)
_INT8_AVX2 = _Kernel("int8_gemm_avx2", ["-mavx2"], "hcache_int8_avx2.int8_mm", lambda: cpu().avx2, source="int8_gemm")
_INT4 = _Kernel("int4_gemm", [*_AVX512, "-mavx512vnni"], "hcache_int4.int4_linear", lambda: cpu().vnni)
# the same source without VNNI, on any x86 with AVX2 and FMA
_INT4_AVX2 = _Kernel(
    "int4_gemm_avx2", ["-mavx2"], "hcache_int4_avx2.int4_linear", lambda: cpu().avx2, source="int4_gemm"
)
_DECODE = _Kernel("decode_attention", [*_AVX512, "-mavx512dq"], "hcache_decode.decode_attention", lambda: cpu().avx512)
_DECODE_AVX2 = _Kernel(
    "decode_attention_avx2",
    ["-mavx2"],
    "hcache_decode_avx2.decode_attention",
    lambda: cpu().avx2,
    source="decode_attention",
)
# every form, the served ones and those kept for comparing forms
FORMS = (_ATTENTION, _ATTENTION_F, _ATTENTION_AVX2, _INT8, _INT8_AVX2, _INT4, _INT4_AVX2, _DECODE, _DECODE_AVX2)
# the forms this CPU serves with
_SERVED_ATTENTION = _ATTENTION if cpu().bf16 else _ATTENTION_F if cpu().avx512 else _ATTENTION_AVX2
_SERVED_INT4 = _INT4 if cpu().vnni else _INT4_AVX2
_SERVED_INT8 = _INT8 if cpu().vnni else _INT8_AVX2
_SERVED_DECODE = _DECODE if cpu().avx512 else _DECODE_AVX2
KERNELS = (_SERVED_INT8, _SERVED_INT4, _SERVED_ATTENTION, _SERVED_DECODE)


def build_all() -> list[threading.Thread]:
    """Build every kernel this CPU takes, each on a thread of its own: the compilers run as
    child processes, so on a first start they overlap each other and the model's loading,
    and the start pays about the slowest build, not their sum. A kernel's getter waits for
    its build."""
    threads = []
    for k in KERNELS:
        if COMPILE and k.runs_here() and not k._done:
            threads.append(threading.Thread(target=k.get, name=f"build-{k.name}", daemon=True))
            threads[-1].start()
    return threads


def attention_bf16() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor] | None:
    """`op(q [T, H, D], k [S, KvH, D], v, scale) -> [T, H*D]`, all bfloat16 on the CPU, head
    dims contiguous and a multiple of 16 up to 128; the last T positions attend causally.
    With AVX512-BF16 its dot-product form, else its AVX-512F form (`attention_avx512f`), else
    its AVX2 form (`attention_avx2`): the same bits."""
    return _SERVED_ATTENTION.get()


def attention_avx512f() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor] | None:
    """`attention_bf16`'s AVX-512F form on any CPU with AVX-512, for comparing the two forms."""
    return _ATTENTION_F.get()


def attention_avx2() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor] | None:
    """`attention_bf16`'s AVX2 form on any CPU with AVX2 and FMA, for comparing the forms."""
    return _ATTENTION_AVX2.get()


def decode_attention() -> Callable[..., torch.Tensor] | None:
    """`op(q [B, H, D], k [N, KvH, D], v, rows [B, W], lengths [B], scale) -> [B, H*D]`: each
    sequence's new token over its first `lengths[b]` keys, pool rows `rows[b]` (int64); q
    float32 or bfloat16, the pools bfloat16 or float32, head dims contiguous, D one of
    `DECODE_HEAD_DIMS`; the output in q's dtype. With AVX-512 its AVX-512 form, else its
    AVX2 one (`decode_attention_avx2`): the same bits."""
    return _SERVED_DECODE.get()


def decode_attention_avx2() -> Callable[..., torch.Tensor] | None:
    """`decode_attention`'s AVX2 form on any CPU with AVX2 and FMA, for comparing the two forms."""
    return _DECODE_AVX2.get()


def int8_gemm() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor] | None:
    """`op(a, tiles, sums, scales, zero) -> (a - zero) @ w.T * scales`, float32 `[M, N]`, for
    uint8 activations `a [M, K]` and the weight rows `w [N, K]` in `int8_pack`'s tiles. Its
    library (`int8_ops`) also holds `int8_linear` (float rows in two passes each) and
    `int8_glu`. With AVX512-VNNI its VNNI form, else its AVX2 one: the same bits."""
    return _SERVED_INT8.get()


def int8_gemm_avx2() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor] | None:
    """`int8_gemm`'s AVX2 form on any CPU with AVX2 and FMA, for comparing the two forms."""
    return _INT8_AVX2.get()


def int8_ops() -> Any:
    """The served int8 form's library: `torch.ops.hcache_int8`, or `hcache_int8_avx2`."""
    return _SERVED_INT8.ops()


def int4_gemm() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """With AVX512-VNNI its VNNI form, else its AVX2 one (`int4_gemm_avx2`), which gives
    the same bits. `op(x, tiles, scale_zeros) -> x @ w.T`, float32 `[M, N]`, for bfloat16 or float32
    `x [M, K]` (each row quantized to two int8 passes inside, as `quant.int8_rows_mm` does) and the int4
    groups `w = (q - 8) * scale + zero` of `[N, K]`, the nibbles in `int4_pack`'s tiles, scale
    and zero bfloat16 `[K / 32, N, 2]`."""
    return _SERVED_INT4.get()


def int4_gemm_avx2() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """`int4_gemm`'s AVX2 form on any CPU with AVX2 and FMA, for comparing the two forms."""
    return _INT4_AVX2.get()


def int4_pack(q: torch.Tensor) -> torch.Tensor:
    """uint8 nibbles `[N, K]` (K a multiple of 32) into `int4_gemm`'s tiles (both forms'):
    the served form packs."""
    return _SERVED_INT4.ops().pack(q)


def int8_pack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 rows `[N, K]` (K a multiple of 4, every weight within +-127) into `int8_gemm`'s
    tiles (both forms'), and each row's sum."""
    return int8_ops().pack(w)


def _build(name: str, source_name: str, isa: list[str], op: str) -> Callable[..., torch.Tensor] | None:
    from torch.utils.cpp_extension import load

    try:
        if shutil.which("ninja") is None:  # the ninja package's binary, outside an activated venv
            import ninja

            os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])
        source = Path(__file__).with_name(f"{source_name}.cpp")
        # torch rebuilds when a source or a flag changes, and it hashes no header: ours go in a flag
        flags = [*_FLAGS, *isa, f"-DHCACHE_HEADERS={source_digest('*.h')}"]
        t0 = time.perf_counter()
        load(f"hcache_{name}", [str(source)], extra_cflags=flags, extra_ldflags=["-fopenmp"], is_python_module=False)
        log.info("kernel %s ready in %.1f s", name, time.perf_counter() - t0)
        namespace, fn = op.split(".")
        return getattr(getattr(torch.ops, namespace), fn)
    except Exception as e:  # no compiler, or one without the ISA: the library path serves
        log.warning("building %s failed, it runs on library kernels: %s", name, e)
        return None
