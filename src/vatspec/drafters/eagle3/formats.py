"""EAGLE-3's served formats, written from the engines' own loaders:

=============  ======================================  ===========================================
format         config.json                             weights (no embedding: the target's)
=============  ======================================  ===========================================
eagle3-hf      LlamaConfig, LlamaForCausalLMEagle3     midlayer.*, fc, norm, lm_head, d2t, t2d
speculators    Eagle3Speculator + transformer_layer_   layers.0.*, fc, norm, lm_head, d2t, t2d,
               config + speculators_config             embed_tokens (the target's)
=============  ======================================  ===========================================

Layer ids: SGLang's ``eagle_config.eagle_aux_hidden_state_layer_ids`` are the output of layer i (SGLang adds 1
and captures the residual stream entering layer i + 1): written as ours. vLLM's top-level
``eagle_aux_hidden_state_layer_ids`` (both formats) are used as given, the stream *entering* layer j: written as
ours + 1. The defaults agree: outputs of 1, L//2-1, L-4 are SGLang's and vLLM's ``[2, L//2, L-3]``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors import safe_open
from torch import Tensor

from vatspec.drafters.eagle3.config import DEFAULT_TTT_STEPS, Eagle3Config, default_layer_ids, rope_from_config
from vatspec.drafters.layers import rope_parameters
from vatspec.drafters.served import (
    CONFIG,
    LLAMA_LAYER_KEYS,
    WEIGHTS,
    ConfigCheck,
    ExportError,
    Finding,
    ServedFormat,
    embedding_matches,
    engine_layer_order,
    fit,
    increasing,
    int_list,
    layer_fields,
    to_vllm_ids,
)
from vatspec.drafters.vocab import check_draft_vocab

EAGLE3_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
_EAGLE = frozenset({"draft_vocab_size", "target_hidden_size", "norm_before_residual",
                    "eagle_aux_hidden_state_layer_ids"})


class Eagle3Format(ServedFormat):
    """What both EAGLE-3 formats share: one Llama layer over 3 target layers, the draft vocabulary maps."""

    kind = "eagle3"
    layer_prefix: str  # the decoder layer's tensors: "midlayer." (as the drafter names them) or "layers.0."
    norm_before_residual = False  # what a config without the field means
    tensor_dtypes: ClassVar[dict[str, str]] = {"d2t": "I64", "t2d": "BOOL"}
    vllm_method = "eagle3"
    sglang_algorithm = "EAGLE3"
    sglang_note = "Chain drafting (`--speculative-eagle-topk 1`) is what training simulated."

    def _fields(self, drafter) -> dict:
        c = drafter.config
        return layer_fields(c, model_type="llama", num_layers=1, heads=c.num_heads, kv_heads=c.num_kv_heads)

    def _eagle(self, drafter) -> dict:
        c = drafter.config  # the residual is the pre-norm h (vLLM's speculators default is True)
        return {"draft_vocab_size": c.draft_vocab_size, "target_hidden_size": c.target_hidden_size,
                "norm_before_residual": False}

    # ------------------------------------------------------------------ a config.json
    def layer_ids(self, cfg: dict, num_layers: int) -> tuple[list[int], list[str]]:
        """SGLang's ``eagle_config`` ids, else vLLM's top-level ids - 1, else both engines' default."""
        vllm = cfg.get("eagle_aux_hidden_state_layer_ids")
        sglang = self._sglang_ids(cfg)
        if sglang is not None:
            ids = [int(i) for i in sglang]
            if vllm is not None and to_vllm_ids(ids) != [int(i) for i in vllm]:
                return ids, [f"eagle_config.eagle_aux_hidden_state_layer_ids {ids} (SGLang, output of layer i) and "
                             f"eagle_aux_hidden_state_layer_ids {vllm} (vLLM, input of layer j) disagree; using "
                             "SGLang's (SGLang and vLLM would read different layers)"]
            return ids, []
        if vllm is not None:
            return [int(i) - 1 for i in vllm], []
        return list(default_layer_ids(num_layers)), []

    def _sglang_ids(self, cfg: dict) -> list | None:
        return None

    def target_rope(self, target_config) -> tuple[float, dict | None]:
        """The draft is its own model: like the target where the engines serve its scaling as transformers
        computes it (linear, llama3, yarn), else plain at the target's theta (dynamic, longrope), as it trains."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # training said it once already
            return rope_from_config(target_config)

    # ------------------------------------------------------------------ export
    def check_exportable(self, drafter) -> None:
        c = drafter.config
        if len(c.target_layer_ids) != 3:
            raise ExportError(f"EAGLE-3 engines read exactly 3 target layers (fc: 3 * target_hidden_size); "
                              f"this draft uses {list(c.target_layer_ids)}")
        if c.hidden_act != "silu":
            raise ExportError(f"the engines' EAGLE-3 MLP is SiLU only; this draft was trained with hidden_act="
                              f"{c.hidden_act!r} (built before drafts were given SiLU whatever the target runs): "
                              "retrain it to serve it")

    def build_config(self, drafter, target, dtype: str, *, k: int | None = None, verifier: str | None = None,
                     mask_token_id: int | None = None) -> dict:
        if mask_token_id is not None:
            raise ExportError("--mask-token-id is for DFlash drafts")
        return self._config(drafter, target, dtype, sorted(int(i) for i in drafter.config.target_layer_ids),
                            k=k, verifier=verifier)

    def _config(self, drafter, target, dtype: str, ids: list[int], *, k: int | None, verifier: str | None) -> dict:
        raise NotImplementedError

    # ------------------------------------------------------------------ validation
    def expected_weights(self, cfg: dict) -> dict[str, tuple[int, ...]]:
        lc = self.layer_config(cfg)
        H, I, nh = lc["hidden_size"], lc["intermediate_size"], lc["num_attention_heads"]
        nkv, hd = lc.get("num_key_value_heads") or nh, lc.get("head_dim") or H // nh
        Ht = cfg.get("target_hidden_size") or H
        V, Vd = lc["vocab_size"], cfg["draft_vocab_size"]
        p = self.layer_prefix  # q/k/v read cat(embedding, hidden): 2H
        layer = {f"{p}self_attn.q_proj.weight": (nh * hd, 2 * H), f"{p}self_attn.k_proj.weight": (nkv * hd, 2 * H),
                 f"{p}self_attn.v_proj.weight": (nkv * hd, 2 * H), f"{p}self_attn.o_proj.weight": (H, nh * hd),
                 f"{p}mlp.gate_proj.weight": (I, H), f"{p}mlp.up_proj.weight": (I, H),
                 f"{p}mlp.down_proj.weight": (H, I), f"{p}input_layernorm.weight": (H,),
                 f"{p}post_attention_layernorm.weight": (H,), f"{p}hidden_norm.weight": (H,)}
        return {"fc.weight": (H, 3 * Ht), **layer, "norm.weight": (H,), "lm_head.weight": (Vd, H), "d2t": (Vd,),
                "t2d": (V,)}

    def check_config(self, cfg: dict, check: ConfigCheck) -> None:
        want, lc = check.want, self.layer_config(cfg)
        want(cfg["architectures"] == self.architectures,
             f"architectures {cfg['architectures']}, expected {self.architectures}")
        want(lc["num_hidden_layers"] == 1 and lc["model_type"] == "llama", "an EAGLE-3 draft is one llama layer")
        want(cfg["norm_before_residual"] is False, "norm_before_residual must be false (residual on the pre-norm h)")
        dv = cfg["draft_vocab_size"]
        want(isinstance(dv, int) and isinstance(lc["vocab_size"], int) and 1 <= dv <= lc["vocab_size"],
             f"draft_vocab_size {dv} must be in [1, vocab_size={lc['vocab_size']}]")
        vllm = cfg["eagle_aux_hidden_state_layer_ids"]
        want(int_list(vllm) and len(vllm) == 3 and min(vllm) >= 1,
             f"eagle_aux_hidden_state_layer_ids {vllm} must be 3 vLLM ids (input of layer j, so >= 1)")
        want(increasing(vllm), f"eagle_aux_hidden_state_layer_ids {vllm} must be distinct and increasing (the "
             "engines capture layers in the order they run)")

    def check_weights(self, tensor, bad: list[str]) -> None:
        try:
            check_draft_vocab(tensor("d2t"), tensor("t2d"))
        except ValueError as e:
            bad.append(f"{WEIGHTS}: d2t / t2d: {e}")

    # ------------------------------------------------------------------ import
    def read(self, folder: Path, cfg: dict, weights: dict[str, Tensor], target, *,
             k: int | None = None) -> tuple[Eagle3Config, dict[str, Tensor]]:
        """EAGLE-3's k (TTT steps): ``k``, else the speculators ``speculative_tokens``, else
        ``DEFAULT_TTT_STEPS`` (a training setting the HF format does not record). A draft over the whole
        target vocabulary may come without d2t / t2d: the identity maps."""
        src = str(folder / CONFIG)
        config = self._read_config(cfg, target, src, k)
        if "d2t" not in weights and "t2d" not in weights and config.draft_vocab_size == config.vocab_size:
            weights = {**weights, "d2t": torch.zeros(config.vocab_size, dtype=torch.long),
                       "t2d": torch.ones(config.vocab_size, dtype=torch.bool)}
        return config, weights

    def _read_config(self, cfg: dict, target, src: str, k: int | None) -> Eagle3Config:
        lc = cfg.get(self.layer_key) if self.layer_key else cfg
        if not isinstance(lc, dict):
            raise ExportError(f"{src}: {self.layer_key} is missing")
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
            if name not in lc:
                raise ExportError(f"{src}: {name} is missing")
        unsupported = {"num_hidden_layers": lc.get("num_hidden_layers", 1) != 1,
                       "norm_before_residual": bool(cfg.get("norm_before_residual", self.norm_before_residual)),
                       "attention_bias": bool(lc.get("attention_bias")), "mlp_bias": bool(lc.get("mlp_bias")),
                       "bias": bool(cfg.get("bias")), "norm_before_fc": bool(cfg.get("norm_before_fc")),
                       "fc_norm": bool(cfg.get("fc_norm")),
                       "use_aux_hidden_state": (cfg.get("eagle_config") or {}).get("use_aux_hidden_state",
                                                                                  True) is False}
        for name, hit in unsupported.items():
            if hit:
                raise ExportError(f"{src}: {name}={cfg.get(name, lc.get(name))!r} is an EAGLE-3 variant vatspec's "
                                  "drafter does not implement (one llama layer, residual on the pre-norm h, no biases)")
        H, V = lc["hidden_size"], lc["vocab_size"]
        fit(src, "vocab_size", V, target.vocab_size)
        fit(src, "target_hidden_size", cfg.get("target_hidden_size") or H, target.hidden_size)
        fit(src, "hidden_size (the draft shares the target's embedding)", H, target.hidden_size)
        ids, problems = self.layer_ids(cfg, target.num_layers)
        for problem in problems:
            warnings.warn(f"{src}: {problem}", stacklevel=4)
        ids = engine_layer_order(ids, src)
        if len(ids) != 3 or min(ids) < 0 or max(ids) >= target.num_layers:
            raise ExportError(f"{src}: layer ids {ids} (output of layer i) do not fit a {target.num_layers}-layer "
                              "target")
        k = k if k is not None else self.served_k(cfg)
        nh = lc["num_attention_heads"]
        theta, scaling = rope_parameters(lc)
        try:
            return Eagle3Config(
                hidden_size=H, target_hidden_size=cfg.get("target_hidden_size") or H, num_heads=nh,
                num_kv_heads=lc.get("num_key_value_heads") or nh, head_dim=lc.get("head_dim") or H // nh,
                intermediate_size=lc["intermediate_size"], rms_norm_eps=float(lc.get("rms_norm_eps", 1e-6)),
                rope_theta=theta, vocab_size=V, draft_vocab_size=cfg.get("draft_vocab_size") or V,
                target_layer_ids=ids, ttt_steps=int(k or DEFAULT_TTT_STEPS),
                max_position_embeddings=int(lc.get("max_position_embeddings", 2048)),
                hidden_act=lc.get("hidden_act", "silu"), rope_scaling=scaling,
            )
        except ValueError as e:
            raise ExportError(f"{src}: {e}") from e

    # ------------------------------------------------------------------ the model card
    def card_rows(self, cfg: dict, k: int) -> list[tuple[str, Any]]:
        vocab = f"{cfg['draft_vocab_size']} of the target's {self.layer_config(cfg)['vocab_size']}"
        return [("tokens drafted a round (k)", k), ("draft vocabulary", vocab)]

    def sglang_flags(self, k: int) -> str:
        return f"--speculative-num-steps {k} --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}"

    # ------------------------------------------------------------------ vatspec check
    def weight_findings(self, cfg: dict, tensors: dict[str, Tensor], target) -> list[Finding]:
        if "d2t" in tensors and "t2d" in tensors:
            try:
                check_draft_vocab(tensors["d2t"], tensors["t2d"])
            except ValueError as e:
                return [Finding(False, "vocab maps", f"d2t / t2d: {e}")]
            n, size = tensors["d2t"].numel(), cfg.get("draft_vocab_size")
            ok = size is None or n == size
            return [Finding(ok, "vocab maps", f"d2t / t2d consistent, {n} draft tokens" if ok else
                            f"d2t has {n} entries, draft_vocab_size is {size}")]
        if cfg.get("draft_vocab_size") not in (None, target.vocab_size):
            return [Finding(False, "vocab maps", f"draft_vocab_size {cfg['draft_vocab_size']} without d2t / t2d")]
        return []


class Eagle3HF(Eagle3Format):
    """``eagle3-hf``: SGLang's and vLLM's ``LlamaForCausalLMEagle3`` (a LlamaConfig at the top level)."""

    name = "eagle3-hf"
    tags = ("eagle3",)
    layer_prefix = "midlayer."
    architectures: ClassVar[list[str]] = ["LlamaForCausalLMEagle3"]
    config_keys = LLAMA_LAYER_KEYS | _EAGLE | {"architectures", "torch_dtype", "eagle_config"}

    def detect(self, cfg: dict) -> bool:
        archs = cfg.get("architectures") or []
        return cfg.get("speculators_model_type") is None and any(a in EAGLE3_ARCHS for a in archs)

    def _sglang_ids(self, cfg: dict) -> list | None:
        return (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")

    def _config(self, drafter, target, dtype: str, ids: list[int], *, k: int | None, verifier: str | None) -> dict:
        return {"architectures": list(self.architectures), **self._fields(drafter), "torch_dtype": dtype,
                **self._eagle(drafter),
                "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": ids},
                "eagle_aux_hidden_state_layer_ids": to_vllm_ids(ids)}

    def check_config(self, cfg: dict, check: ConfigCheck) -> None:
        super().check_config(cfg, check)
        if check.keys(cfg["eagle_config"], {"use_aux_hidden_state", "eagle_aux_hidden_state_layer_ids"},
                      "eagle_config"):
            ids, vllm = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"], cfg["eagle_aux_hidden_state_layer_ids"]
            check.want(cfg["eagle_config"]["use_aux_hidden_state"] is True,
                       "eagle_config.use_aux_hidden_state must be true")
            check.want(int_list(ids) and to_vllm_ids(ids) == vllm, f"eagle_config.eagle_aux_hidden_state_layer_ids "
                       f"{ids} (SGLang: output of layer i) must be eagle_aux_hidden_state_layer_ids {vllm} (vLLM: "
                       "input) - 1")


class Speculators(Eagle3Format):
    """``speculators``: vllm-project/speculators' ``Eagle3Speculator`` (the layer under ``transformer_layer_config``;
    the verifier's embedding carried, as the library fills a missing one with uninitialised memory when it loads,
    and vLLM shares the target's only when the two are equal)."""

    name = "speculators"
    tags = ("eagle3", "speculators")
    vllm_alone = True
    sglang_algorithm = None  # SGLang loads EAGLE-3 drafts as eagle3-hf only
    layer_prefix = "layers.0."
    layer_key = "transformer_layer_config"
    norm_before_residual = True  # vLLM's speculators default
    architectures: ClassVar[list[str]] = ["Eagle3Speculator"]
    config_keys = _EAGLE | {"speculators_model_type", "architectures", "torch_dtype", "transformer_layer_config",
                            "speculators_config"}

    def detect(self, cfg: dict) -> bool:
        if cfg.get("speculators_model_type") is None:
            return False
        if cfg["speculators_model_type"] != "eagle3":
            raise ExportError(f"speculators_model_type {cfg['speculators_model_type']!r} is not supported "
                              "(only 'eagle3')")
        return True

    def _config(self, drafter, target, dtype: str, ids: list[int], *, k: int | None, verifier: str | None) -> dict:
        """``k`` tokens drafted per round, written as ``speculative_tokens`` (default: ``drafter.k``, the TTT
        steps) and ``verifier``, the target name vLLM loads when serving the draft folder alone (default: the
        target's path)."""
        cfg = getattr(target.model, "config", None)
        proposal = {"proposal_type": "greedy", "speculative_tokens": int(k or drafter.k),
                    "verifier_accept_k": 1, "accept_tolerance": 0.0}
        verifier = {"name_or_path": verifier or target.path or getattr(cfg, "_name_or_path", None) or None,
                    "architectures": list(getattr(cfg, "architectures", None) or [])}
        return {"speculators_model_type": "eagle3", "architectures": list(self.architectures), "torch_dtype": dtype,
                "transformer_layer_config": self._fields(drafter), **self._eagle(drafter),
                "eagle_aux_hidden_state_layer_ids": to_vllm_ids(ids),
                "speculators_config": {"algorithm": "eagle3", "proposal_methods": [proposal],
                                       "default_proposal_method": "greedy", "verifier": verifier}}

    def served_state(self, drafter, target) -> dict[str, Tensor]:
        state = {self._served_name(n): v for n, v in super().served_state(drafter, target).items()}
        state["embed_tokens.weight"] = target.input_embedding()
        return state

    @staticmethod
    def _served_name(name: str) -> str:
        return "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name

    def internal_name(self, name: str) -> str:
        return "midlayer." + name[len("layers.0."):] if name.startswith("layers.0.") else name

    def expected_weights(self, cfg: dict) -> dict[str, tuple[int, ...]]:
        lc = self.layer_config(cfg)  # the target's embedding: the library does not load it from the verifier
        return {**super().expected_weights(cfg), "embed_tokens.weight": (lc["vocab_size"], lc["hidden_size"])}

    def check_config(self, cfg: dict, check: ConfigCheck) -> None:
        super().check_config(cfg, check)
        sc = cfg["speculators_config"]
        if not check.keys(sc, {"algorithm", "proposal_methods", "default_proposal_method", "verifier"},
                          "speculators_config"):
            return
        check.want(sc["algorithm"] == "eagle3" and sc["default_proposal_method"] == "greedy",
                   "speculators_config: algorithm 'eagle3', default_proposal_method 'greedy'")
        pm = sc["proposal_methods"]
        if isinstance(pm, list) and len(pm) == 1 and check.keys(pm[0], {"proposal_type", "speculative_tokens",
                                                                        "verifier_accept_k", "accept_tolerance"},
                                                                "speculators_config.proposal_methods[0]"):
            check.want(pm[0]["proposal_type"] == "greedy" and isinstance(pm[0]["speculative_tokens"], int)
                       and pm[0]["speculative_tokens"] >= 1, f"proposal_methods[0] {pm[0]}")
        else:
            check.want(False, "speculators_config.proposal_methods must hold one greedy method")
        check.keys(sc["verifier"], {"name_or_path", "architectures"}, "speculators_config.verifier")

    def check_fit(self, cfg: dict, weights: Path, target, bad: list[str]) -> None:
        with safe_open(str(weights), framework="pt") as f:
            emb = f.get_tensor("embed_tokens.weight")
        if not embedding_matches(emb, target):
            bad.append(f"{WEIGHTS}: embed_tokens.weight is not the target's input embedding")

    def served_k(self, cfg: dict) -> int | None:
        methods = (cfg.get("speculators_config") or {}).get("proposal_methods") or [{}]
        return methods[0].get("speculative_tokens")

    def named_target(self, cfg: dict) -> str | None:
        return ((cfg.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")

    def weight_findings(self, cfg: dict, tensors: dict[str, Tensor], target) -> list[Finding]:
        out = super().weight_findings(cfg, tensors, target)
        if not any(n.endswith("embed_tokens.weight") for n in tensors):
            out.insert(0, Finding(False, "embedding", "embed_tokens.weight is missing: the speculators library leaves "
                                  "a missing embedding uninitialised (it copies the verifier's only over a NaN "
                                  "placeholder)"))
        return out


EAGLE3_HF = Eagle3HF()
SPECULATORS = Speculators()
