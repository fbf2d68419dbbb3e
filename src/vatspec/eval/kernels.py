"""CPU kernels for the target's few-row products and frozen casts (``vatspec.target`` uses them).

``skinny_linear``: a decode step's linears run on 1..k+1 rows, where ``F.linear`` (a GEMV or a small-M
GEMM) is slowest on some CPUs; ``weight @ x.T`` can stream the weight faster. ``auto`` times both once
per weight shape and row count in this process and keeps the faster (``perf/bench_target_step.py``
compares them side by side). ``frozen_cast``: a frozen weight's bf16 cast, kept while it is unchanged.
"""

from __future__ import annotations

import math
import time
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn

SKINNY_ROWS = 16  # up to this many rows, a CPU linear may run as weight @ x.T (see skinny_linear)
# the few-row kernels: "auto" (the faster one, measured once per shape and row count in this process),
# "matmul" (always weight @ x.T) or "linear" (always F.linear)
KERNELS = ("auto", "matmul", "linear")
_FASTER: dict[tuple, bool] = {}  # (out, in, rows, dtype, threads) -> weight @ x.T beat F.linear here
_TIMING_REPS = 7  # best of 7 each after a warm-up, interleaved: separates kernels that differ by > 10%
# bytes of weight copies one timing cycles through, so the weight streams from memory as in a model pass
# (the layers' weights together exceed the CPU's caches): a weight timed hot in cache can pick the other
# kernel (EPYC, [576, 576], 1 row: F.linear 31 against 51 us hot, 113 against 75 us cold)
_STREAM_BYTES = 256 * 2**20
_MAX_COPIES = 256  # SmolLM2's smallest weight needs 203; a test model's tiny ones would need ~10^5


def _matmul_linear(x2: Tensor, weight: Tensor) -> Tensor:
    """``F.linear(x2, weight)`` for a ``[rows, in]`` x2 as ``weight @ x2.T`` (one row padded to two)."""
    rows = x2.shape[0]
    if rows == 1:  # a 1-column product falls back to the GEMV; pad to 2 columns
        x2 = torch.cat([x2, x2.new_zeros(1, x2.shape[1])])
    return (weight @ x2.T).T[:rows].contiguous()


def _best_seconds_interleaved(a, b) -> tuple[float, float]:
    """(best seconds of ``a``, of ``b``) over ``_TIMING_REPS`` rounds after a warm-up, the two run back to
    back in an order that alternates by round (a b, b a, ...): a burst of load from another job slows both
    alike or spares one round of each, where timing all of ``a`` and then all of ``b`` lets one burst pick the
    kernel for the rest of the process."""
    a(), b()
    best = [math.inf, math.inf]
    for r in range(_TIMING_REPS):
        for i in ((0, 1) if r % 2 == 0 else (1, 0)):
            t0 = time.perf_counter()
            (a, b)[i]()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best[0], best[1]


def _matmul_faster(weight: Tensor, rows: int) -> bool:
    """Whether ``weight @ x.T`` beats ``F.linear`` for ``rows`` rows of this weight's shape on this CPU,
    timed once per shape, row count, dtype and thread count (random inputs, no grad), interleaved
    (``_best_seconds_interleaved``), each kernel over the same cycle of weight copies (``_STREAM_BYTES`` in
    all, ``_MAX_COPIES`` at most) so that neither finds the weight in cache."""
    key = (*weight.shape, rows, weight.dtype, torch.get_num_threads())
    if key not in _FASTER:
        with torch.no_grad():
            w = weight.detach()
            n = min(_MAX_COPIES, math.ceil(_STREAM_BYTES / (w.numel() * w.element_size())))
            copies = [w] + [w.clone() for _ in range(n - 1)]
            x = torch.randn(rows, w.shape[1], dtype=w.dtype)
            matmul, linear = _best_seconds_interleaved(lambda: [_matmul_linear(x, c) for c in copies],
                                                       lambda: [F.linear(x, c) for c in copies])
            _FASTER[key] = matmul < linear
    return _FASTER[key]


def skinny_linear(x: Tensor, weight: Tensor, bias: Tensor | None, kernel: str = "auto") -> Tensor:
    """``F.linear(x, weight, bias)``, with the faster kernel for the few rows of a decode step on CPU.

    With few rows, ``F.linear`` runs a GEMV (1 row) or a small-M GEMM, and which of it and the same
    product as ``weight @ x.T`` is faster depends on the CPU: on the AMD EPYC (Zen 4) machine the
    matmul streams the weight once over both cores (lm_head [49152, 576]: 1 row 10.7 -> 4.0 ms, 8 rows
    16.8 -> 8.3 ms), on an Intel Xeon (2.0 GHz, AMX) ``F.linear`` is faster up to ~8 rows (1 row 9.4
    against 20.3 ms) and the matmul past that (``perf/bench_target_step.py``). So ``kernel="auto"``
    times both once per weight shape and row count, with the weight out of cache as in a model pass,
    and keeps the faster. Same values up to float rounding (~1e-6).
    """
    rows = x.numel() // x.shape[-1]
    if (kernel == "linear" or x.device.type != "cpu" or rows > SKINNY_ROWS or x.dtype != weight.dtype
            or not x.is_floating_point()):
        return F.linear(x, weight, bias)
    if kernel == "auto" and not _matmul_faster(weight, rows):
        return F.linear(x, weight, bias)
    out = _matmul_linear(x.reshape(rows, x.shape[-1]), weight)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


_CASTS: dict[tuple[int, torch.dtype], tuple[weakref.ref, int, Tensor]] = {}


def frozen_cast(weight: Tensor, dtype: torch.dtype) -> Tensor:
    """``weight.to(dtype)``, kept while ``weight`` lives unchanged (the same tensor at the same
    version), for a weight without grad that bf16 autocast would otherwise cast at every call: the
    target's lm_head ([49152, 576] on SmolLM2) costs ~20 ms a cast on the 2-core CPU, several times
    per training step. A weight that trains is cast afresh (autocast caches those itself)."""
    if weight.dtype == dtype or weight.requires_grad:
        return weight.to(dtype)
    key = (id(weight), dtype)
    hit = _CASTS.get(key)
    if hit is not None and hit[0]() is weight and hit[1] == weight._version:
        return hit[2]
    for k in [k for k, (ref, _, _) in _CASTS.items() if ref() is None]:  # drop the casts of freed weights
        del _CASTS[k]
    _CASTS[key] = (weakref.ref(weight), weight._version, cast := weight.detach().to(dtype))
    return cast


class SkinnyLinear(nn.Linear):
    """``nn.Linear`` (same parameters and state_dict keys) whose few-row CPU products, a decode
    step's, take the ``kernel`` of ``skinny_linear``; larger batches are unchanged."""

    kernel = "auto"

    def forward(self, x: Tensor) -> Tensor:
        return skinny_linear(x, self.weight, self.bias, self.kernel)


def use_skinny_linears(model: nn.Module) -> list[SkinnyLinear]:
    """The target's linears as ``SkinnyLinear`` (the class is swapped in place; parameters, hooks and
    state_dict stay as they are): a CPU decode step of the target is ~30 x 7 linears on 1..k+1 rows,
    where ``F.linear`` is slowest. ``perf/bench_target_step.py`` measures a step and a verify pass with
    each kernel side by side."""
    out = []
    for m in model.modules():
        if type(m) in (nn.Linear, SkinnyLinear):
            m.__class__ = SkinnyLinear
            out.append(m)
    return out
