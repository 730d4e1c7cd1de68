"""Quantized weights on packed low-bit CPU kernels: ours where the CPU has VNNI, else torch's.

- `Int4Linear`: group-wise asymmetric int4 (groups of 32 along the input), `(q - 8) * scale
  + zero` per group, on our AVX512-VNNI kernel or `aten._weight_int4pack_mm_for_cpu`.
  GGUF's Q4_1 blocks (32 weights, a scale d and a minimum m: `q * d + m`) map onto it
  exactly as `scale = d`, `zero = m + 8 d`; scale and zero stay bfloat16 (what torch's
  kernel takes), their only rounding.
- `Int8Linear`: per-row symmetric int8 on our AVX512-VNNI kernel, else oneDNN's int8 GEMM
  (`_weight_int8pack_mm` without oneDNN), for GGUF's 5- to 8-bit blocks (Q5_0, Q5_1, Q5_K,
  Q6_K, Q8_0), whose 32-weight scales no packed kernel takes: each row is requantized to
  int8 at its own scale, half a step of rounding; and for the LM head. Every path
  quantizes the activations in two passes per row (`int8_rows_mm`): restore paths whose
  activations differ in last bits must round them alike, which one coarse pass per group
  did not (greedy tokens changed near ties). An LM head's passes are of 7 bits
  (`LM_HEAD_BITS`): without VNNI its sums then need no signs moved, and its logits stay
  within rounding of the 8-bit head's.
- `Int8Rows`: the same rows shared by the token embedding (a row per token) and a tied head.

Float weights (safetensors, or GGUF types without a packed form) are quantized on load by
min/max per group (`int4_from_float`)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hcache.kernels import native
from hcache.kernels.cpu import cpu

GROUP = 32
WEIGHT_MODES = ("float", "packed")


class _Bf16Scales(nn.Module):
    """Scales stay bfloat16, what the kernels take, when the model moves to another dtype
    (`.to(torch.float32)` converts every float buffer)."""

    def _apply(self, fn: Callable, recurse: bool = True) -> nn.Module:
        super()._apply(fn, recurse)
        for name, t in self.named_buffers(recurse=False):
            if t.is_floating_point():
                setattr(self, name, t.to(torch.bfloat16))
        return self


def _cat_bias(mods: tuple[nn.Module, ...]) -> torch.Tensor | None:
    """The modules' biases end to end (zeros for one without), or None where none has one."""
    if all(m.bias is None for m in mods):
        return None
    dt = next(m.bias.dtype for m in mods if m.bias is not None)
    return torch.cat([torch.zeros(m.out_features, dtype=dt) if m.bias is None else m.bias.data for m in mods])


class Int4Linear(_Bf16Scales):
    """`x @ w.T + bias` for int4 groups of 32 inputs, `w = (q - 8) * scale + zero`. Where our
    kernel runs (`kernels.native.int4_gemm`: AVX512-VNNI or AVX2) the nibbles live in its tiles, and it
    quantizes the bfloat16 activations inside the call, a row at a time in the two int8 passes
    of `int8_rows_mm`; elsewhere they live in torch's int4 form, on its kernel. Both compute
    each output row from its own activation row, and each output column alone."""

    def __init__(
        self,
        packed: torch.Tensor | None,
        scales_zeros: torch.Tensor,
        bias: torch.Tensor | None = None,
        tiles: torch.Tensor | None = None,
    ):
        super().__init__()
        self.in_features, self.out_features = scales_zeros.shape[0] * GROUP, scales_zeros.shape[1]
        self.register_buffer("packed", packed)  # torch's int4 form
        self.register_buffer("tiles", tiles)  # or our kernel's
        self.register_buffer("scales_zeros", scales_zeros)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_groups(
        cls, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bias: torch.Tensor | None = None
    ) -> Int4Linear:
        """q `[N, K]` in 0..15, scale and minimum `[N, K/32]`: weight = q * scale + minimum."""
        zero = minimum.float() + 8 * scale.float()
        sz = torch.stack([scale.float().t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
        if native.int4_gemm() is not None:
            return cls(None, sz, bias, tiles=native.int4_pack(q.to(torch.uint8)))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        return cls(packed, sz, bias)

    @classmethod
    def cat(cls, mods: tuple[Int4Linear, ...]) -> Int4Linear:
        """One matrix of the modules' output rows, in order (both packed forms are row-major
        in N, the scales N-minor): the kernels compute each output column alone, so one call
        gives the separate calls' bits. Our tiles hold 16 rows: every part but the last must
        be whole tiles (`joins`)."""
        sz, bias = torch.cat([m.scales_zeros for m in mods], dim=1), _cat_bias(mods)
        if mods[0].tiles is None:
            return cls(torch.cat([m.packed for m in mods]), sz, bias)
        if any(m.out_features % 16 for m in mods[:-1]):
            raise ValueError("int4 tiles concatenate only after whole tiles of 16 rows")
        return cls(None, sz, bias, tiles=torch.cat([m.tiles for m in mods]))

    @staticmethod
    @functools.cache
    def joins(rows: int) -> bool:
        """Whether a matrix of `rows` output rows can stand before others in one packed
        matrix (`cat`, and `rows` views past it) with every part keeping its bits. The
        kernels pack N in blocks of rows whose width is the ISA's, and a part but the last
        that is not whole blocks shifts the rest: a probe on random matrices answers."""
        if rows % 16:  # neither kernel packs such a matrix to concatenate
            return False
        g = torch.Generator().manual_seed(0)
        a, b = (int4_from_float(torch.randn(n, 2 * GROUP, generator=g)) for n in (rows, 16))
        x = torch.randn(3, 2 * GROUP, generator=g)
        with torch.no_grad():
            return torch.equal(Int4Linear.cat((a, b))(x), torch.cat([a(x), b(x)], dim=-1))

    def rows(self, lo: int, hi: int) -> Int4Linear:
        """Output rows `lo..hi` as a module of their own, sharing the packed weights (the scales,
        a 32nd of their size, are copied: the kernels take them contiguous). In our tiles `lo`
        starts a tile; the rows of a last tile past `hi` are masked off."""
        bias = None if self.bias is None else self.bias[lo:hi]
        sz = self.scales_zeros[:, lo:hi].contiguous()
        if self.tiles is None:
            return Int4Linear(self.packed[lo:hi], sz, bias)
        if lo % 16:
            raise ValueError(f"int4 tiles start every 16 rows, not at {lo}")
        return Int4Linear(None, sz, bias, tiles=self.tiles[lo // 16 : (hi + 15) // 16])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # bfloat16 activations on either kernel (torch's takes nothing else): the graph's and
        # eager code's float32 values can differ in their last bits, which bfloat16 rounds away
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if self.tiles is not None:
            y = native.int4_gemm()(flat, self.tiles, self.scales_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, self.scales_zeros)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


class Int8Linear(_Bf16Scales):
    """`x @ (q * scale).T + bias` for int8 q `[N, K]` and a bfloat16 scale per row: GGUF's
    5- to 8-bit matrices. `pack` moves the rows into one packed form, its activations
    quantized a row at a time (`int8_rows_mm`): our AVX512-VNNI kernel's tiles where it
    runs (`kernels.native.int8_gemm`), else oneDNN's prepacked copy; without either it
    stays on `_weight_int8pack_mm`, which runs a row at a time (a batch-32 step several
    times slower). Every path computes each output row from its own activation row alone: a
    row's result never depends on the batch around it."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.register_buffer("q", q)
        self.register_buffer("scales", scales)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.register_buffer("tiles", None)  # `pack_native`'s: the rows in the kernel's tiles
        self.register_buffer("sums", None)  # and each row's sum
        self._handle: int | None = None  # `pack_for_onednn`'s copy, in `_ONEDNN`
        # each activation pass's bits, sign included (`int8_rows_mm`); an LM head takes 7
        # (`LM_HEAD_BITS`), and oneDNN at most what this CPU sums exactly
        self.bits = 8
        self._bits = 8  # oneDNN's activations'
        self.packed_bytes = 0  # bytes held outside the module's tensors (oneDNN's copy)

    @classmethod
    def from_float(cls, w: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        s = (w.float().abs().amax(dim=1) / 127).clamp_min(1e-12)
        q = torch.round(w.float() / s[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(q, s.to(torch.bfloat16), bias)

    @classmethod
    def cat(cls, mods: tuple[Int8Linear, ...]) -> Int8Linear:
        return cls(torch.cat([m.q for m in mods]), torch.cat([m.scales for m in mods]), _cat_bias(mods))

    def rows(self, lo: int, hi: int) -> Int8Linear:
        """Output rows `lo..hi` as a module of their own (before packing: a view of the rows)."""
        bias = None if self.bias is None else self.bias[lo:hi]
        return Int8Linear(self.q[lo:hi], self.scales[lo:hi], bias)

    @property
    def is_packed(self) -> bool:
        return self.tiles is not None or self._handle is not None

    def pack(self, keep_rows: bool = False) -> bool:
        """The rows into the fastest packed form this CPU has; False where none is."""
        return self.pack_native() or self.pack_for_onednn(keep_rows=keep_rows)

    def pack_native(self) -> bool:
        """Serve `forward` on our AVX512-VNNI kernel from its tiles of the rows, which
        replace them (a tied embedding looks its rows up in the tiles); False where the
        kernel does not run here or K is not a multiple of 4."""
        if self.tiles is not None:
            return True
        if native.int8_gemm() is None or self.in_features % 4 or self._handle is not None:
            return False
        self.tiles, self.sums = native.int8_pack(self.q)
        self.q = self.q.new_empty((self.out_features, 0))
        return True

    def pack_for_onednn(self, bits: int | None = None, keep_rows: bool = False) -> bool:
        """Serve `forward` on oneDNN's int8 GEMM from a prepacked copy of the rows, its
        activations quantized to `bits` (default: what this CPU sums exactly,
        `Cpu.onednn_activation_bits`), at most the module's own `bits`; False where this
        torch has no oneDNN. The rows are dropped unless `keep_rows` (an embedding tied to a
        head looks them up)."""
        if self._handle is not None:
            return True
        onednn = torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_prepack")
        if self.tiles is not None or not onednn:
            return False
        packed = torch.ops.onednn.qlinear_prepack(self.q, None)
        zeros = torch.zeros(self.out_features, dtype=torch.int32)
        self._handle, self._bits = len(_ONEDNN), min(bits or cpu().onednn_activation_bits, self.bits)
        _ONEDNN.append((packed, self.scales.float(), zeros, self._bits))
        self.packed_bytes = self.q.numel()
        if not keep_rows:
            self.q = self.q.new_empty((self.out_features, 0))
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias
        if self.tiles is not None:  # the two passes of `int8_rows_mm`, inside the op
            flat = x.reshape(-1, self.in_features)
            # a float32 bias is added there too, as torch adds it (other dtypes round y first)
            inside, bias = (bias, None) if bias is not None and x.dtype == torch.float32 else (None, bias)
            y = native.int8_ops().int8_linear(flat, self.tiles, self.sums, self.scales, inside, self.bits).to(x.dtype)
        elif self._handle is not None:
            mm = functools.partial(onednn_int8_mm, handle=self._handle)
            y = int8_rows_mm(x.reshape(-1, self.in_features), mm, self._bits).to(x.dtype)
        else:
            flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
            y = torch.ops.aten._weight_int8pack_mm(flat, self.q, self.scales).to(x.dtype)
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], self.out_features)


def glu_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Gate and up rows `[N, ...]` interleaved eight at a time: gate 0-7, up 0-7, gate 8-15..."""
    n = gate.shape[0]
    return torch.stack((gate.view(n // 8, 8, *gate.shape[1:]), up.view(n // 8, 8, *up.shape[1:])), 1).flatten(0, 2)


class Int8Glu(Int8Linear):
    """`silu(x @ gate.T) * (x @ up.T)`, SwiGLU's first half, as one int8 matrix of the two's
    rows (`glu_rows`). On our kernel each 16-lane tile then holds 8 outputs' gate and up
    sums, and the op applies the activation in registers (`int8_glu`): the
    `[T, 2I]` product is never written, nor read back by elementwise ops (on two cores
    those read what the other core's half of the kernel just wrote). Elsewhere the rows'
    output is split and activated in torch."""

    @classmethod
    def of(cls, gate: Int8Linear, up: Int8Linear) -> Int8Glu | None:
        """None where the pair does not interleave: rows not a multiple of 8, or biases."""
        if gate.out_features % 8 or gate.q.shape != up.q.shape or gate.bias is not None or up.bias is not None:
            return None
        return cls(glu_rows(gate.q, up.q), glu_rows(gate.scales, up.scales))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tiles is not None:
            flat = x.reshape(-1, self.in_features)
            y = native.int8_ops().int8_glu(flat, self.tiles, self.sums, self.scales).to(x.dtype)
            return y.view(*x.shape[:-1], self.out_features // 2)
        both = super().forward(x).unflatten(-1, (-1, 2, 8))
        return (F.silu(both[..., 0, :]) * both[..., 1, :]).flatten(-2)


class Int8Rows(Int8Linear):
    """A `[rows, dim]` matrix of int8 rows that an LM head (`forward`) and the embedding it is
    tied to (`lookup`) share."""

    def lookup(self, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.tiles is None:
            q = self.q[tokens]
        else:  # row r is lane r % 16 of tile r // 16, 4 inputs a step
            q = self.tiles[tokens // 16, :, tokens % 16, :].reshape(*tokens.shape, self.in_features)
        return q.to(dtype) * self.scales[tokens, None].to(dtype)


# oneDNN's prepacked int8 matrices (opaque tensors), with their scales, zero points and
# activation bits. The custom op takes an index into this list: dynamo and inductor see no
# opaque tensor, and traced code reads nothing of it (a guard on it would recompile a graph
# whenever another matrix is packed).
_ONEDNN: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = []


def int8_rows_mm(x: torch.Tensor, mm: Callable[[torch.Tensor], torch.Tensor], bits: int) -> torch.Tensor:
    """`x @ rows.T` (float32 `[M, rows]`) on an int8 GEMM `mm` (uint8 activations around
    the zero point 2^(bits-1), float32 out). Each row of `x` is quantized
    on its own (so a row's result never depends on the others in the batch), in two passes:
    the row at its own scale, then what that left over at the remainder's (two passes of
    `bits`-bit values, sign included: about 14 bits at 8, 12 at 7, where one 8-bit pass
    moved the shipped text's perplexity measurably). Both passes go in one call, which
    costs about what one pass does. Each scale is a power of two, taken from the row's
    largest magnitude by masking its exponent: the quantized values and the remainder are
    then exact, so an inductor-fused graph computes them to the same bits as eager code (no
    reciprocal or fused multiply-add can round otherwise) and the per-call work fuses into
    the graph around the GEMM. The integer sums are exact, so each output is
    `sum * row_scale * activation_scale`, rounded the same way at any batch size. `bits`: the
    packed form's."""
    top = 2 ** (bits - 1) - 1
    x = x.float()
    m = x.shape[0]
    s1 = _pow2_scale(x, bits)
    q1 = torch.round(x * s1.reciprocal()).clamp(-top, top)
    rest = x - q1 * s1
    s2 = _pow2_scale(rest, bits)
    q2 = torch.round(rest * s2.reciprocal()).clamp(-top, top)
    q = (torch.cat([q1, q2]) + (top + 1)).to(torch.uint8)
    y = mm(q)
    return y[:m] * s1 + y[m:] * s2


def _pow2_scale(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Per row, the power of two that puts the largest magnitude in [2^(bits-2), 2^(bits-1)):
    the float32 exponent field alone (a row of zeros takes 2^-100's)."""
    amax = x.abs().amax(1, keepdim=True).clamp_min(2.0**-100)
    p = (amax.view(torch.int32) & 0x7F800000).view(torch.float32)  # 2^floor(log2(amax))
    return p * 2.0 ** -(bits - 2)


@torch.library.custom_op("hcache::onednn_int8_mm", mutates_args=())
def onednn_int8_mm(q: torch.Tensor, handle: int) -> torch.Tensor:
    """`(q - zero) @ rows.T * row_scale` (float32) for uint8 activations around the zero point
    2^(bits-1): VNNI multiplies only unsigned by signed bytes (oneDNN ran signed activations
    on a reference path), and without VNNI the pair sums saturate past 16 bits unless the
    activations stay at or below 128 (`bits` 7)."""
    packed, scales, zeros, bits = _ONEDNN[handle]
    zp = 2 ** (bits - 1)
    return torch.ops.onednn.qlinear_pointwise(
        q, 1.0, zp, packed, scales, zeros, None, 1.0, 0, torch.float32, "none", [], ""
    )


@onednn_int8_mm.register_fake
def _(q: torch.Tensor, handle: int) -> torch.Tensor:
    return q.new_empty((q.shape[0], _ONEDNN[handle][1].shape[0]), dtype=torch.float32)


class Int8Embedding(nn.Module):
    def __init__(self, rows: Int8Rows, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.rows = rows
        self.dtype = dtype  # the activations'

    def _apply(self, fn: Callable, recurse: bool = True) -> nn.Module:
        self.dtype = fn(torch.empty(0, dtype=self.dtype)).dtype  # follows `.to(dtype)` as a weight would
        return super()._apply(fn, recurse)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.rows.lookup(tokens, self.dtype)


def int4_from_float(w: torch.Tensor, bias: torch.Tensor | None = None) -> Int4Linear:
    """Min/max per group of 32: the float matrix `[N, K]` as Q4_1 would store it."""
    n, k = w.shape
    g = w.float().reshape(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).reshape(n, k)
    return Int4Linear.from_groups(q, scale, lo, bias)
