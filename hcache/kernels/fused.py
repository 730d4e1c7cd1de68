"""RMSNorm and RoPE, each one pass over a layer's rows.

In eager PyTorch both are chains of elementwise ops (RMSNorm: to float32, square,
mean, scale, back to the model dtype, weight; RoPE: four products and two sums),
each a full pass over memory: most of the H restore path's compute on a CPU, growing
faster than the rows once they outgrow the caches. On CPUs
`torch.compile` (inductor's C++ kernels) fuses each chain into one loop with the
eager roundings (`emulate_precision_casts`): RoPE comes out bit-identical, RMSNorm
differs only by the order of its float32 sum (a few elements in a million, by one
unit in the last place).
Each compiled kernel is timed against its eager form once per process and the faster
one runs from then on: a compiled kernel can be slower (see `_Compiled`).

Few rows (a decode step's) stay eager: a compiled call's guards cost more than the
passes it saves there. So does every other device, and everything when compiling
fails (logged once) or `HCACHE_COMPILE=0`. The eager forms are in place and keep
the reference's roundings."""

from __future__ import annotations

import logging
import statistics
import threading
import time
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F

from hcache.kernels import COMPILE

log = logging.getLogger(__name__)

MIN_ROWS = 64  # fewer rows than this: eager
CAL_ROWS = 4096  # compiled and eager forms are timed at this many rows (a restore's layer)


def rms_norm_eager(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == weight.dtype == torch.float32 and x.shape[0] < MIN_ROWS:
        # the same ops and roundings, dispatched from C++: a turn's few rows pay per op (its
        # temporaries are not in place, which more rows than these would feel)
        return F.rms_norm(x, weight.shape, weight, eps)
    # the reference's roundings (normalise in float32, scale in the model dtype), in place:
    # every temporary of a layer's rows is megabytes
    xf = x.to(torch.float32, copy=True)
    xf.mul_(xf.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_())
    out = xf.to(x.dtype)
    return out.mul_(weight) if weight.dtype == out.dtype else weight * out


def rope_eager(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    # `x1 * cos - x2 * sin`, `x2 * cos + x1 * sin` per half: the roundings of the rotate-half
    # form `x * cos + cat(-x2, x1) * sin`, without its concatenated copy
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :half], sin[:, None, :half]
    out = torch.empty_like(x) if out is None else out
    o1, o2 = out[..., :half], out[..., half:]
    tmp = torch.mul(x2, s)
    torch.mul(x1, c, out=o1).sub_(tmp)
    torch.mul(x1, s, out=tmp)
    torch.mul(x2, c, out=o2).add_(tmp)
    return out


def _rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def _rope_into_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    out.copy_(_rope_ref(x, cos, sin))  # inductor writes the fused result straight into `out`
    return out


class _Compiled:
    """`fn` compiled for CPUs on first use, then timed against its eager form on `CAL_ROWS`
    rows; None from `__call__` where the eager form must run: compiling is off or failed, or
    the compiled kernel was not faster here. Inductor vectorises only for a CPU ISA it has
    checked (it loads a test library in a child Python); when that check fails it emits
    scalar C++ without a word, slower than eager: the timing is what catches that."""

    failed = not COMPILE
    _lock = threading.Lock()

    def __init__(self, fn: Callable, eager: Callable[..., torch.Tensor], name: str):
        self.fn, self.eager, self.name = fn, eager, name
        # per shape class (`_shape_class`): what runs, and why, for one model's rows is
        # decided on rows of their own shape, whatever other models ran before
        self._compiled: dict[tuple, Callable] = {}
        self.faster: dict[tuple, bool] = {}  # absent until timed
        self.timings: dict[tuple, dict[str, float]] = {}

    def get(self, key: tuple) -> Callable | None:
        """The kernel compiled for inputs of shape class `key`: a copy of its own, so that
        what other models compiled before (dynamo keeps its graphs per code object, and its
        record of which sizes varied per name) never changes which code, and so which
        rounding, this model's rows get."""
        if _Compiled.failed:
            return None
        fn = self._compiled.get(key)
        if fn is None:
            with _Compiled._lock:
                fn = self._compiled.get(key)
                if fn is None:
                    import torch._dynamo
                    import torch._inductor.config

                    torch._inductor.config.emulate_precision_casts = True  # the eager roundings
                    # per copy: inference tensors or not, and row-count classes
                    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
                    fn = torch.compile(own_code(self.fn, _tag(key)), dynamic=True, fullgraph=True)
                    self._compiled[key] = fn
        return fn

    def __call__(self, *args: object) -> torch.Tensor | None:
        """The compiled result, or None where the eager form must run."""
        key = _shape_class(args)
        fn = self.get(key)
        if fn is None or self.faster.get(key) is False:
            return None
        try:
            out = fn(*args)
            if key not in self.faster:
                with _Compiled._lock:
                    if key not in self.faster:
                        self._time(fn, args, key)
        except Exception as e:  # no compiler, an unsupported build: eager from now on
            _Compiled.failed = True
            log.warning("torch.compile unavailable (%s: %s); RMSNorm and RoPE run eager", type(e).__name__, e)
            return None
        return out if self.faster[key] else None

    def _time(self, fn: Callable, args: tuple, key: tuple) -> None:
        """Median of 5 alternating runs of each form on `CAL_ROWS` rows shaped like `args`."""
        rows = args[0].shape[0]  # type: ignore[union-attr]
        # inputs of the same kinds (inference tensors or not) as the call's: another kind
        # would compile the kernel again
        cal = tuple(_like(a, CAL_ROWS) if _rows_of(a, rows) else a for a in args)
        times: dict[str, list[float]] = {"compiled": [], "eager": []}
        forms = {"compiled": fn, "eager": self.eager}
        for i in range(6):  # the first round warms both
            for name, f in forms.items():
                t0 = time.perf_counter()
                f(*cal)
                if i:
                    times[name].append(time.perf_counter() - t0)
        t = self.timings[key] = {f"{k}_ms": statistics.median(v) * 1e3 for k, v in times.items()}
        self.faster[key] = t["compiled_ms"] < 0.95 * t["eager_ms"]
        chosen = "compiled" if self.faster[key] else "eager"
        ms = f"compiled {t['compiled_ms']:.2f} ms, eager {t['eager_ms']:.2f} ms"
        log.info("%s (%s) at %d rows: %s: %s", self.name, _tag(key), CAL_ROWS, ms, chosen)


def _shape_class(args: tuple) -> tuple:
    return tuple((a.dtype, *a.shape[1:]) for a in args if isinstance(a, torch.Tensor))


def _tag(key: tuple) -> str:
    """A shape class as a name: `float32_576__float32` (an RMSNorm's rows and weight)."""
    return "__".join("_".join(map(_word, part)) for part in key)


def _word(x: object) -> str:
    """`x` in a name: dtypes without `torch.`."""
    return str(x).removeprefix("torch.")


def own_code(fn: Callable, *parts: object) -> Callable:
    """`fn` with a code object of its own, named `fn`'s name and `parts` (`torch.` dropped
    from dtypes). Dynamo keeps compiled graphs per code object, and what it learned of their
    inputs (which sizes varied: the code state that decides which are compiled dynamic) per
    file, line and name, for the process and in its cache on disk: a copy with a name of
    its own learns only from its own calls."""
    assert isinstance(fn, types.FunctionType)
    name = "__".join([fn.__name__, *map(_word, parts)])
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def _rows_of(a: object, rows: int) -> bool:
    """Is `a` one of the call's row-shaped inputs (not a weight vector of as many elements)?"""
    return isinstance(a, torch.Tensor) and a.dim() > 1 and a.shape[0] == rows


def _like(a: torch.Tensor, rows: int) -> torch.Tensor:
    """`rows` random rows laid out as `a`'s (a view of every other row, say): another
    layout would compile the kernel again."""
    with torch.inference_mode(a.is_inference()):
        t = torch.empty_strided((rows, *a.shape[1:]), a.stride(), dtype=a.dtype, device=a.device)
        return t.copy_(torch.randn(t.shape))


_norm = _Compiled(_rms_norm_ref, lambda x, w, eps: rms_norm_eager(x, w, eps), "RMSNorm")
_rope = _Compiled(_rope_ref, lambda x, c, s: rope_eager(x, c, s, None), "RoPE")
_rope_into = _Compiled(_rope_into_ref, lambda x, c, s, out: rope_eager(x, c, s, out), "RoPE into rows")


def _compiles(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.shape[0] >= MIN_ROWS and not _Compiled.failed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x `[T, D]`."""
    if torch.compiler.is_compiling():  # inside a graph being traced (the decode step): fused there
        return _rms_norm_ref(x, weight, eps)
    if _compiles(x):
        out = _norm(x, weight, eps)
        if out is not None:
            return out
    return rms_norm_eager(x, weight, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x `[T, heads, head_dim]`, cos/sin `[T, head_dim]` with equal halves; into `out` when given."""
    if torch.compiler.is_compiling():
        return _rope_ref(x, cos, sin) if out is None else _rope_into_ref(x, cos, sin, out)
    if _compiles(x):
        res = _rope(x, cos, sin) if out is None else _rope_into(x, cos, sin, out)
        if res is not None:
            return res
    return rope_eager(x, cos, sin, out)


def compiled() -> bool:
    """Can inputs of many rows on a CPU run compiled (as far as is known before trying)?"""
    return not _Compiled.failed


def choices() -> dict[str, dict[str, dict]]:
    """Per kernel and shape class timed so far (`float32_576__float32`: its inputs' dtypes and
    row shapes): which form runs, and the timings."""
    return {
        k.name: {
            _tag(key): {"runs": "compiled" if fast else "eager", **k.timings[key]} for key, fast in k.faster.items()
        }
        for k in (_norm, _rope, _rope_into)
    }
