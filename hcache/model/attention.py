"""Attention over a KV cache. The model hands each layer's post-RoPE q, k, v to
`cache.attend`; the cache stores k, v and runs attention over everything it holds.
The caches (model/cache.py's contiguous one, the engine's paged one) call in here."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F

from hcache.kernels import native
from hcache.kernels.cpu import cpu
from hcache.kernels.fused import own_code

KEY_BLOCK = 64  # a decode step attends over whole blocks of this many keys


def key_width(n: int) -> int:
    """Keys a decode step over `n` tokens reads: `n` rounded up to whole key blocks."""
    return -(-n // KEY_BLOCK) * KEY_BLOCK


def decode_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """Which of `width` key rows each of the sequences of `lengths` `[B]` attends to: `[B, 1, 1, width]`."""
    return (torch.arange(width, device=lengths.device)[None, :] < lengths[:, None])[:, None, None, :]


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rows: torch.Tensor,
    lengths: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """One new token per sequence: q `[B, H, D]` over the K/V pools `[N, KvH, D]`, sequence b's
    keys at pool rows `rows[b]` (`[B, W]`, W whole key blocks), of which it attends to the
    first `lengths[b]`; returns `[B, H*D]`.
    Every decode path (alone or batched, eager or inside the compiled step) comes here so
    that a sequence's bits depend neither on its batch nor on the path. On x86 with AVX2
    that is our kernel (`native.decode_attention`, one set of bits for its AVX-512 and AVX2
    forms), which reads the rows where they lie; on other CPUs `_decode_rows`, compiled
    even when called eagerly; elsewhere torch's SDPA over the gathered rows, a KV head's
    query heads as that head's query rows (K/V never repeated) in the keys' dtype."""
    d = k.shape[2]
    scale = d**-0.5 if scale is None else scale
    if q.device.type == "cpu":
        op = native.decode_attention()
        if op is not None and d in native.DECODE_HEAD_DIMS:
            return op(q, k, v, rows, lengths, scale)
        attend = _decode_rows if torch.compiler.is_compiling() else _compiled_decode(q, k)
        return attend(q, k, v, rows, lengths, scale)
    keys, values, mask = _gathered(k, v, rows, lengths)
    b, _, kvh, d = keys.shape
    qg = q.to(keys.dtype).view(b, kvh, -1, d)
    out = F.scaled_dot_product_attention(qg, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, scale=scale)
    return out.reshape(b, -1).to(q.dtype)


def _gathered(
    k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each sequence's K/V rows `[B, W, KvH, D]` and which it attends to (`decode_mask`)."""
    (b, w), flat = rows.shape, rows.reshape(-1)
    keys = k.index_select(0, flat).view(b, w, *k.shape[1:])
    return keys, v.index_select(0, flat).view(b, w, *v.shape[1:]), decode_mask(lengths, w)


def _decode_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor, scale: float
) -> torch.Tensor:
    """`decode_attention` on a CPU without our kernel: the rows gathered and attended by
    `_decode_reductions`, which inductor fuses into a few loops."""
    keys, values, mask = _gathered(k, v, rows, lengths)
    return _decode_reductions(q, keys, values, mask, scale)


def _decode_reductions(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """`decode_attention` as plain reductions in float32 (K/V widened, not q rounded), for
    inductor to fuse with the gather of the rows into a few loops: torch's CPU flash kernel
    pays per sequence and head for its small bfloat16 GEMMs. Each sum over keys runs along
    the keys in order per output, so the masked keys a wider batch pads a sequence with add
    exact zeros and a sequence's bits do not depend on its batch."""
    b, w, kvh, d = keys.shape
    dtype = q.dtype
    # q realized once: inlined into the score loop, its rotary would be recomputed per key
    q = torch.ops.prims.inductor_force_stride_order(q.float() * scale, (q.shape[1] * d, d, 1))
    s = (q.view(b, 1, kvh, -1, d) * keys.float().unsqueeze(3)).sum(-1)  # [B, W, KvH, G]
    s = s.masked_fill(~mask.view(b, w, 1, 1), float("-inf"))
    p = (s - s.amax(1, keepdim=True)).exp()
    out = (p.unsqueeze(-1) * values.float().unsqueeze(3)).sum(1) / p.sum(1).unsqueeze(-1)
    return out.reshape(b, -1).to(dtype)


_compiled: dict[tuple, Callable[..., torch.Tensor]] = {}


def _compiled_decode(q: torch.Tensor, k: torch.Tensor) -> Callable[..., torch.Tensor]:
    """`_decode_rows` compiled for eager callers, who then run the kernels the compiled
    step inlines, not eager ops that sum in another order. Shapes are dynamic; each head
    layout and dtype pair gets a copy of its own, so that models served side by side (or a
    test session's many) never reach dynamo's limit of graphs per function."""
    key = (q.dtype, k.dtype, q.shape[1], *k.shape[1:])
    if key not in _compiled:
        import torch._inductor.inductor_prims  # registers the prim

        _compiled[key] = torch.compile(own_code(_decode_rows, *key), dynamic=True, fullgraph=True)
    return _compiled[key]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """The last `T` of `S` positions attend causally: query i sees keys 0..S-T+i.
    q `[T, H, D]`, k/v `[S, KvH, D]` (views of a cache's rows: never copied); returns `[T, H*D]`.
    K/V kept in a narrower dtype than q's (a bfloat16 cache under float32 activations) are
    attended in theirs: q is cast to it, not the cache."""
    if q.dtype != k.dtype:
        return causal_attention(q.to(k.dtype), k, v, scale).to(q.dtype)
    t, s = q.shape[0], k.shape[0]
    if q.device.type == "cpu":
        return _causal_cpu(q, k, v, s - t, scale)
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    gqa = qh.shape[1] != kh.shape[1]
    if t == 1:
        out = F.scaled_dot_product_attention(qh, kh, vh, scale=scale, enable_gqa=gqa)
    elif t == s:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(diagonal=s - t)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.squeeze(0).transpose(0, 1).reshape(t, -1)


QUERY_BLOCK = 128  # queries per masked call


def positional_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Queries of tokens at any positions `q_pos` `[T]` (a blend's recomputed few) over the
    keys of positions 0..S-1: query i sees keys 0..q_pos[i]. q `[T, H, D]`, k/v `[S, KvH, D]`;
    returns `[T, H*D]`. In float32, by blocks of queries, each over the keys up to its last
    position: with positions ascending, that skips about half the masked work."""
    t = q.shape[0]
    kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (k, v))
    gqa = q.shape[1] != k.shape[1]
    out = torch.empty(t, q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
    ends = q_pos.tolist()
    for lo in range(0, t, QUERY_BLOCK):
        hi = min(t, lo + QUERY_BLOCK)
        n = max(ends[lo:hi]) + 1
        mask = torch.arange(n, device=q.device)[None, :] <= q_pos[lo:hi, None]
        qh = q[lo:hi].float().transpose(0, 1).unsqueeze(0)
        kf, vf = kh[:, :, :n].float(), vh[:, :, :n].float()
        o = F.scaled_dot_product_attention(qh, kf, vf, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[lo:hi] = o.squeeze(0).transpose(0, 1).reshape(hi - lo, -1)
    return out


_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_linear = torch.ops.mkldnn._linear_pointwise  # oneDNN's matmul with float32 out, as inductor calls it

# The CPU's attention path (`Cpu.attention`): with AMX torch's flash kernel keeps the tiles;
# AVX-512 takes our kernel, or where it did not build, with AVX512-BF16 past `MATMUL_MIN_KEYS`
# oneDNN's matmuls (MKL's bfloat16 GEMM, flash's, runs far below them on AMD); without
# bfloat16 hardware both bfloat16 GEMMs run reference loops, and K/V are widened to float32
# for the float32 kernels.
_PATH = cpu().attention
_BF16_GEMMS = cpu().bf16
_MATMULS = torch.backends.mkldnn.is_available() and _PATH == "native" and _BF16_GEMMS
ROW_BLOCK = 128  # grouped query rows per score block: 128 x 8K float32 scores stay in cache
MATMUL_MIN_KEYS = 1536  # below about this many prefix keys flash's single call is the quicker
_scratch = threading.local()  # per thread: the float32 copies of a layer's K and V, a causal mask


def _widened(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V in float32, in a buffer reused from call to call: fresh memory for a long
    context's copy costs more in page faults than the copy."""
    n = k.numel()
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < 2 * n:
        with torch.inference_mode(False):  # a normal tensor: callers in and out of inference mode fill it
            buf = _scratch.buf = torch.empty(2 * max(n, 1 << 20))
    kf, vf = buf[:n].view(k.shape), buf[n : 2 * n].view(v.shape)
    return kf.copy_(k), vf.copy_(v)


def widened_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, scale: float | None
) -> torch.Tensor:
    """`_causal_cpu` for a bfloat16 cache on the float32 kernels: K/V widened (the library
    path of CPUs without bfloat16 hardware)."""
    return _causal_cpu(q.float(), *_widened(k, v), prefix, scale).to(q.dtype)


def _causal_mask(t: int, prefix: int, device: torch.device) -> torch.Tensor:
    """`[T, prefix + T]` float32, 0 where the last T positions see a key and -inf where they
    do not (added to the scores). The last one made is kept, for a forward's other layers."""
    key = (t, prefix, device)
    if getattr(_scratch, "mask_key", None) != key:
        seen = torch.ones(t, prefix + t, dtype=torch.bool, device=device).tril(diagonal=prefix)
        with torch.inference_mode(False):
            _scratch.mask = torch.zeros(seen.shape, device=device).masked_fill_(~seen, float("-inf"))
        _scratch.mask_key = key
    return _scratch.mask


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """q `[T, H, D]` as `[1, KvH, G*T, D]`: a KV head's G query heads become G*T query rows,
    so one unmasked attention serves the group and K/V are read as they lie."""
    t, h, d = q.shape
    return q.view(t, kv_heads, h // kv_heads, d).permute(1, 2, 0, 3).reshape(1, kv_heads, -1, d)


def _ungrouped(out: torch.Tensor, t: int) -> torch.Tensor:
    """`[1, KvH, G*T, D]` back to `[T, H*D]`."""
    kvh, _, d = out.shape[1:]
    return out.view(kvh, -1, t, d).permute(2, 0, 1, 3).reshape(t, -1)


def rows_alone(kv_dtype: torch.dtype, head_dim: int) -> bool:
    """Does `causal_attention` on a CPU over keys of `kv_dtype` run our kernel, which computes
    every query row on its own (a block's last row alone gets the bits it gets in the block)?"""
    return (
        _PATH == "native"
        and kv_dtype == torch.bfloat16
        and head_dim % 16 == 0
        and head_dim <= 128
        and native.attention_bf16() is not None
    )


def _causal_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, scale: float | None) -> torch.Tensor:
    """Flash attention. A float32 cache: one pass over every key, masked past each row's
    position. Otherwise, without a T x S mask: the new block attends to the prefix unmasked
    (query heads grouped over their KV head) and to itself causally; the two partial
    results are merged by their log-sum-exp. A bfloat16 cache takes the CPU's path
    (`_PATH`): our kernel (`kernels/native.py`; where it did not build, with AVX512-BF16
    `_matmul_attention` past `MATMUL_MIN_KEYS`, else float32 copies), torch's flash kernel,
    or float32 copies."""
    t, kvh = q.shape[0], k.shape[1]
    if rows_alone(k.dtype, q.shape[2]) and q.stride(2) == k.stride(2) == v.stride(2) == 1:
        op = native.attention_bf16()
        assert op is not None
        d = q.shape[2]
        return op(q, k, v, d**-0.5 if scale is None else scale)
    if k.dtype == torch.bfloat16 and (_PATH == "float32" or (_PATH == "native" and not _BF16_GEMMS)):
        return widened_attention(q, k, v, prefix, scale)
    kh, vh = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    if prefix == 0 and t > 1:
        out, _ = _flash(q.transpose(0, 1).unsqueeze(0), kh, vh, is_causal=True, scale=scale)
        return out.squeeze(0).transpose(0, 1).reshape(t, -1)
    if t == 1:
        out, _ = _flash(_grouped(q, kvh), kh, vh, scale=scale)
        return _ungrouped(out, t)
    if k.dtype == torch.float32:
        # one masked pass over every key: each row meets the key blocks of a one-pass
        # prefill in its order, so a turn over a float32 cache (the AVX2 path's widened one
        # included) gives the prefill's bits, which the two merged passes below do not
        mask = _causal_mask(t, prefix, q.device)
        out, _ = _flash(q.transpose(0, 1).unsqueeze(0), kh, vh, attn_mask=mask, scale=scale)
        return out.squeeze(0).transpose(0, 1).reshape(t, -1)
    if _MATMULS and k.dtype == torch.bfloat16 and prefix >= MATMUL_MIN_KEYS:
        return _matmul_attention(q, k, v, prefix, scale)
    pre, lse_pre = _flash(_grouped(q, kvh), kh[:, :, :prefix], vh[:, :, :prefix], scale=scale)
    qh = q.transpose(0, 1).unsqueeze(0)
    blk, lse_blk = _flash(qh, kh[:, :, prefix:], vh[:, :, prefix:], is_causal=True, scale=scale)
    # lse_pre is per grouped row [1, KvH, G*T]; lse_blk per head [1, H, T]: both to [T, H]
    lse_pre = lse_pre.view(kvh, -1, t).permute(2, 0, 1).reshape(t, -1)
    lse_blk = lse_blk.squeeze(0).transpose(0, 1)
    w_pre = torch.sigmoid(lse_pre - lse_blk).unsqueeze(-1)  # exp(a) / (exp(a) + exp(b))
    pre = _ungrouped(pre, t).view(t, -1, q.shape[2])
    blk = blk.squeeze(0).transpose(0, 1)
    return torch.lerp(blk.float(), pre.float(), w_pre).to(q.dtype).reshape(t, -1)


def _matmul_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, scale: float | None
) -> torch.Tensor:
    """`_causal_cpu` from oneDNN matmuls, for bfloat16 q `[T, H, D]` and k/v `[S, KvH, D]`
    (S = prefix + T). Per KV head and block of grouped query rows, one pass over all S
    keys: scores in float32 from the bfloat16 values (K widened, not rounded), the new
    block's later keys masked, an in-place softmax in base 2, and P rounded to bfloat16
    for P V as the flash kernel rounds it. Returns `[T, H*D]`."""
    t, kvh, d = q.shape[0], k.shape[1], q.shape[2]
    scale = d**-0.5 if scale is None else scale
    qg = _grouped(q, kvh)[0]  # [KvH, G*T, D]: row r is token r % T
    out = torch.empty_like(qg)
    token = torch.arange(qg.shape[1], device=q.device) % t
    later = torch.arange(t, device=q.device)[None, :] > token[:, None]  # [G*T, T]: keys each row must not see
    for h in range(kvh):
        keys, values = k[:, h].float(), v[:, h]
        rows = qg[h].float() * (scale * math.log2(math.e))  # scores in base 2: exp2 is the quick one
        for r in range(0, rows.shape[0], ROW_BLOCK):
            s = _linear(rows[r : r + ROW_BLOCK], keys, None, "none", [], "")
            unseen = later[r : r + ROW_BLOCK]
            s[:, prefix:].masked_fill_(unseen, float("-inf"))
            # denormal and zero results take a slow path (10-30x); below 2**-115 they are
            # invisible beside the row's largest term (1), and masked keys become 0 after
            p = s.sub_(s.amax(-1, keepdim=True)).clamp_(min=-115.0).exp2_()
            p[:, prefix:].masked_fill_(unseen, 0.0)
            total = p.sum(-1, keepdim=True)
            out[h, r : r + ROW_BLOCK] = torch.mm(p.to(torch.bfloat16), values).float().div_(total)
    return _ungrouped(out[None], t)
