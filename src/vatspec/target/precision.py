"""Training precision: ``train.precision=bf16`` is bfloat16 autocast over float32 master weights."""

from __future__ import annotations

from pathlib import Path

import torch


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
