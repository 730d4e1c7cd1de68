"""GGUF's quantized blocks onto packed kernels, as the file stores them.

- 4-bit blocks (Q4_0, Q4_1, Q4_K) are group-wise int4 of 32 weights, `q * scale + minimum`,
  exactly: Q4_0 is `d * (q - 8)`, Q4_1 `d * q + m`, and a Q4_K sub-block of 32
  `d * sc * q - dmin * m`. Only the kernel's bfloat16 scale and zero round.
- 5- to 8-bit blocks (Q5_0, Q5_1, Q5_K, Q6_K, Q8_0) are requantized to int8 with a scale
  per row (`Int8Linear`): no packed kernel takes their 32-weight scales.

The bit layouts are read with the `gguf` package's own helpers where it has them."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import Q4_K, dequantize
from torch import nn

from hcache.model.quant import GROUP, Int4Linear, Int8Linear

INT4_TYPES = (T.Q4_0, T.Q4_1, T.Q4_K)
INT8_TYPES = (T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K, T.Q8_0)
PACKED_TYPES = INT4_TYPES + INT8_TYPES

Groups = tuple[np.ndarray, np.ndarray, np.ndarray]  # q [N, K] uint8, scale and minimum [N, K/32] float32


def packed_linear(
    data: np.ndarray, qtype: T, rows: int, cols: int, heads: int | None = None, bias: torch.Tensor | None = None
) -> nn.Module | None:
    """A tensor's raw blocks as a packed module, or None where the type has no packed form.
    `heads`: undo llama.cpp's permute of Q/K rows (`unpermute`) for that many heads."""
    if qtype in INT4_TYPES:
        q, scale, minimum = int4_groups(data, qtype, rows, cols)
        if heads is not None:
            q, scale, minimum = (unpermute(a, heads) for a in (q, scale, minimum))
        arrays = (torch.from_numpy(np.ascontiguousarray(a)) for a in (q, scale, minimum))
        return Int4Linear.from_groups(*arrays, bias=bias)
    if qtype in INT8_TYPES:
        w = dequantize(data, qtype).reshape(rows, cols)
        if heads is not None:
            w = unpermute(w, heads)
        return Int8Linear.from_float(torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)), bias)
    return None


def int4_groups(data: np.ndarray, qtype: T, rows: int, cols: int) -> Groups:
    if qtype == T.Q4_0:
        return q4_0_groups(data, rows, cols)
    if qtype == T.Q4_1:
        return q4_1_groups(data, rows, cols)
    if qtype == T.Q4_K:
        return q4_k_groups(data, rows, cols)
    raise ValueError(f"{qtype.name} is not a 4-bit block type")


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes of a 32-weight block: weight j in the low nibble of byte j, j+16 in its high."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _f16(b: np.ndarray) -> np.ndarray:
    return b.copy().view(np.float16)[..., 0].astype(np.float32)


def q4_0_groups(raw: np.ndarray, rows: int, cols: int) -> Groups:
    """Q4_0: a block is d (float16) then 16 bytes of nibbles; weight = d * (q - 8)."""
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // GROUP, 18)
    d = _f16(blocks[..., 0:2])
    return _nibbles(blocks[..., 2:]).reshape(rows, cols), d, -8 * d


def q4_1_groups(raw: np.ndarray, rows: int, cols: int) -> Groups:
    """Q4_1: d and m (float16) then 16 bytes of nibbles; weight = d * q + m."""
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // GROUP, 20)
    return _nibbles(blocks[..., 4:]).reshape(rows, cols), _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])


def q4_k_groups(raw: np.ndarray, rows: int, cols: int) -> Groups:
    """Q4_K: super-blocks of 256 (d, dmin, 12 bytes of 6-bit scales and minimums, 128 bytes of
    nibbles). Sub-block 2j takes the low nibbles of bytes 32j..32j+31, sub-block 2j+1 their
    high nibbles; weight = d * sc * q - dmin * m."""
    blocks = np.ascontiguousarray(raw).reshape(rows * (cols // 256), 144)
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(rows, cols)
    scale = (d[:, None] * sc.astype(np.float32)).reshape(rows, cols // GROUP)
    minimum = -(dmin[:, None] * m.astype(np.float32)).reshape(rows, cols // GROUP)
    return q, scale, minimum


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's convert-time permute of Q/K rows (weights, biases, group scales)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
