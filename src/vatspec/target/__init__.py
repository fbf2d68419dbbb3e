"""The target: the frozen model drafters learn from (``model``), the family rules its logits follow
(``families``), what its architecture is and which engines serve drafts for it (``architecture``), how
verification takes its cache back (``rollback``) and the precision it and training run at (``precision``).

    target = open_target("Qwen/Qwen3-8B", device="cuda", dtype="bfloat16")
"""

from vatspec.target.model import (
    DTYPES,
    Target,
    TargetError,
    TargetOutput,
    device_name,
    dtype_name,
    load_gguf_model,
    open_target,
    prepare_default_target,
    prepare_gguf_target,
    resolve_device,
)

__all__ = ["DTYPES", "Target", "TargetError", "TargetOutput", "device_name", "dtype_name", "load_gguf_model",
           "open_target", "prepare_default_target", "prepare_gguf_target", "resolve_device"]
