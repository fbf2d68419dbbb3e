"""Training precision: ``train.precision=bf16`` is bfloat16 autocast over float32 master weights, and the
bf16 casts of frozen weights kept while they are unchanged (``frozen_cast``)."""

from __future__ import annotations

import weakref
from pathlib import Path

import torch
from torch import Tensor


def precision_context(device: torch.device, precision: str):
    """bfloat16 autocast for ``train.precision=bf16`` (float32 master weights and optimizer state), else a no-op."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bfloat16 in hardware, so that ``train.precision=bf16`` is faster:
    a GPU that supports it, or a CPU with AVX512-BF16 or AMX (read from /proc/cpuinfo; False where
    there is none). Without them a CPU emulates bf16 products, slower than float32."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return False
    return bool({"avx512_bf16", "amx_bf16"} & set(flags.split()))


_CASTS: dict[tuple[int, torch.dtype], tuple[weakref.ref, int, Tensor]] = {}


def frozen_cast(weight: Tensor, dtype: torch.dtype) -> Tensor:
    """``weight.to(dtype)``, kept while ``weight`` lives unchanged (the same tensor at the same
    version), for a weight without grad that bf16 autocast would otherwise cast at every call: a large
    frozen weight such as the target's lm_head is cast several times per training step, each a
    measurable share of a CPU step (docs/LOG.md, "Figures moved out of code comments"). A weight that
    trains is cast afresh (autocast caches those itself)."""
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
