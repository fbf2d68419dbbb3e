"""The serving engines' weight loaders, applied to real exports: every exported tensor must land on
a parameter the engine's model defines, with that parameter's shape, and every parameter the engine
needs must be provided (or be one the engine takes from the target, like the embedding).

SGLang and vLLM need a GPU runtime and cannot be imported here. Instead, for each engine and format,
this file holds two small functions transcribed from the engine's source at a pinned commit (cited
above each one):

* ``*_params(cfg)``: the parameters the engine's draft model defines, built from the config.json the
  export wrote, the way the model's ``__init__`` builds its modules (fused ``qkv_proj`` /
  ``gate_up_proj`` with their shards, ``fc``, norms, ``lm_head``, the vocabulary map);
* ``*_route(name, params)``: the engine's ``load_weights`` name handling for one checkpoint tensor
  (``midlayer.`` -> ``layers.0.``, the ``model.`` prefix, ``stacked_params_mapping``, ``d2t`` /
  ``t2d``), returning the parameter and shard it lands on, or that the engine skips it.

Only these short naming rules are transcribed; shapes follow the module constructors. The commits
are those the stored-source index returned for each file (it holds several versions of a file,
including branch states); the names and shapes used here are the same in every stored version read.

Engines and formats: vLLM loads ``eagle3-hf``, ``speculators`` (both into ``Eagle3LlamaForCausalLM``)
and ``dflash`` (``DFlashQwen3ForCausalLM``); SGLang loads ``eagle3-hf`` (``LlamaForCausalLMEagle3``)
and ``dflash`` (``DFlashDraftModel``). SGLang has no loader for the ``speculators`` format at the
pinned version (``llama_eagle3.py``'s ``EntryClass`` is ``[LlamaForCausalLMEagle3]`` only, and its
loader would drop the ``layers.0.*`` names silently: see the negative controls).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.conftest import StubTokenizer, tiny_llama
from tests.test_export import BLOCK, VD, H, L, V, make_drafter
from vatspec.export import export_draft
from vatspec.target import Target

pytestmark = pytest.mark.usefixtures("one_thread")

SKIP = "skip"  # the engine's loader deliberately ignores the tensor (t2d, a dropped optional name)
NOWHERE = "nowhere"  # the loader finds no parameter for it (vLLM raises; SGLang drops it silently)


@dataclass(frozen=True)
class Param:
    """One parameter of the engine's draft model (logical shape: vLLM/SGLang pad vocab rows of
    ``VocabParallelEmbedding`` / ``ParallelLMHead`` internally, and their loaders check the logical
    row count). ``shards``: for fused parameters, rows per shard id, concatenated along dim 0."""

    shape: tuple[int, ...]
    shards: dict = field(default_factory=dict)
    integer: bool = False  # an index tensor (d2t), not weights
    from_target: bool = False  # the engine fills it from the target when the draft does not ship it
    optional: bool = False  # built by the engine, loaded only from another source (e.g. a .pt file)


def _geometry(c: dict) -> tuple[int, int, int, int, int]:
    H_, nh = c["hidden_size"], c["num_attention_heads"]
    nkv = c.get("num_key_value_heads") or nh
    hd = c.get("head_dim") or H_ // nh
    assert not c.get("attention_bias") and not c.get("mlp_bias"), "bias parameters are not modelled here"
    return H_, c["intermediate_size"], nh, nkv, hd


def _qkv(nh: int, nkv: int, hd: int, fan_in: int) -> Param:
    # QKVParallelLinear(fan_in, head_dim, total_num_heads, total_num_kv_heads): weight
    # [(nh + 2 nkv) hd, fan_in], loaded per shard "q" / "k" / "v".
    return Param(((nh + 2 * nkv) * hd, fan_in), {"q": nh * hd, "k": nkv * hd, "v": nkv * hd})


def _gate_up(I: int, H_: int) -> Param:
    # MergedColumnParallelLinear(H, [I, I]): weight [2 I, H], loaded per shard 0 (gate) / 1 (up).
    return Param((2 * I, H_), {0: I, 1: I})


STACKED_DOTTED = [  # (param_name, shard_name, shard_id), as both engines' EAGLE-3 loaders write it
    (".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1),
]


# ============================================================================ vLLM, EAGLE-3
# vllm-project/vllm vllm/transformers_utils/configs/speculators/base.py @ 052316aeab2a1b2a9076518f20fe776052b947c9
#   SpeculatorsConfig.extract_transformers_pre_trained_config: start from transformer_layer_config,
#   apply the algorithm's updater;
# vllm-project/vllm vllm/transformers_utils/configs/speculators/algos.py @ cfb173ab8e1b8e44dd35f8b5188255b6a03e13ec
#   update_eagle3: draft_vocab_size, target_hidden_size (if set), norm_before_residual (default True),
#   architectures = ["Eagle3LlamaForCausalLM"], eagle_aux_hidden_state_layer_ids (if set).
def vllm_eagle3_config(fmt: str, cfg: dict) -> dict:
    if fmt != "speculators":
        return dict(cfg)
    c = dict(cfg["transformer_layer_config"])
    c["draft_vocab_size"] = cfg.get("draft_vocab_size")
    if cfg.get("target_hidden_size") is not None:
        c["target_hidden_size"] = cfg["target_hidden_size"]
    c["norm_before_residual"] = cfg.get("norm_before_residual", True)
    c["architectures"] = ["Eagle3LlamaForCausalLM"]
    if cfg.get("eagle_aux_hidden_state_layer_ids"):
        c["eagle_aux_hidden_state_layer_ids"] = cfg["eagle_aux_hidden_state_layer_ids"]
    return c


# vllm-project/vllm vllm/model_executor/models/llama_eagle3.py @ 00bd1493b3e82d6c13c68ee8a0e1c5a96707e190
#   LlamaDecoderLayer.__init__ (qkv_proj input 2 H for layer 0, H after; hidden_norm), LlamaModel.__init__
#   (embed_tokens [vocab_size, H]; fc = ReplicatedLinear(3 * target_hidden_size -> H) when
#   eagle_config.use_aux_hidden_state is absent or true; norm), Eagle3LlamaForCausalLM.__init__
#   (lm_head = ParallelLMHead(draft_vocab_size, H); draft_id_to_target_id long [draft_vocab_size]).
#   The embedding is skipped when the draft ships none (skip_substrs "embed_tokens") and the proposer
#   shares the target's.
def vllm_eagle3_params(c: dict) -> dict[str, Param]:
    H_, I, nh, nkv, hd = _geometry(c)
    Vd = c.get("draft_vocab_size") or c["vocab_size"]
    Ht = c.get("target_hidden_size") or H_
    p = {"model.embed_tokens.weight": Param((c["vocab_size"], H_), from_target=True),
         "model.norm.weight": Param((H_,)), "lm_head.weight": Param((Vd, H_)),
         "draft_id_to_target_id": Param((Vd,), integer=True)}
    eagle = c.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state", True):
        p["model.fc.weight"] = Param((H_, 3 * Ht))
    for i in range(c["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        p |= {pre + "self_attn.qkv_proj.weight": _qkv(nh, nkv, hd, 2 * H_ if i == 0 else H_),
              pre + "self_attn.o_proj.weight": Param((H_, nh * hd)),
              pre + "mlp.gate_up_proj.weight": _gate_up(I, H_), pre + "mlp.down_proj.weight": Param((H_, I)),
              pre + "input_layernorm.weight": Param((H_,)), pre + "post_attention_layernorm.weight": Param((H_,)),
              pre + "hidden_norm.weight": Param((H_,))}
    return p


# Same file and commit: Eagle3LlamaForCausalLM.load_weights ("t2d" skipped; "d2t" renamed
# draft_id_to_target_id; "mask_hidden" skipped with a warning when parallel drafting is off; every
# name without "lm_head" gets "model."), then AutoWeightsLoader hands "model.*" to
# LlamaModel.load_weights ("midlayer." -> "layers.0."; stacked_params_mapping; params_dict[name],
# a KeyError for an unknown name; unknown top-level names raise in AutoWeightsLoader).
def vllm_eagle3_route(name: str, params: dict) -> tuple[str, object]:
    if "t2d" in name:
        return SKIP, None
    if "d2t" in name:
        name = name.replace("d2t", "draft_id_to_target_id")
    elif "mask_hidden" in name:
        return SKIP, None
    elif "lm_head" not in name:
        name = "model." + name
    if name.startswith("model."):
        inner = name[len("model."):]
        if "midlayer." in inner:
            inner = inner.replace("midlayer.", "layers.0.")
        for param_name, shard_name, shard in STACKED_DOTTED:
            if shard_name in inner:
                name, sid = "model." + inner.replace(shard_name, param_name), shard
                break
        else:
            name, sid = "model." + inner, None
    else:
        sid = None
    return (name, sid) if name in params else (NOWHERE, name)


# ============================================================================ SGLang, EAGLE-3
# sgl-project/sglang python/sglang/srt/models/llama_eagle3.py @ 03d5a7771f6082e7737a5f19cae7d1e863087013
#   LlamaDecoderLayer (qkv_proj = QKVParallelLinear(2 H, ...), mlp, hidden_norm; input_layernorm and
#   post_attention_layernorm from the Llama layer), LlamaModel (embed_tokens [vocab_size, H];
#   fc = nn.Linear(3 * target_hidden_size, H); midlayer; norm), LlamaForCausalLMEagle3.__init__
#   (lm_head = ParallelLMHead(draft_vocab_size, H) unless tie_word_embeddings, where it is the embedding).
#   The embedding comes from the target: sgl-project/sglang python/sglang/srt/models/llama.py
#   @ bf7a0e237e8d5b2ce5402f5d2fafce31e012dbdf LlamaForCausalLM.set_embed, called by the EAGLE worker.
#   "hot_token_id" is not a parameter: load_weights computes it from d2t (d2t + arange); it is required
#   here because the export's draft vocabulary is smaller than the target's.
def sglang_eagle3_params(c: dict) -> dict[str, Param]:
    H_, I, nh, nkv, hd = _geometry(c)
    assert c["num_hidden_layers"] == 1, "additional_layers (BasicDecoderLayer) are not modelled here"
    assert not c.get("tie_word_embeddings"), "a tied draft reads its lm_head from the embedding"
    Vd = c.get("draft_vocab_size") or c["vocab_size"]
    Ht = c.get("target_hidden_size") or H_
    pre = "model.midlayer."
    return {"model.embed_tokens.weight": Param((c["vocab_size"], H_), from_target=True),
            "model.fc.weight": Param((H_, 3 * Ht)),
            pre + "self_attn.qkv_proj.weight": _qkv(nh, nkv, hd, 2 * H_),
            pre + "self_attn.o_proj.weight": Param((H_, nh * hd)),
            pre + "mlp.gate_up_proj.weight": _gate_up(I, H_), pre + "mlp.down_proj.weight": Param((H_, I)),
            pre + "input_layernorm.weight": Param((H_,)), pre + "post_attention_layernorm.weight": Param((H_,)),
            pre + "hidden_norm.weight": Param((H_,)),
            "model.norm.weight": Param((H_,)), "lm_head.weight": Param((Vd, H_)),
            "hot_token_id": Param((Vd,), integer=True)}


# Same file and commit: LlamaForCausalLMEagle3.load_weights ("d2t" -> hot_token_id; "t2d" skipped;
# stacked: name.replace(shard, param), then "model."-prefixed unless the bare name is a parameter;
# regular: the name itself if a parameter, else "model." + name; a name found in neither is dropped
# without an error).
def sglang_eagle3_route(name: str, params: dict) -> tuple[str, object]:
    if "d2t" in name:
        return "hot_token_id", None
    if "t2d" in name:
        return SKIP, None
    for param_name, shard_name, shard in STACKED_DOTTED:
        if shard_name not in name:
            continue
        name = name.replace(shard_name, param_name)
        resolved = f"model.{name}" if name not in params else name
        return (resolved, shard) if resolved in params else (NOWHERE, name)
    resolved = name if name in params else f"model.{name}"
    return (resolved, None) if resolved in params else (NOWHERE, name)


# ============================================================================ vLLM, DFlash
# vllm-project/vllm vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py @ 0cfdd2e15d6991f354c6e22fd7f7e7577afe0424
#   get_eagle3_aux_layers_from_config: eagle_aux_hidden_state_layer_ids, else dflash_config.target_layer_ids + 1.
def vllm_aux_layers(c: dict) -> list[int] | None:
    ids = c.get("eagle_aux_hidden_state_layer_ids")
    if not ids and isinstance(c.get("dflash_config"), dict):
        ids = [i + 1 for i in (c["dflash_config"].get("target_layer_ids") or [])]
    return list(ids) if ids else None


def _dflash_layers(c: dict, prefix: str) -> dict[str, Param]:
    """The Qwen3-style DFlash decoder layers both engines build (fused qkv and gate_up, q/k norms)."""
    H_, I, nh, nkv, hd = _geometry(c)
    p: dict[str, Param] = {}
    for i in range(c["num_hidden_layers"]):
        pre = f"{prefix}layers.{i}."
        p |= {pre + "self_attn.qkv_proj.weight": _qkv(nh, nkv, hd, H_),
              pre + "self_attn.o_proj.weight": Param((H_, nh * hd)),
              pre + "self_attn.q_norm.weight": Param((hd,)), pre + "self_attn.k_norm.weight": Param((hd,)),
              pre + "mlp.gate_up_proj.weight": _gate_up(I, H_), pre + "mlp.down_proj.weight": Param((H_, I)),
              pre + "input_layernorm.weight": Param((H_,)), pre + "post_attention_layernorm.weight": Param((H_,))}
    return p


# vllm-project/vllm vllm/model_executor/models/qwen3_dflash.py @ 036a00d1f5d00d449d02dce9babdd15a5b4d06c9
#   DFlashQwen3Attention (qkv_proj [(nh + 2 nkv) hd, H], o_proj, per-head q_norm / k_norm [hd]),
#   DFlashQwen3DecoderLayer (Qwen3MLP = Qwen2MLP: gate_up_proj, down_proj; two norms),
#   DFlashQwen3Model.__init__ (embed_tokens deferred: built only when the checkpoint has one;
#   mask_embedding [H], loaded only from mask_embedding.pt; fc = ReplicatedLinear(target_hidden_size *
#   len(aux layers) -> H) (_get_dflash_fc_input_size); hidden_norm; norm),
#   DFlashQwen3ForCausalLM.__init__ (lm_head deferred: built only when the checkpoint has one, else the
#   target's; draft_id_to_target_id only when draft_vocab_size differs from the target's vocabulary).
def vllm_dflash_params(c: dict, target_vocab: int) -> dict[str, Param]:
    H_, I, nh, nkv, hd = _geometry(c)
    Vd = c.get("draft_vocab_size") or c["vocab_size"]
    Ht = c.get("target_hidden_size") or H_
    aux = vllm_aux_layers(c)
    drafter = dict(c.get("eagle_config") or {}) | dict(c.get("dflash_config") or {})
    p = {"model.embed_tokens.weight": Param((c["vocab_size"], H_), from_target=True),
         "lm_head.weight": Param((Vd, H_), from_target=True),
         "model.mask_embedding": Param((H_,), optional=True),
         "model.hidden_norm.weight": Param((H_,)), "model.norm.weight": Param((H_,))}
    if drafter.get("use_aux_hidden_state", c.get("use_aux_hidden_state", True)):
        p["model.fc.weight"] = Param((H_, Ht * (len(aux) if aux else c["num_hidden_layers"])))
    if Vd != target_vocab:
        p["draft_id_to_target_id"] = Param((Vd,), integer=True)
    p |= _dflash_layers(c, "model.")
    return p


# Same file and commit: DFlashQwen3ForCausalLM.load_weights ("mask_hidden" asserted absent; "t2d"
# skipped; "d2t" -> draft_id_to_target_id; "model." prefix unless "lm_head"; a WeightsMapper drops
# "mask_embedding" unless mask_embedding.pt was read, "embed_tokens" / "draft_id_to_target_id" unless
# present), then DFlashQwen3Model.load_weights with hf_to_vllm_mapper ("midlayer." -> "layers.0.",
# "encoder.output_norm_enc." -> "hidden_norm.", "encoder.fc." -> "fc."; ".q_proj" / ".k_proj" / ".v_proj"
# -> ".qkv_proj" shards, ".gate_proj" / ".up_proj" -> ".gate_up_proj" shards). AutoWeightsLoader raises
# on a name that matches no parameter.
VLLM_DFLASH_SUBSTR = {"midlayer.": "layers.0.", "encoder.output_norm_enc.": "hidden_norm.", "encoder.fc.": "fc."}
VLLM_DFLASH_STACKED = {".q_proj": (".qkv_proj", "q"), ".k_proj": (".qkv_proj", "k"), ".v_proj": (".qkv_proj", "v"),
                       ".gate_proj": (".gate_up_proj", 0), ".up_proj": (".gate_up_proj", 1)}


def vllm_dflash_route(name: str, params: dict, *, mask_embedding_pt: bool = False) -> tuple[str, object]:
    if "mask_hidden" in name:
        return NOWHERE, name  # an AssertionError in the engine
    if "t2d" in name:
        return SKIP, None
    if "d2t" in name:
        name = name.replace("d2t", "draft_id_to_target_id")
    elif "lm_head" not in name:
        name = "model." + name
    if "mask_embedding" in name and not mask_embedding_pt:
        return SKIP, None  # dropped by the outer WeightsMapper: only mask_embedding.pt sets it
    sid = None
    if name.startswith("model."):
        inner = name[len("model."):]
        for old, new in VLLM_DFLASH_SUBSTR.items():
            inner = inner.replace(old, new)
        for old, (new, shard) in VLLM_DFLASH_STACKED.items():
            if old in inner:
                inner, sid = inner.replace(old, new), shard
                break
        name = "model." + inner
    return (name, sid) if name in params else (NOWHERE, name)


# ============================================================================ SGLang, DFlash
# sgl-project/sglang python/sglang/srt/speculative/dflash_utils.py @ 00731f0bc9fa81c39802754fb4b62e9cce967582
#   parse_dflash_draft_config / DFlashDraftConfig.resolve_target_layer_ids: dflash_config.target_layer_ids
#   (or top-level target_layer_ids), else build_target_layer_ids(num_target_layers or draft layers, draft layers).
def sglang_dflash_layer_ids(c: dict) -> list[int]:
    d = c.get("dflash_config") or {}
    ids = d.get("target_layer_ids", c.get("target_layer_ids"))
    if ids is not None:
        return [int(i) for i in ids]
    n, t = c["num_hidden_layers"], d.get("num_target_layers", c.get("num_target_layers")) or c["num_hidden_layers"]
    return [t // 2] if n == 1 else [int(round(1 + i * (t - 4) / (n - 1))) for i in range(n)]


# sgl-project/sglang python/sglang/srt/models/dflash.py @ 003b23d7388eabdfbfecd2610c7e228f9f6a2734
#   DFlashAttention (qkv_proj [(nh + 2 nkv) hd, H], o_proj, q_norm / k_norm [hd]; RadixAttention and the
#   rotary embedding hold no parameters), DFlashMLP (gate_up_proj, down_proj), DFlashDecoderLayer,
#   DFlashDraftModel.__init__ (layers, norm, fc = ReplicatedLinear(len(target_layer_ids) * hidden_size
#   -> hidden_size): the *draft's* hidden size, hidden_norm). No embedding and no lm_head: the DFlash
#   worker embeds the block with the target's embedding and samples with the target's lm_head.
def sglang_dflash_params(c: dict) -> dict[str, Param]:
    H_, I, nh, nkv, hd = _geometry(c)
    p = {"norm.weight": Param((H_,)), "hidden_norm.weight": Param((H_,)),
         "fc.weight": Param((H_, len(sglang_dflash_layer_ids(c)) * H_))}
    p |= _dflash_layers(c, "")
    return p


# Same file and commit: DFlashDraftModel.load_weights (stacked_params_mapping without dots, matched as
# f".{weight_name}." and replaced with name.replace(weight_name, param_name); resolve_param_name: the name,
# the name without "model.", or "model." + name; an unresolved stacked name falls through to the regular
# path; an unresolved regular name is ignored without an error).
STACKED_PLAIN = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
                 ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]


def sglang_dflash_route(name: str, params: dict) -> tuple[str, object]:
    def resolve(n: str) -> str | None:
        if n in params:
            return n
        if n.startswith("model."):
            return n[len("model."):] if n[len("model."):] in params else None
        return f"model.{n}" if f"model.{n}" in params else None

    for param_name, weight_name, shard in STACKED_PLAIN:
        if f".{weight_name}." not in name:
            continue
        resolved = resolve(name.replace(weight_name, param_name))
        if resolved is None:
            continue
        return resolved, shard
    resolved = resolve(name)
    return (resolved, None) if resolved is not None else (NOWHERE, name)


# ============================================================================ the check
def engine_load(route, params: dict[str, Param], tensors: dict[str, tuple[tuple[int, ...], str]]) -> list[str]:
    """Apply an engine's routing to an export's tensors (name -> (shape, safetensors dtype)); return
    every problem: a tensor that lands nowhere, a wrong shape or kind, a shard loaded twice, a
    parameter the engine needs that nothing provides."""
    problems, loaded = [], {}
    for name, (shape, dtype) in sorted(tensors.items()):
        dest, shard = route(name, params)
        if dest == SKIP:
            continue
        if dest == NOWHERE:
            problems.append(f"{name}: lands nowhere (as {shard!r})")
            continue
        p = params[dest]
        if shard is None:
            want = p.shape
        elif shard in p.shards:
            want = (p.shards[shard], *p.shape[1:])
        else:
            problems.append(f"{name} -> {dest}: shard {shard!r} of a parameter without it")
            continue
        if tuple(shape) != want:
            problems.append(f"{name} -> {dest}[{shard}]: shape {list(shape)}, the engine's is {list(want)}")
        if p.integer != (dtype in ("I64", "I32")):
            problems.append(f"{name} -> {dest}: dtype {dtype} for an {'index' if p.integer else 'weight'} parameter")
        loaded.setdefault(dest, []).append(shard)
    for dest, p in params.items():
        got, need = loaded.get(dest, []), list(p.shards) if p.shards else [None]
        if not got and (p.from_target or p.optional):
            continue
        if sorted(map(repr, got)) != sorted(map(repr, need)):
            problems.append(f"{dest}: loaded {got}, the engine needs {need}")
    for dest, p in params.items():  # fused parameters: the shards tile the rows exactly
        assert not p.shards or sum(p.shards.values()) == p.shape[0], dest
    return problems


def read_tensors(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {n: (tuple(f.get_slice(n).get_shape()), f.get_slice(n).get_dtype()) for n in f.keys()}  # noqa: SIM118


# ============================================================================ exports of tiny drafters
@pytest.fixture(scope="module")
def target() -> Target:
    return Target(tiny_llama(vocab_size=V, hidden_size=H, layers=L, seed=0), StubTokenizer())


@pytest.fixture(scope="module")
def exports(target, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engines")
    e3, df = make_drafter("eagle3", target), make_drafter("dflash", target)
    return {"eagle3-hf": export_draft(e3, target, root / "hf"),
            "speculators": export_draft(e3, target, root / "spec", fmt="speculators"),
            "dflash": export_draft(df, target, root / "df")}


def _cfg(out: Path) -> dict:
    return json.loads((out / "config.json").read_text())


ENGINES = {  # (engine, format) -> (params from config.json, route)
    ("vllm", "eagle3-hf"): (lambda c: vllm_eagle3_params(vllm_eagle3_config("eagle3-hf", c)), vllm_eagle3_route),
    ("vllm", "speculators"): (lambda c: vllm_eagle3_params(vllm_eagle3_config("speculators", c)), vllm_eagle3_route),
    ("sglang", "eagle3-hf"): (sglang_eagle3_params, sglang_eagle3_route),
    ("vllm", "dflash"): (lambda c: vllm_dflash_params(c, target_vocab=V), vllm_dflash_route),
    ("sglang", "dflash"): (sglang_dflash_params, sglang_dflash_route),
}
CASES = [pytest.param(e, f, id=f"{e}-{f}") for e, f in ENGINES]
FIRST_QKV_AND_FC = {  # the first layer's fused qkv and the feature projection, by engine parameter name
    ("vllm", "eagle3-hf"): ("model.layers.0.self_attn.qkv_proj.weight", "model.fc.weight"),
    ("vllm", "speculators"): ("model.layers.0.self_attn.qkv_proj.weight", "model.fc.weight"),
    ("sglang", "eagle3-hf"): ("model.midlayer.self_attn.qkv_proj.weight", "model.fc.weight"),
    ("vllm", "dflash"): ("model.layers.0.self_attn.qkv_proj.weight", "model.fc.weight"),
    ("sglang", "dflash"): ("layers.0.self_attn.qkv_proj.weight", "fc.weight"),
}


@pytest.mark.parametrize("engine, fmt", CASES)
def test_every_exported_tensor_lands_on_an_engine_parameter(exports, engine, fmt):
    params_of, route = ENGINES[engine, fmt]
    cfg, tensors = _cfg(exports[fmt]), read_tensors(exports[fmt])
    params = params_of(cfg)
    assert engine_load(route, params, tensors) == []
    # the shapes the engines build from the config are the drafter's geometry, not just self-consistent
    c = vllm_eagle3_config(fmt, cfg) if fmt != "dflash" else cfg
    nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    qkv, fc = FIRST_QKV_AND_FC[engine, fmt]
    assert params[qkv].shape == ((nh + 2 * nkv) * hd, H if fmt == "dflash" else 2 * H)  # EAGLE-3: cat(embed, h)
    assert params[fc].shape == (H, (2 if fmt == "dflash" else 3) * H)  # DFlash: 2 target layers ([1, 5])
    if fmt != "dflash":  # EAGLE-3 ships its own reduced-vocabulary head and the map back to target ids
        assert params["lm_head.weight"].shape == (VD, H) and "t2d" in tensors
        assert route("t2d", params) == (SKIP, None)


def test_vllm_speculators_carries_the_verifier_embedding(exports, target):
    # PENDING the speculators export change (embed_tokens.weight, the target's input embedding, in the
    # speculators export): fails until that change is merged. vLLM's Eagle3LlamaForCausalLM.load_weights
    # (llama_eagle3.py @ 00bd1493b3e8) loads it into model.embed_tokens when present, and the speculators
    # library reads it; without it the library fills the parameter with uninitialised memory (issue #18).
    tensors, params = read_tensors(exports["speculators"]), vllm_eagle3_params(
        vllm_eagle3_config("speculators", _cfg(exports["speculators"])))
    assert "embed_tokens.weight" in tensors
    assert vllm_eagle3_route("embed_tokens.weight", params) == ("model.embed_tokens.weight", None)
    assert tensors["embed_tokens.weight"][0] == params["model.embed_tokens.weight"].shape == (V, H)
    emb = load_file(exports["speculators"] / "model.safetensors")["embed_tokens.weight"]
    assert torch.equal(emb, target.embed_tokens.weight.detach().to(emb.dtype))  # vLLM shares it when identical
    assert engine_load(vllm_eagle3_route, params, tensors) == []


def test_dflash_config_type_is_the_reference_loaders(exports):
    # PENDING the DFlash export change (config model_type "qwen3"): fails until that change is merged.
    # z-lab dflash 0.1.0 dflash/model.py: DFlashDraftModel.config_class = Qwen3Config, and transformers
    # warns when a config of another model_type instantiates it. vLLM's DFlashQwen3* (qwen3_dflash.py
    # @ 036a00d1f5d0) is written against Qwen3Config too; neither engine keys anything on model_type
    # (the model class comes from architectures ["DFlashDraftModel"]).
    from transformers import Qwen3Config

    cfg = _cfg(exports["dflash"])
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["model_type"] == Qwen3Config.model_type == "qwen3"


def test_config_fields_the_loaders_read(exports, target):
    """The config fields each loader reads to place the tensors and pick the target layers."""
    hf, spec, df = (_cfg(exports[f]) for f in ("eagle3-hf", "speculators", "dflash"))
    # vLLM, speculators: SpeculatorsConfig.validate_speculators_config (base.py @ 052316aeab2a) looks up
    # proposal_methods[0].speculative_tokens, verifier.name_or_path and transformer_layer_config
    # (the tiny target here has no path, so only the key is checked, as vLLM's validation does).
    sc = spec["speculators_config"]
    assert sc["proposal_methods"][0]["speculative_tokens"] >= 1 and "name_or_path" in sc["verifier"]
    assert isinstance(spec["transformer_layer_config"], dict)
    # update_eagle3 defaults norm_before_residual to True; the drafter adds the pre-norm residual
    assert vllm_eagle3_config("speculators", spec)["norm_before_residual"] is False
    # vLLM captures the stream *entering* layer j (llama.py @ e06c9ba2a6ea LlamaModel.forward); SGLang
    # adds 1 to eagle_config's ids (llama.py @ bf7a0e237e8d set_eagle3_layers_to_capture): the two
    # fields name the same layers, and both must be real layers of the target.
    sglang_ids = [i + 1 for i in hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
    for c in (hf, spec):
        assert vllm_aux_layers(c) == sglang_ids and all(0 < j < L for j in sglang_ids)
    # DFlash: vLLM reads eagle_aux_hidden_state_layer_ids first, dflash_config.target_layer_ids + 1
    # otherwise; SGLang reads dflash_config.target_layer_ids and adds 1: the same capture points.
    assert vllm_aux_layers(df) == [i + 1 for i in sglang_dflash_layer_ids(df)]
    assert all(0 <= i < L for i in sglang_dflash_layer_ids(df))
    # both engines embed the MASK slots with the target's embedding row dflash_config.mask_token_id
    # (SGLang dflash_worker.py @ 0468412fb7dc _resolve_mask_token_id: an id inside the target vocabulary)
    assert 0 <= df["dflash_config"]["mask_token_id"] < target.vocab_size
    assert df["block_size"] == BLOCK and df["is_causal"] is False


@pytest.mark.parametrize("fmt", ["eagle3-hf", "speculators", "dflash"])
def test_layer_ids_written_in_the_engines_capture_order(exports, fmt):
    # Both engines fill the feature list inside the target's layer loop (vLLM llama.py @ e06c9ba2a6ea
    # LlamaModel.forward: `if idx in self.aux_hidden_state_layers: aux_hidden_states.append(...)`;
    # SGLang llama.py @ bf7a0e237e8d LlamaModel.forward: `if i in self.layers_to_capture: ...`), so fc
    # sees the layers in increasing order whatever order the config lists them in.
    c = _cfg(exports[fmt])
    lists = [vllm_aux_layers(c)]
    lists.append(c["dflash_config"]["target_layer_ids"] if fmt == "dflash"
                 else c.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids") or lists[0])
    for ids in lists:
        assert ids == sorted(set(ids)), f"{fmt}: {ids} is not in capture (increasing layer) order"


# ============================================================================ negative controls
def _renamed(tensors: dict, old: str, new: str) -> dict:
    assert old in tensors
    return {(new if n == old else n): v for n, v in tensors.items()}


@pytest.mark.parametrize("engine, fmt", CASES)
def test_misnamed_misshaped_or_missing_tensors_are_caught(exports, engine, fmt):
    params_of, route = ENGINES[engine, fmt]
    cfg, tensors = _cfg(exports[fmt]), read_tensors(exports[fmt])
    params = params_of(cfg)
    prefix = {"eagle3-hf": "midlayer.", "speculators": "layers.0.", "dflash": "layers.1."}[fmt]

    # a misnamed projection lands nowhere, and its parameter's shard stays unloaded
    bad = engine_load(route, params, _renamed(tensors, prefix + "self_attn.k_proj.weight",
                                              prefix + "self_attn.key_proj.weight"))
    assert any("key_proj" in p and "lands nowhere" in p for p in bad)
    assert any("qkv_proj.weight: loaded" in p for p in bad)
    # a wrong shape (fc reading one target layer too few)
    shape, dtype = tensors["fc.weight"]
    bad = engine_load(route, params, tensors | {"fc.weight": ((shape[0], shape[1] - H), dtype)})
    assert bad and all("fc.weight" in p and "shape" in p for p in bad)
    # a missing tensor the engine cannot take from the target
    bad = engine_load(route, params, {n: v for n, v in tensors.items() if n != "norm.weight"})
    assert bad == [f"{'' if (engine, fmt) == ('sglang', 'dflash') else 'model.'}norm.weight: loaded [], "
                   "the engine needs [None]"]
    # a float tensor where the engine wants the index map
    if "d2t" in tensors:
        bad = engine_load(route, params, tensors | {"d2t": (tensors["d2t"][0], "F32")})
        assert bad and "dtype F32" in bad[0]


def test_speculators_names_do_not_load_in_sglang(exports):
    # SGLang's EAGLE-3 loader drops unknown names silently: the speculators layout (layers.0.*) would
    # leave the whole decoder layer at its initial values. The check sees every one of them.
    params = sglang_eagle3_params(vllm_eagle3_config("speculators", _cfg(exports["speculators"])))
    bad = engine_load(sglang_eagle3_route, params, read_tensors(exports["speculators"]))
    layer = [n for n in read_tensors(exports["speculators"]) if n.startswith("layers.0.")]
    assert len([p for p in bad if "lands nowhere" in p]) == len(layer) == 10  # q, k, v, o, gate, up, down, 3 norms
    assert {p.split(":")[0] for p in bad if "loaded []" in p} == {
        n for n in params if n.startswith("model.midlayer.")}


def test_a_mask_row_in_the_weights_file_is_not_read_by_vllm(exports, tmp_path):
    # vLLM (qwen3_dflash.py @ 036a00d1f5d0, DFlashQwen3ForCausalLM.load_weights) drops any
    # "mask_embedding" name from model.safetensors unless mask_embedding.pt was found and read:
    # a learned MASK row has to be shipped as that file, not inside the weights.
    params = vllm_dflash_params(_cfg(exports["dflash"]), target_vocab=V)
    assert vllm_dflash_route("mask_embedding", params) == (SKIP, None)
    assert vllm_dflash_route("mask_embedding", params, mask_embedding_pt=True) == ("model.mask_embedding", None)
    out = shutil.copytree(exports["dflash"], tmp_path / "df")
    w = load_file(out / "model.safetensors")
    w["mask_embedding"] = torch.zeros(H)
    save_file(w, out / "model.safetensors")
    assert engine_load(vllm_dflash_route, params, read_tensors(out)) == []  # loads, but without the row
    assert engine_load(lambda n, p: vllm_dflash_route(n, p, mask_embedding_pt=True), params, read_tensors(out)) == []
