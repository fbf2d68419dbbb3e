"""The CPU kernel of a decode step's few-row products, chosen by the decode loop.

A decode step's linears run on 1..k+1 rows, where ``F.linear`` (a GEMV or a small-M GEMM) is slowest on
some CPUs; ``weight @ x.T`` can stream the weight faster. ``auto`` times both once per weight shape and
row count in this process and keeps the faster (``perf/bench_target_step.py`` compares them side by side).
The models themselves keep plain ``nn.Linear`` layers: the decode loop swaps them for the block it runs

    with few_row_kernel(target.model, drafter, kind="auto"):
        ...  # every nn.Linear of both takes the few-row kernel; after the block, each is as before
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager

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
# kernel (the timings: docs/LOG.md, "Figures moved out of code comments")
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
    matmul, which streams the weight once over both cores, won at 1, 2, 4 and 8 rows; on an
    Intel Xeon with AMX ``F.linear`` won at the fewest rows and the matmul past them
    (``perf/bench_target_step.py``; the timings: docs/LOG.md, "Figures moved out of code comments").
    So ``kernel="auto"`` times both once per weight shape and row count, with the weight out of cache
    as in a model pass, and keeps the faster. Same values up to float rounding (~1e-6).
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


class SkinnyLinear(nn.Linear):
    """``nn.Linear`` (same parameters and state_dict keys) whose few-row CPU products, a decode
    step's, take the ``kernel`` of ``skinny_linear``; larger batches are unchanged."""

    kernel = "auto"

    def forward(self, x: Tensor) -> Tensor:
        return skinny_linear(x, self.weight, self.bias, self.kernel)


@contextmanager
def few_row_kernel(*models: object, kind: str = "auto") -> Iterator[None]:
    """Inside the block, every ``nn.Linear`` of ``models`` (what is not an ``nn.Module`` skipped: None, a
    scripted test drafter) is a ``SkinnyLinear`` running
    ``kind``: its class is swapped in place, so parameters, hooks and state_dict stay as they are; after
    the block each layer has its class and kernel back. Blocks nest. ``kind``: ``auto`` (the faster,
    timed once per weight shape and row count in this process), ``matmul`` or ``linear`` (``F.linear``)."""
    if kind not in KERNELS:
        raise ValueError(f"few_row_kernel must be one of {KERNELS}, got {kind!r}")
    saved = []
    for model in models:
        for m in model.modules() if isinstance(model, nn.Module) else ():
            if type(m) in (nn.Linear, SkinnyLinear):
                saved.append((m, type(m), m.__dict__.get("kernel")))
                m.__class__ = SkinnyLinear
                m.kernel = kind
    try:
        yield
    finally:
        for m, cls, kernel in reversed(saved):
            m.__class__ = cls
            if kernel is None:
                m.__dict__.pop("kernel", None)
            else:
                m.kernel = kernel
