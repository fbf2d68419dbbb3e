"""EAGLE-3 drafter: one Llama decoder layer over fused target features, trained by a test-time unroll.

Architecture (the served HF ``LlamaForCausalLMEagle3`` layout; parameter names are the export names)::

    h_0   = fc(cat(f_low, f_mid, f_high))                      fc: n*H_t -> H, no bias
    x     = cat(input_layernorm(embed(token)), hidden_norm(h)) [2H]; q/k/v read 2H
    h'    = h + o_proj(attn(x));  h_out = h' + mlp(post_attention_layernorm(h'))
    logits = lm_head(norm(h_out))                               over the draft vocabulary (d2t / t2d)
    h_out (pre-norm) is the next step's h.

``embed`` is the target's input embedding, frozen and deliberately *not* a submodule: it is not in
``state_dict()``, ``parameters()`` or DDP. ``attach_target`` keeps a reference.

Alignment of the training-time test (TTT) unroll of k = ``ttt_steps`` steps (checked against SpecForge
``specforge/core/eagle3.py``: ``target`` and ``input_ids`` are shifted left once before step 0 and
once more after every step, the hidden state is not shifted)::

    chain index t, step i = 0..k-1:
      reads   f_t (step 0 only, through fc) or its own step-(i-1) output at index t,
              and the teacher-forced token x_{t+1+i}; RoPE position t + i
      attends step-0 keys of indexes 0..t (causal), plus its own keys of steps 1..i at index t
      predicts x_{t+2+i}; the target distribution is the target's logits at t+1+i
      is supervised where ``loss_mask`` marks x_{t+2+i} (our loss_mask marks prediction
      targets; SpecForge shifts its own mask with input_ids, which differs only at span edges)

The step-0 keys are *not* shrunk by one diagonal per step, as early EAGLE/SpecForge code did
(SafeAILab/EAGLE#247, sgl-project/SpecForge#245; current SpecForge flex masks use ``q >= kv``):
with the full causal set, step i at index t is exactly what inference computes when the context
ends at t and i tokens have been drafted (``Eagle3Session``), which the tests check.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from transformers.activations import ACT2FN

from vatspec.drafters import DEFAULT_TTT_STEPS
from vatspec.drafters.base import AcceptHead, DraftOutput, Linear, SavedConfig, batch_field, distinct_layers
from vatspec.drafters.eagle3_session import Eagle3Session
from vatspec.drafters.layers import (
    MLP,
    RMSNorm,
    apply_rope,
    attention,
    draft_activation,
    rope_cos_sin,
    rope_init,
    rope_parameters,
)
from vatspec.drafters.vocab import check_draft_vocab

# RoPE scalings the draft carries from its target: those the engines' Llama layer (vLLM and SGLang ``get_rope``)
# computes for the draft's config.json as transformers does. Not ``dynamic`` (vLLM and SGLang rotate with one base
# for the whole context, transformers rescales it with the sequence length) nor ``longrope`` (a table switched by
# sequence length): with those the draft trains and is served with plain RoPE at the target's theta.
DRAFT_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# the keys of those types transformers' initialisers read (``modeling_rope_utils``); others are not carried
_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
              "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")


# ----------------------------------------------------------------------------- config
def default_layer_ids(num_layers: int, *, distinct: bool = False) -> tuple[int, int, int]:
    """Reference low/mid/high layers: outputs of layers ``1, L//2 - 1, L - 4`` (our layer ids), the engines'
    default. ``distinct`` (what training builds): a layer the formula repeats on a target under 7 layers
    moves up to the next one (``distinct_layers``)."""
    ids = (1, num_layers // 2 - 1, num_layers - 4)
    if min(ids) < 0 or max(ids) >= num_layers:
        raise ValueError(
            f"a {num_layers}-layer target is too shallow for the default EAGLE-3 layers {ids}; "
            "set drafter.target_layer_ids"
        )
    return tuple(distinct_layers(list(ids), num_layers, "EAGLE-3")) if distinct else ids


def rope_from_config(cfg) -> tuple[float, dict | None]:
    """``(rope_theta, rope_scaling | None)`` of the draft for a HF target config (``rope_parameters``).

    Keeps the scaling types of ``DRAFT_ROPE_TYPES`` (linear, llama3, yarn: gpt-oss, DeepSeek-V3, Qwen3 long
    context) and their keys, so the draft rotates as its target in training, in its export and in ``check``;
    others are dropped with a warning, and the draft trains and is exported with plain RoPE (it is its own
    model: it only has to agree with its served config, not with the target's RoPE).
    """
    theta, scaling = rope_parameters(cfg)
    if scaling is None:
        return theta, None
    rope_type = scaling["rope_type"]
    if rope_type not in DRAFT_ROPE_TYPES:
        warnings.warn(
            f"target RoPE scaling {rope_type!r} is not one the engines serve an EAGLE-3 draft with as transformers "
            f"computes it ({', '.join(DRAFT_ROPE_TYPES[1:])}); the draft uses plain RoPE",
            stacklevel=2,
        )
        return theta, None
    return theta, {"rope_type": rope_type, **{key: scaling[key] for key in _ROPE_KEYS if key in scaling}}


@dataclass(frozen=True)
class Eagle3Config(SavedConfig):
    """Everything that shapes an EAGLE-3 draft; saved with every checkpoint (``to_dict``)."""

    hidden_size: int
    target_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int  # target vocabulary V
    draft_vocab_size: int  # Vd <= V
    target_layer_ids: tuple[int, ...]  # our convention: output of decoder layer i
    ttt_steps: int = DEFAULT_TTT_STEPS  # the reference trainers' name; everything downstream reads ``k``
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"  # ``from_target`` builds SiLU; another loads (an older checkpoint) but is not exported
    rope_scaling: dict | None = field(default=None, hash=False)  # {"rope_type": "linear"|"llama3"|"yarn", ...}

    def __post_init__(self):
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        problems = []
        if not self.target_layer_ids:
            problems.append("target_layer_ids is empty")
        if self.num_heads % self.num_kv_heads:
            problems.append(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            problems.append(f"head_dim={self.head_dim} must be even for RoPE")
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            problems.append(f"draft_vocab_size={self.draft_vocab_size} must be in [1, vocab_size={self.vocab_size}]")
        if self.ttt_steps < 1:
            problems.append(f"ttt_steps={self.ttt_steps} must be >= 1")
        if self.hidden_act not in ACT2FN:
            problems.append(f"hidden_act={self.hidden_act!r} is not a known activation")
        rt = (self.rope_scaling or {}).get("rope_type", "default")
        if rt not in DRAFT_ROPE_TYPES:
            problems.append(f"rope_scaling.rope_type={rt!r} is not one of {DRAFT_ROPE_TYPES}")
        if problems:
            raise ValueError("Eagle3Config: " + "; ".join(problems))

    @classmethod
    def from_target(
        cls,
        target,
        draft_vocab_size: int = 32000,
        ttt_steps: int = DEFAULT_TTT_STEPS,
        target_layer_ids: Sequence[int] | None = None,
    ) -> Eagle3Config:
        """Reference shapes for ``target``: draft width = target width, the target's attention
        geometry, MLP size, norm eps and RoPE (``rope_from_config``); draft vocabulary capped by the
        target's. The MLP runs SiLU whatever the target's does (``draft_activation``): the engines'
        EAGLE-3 layer runs nothing else."""
        cfg = target.config
        ids = (tuple(target_layer_ids) if target_layer_ids is not None
               else default_layer_ids(target.num_layers, distinct=True))
        target.check_layer_ids(ids)
        H = int(target.hidden_size)
        nh = int(cfg.num_attention_heads)
        nkv = int(getattr(cfg, "num_key_value_heads", None) or nh)
        theta, scaling = rope_from_config(cfg)
        return cls(
            hidden_size=H,
            target_hidden_size=H,
            num_heads=nh,
            num_kv_heads=nkv,
            head_dim=int(getattr(cfg, "head_dim", None) or H // nh),
            intermediate_size=int(cfg.intermediate_size),
            rms_norm_eps=float(getattr(cfg, "rms_norm_eps", None) or 1e-6),
            rope_theta=theta,
            vocab_size=int(target.vocab_size),
            draft_vocab_size=min(int(draft_vocab_size), int(target.vocab_size)),
            target_layer_ids=ids,
            ttt_steps=int(ttt_steps),
            max_position_embeddings=int(getattr(cfg, "max_position_embeddings", None) or 2048),
            hidden_act=draft_activation(cfg, "EAGLE-3"),
            rope_scaling=scaling,
        )

    @property
    def k(self) -> int:
        """Drafted positions per chain (training) and per decode round: the TTT steps."""
        return self.ttt_steps


# ----------------------------------------------------------------------------- layers
class Attention(nn.Module):
    """Llama attention whose q/k/v read the 2H concat; the score pattern is the caller's (``attend``)."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.num_kv_heads = c.num_kv_heads
        self.groups = c.num_heads // c.num_kv_heads
        self.head_dim = c.head_dim
        self.q_proj = Linear(2 * c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = Linear(2 * c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = Linear(2 * c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, T, 2H] -> q [B, nkv, g, T, hd] (RoPE), k [B, nkv, T, hd] (RoPE), v [B, nkv, T, hd].

        Query head ``j * g + r`` shares kv head ``j`` (HF ``repeat_kv`` order)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_kv_heads, self.groups, self.head_dim).permute(0, 2, 3, 1, 4)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


class DecoderLayer(nn.Module):
    """The EAGLE-3 midlayer. ``attend(q, k, v) -> [B, nkv, g, T, hd]`` decides which keys each
    query sees (the TTT pattern in training, a KV cache at inference)."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c.hidden_size, c.intermediate_size, c.hidden_act)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, emb: Tensor, h: Tensor, cos: Tensor, sin: Tensor, attend) -> Tensor:
        """emb [B, T, H] token embeddings, h [B, T, H] hidden input -> pre-norm output [B, T, H]."""
        B, T, _ = h.shape
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(h)], dim=-1)  # [B, T, 2H]
        q, k, v = self.self_attn.qkv(x, cos, sin)
        a = attend(q, k, v).permute(0, 3, 1, 2, 4).reshape(B, T, -1)  # [B, T, nh*hd]
        h = h + self.self_attn.o_proj(a)  # residual on the pre-norm h
        return h + self.mlp(self.post_attention_layernorm(h))


class _UnrollAttend:
    """Keys of a TTT unroll: step 0's for every index (causal), later steps' per index (diagonal)."""

    def __init__(self, visible: Tensor):
        self.visible = visible  # bool [B, 1, 1, T, T]
        self.k0: Tensor | None = None
        self.v0: Tensor | None = None
        self.k_diag: list[Tensor] = []
        self.v_diag: list[Tensor] = []

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if self.k0 is None:
            self.k0, self.v0 = k, v
            return attention(q, k, v, self.visible)
        self.k_diag.append(k)
        self.v_diag.append(v)
        k_diag = torch.stack(self.k_diag, dim=-2)  # [B, nkv, T, i, hd]
        v_diag = torch.stack(self.v_diag, dim=-2)
        return attention(q, self.k0, self.v0, self.visible, k_diag, v_diag)


# ----------------------------------------------------------------------------- drafter
class Eagle3Drafter(nn.Module):
    """EAGLE-3 draft model. Training: ``training_forward``; inference: ``new_session``."""

    kind = "eagle3"
    schedule = "eagle3"  # fixed-weight curve of the losses: 0.8 ** j at 0-based position j

    def __init__(self, config: Eagle3Config):
        super().__init__()
        c = config
        self.config = c
        self.hidden_size = c.hidden_size
        self.fc = Linear(len(c.target_layer_ids) * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = DecoderLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        # Identity map over the first Vd ids until set_vocab installs the real one.
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[: c.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        # transformers' own initialisers: the frequencies and the factor cos / sin are scaled by (YaRN's
        # attention factor; 1 otherwise). Kept out of buffers so .to(bfloat16) never rounds the frequencies.
        self._inv_freq, self._rope_scale = rope_init(c.head_dim, c.rope_theta, c.rope_scaling,
                                                     c.max_position_embeddings)
        self._inv_freq_by_device: dict[torch.device, Tensor] = {}
        object.__setattr__(self, "_embed", None)  # the target's embedding: a reference, not a submodule
        object.__setattr__(self, "_target_head", None)  # the target's hidden -> logits, a reference too

    @classmethod
    def from_target(cls, target, **config_kw) -> Eagle3Drafter:
        """``Eagle3Config.from_target(target, **config_kw)``, built and attached to ``target``."""
        drafter = cls(Eagle3Config.from_target(target, **config_kw))
        drafter.attach_target(target)
        return drafter

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.config.target_layer_ids

    @property
    def k(self) -> int:
        """Drafted positions per chain and per decode round (``config.k``)."""
        return self.config.k

    def __deepcopy__(self, memo: dict) -> Eagle3Drafter:
        """Copies share the target's embedding instead of duplicating it."""
        if self._embed is not None:
            memo[id(self._embed)] = self._embed
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            object.__setattr__(new, key, copy.deepcopy(value, memo))
        return new

    # --------------------------------------------------------------- target, vocabulary
    def attach_target(self, target) -> None:
        """Keep a reference to the target's frozen input embedding (a ``Target`` or the module)."""
        emb = target.embed_tokens if hasattr(target, "embed_tokens") else target
        w = getattr(emb, "weight", None)
        if w is None or tuple(w.shape) != (self.config.vocab_size, self.config.hidden_size):
            shape = None if w is None else tuple(w.shape)
            raise ValueError(
                f"target embedding {shape} does not fit the draft "
                f"(vocab_size={self.config.vocab_size}, hidden_size={self.config.hidden_size})"
            )
        object.__setattr__(self, "_embed", emb)
        object.__setattr__(self, "_target_head", getattr(target, "logits", None))  # Target.logits, for chunking

    def set_vocab(self, d2t: Tensor, t2d: Tensor) -> None:
        """Install a draft vocabulary (``vocab.build_draft_vocab``): d2t [Vd] long, t2d [V] bool."""
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(
                f"set_vocab: d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)} do not fit the draft "
                f"(expected {tuple(self.d2t.shape)} / {tuple(self.t2d.shape)})"
            )
        check_draft_vocab(d2t, t2d)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    @torch.no_grad()
    def embed(self, ids: Tensor) -> Tensor:
        """Frozen target embedding of target-vocabulary ids: [...] -> [..., H] in the draft's dtype."""
        if self._embed is None:
            raise RuntimeError("Eagle3Drafter has no target embedding: call attach_target(target) first")
        w = self._embed.weight
        out = self._embed(ids.to(w.device))
        return out.to(device=self.fc.weight.device, dtype=self.fc.weight.dtype)

    def _rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions [T] long -> cos, sin [T, hd] in the draft's dtype (computed in float32)."""
        dev = positions.device
        inv = self._inv_freq_by_device.get(dev)
        if inv is None:
            inv = self._inv_freq_by_device[dev] = self._inv_freq.to(dev)
        cos, sin = rope_cos_sin(positions, inv)  # [T, hd] float32
        dt = self.fc.weight.dtype
        return (cos * self._rope_scale).to(dt), (sin * self._rope_scale).to(dt)

    # --------------------------------------------------------------- training
    def forward(self, batch, tout, *, with_logits: bool = True) -> DraftOutput:
        return self.training_forward(batch, tout, with_logits=with_logits)

    def training_forward(self, batch, tout, *, with_logits: bool = True) -> DraftOutput:
        """The TTT unroll over every chain index of the batch (module docstring: alignment). One function: the
        unroll's steps share the keys, masks and RoPE tables it builds, in the order the reference runs them.

        batch: ``input_ids`` [B, T] long, ``attention_mask`` [B, T], ``loss_mask`` [B, T] bool
               (True = token t is a prediction target); a mapping or an object with those fields.
        tout:  ``TargetOutput`` with ``features`` [B, T, n*H_t] of ``target_layer_ids`` and
               full ``logits`` [B, T, V].

        Returns a ``DraftOutput`` over chains t = 0 .. T' - 1, T' = T - 2: every chain start whose
        step-0 label x_{t+2} exists, so each supervised token (the end-of-turn tokens at the end of a
        sequence included) is step 0 of one chain. Steps whose label would lie past the sequence
        end (t + 2 + i >= T, the last k - 2 chains) are computed on padding and are invalid.
          logits        [B, T', k, Vd]  draft logits (the draft's dtype)
          hidden        [B, T', k, H]   the *post-norm* final hidden state (what lm_head and the
                                        accept head read)
          target_logits [B, T', k, V]   [b, t, i] = logits[b, t + 1 + i] where t + 1 + i < T, zeros
                                        past the end: a strided view (k <= 2: of ``tout.logits``
                                        itself; else of one copy of its rows 1.. padded with k - 2
                                        zero rows, i.e. [B, T + k - 3, V], never [B, T', k, V])
          valid         [B, T', k]      prefix mask (cumprod over i) of: indexes t and t+1 are real
                                        tokens, label position t+2+i < T, attention_mask and
                                        loss_mask true there
        Whether the target's argmax lies in the draft vocabulary is left to the losses (t2d).
        ``with_logits=False`` (the chunked loss path, ``vatspec.objective.chunked``): no logits and no padded
        copy; ``lm_head`` is the lm_head weight, ``target_logits`` is ``tout.logits`` as rows
        [B*T, V] (or, when the target ran without logits, ``tout.hidden`` as rows [B*T, H_t] with
        ``target_head`` = the target's ``logits``) and ``target_index`` [B, T', k] = b*T + t + 1 + i
        (clamped to the last row where past the end: those positions are invalid).
        """
        input_ids = batch_field(batch, "input_ids")
        B, T = input_ids.shape
        attention_mask = batch_field(batch, "attention_mask", required=False)
        am = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        lm = batch_field(batch, "loss_mask").bool()
        k = self.config.k
        Tc = T - 2  # chain starts t with a step-0 label x_{t+2}
        if Tc < 1:
            raise ValueError(
                f"training_forward: sequence length {T} must be at least 3 (chain t reads f_t and x_t+1 "
                "and predicts x_t+2)"
            )
        feats, logits_t = tout.features, tout.logits
        n_feat = len(self.target_layer_ids) * self.config.target_hidden_size
        if feats is None or tuple(feats.shape) != (B, T, n_feat):
            shape = None if feats is None else tuple(feats.shape)
            raise ValueError(f"tout.features {shape} must be [B, T, {n_feat}] = ({B}, {T}, {n_feat})")
        need = with_logits or logits_t is not None  # chunked: the target may run without logits
        if need and (logits_t is None or tuple(logits_t.shape) != (B, T, self.config.vocab_size)):
            shape = None if logits_t is None else tuple(logits_t.shape)
            raise ValueError(f"tout.logits {shape} must be full [B, T, V] = ({B}, {T}, {self.config.vocab_size})")
        assert am.shape == lm.shape == (B, T), f"masks {tuple(am.shape)} / {tuple(lm.shape)} vs input_ids {(B, T)}"

        dev = self.fc.weight.device
        am, lm, input_ids = am.to(dev), lm.to(dev), input_ids.to(dev)
        pad = max(0, k - 2)  # rows read past the sequence end: step k - 1 of chain T' - 1 reads x_{T+k-3}
        # 1. inputs: h_0 = fc(f_t); step i at index t reads x_{t+1+i} = emb[:, t+i]. Past x_{T-1} the
        # embedding is zero; only (t, i) with t + 1 + i >= T read it, and those are invalid, as is
        # everything that sees them: their keys (steps >= 1) are seen only by later steps of the
        # same chain (the diagonal), and step 0, whose keys every later index sees, never reads padding.
        h = self.fc(feats[:, :Tc].to(device=dev, dtype=self.fc.weight.dtype))  # [B, T', H]
        emb = torch.nn.functional.pad(self.embed(input_ids[:, 1:]), (0, 0, 0, pad))  # [B, T-1+pad, H]
        # 2. step-0 keys: causal over real tokens; a query always sees its own key (no empty rows)
        idx = torch.arange(Tc, device=dev)
        causal = idx[None, :] <= idx[:, None]  # [T'(query), T'(key)]
        own = idx[None, :] == idx[:, None]
        visible = causal & (am[:, None, :Tc] | own)  # [B, T', T']
        attend = _UnrollAttend(visible[:, None, None])  # [B, 1, 1, T', T']
        # 3. unroll: the pre-norm output is the next step's h
        logits, hidden = [], []
        for i in range(k):
            cos, sin = self._rope(idx + i)  # RoPE position t + i
            h = self.midlayer(emb[:, i : i + Tc], h, cos, sin, attend)
            hn = self.norm(h)
            hidden.append(hn)
            if with_logits:
                logits.append(self.lm_head(hn))
        # 4. targets and supervision, aligned to [b, t, i]. Rows t + 1 + i run to T + k - 3, k - 2 past
        # the end: a strided view cannot reach past its storage, so for k > 2 the rows are copied
        # once with zero padding ([B, T + k - 3, V], the logits' own size plus k - 2 rows); zeros,
        # not -inf, keep the unused softmaxes finite (a NaN there would reach the gradient).
        with torch.no_grad():
            sup = torch.nn.functional.pad(am & lm, (0, k - 1), value=False)  # [B, T+k-1], out of range = False
            label_ok = sup[:, 2:].unfold(1, k, 1)  # [B, T', k]: sup at t + 2 + i
            start_ok = am[:, :Tc] & am[:, 1 : Tc + 1]  # [B, T']: f_t and x_{t+1} are real
            valid = (start_ok[..., None] & label_ok).long().cumprod(-1).bool()
        if not with_logits:
            step = idx[:, None] + 1 + torch.arange(k, device=dev)  # [T', k] t + 1 + i
            index = torch.arange(B, device=dev)[:, None, None] * T + step.clamp(max=T - 1)  # [B, T', k]
            head = None
            if logits_t is None:
                if self._target_head is None:
                    raise ValueError("tout.logits is None and the drafter was attached to no Target (its logits)")
                logits_t, head = tout.hidden, self._target_head
            return DraftOutput(
                logits=None, hidden=torch.stack(hidden, dim=2), target_logits=logits_t.reshape(B * T, -1),
                valid=valid, lm_head=self.lm_head.weight, target_index=index, target_head=head,
                target_vocab_size=self.config.vocab_size,
            )
        rows = logits_t[:, 1:]  # [B, T-1, V]
        if pad:
            rows = torch.nn.functional.pad(rows, (0, 0, 0, pad))  # [B, T-1+pad, V]
        target_logits = rows.unfold(1, k, 1)[:, :Tc].transpose(-1, -2)  # [B, T', k, V], a view of rows
        return DraftOutput(
            logits=torch.stack(logits, dim=2),
            hidden=torch.stack(hidden, dim=2),
            target_logits=target_logits,
            valid=valid,
        )

    # --------------------------------------------------------------- inference
    def new_session(self, head: AcceptHead | None = None, exit_threshold: float | None = None) -> Eagle3Session:
        """An inference session for one sequence (batch size 1). See ``Eagle3Session``."""
        return Eagle3Session(self, head=head, exit_threshold=exit_threshold)
