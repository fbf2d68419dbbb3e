"""Greedy speculative decoding of exported drafts in SGLang: what a served draft commits and accepts.

The SGLang counterpart of `tools/vllm_generate.py`, with the same arguments and output; it runs in a
Python environment that holds SGLang, not vatspec, and `tools/vllm_parity.py --engine sglang` calls it.
For the target alone and then for each ``NAME=DIR`` (an `vatspec export` folder: `eagle3-hf`, or `dflash`
with k = its block size - 1), one `sglang.Engine` generates every prompt at temperature 0, one prompt at a
time, and the request's speculative counters (``spec_verify_ct``, ``spec_num_correct_drafts``,
``spec_correct_drafts_histogram``) are read from its ``meta_info``.

On a GPU this is SGLang as users run it. On a machine without one, SGLang 0.5.23 has no CPU path short of
`sgl-kernel`'s CPU build (not on PyPI): the script then runs SGLang's GPU code on the CPU, which needs
these changes, all made here and nothing else:
- ``TRITON_INTERPRET=1``: SGLang's Triton kernels (attention, KV-cache moves, tree building, greedy
  verification) run in Triton's interpreter. Correct, and two orders of magnitude slow: wall times of
  this mode are not speeds.
- the speculative kernels' dispatch (``spec_tree``, ``cache_locs``) takes the branch SGLang takes on Intel
  XPUs, its own Triton kernels: on a plain CPU it would skip tree building and greedy verification.
- ``Tensor.record_stream`` returns at once for CPU tensors (there are no streams to record).
- ``torchvision`` (imported by SGLang's multimodal configs; PyPI's build needs CUDA's torch) and
  ``vllm._custom_ops`` (a rotary kernel SGLang imports but does not call on this path; the stand-in
  raises if it ever is) are stand-in modules when they cannot be imported.
- DFlash only: SGLang's speculative settings see a platform that allows DFlash with Triton drafts (it
  refuses DFlash on a CPU device), and its extend path gives the draft its input embeddings in the model's
  dtype: SGLang casts them to bf16 whatever the dtype (``ModelRunner._extend_forward_kwargs``), which fails
  in a float32 engine and is a no-op in the bf16 one users run.
The target alone runs with the ``torch_native`` attention backend; with a draft, target and draft run
``triton`` (SGLang refuses ``torch_native`` with EAGLE drafts, and DFlash's verify step fails in it), in
float32: Triton's interpreter computes SGLang's Triton attention wrongly in bf16 (docs/serving.md).

Environment (CPU, no GPU; ~2 min):

    python -m venv ~/sglang-cpu && ~/sglang-cpu/bin/pip install torch==2.13.0
    ~/sglang-cpu/bin/pip install transformers==5.19.0 psutil requests pydantic numpy safetensors pillow \\
        scipy tqdm pyyaml
    ~/sglang-cpu/bin/pip install --no-deps sglang==0.5.23 orjson pybase64 triton starlette fastapi uvicorn \\
        uvloop msgspec pyzmq ipython traitlets aiohttp multidict attrs yarl propcache aiohappyeyeballs \\
        aiosignal frozenlist apache-tvm-ffi==0.1.11 sentencepiece compressed-tensors einops \\
        partial-json-parser opentelemetry-api setproctitle xgrammar==0.2.7 dill loguru gguf openai sniffio

    ~/sglang-cpu/bin/python tools/sglang_generate.py --target TARGET_DIR --prompts prompts.json \\
        --out sglang.json --k 1 --max-tokens 32 --draft eagle3=served/eagle3
"""

from __future__ import annotations

import gc
import importlib.machinery
import json
import os
import sys
import time
import types
from pathlib import Path

import torch

EMULATED = not torch.cuda.is_available()
# SGLang's scheduler and detokenizer processes are spawned: they run this file again as ``__mp_main__``,
# so the CPU changes (made at the end of this block of definitions) hold there too. Imported by name
# (the tests), it changes nothing.
RUN = __name__ in ("__main__", "__mp_main__")
if EMULATED and RUN:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports Triton


class _StandIn(types.ModuleType):
    """A module whose every attribute is another stand-in: enough for code that is imported, never run."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _StandIn(f"{self.__name__}.{name}")

    def __call__(self, *args, **kwargs):
        return _StandIn(f"{self.__name__}()")


def _stand_in(name: str, **attrs) -> None:
    mod = _StandIn(name)
    mod.__path__ = []
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod


def _never_called(*args, **kwargs):
    raise NotImplementedError("SGLang called vLLM's rotary kernel: this run would not be SGLang's own code")


def _cpu_changes() -> None:
    try:
        import torchvision  # noqa: F401
    except (ImportError, RuntimeError):
        from transformers.utils import import_utils

        import_utils.is_torchvision_available()  # cached as absent before the stand-in exists
        names = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional",
                 "torchvision.transforms.v2", "torchvision.io")
        for name in names:  # parents first: each child is set on its parent as it is made
            _stand_in(name)
            parent, _, child = name.rpartition(".")
            if parent:
                setattr(sys.modules[parent], child, sys.modules[name])
    try:
        import vllm._custom_ops  # noqa: F401
    except ImportError:
        _stand_in("vllm")
        _stand_in("vllm._custom_ops", rotary_embedding=_never_called)

    import sglang.kernels.ops.speculative.cache_locs as cache_locs
    import sglang.kernels.ops.speculative.spec_tree as spec_tree

    spec_tree._is_xpu = True
    cache_locs._is_xpu = True
    record_stream = torch.Tensor.record_stream

    def record_stream_cpu(self, stream):
        if self.device.type != "cpu":
            return record_stream(self, stream)

    torch.Tensor.record_stream = record_stream_cpu

    import sglang.srt.arg_groups.speculative_hook as speculative_hook
    from sglang.srt.model_executor.model_runner import ModelRunner

    speculative_hook.current_platform = _DFlashOnCpu(speculative_hook.current_platform)
    extend_kwargs = ModelRunner._extend_forward_kwargs

    def extend_kwargs_in_model_dtype(self, forward_batch, pp_proxy_tensors):
        kwargs = extend_kwargs(self, forward_batch, pp_proxy_tensors)
        if forward_batch.input_embeds is not None and forward_batch.replace_embeds is None:
            kwargs["input_embeds"] = forward_batch.input_embeds.to(self.dtype)
        return kwargs

    ModelRunner._extend_forward_kwargs = extend_kwargs_in_model_dtype


class _DFlashOnCpu:
    """SGLang's platform, as its speculative settings see it, with DFlash allowed on the CPU (triton drafts)."""

    def __init__(self, platform):
        self._platform = platform

    def __getattr__(self, name):
        return getattr(self._platform, name)

    def is_out_of_tree(self) -> bool:
        return True

    def supports_speculative_algorithm(self, algorithm: str) -> bool:
        return True

    def supports_speculative_draft_attention_backend(self, algorithm: str, backend: str) -> bool:
        return backend == "triton"

    def get_default_speculative_draft_attention_backend(self, algorithm: str) -> str:
        return "triton"


if EMULATED and RUN:
    _cpu_changes()


def counters(meta: dict, k: int) -> dict:
    """One request's speculative counters, as vllm_generate.py reports them."""
    rounds = int(meta.get("spec_verify_ct", 0))
    hist = list(meta.get("spec_correct_drafts_histogram") or [])
    hist += [0] * (k + 1 - len(hist))
    return {"drafts": rounds, "draft_tokens": int(meta.get("spec_num_proposed_drafts", rounds * k)),
            "accepted": int(meta.get("spec_num_correct_drafts", 0)),
            "accepted_per_pos": [sum(hist[j + 1:]) for j in range(k)]}


def architecture(draft: Path) -> str:
    """The export's model class, as SGLang reads it from config.json."""
    return json.loads((draft / "config.json").read_text()).get("architectures", [""])[0]


def run(target: str, draft: Path | None, k: int, prompts: list, max_tokens: int, dtype: str) -> dict:
    import sglang

    kw = dict(model_path=target, dtype=dtype, random_seed=0, max_running_requests=1, context_length=2048,
              disable_cuda_graph=True, log_level="warning", mem_fraction_static=0.5)
    if EMULATED:
        kw.update(device="cpu", attention_backend="torch_native")
    if draft is not None:
        kw.update(speculative_draft_model_path=str(draft))
        if "DFlash" in architecture(draft):
            kw.update(speculative_algorithm="DFLASH", speculative_dflash_block_size=k + 1)
        else:
            kw.update(speculative_algorithm="EAGLE3", speculative_num_steps=k, speculative_eagle_topk=1,
                      speculative_num_draft_tokens=k + 1)
        if EMULATED:
            kw.update(attention_backend="triton")
    engine = sglang.Engine(**kw)
    params = {"temperature": 0.0, "max_new_tokens": max_tokens}
    res = {"tokens": [], "drafts": [], "draft_tokens": [], "accepted": [], "accepted_per_pos": [], "wall_s": []}
    try:
        for ids in prompts:
            t0 = time.perf_counter()
            out = engine.generate(input_ids=[ids], sampling_params=params)[0]
            res["wall_s"].append(time.perf_counter() - t0)
            res["tokens"].append(list(out["output_ids"]))
            c = counters(out["meta_info"], k)
            for key in ("drafts", "draft_tokens", "accepted", "accepted_per_pos"):
                res[key].append(c[key])
    finally:
        engine.shutdown()
        gc.collect()
    return res


def main() -> None:
    from vllm_generate import read_cli  # its sibling (stdlib only at import): the same arguments and checks

    args, prompts, drafts = read_cli(__doc__, "speculative_num_steps (a chain: topk 1, k + 1 draft tokens)")
    for _, path in drafts:
        arch = architecture(path)
        if "Eagle3" not in arch and "DFlash" not in arch:
            raise SystemExit(f"{path / 'config.json'}: architectures {arch!r}: not an EAGLE-3 or DFlash draft")
    results = {"emulated": EMULATED}
    for name, path in [(None, None), *drafts]:
        results[name or "target"] = run(args.target, path, args.k, prompts, args.max_tokens, args.dtype)
        args.out.write_text(json.dumps(results))  # what finished is kept if a later engine fails
    print(f"wrote {args.out}: " + ", ".join(n for n in results if n != "emulated"))


if __name__ == "__main__":
    main()
