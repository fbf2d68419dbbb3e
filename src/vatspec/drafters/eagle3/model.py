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

import torch
from torch import Tensor, nn

from vatspec.drafters.base import AcceptHead, Drafter, DraftOutput, batch_field
from vatspec.drafters.eagle3.config import Eagle3Config, default_layer_ids
from vatspec.drafters.eagle3.formats import EAGLE3_HF, SPECULATORS
from vatspec.drafters.eagle3.session import Eagle3Session
from vatspec.drafters.layers import MLP, RMSNorm, apply_rope, attention, rope_cos_sin, rope_init
from vatspec.drafters.vocab import build_draft_vocab, check_draft_vocab, target_ids


# ----------------------------------------------------------------------------- layers
class Attention(nn.Module):
    """Llama attention whose q/k/v read the 2H concat; the score pattern is the caller's (``attend``)."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.num_kv_heads = c.num_kv_heads
        self.groups = c.num_heads // c.num_kv_heads
        self.head_dim = c.head_dim
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)

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
class Eagle3Drafter(Drafter):
    """EAGLE-3 draft model. Training: ``training_forward``; inference: ``new_session``."""

    kind = "eagle3"
    title = "EAGLE-3"
    config_class = Eagle3Config
    schedule = "eagle3"  # fixed-weight curve of the losses: 0.8 ** j at 0-based position j
    baseline_loss = "eagle3"  # soft CE on that curve (SpecForge)
    reference_optim = {"lr": 1e-4, "warmup_ratio": 0.015, "grad_clip": 0.5}  # SpecForge's EAGLE-3 recipe
    formats = (EAGLE3_HF, SPECULATORS)
    fixed_depth = 1  # one decoder layer, the engines' EAGLE-3 layout

    def __init__(self, config: Eagle3Config):
        super().__init__()
        c = config
        self.config = c
        self.hidden_size = c.hidden_size
        self.fc = nn.Linear(len(c.target_layer_ids) * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = DecoderLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
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

    @classmethod
    def build(cls, cfg, target, token_counts: Tensor | None = None) -> Eagle3Drafter:
        """A new drafter over the ``cfg.draft_vocab_size`` most frequent of ``token_counts`` (all ids alike
        without counts); ``cfg.init_lm_head``: its lm_head and norm start as the target's."""
        layer_ids = list(cfg.target_layer_ids) if cfg.target_layer_ids else None
        drafter = cls.from_target(target, draft_vocab_size=cfg.draft_vocab_size, ttt_steps=cfg.ttt_steps,
                                  target_layer_ids=layer_ids)
        if token_counts is None:
            token_counts = torch.ones(target.vocab_size, dtype=torch.long)
        drafter.set_vocab(*build_draft_vocab(token_counts, drafter.config.draft_vocab_size))
        if cfg.init_lm_head:
            drafter.init_lm_head_from_target(target)
        return drafter

    @classmethod
    def default_layer_ids(cls, num_target_layers: int, num_layers: int = 1) -> list[int]:
        """The engines' low / mid / high layers (``default_layer_ids``); one set whatever ``num_layers``."""
        return list(default_layer_ids(num_target_layers, distinct=True))

    @classmethod
    def config_with_k(cls, config: dict, k: int) -> dict:
        """k is the unroll length (``ttt_steps``): no parameter depends on it."""
        return {**config, "ttt_steps": int(k)}

    def init_mismatch(self, cfg, vocab_size: int) -> str | None:
        have, want = self.config.draft_vocab_size, min(cfg.draft_vocab_size, vocab_size)
        if have != want:
            return (f"drafts over {have} tokens, but drafter.draft_vocab_size={want}; pass "
                    f"drafter.draft_vocab_size={have}")
        return None

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
    def init_lm_head_from_target(self, target) -> None:
        """Option ``drafter.init_lm_head``: copy the target's output rows of the draft vocabulary into ``lm_head``
        and the target's final norm into ``norm``, so the draft starts in the target's output space.
        (The reference initialises both randomly, and so does this project by default: on SmolLM2 this
        start learned slower than random; docs/results.md, "Every lever at a glance".)"""
        rows = target_ids(self.d2t)
        self.lm_head.weight.copy_(target.lm_head.weight[rows.to(target.lm_head.weight.device)])
        final_norm = getattr(getattr(target.model, "model", None), "norm", None)
        gemma_style = str(getattr(target.config, "model_type", "")).startswith("gemma")  # (1 + w) norms
        if final_norm is not None and not gemma_style and final_norm.weight.shape == self.norm.weight.shape:
            self.norm.weight.copy_(final_norm.weight)

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
