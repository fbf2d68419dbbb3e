"""DFlash: a block-diffusion drafter that drafts a whole block of tokens in one forward pass.

Architecture (as z-lab/dflash builds it; parameter names are the served ``DFlashDraftModel`` ones)
-------------------------------------------------------------------------------------------------
    ctx   = hidden_norm(fc(cat(target layer outputs)))          # [.., S, H]   fc: n*H_t -> H, no bias
    block = [anchor token, MASK x (B-1)] -> target embedding     # [.., B, H]
    each layer (Qwen3-style, pre-norm, SwiGLU, q_norm/k_norm per head):
        q    = q_proj(input_layernorm(h_block))                  # queries from the block only
        k, v = cat(k_proj(ctx), k_proj(...block)), same for v     # "KV injection" of the context
        RoPE at absolute positions: ctx keys at 0..S-1, block at anchor..anchor+B-1
        attention is non-causal inside the block; the context is everything before the anchor
    hidden = norm(h_block); logits = target.lm_head(hidden) in float32 (draft vocab = target vocab)

The drafter owns no embedding and no lm_head: it reads the target's (frozen), kept outside its
parameters and state_dict by ``attach_target``. Slot j of a block predicts the token j places after
the anchor; slot 0 (the anchor itself) is never used, so a chain has k = B - 1 positions.

Training flow (what ``vatspec.drafters.plan_batch`` and the loop do)
--------------------------------------------------------------------
    anchors = drafter.sample_anchors(batch, num_anchors, generator)      # Anchors([B, A], [B, A])
    at      = drafter.logits_positions(batch, anchors)                   # bool [B, T]
    tout    = target(input_ids, attention_mask, drafter.target_layer_ids, logits_at=at)  # logits [N, V]
    out     = drafter.training_forward(batch, tout, anchors)             # DraftOutput, chains [B, A, k]

All blocks of a sequence share one forward pass; an attention mask lets block j see the context
strictly before its anchor and its own block, never another block. The target is asked for logits
only at the N positions the blocks predict (anchor + j - 1), not a full [B, T, V].

Inference (batch size 1)
------------------------
    session = drafter.new_session(head, exit_threshold)
    session.extend(features [m, n*H_t], tokens [m])     # newly committed positions + pending token
    proposal = session.propose(k, temperature=..., top_k=..., top_p=..., generator=...)

The session keeps each layer's projected context K/V, so a round projects only the new positions,
then runs the B block tokens through the layers once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vatspec.drafters.base import AcceptHead, DraftOutput, Linear, SavedConfig, batch_field, distinct_layers
from vatspec.drafters.layers import MLP, RMSNorm, apply_rope, rope_cos_sin, rope_init, rope_parameters
from vatspec.drafters.sampling import Proposal, sample, warp_logits
from vatspec.target import Target, TargetOutput

MASK_TOKEN_STRING = "<|MASK|>"  # what the reference trainer adds to a tokenizer without a mask token
MASK_SOURCES = ("override", "tokenizer", "unused_row", "special", "learned")
MIN_CACHE = 256  # initial context-cache capacity of a session (positions); doubles when full


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int, *, distinct: bool = False) -> list[int]:
    """The reference's choice of target layers, one per draft layer (ids = layer outputs).

    ``[L // 2]`` for one draft layer, else ``round(1 + i * (L - 4) / (n - 1))`` for i < n: evenly
    spread from layer 1 to layer L - 3. Python's ``round`` (half to even), as the reference.
    ``distinct`` (what training builds): a layer repeated on a shallow target moves up to the next one.
    """
    L, n = num_target_layers, num_draft_layers
    if n < 1:
        raise ValueError(f"num_draft_layers must be >= 1, got {n}")
    if n == 1:
        return [L // 2]
    if L < 4:
        raise ValueError(f"spreading {n} target layers needs a target of >= 4 layers, got {L}")
    ids = [int(round(1 + i * (L - 4) / (n - 1))) for i in range(n)]
    return distinct_layers(ids, L, "DFlash") if distinct else ids


def pick_mask_token(
    tokenizer: Any, vocab_size: int, *, exclude: Sequence[int] = ()
) -> tuple[int, str, str | None]:
    """Choose the MASK id among the target's ids: ``(mask_token_id, mask_source, mask_token)``.

    In order: the tokenizer's own mask token ("tokenizer"); the first embedding row no token maps to,
    ``len(tokenizer)`` when the embedding is padded (what the reference gets by adding "<|MASK|>",
    e.g. 151669 for Qwen3; "unused_row"); the highest-id special token that is not bos/eos/pad/unk,
    not in ``exclude`` and not emitted by the chat template on a probe conversation ("special",
    e.g. <empty_output> for SmolLM2); else ``vocab_size`` with a learned extra row ("learned").
    """
    if tokenizer is None:
        return vocab_size, "learned", None
    mid = getattr(tokenizer, "mask_token_id", None)
    if mid is not None and 0 <= mid < vocab_size:
        return int(mid), "tokenizer", getattr(tokenizer, "mask_token", None)
    if len(tokenizer) < vocab_size:
        return len(tokenizer), "unused_row", MASK_TOKEN_STRING
    used = {int(i) for i in exclude}
    used |= {int(i) for i in getattr(tokenizer, "all_special_ids", []) or []}
    used |= _chat_template_ids(tokenizer)
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    specials = {int(i): t.content for i, t in decoder.items() if getattr(t, "special", False)}
    free = sorted(i for i in specials if i not in used and 0 <= i < vocab_size)
    if free:
        return free[-1], "special", specials[free[-1]]
    return vocab_size, "learned", None


def _chat_template_ids(tokenizer: Any) -> set[int]:
    """Ids the chat template itself emits (role markers, turn ends) on a small conversation."""
    if not getattr(tokenizer, "chat_template", None):
        return set()
    probe = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "u"},
    ]
    try:
        out = tokenizer.apply_chat_template(probe, tokenize=True, add_generation_prompt=True)
    except Exception:  # a template that rejects the probe: fall back to the special-token exclusions
        return set()
    ids = out["input_ids"] if isinstance(out, Mapping) else out
    return {int(i) for i in ids}


# ----------------------------------------------------------------------------- config
@dataclass(frozen=True)
class DFlashConfig(SavedConfig):
    """Everything needed to rebuild the drafter; sizes default to the target's (``from_target``); saved
    with every checkpoint (``to_dict``)."""

    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    target_hidden_size: int
    vocab_size: int  # the target's: the drafter drafts over the full target vocabulary
    hidden_size: int  # must equal the target's (shared embedding and lm_head)
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    mask_token_id: int  # learned: vocab_size (an extra row) in training, a target id once served
    mask_source: str  # one of MASK_SOURCES
    mask_token: str | None = None
    num_layers: int = 1
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None  # non-default RoPE parameters of the target (HF rope_parameters)
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    target_model_type: str = "qwen3"  # recorded only: the served DFlash layer is a Qwen3 layer whatever the target

    def __post_init__(self):
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        if self.block_size < 2:
            raise ValueError(f"DFlashConfig.block_size must be >= 2 (anchor + 1 draft), got {self.block_size}")
        if self.num_layers < 1:
            raise ValueError(f"DFlashConfig.num_layers must be >= 1, got {self.num_layers}")
        if self.mask_source not in MASK_SOURCES:
            raise ValueError(f"DFlashConfig.mask_source {self.mask_source!r} not in {MASK_SOURCES}")
        # a learned row stands for an extra id past the vocabulary (training) or, once served, for a
        # target id whose input embedding the draft replaces with it (the engines' mask_embedding.pt)
        if self.mask_source == "learned" and not 0 <= self.mask_token_id <= self.vocab_size:
            raise ValueError(f"DFlashConfig.mask_token_id {self.mask_token_id} outside [0, {self.vocab_size}] for a "
                             "learned mask row")
        if self.mask_source != "learned" and not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"DFlashConfig.mask_token_id {self.mask_token_id} outside [0, {self.vocab_size})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("DFlashConfig.num_attention_heads must be a multiple of num_key_value_heads")

    @classmethod
    def from_target(
        cls,
        target: Target,
        num_layers: int = 1,
        block_size: int = 16,
        target_layer_ids: Sequence[int] | None = None,
        mask_token_id: int | None = None,
        **overrides: Any,
    ) -> DFlashConfig:
        """Config for ``target``: reference layer ids, the target's sizes, a mask token picked by
        ``pick_mask_token`` (or ``mask_token_id``). ``overrides`` replace any other field."""
        tc = target.config
        ids = (list(target_layer_ids) if target_layer_ids
               else default_target_layer_ids(target.num_layers, num_layers, distinct=True))
        target.check_layer_ids(ids)
        V = target.vocab_size
        if mask_token_id is not None:
            if not 0 <= mask_token_id < V:
                raise ValueError(f"mask_token_id {mask_token_id} outside the target vocabulary [0, {V})")
            tok = target.tokenizer
            mask = (int(mask_token_id), "override", tok.convert_ids_to_tokens(int(mask_token_id)) if tok else None)
        else:
            exclude = target.eos_token_ids if target.tokenizer is not None else []
            mask = pick_mask_token(target.tokenizer, V, exclude=exclude)
        theta, scaling = rope_parameters(tc)
        heads = tc.num_attention_heads
        kw: dict[str, Any] = dict(
            target_layer_ids=tuple(ids),
            num_target_layers=target.num_layers,
            target_hidden_size=target.hidden_size,
            vocab_size=V,
            hidden_size=target.hidden_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
            head_dim=getattr(tc, "head_dim", None) or target.hidden_size // heads,
            intermediate_size=tc.intermediate_size,
            mask_token_id=mask[0],
            mask_source=mask[1],
            mask_token=mask[2],
            num_layers=num_layers,
            block_size=block_size,
            rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(getattr(tc, "max_position_embeddings", 32768)),
            target_model_type=str(getattr(tc, "model_type", "qwen3")),
        )
        kw.update(overrides)
        return cls(**kw)

    @property
    def k(self) -> int:
        """Drafted positions per chain (training) and per decode round: the block minus its anchor slot."""
        return self.block_size - 1


class Anchors(NamedTuple):
    """Block anchors of a batch: ``positions [B, A]`` long (0 where invalid), ``valid [B, A]`` bool."""

    positions: Tensor
    valid: Tensor


# ----------------------------------------------------------------------------- layers
def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # x [B, h, P, D], cos/sin [B, P, D]
    return apply_rope(x, cos[:, None].to(x.dtype), sin[:, None].to(x.dtype))


class DFlashAttention(nn.Module):
    """Queries from the block; keys/values from the context (projected once, cached) and the block."""

    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.h, self.hkv, self.d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = Linear(c.hidden_size, self.h * self.d, bias=False)
        self.k_proj = Linear(c.hidden_size, self.hkv * self.d, bias=False)
        self.v_proj = Linear(c.hidden_size, self.hkv * self.d, bias=False)
        self.o_proj = Linear(self.h * self.d, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.d, c.rms_norm_eps)
        self.k_norm = RMSNorm(self.d, c.rms_norm_eps)

    def kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """Keys (k_norm, RoPE) and values of ``x [B, P, H]`` -> two ``[B, hkv, P, D]``."""
        B, P, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, P, self.hkv, self.d)).transpose(1, 2)
        v = self.v_proj(x).view(B, P, self.hkv, self.d).transpose(1, 2)
        return _rope(k, cos, sin), v

    def forward(
        self, x: Tensor, k_ctx: Tensor, v_ctx: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None
    ) -> Tensor:
        """x [B, Q, H] (normed block), k_ctx/v_ctx [B, hkv, S, D], mask bool [B, 1, Q, S + Q] or None."""
        B, Q, _ = x.shape
        q = _rope(self.q_norm(self.q_proj(x).view(B, Q, self.h, self.d)).transpose(1, 2), cos, sin)
        k_blk, v_blk = self.kv(x, cos, sin)
        k = torch.cat([k_ctx.to(k_blk.dtype), k_blk], dim=2)  # [B, hkv, S + Q, D]
        v = torch.cat([v_ctx.to(v_blk.dtype), v_blk], dim=2)
        if self.h != self.hkv:
            k = k.repeat_interleave(self.h // self.hkv, dim=1)
            v = v.repeat_interleave(self.h // self.hkv, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, h, Q, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, self.h * self.d))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.self_attn = DFlashAttention(c)
        self.mlp = MLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(
        self, h: Tensor, k_ctx: Tensor, v_ctx: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None
    ) -> Tensor:
        h = h + self.self_attn(self.input_layernorm(h), k_ctx, v_ctx, cos, sin, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


# ----------------------------------------------------------------------------- drafter
class DFlashDrafter(nn.Module):
    """The DFlash draft model. Build with ``DFlashDrafter(config)``, then ``attach_target(target)``."""

    kind = "dflash"
    schedule = "dflash"

    def __init__(self, config: DFlashConfig):
        super().__init__()
        c = self.config = config
        self.target_layer_ids: list[int] = list(c.target_layer_ids)
        self.hidden_size: int = c.hidden_size
        self.block_size: int = c.block_size
        self.mask_token_id: int = c.mask_token_id
        self.d2t = None  # identity: the draft vocabulary is the target's
        self.t2d = None
        self.layers = nn.ModuleList(DFlashDecoderLayer(c) for _ in range(c.num_layers))
        self.fc = Linear(len(c.target_layer_ids) * c.target_hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if c.mask_source == "learned":
            self.mask_embedding = nn.Parameter(torch.empty(c.hidden_size))
        inv_freq, self.rope_scale = rope_init(c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._target: Target | None = None  # not a Module: stays out of parameters and state_dict
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=self.config.initializer_range)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)
        if self.config.mask_source == "learned":
            nn.init.normal_(self.mask_embedding, std=self.config.initializer_range)

    def attach_target(self, target: Target) -> None:
        """Use ``target``'s frozen embedding and lm_head (held by reference, never saved)."""
        c = self.config
        have = (target.hidden_size, target.vocab_size, target.num_layers)
        want = (c.hidden_size, c.vocab_size, c.num_target_layers)
        if have != want:
            raise ValueError(f"target (hidden, vocab, layers) = {have} does not match the DFlash config {want}")
        self._target = target

    @property
    def k(self) -> int:
        """Drafted positions per chain and per decode round (``config.k``)."""
        return self.config.k

    @property
    def target(self) -> Target:
        if self._target is None:
            raise RuntimeError("DFlashDrafter has no target: call attach_target(target) first")
        return self._target

    # ------------------------------------------------------------------ building blocks
    def embed(self, ids: Tensor) -> Tensor:
        """Target embedding of ``ids [...]`` -> ``[..., H]``; the learned MASK row where chosen."""
        w = self.fc.weight
        emb = self.target.embed_tokens
        if self.config.mask_source != "learned":  # the embedding may sit on another device (device_map)
            return emb(ids.to(emb.weight.device)).to(device=w.device, dtype=w.dtype)
        is_mask = ids == self.mask_token_id
        e = emb(ids.masked_fill(is_mask, 0).to(emb.weight.device)).to(device=w.device, dtype=w.dtype)
        return torch.where(is_mask[..., None], self.mask_embedding.to(w.dtype), e)

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin ``[B, P, D]`` for absolute ``positions [B, P]``."""
        cos, sin = rope_cos_sin(positions, self.inv_freq)  # [B, P, D] float32
        return cos * self.rope_scale, sin * self.rope_scale

    def project_context(self, features: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Per-layer context keys/values ``[B, hkv, S, D]`` of target ``features [B, S, n*H_t]``."""
        ctx = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))  # [B, S, H]
        cos, sin = self.rope(positions)
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def run_block(
        self, ids: Tensor, positions: Tensor, ctx_kv: Sequence[tuple[Tensor, Tensor]], mask: Tensor | None
    ) -> Tensor:
        """Block tokens ``ids [B, Q]`` at ``positions [B, Q]`` -> final-normed hidden ``[B, Q, H]``."""
        h = self.embed(ids)
        cos, sin = self.rope(positions)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            h = layer(h, k, v, cos, sin, mask)
        return self.norm(h)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """Target lm_head on the drafter's normed hidden state -> float32 logits ``[..., V]``."""
        return self.target.logits(hidden.to(self.target.lm_head.weight.dtype))

    # ------------------------------------------------------------------ training
    def sample_anchors(self, batch: Any, num_anchors: int, generator: torch.Generator | None = None) -> Anchors:
        """Up to ``num_anchors`` distinct anchors per sequence, sorted, uniformly among candidates.

        A candidate anchor ``a`` is a supervised token whose next token is supervised too
        (``loss_mask[a] & loss_mask[a + 1]``, both attended): at inference the anchor is always a
        committed response token, and its block must have a label. A sequence with fewer candidates
        gets fewer anchors; the rest are ``valid=False`` at position 0. A = min(num_anchors, most
        candidates in the batch), at least 1.
        """
        input_ids, attn, loss = _batch_tensors(batch)
        B, T = input_ids.shape
        dev = input_ids.device
        cand = torch.zeros(B, T, dtype=torch.bool, device=dev)
        cand[:, :-1] = loss[:, :-1] & loss[:, 1:] & attn[:, :-1] & attn[:, 1:]
        counts = cand.sum(1)  # [B]
        A = max(1, min(int(num_anchors), int(counts.max())))
        gdev = generator.device if generator is not None else dev
        r = torch.rand(B, T, generator=generator, device=gdev).to(dev)
        r = r.masked_fill(~cand, 2.0)  # non-candidates sort last
        picked = r.argsort(dim=1)[:, :A]  # [B, A]
        valid = torch.arange(A, device=dev)[None] < counts[:, None]
        positions = picked.masked_fill(~valid, T).sort(dim=1).values  # invalid sort last: valid is a prefix
        return Anchors(positions.masked_fill(~valid, 0), valid)

    def chain_valid(self, batch: Any, anchors: Anchors) -> Tensor:
        """``[B, A, k]`` bool prefix mask: label position anchor + j exists, is attended and supervised."""
        _, attn, loss = _batch_tensors(batch)
        T = attn.shape[1]
        lab = _label_positions(anchors.positions, self.block_size)  # [B, A, k]
        ok = (lab < T) & anchors.valid[..., None]
        lab = lab.clamp(max=T - 1)
        ok &= _gather_bt(attn, lab) & _gather_bt(loss, lab)
        return ok.long().cumprod(-1).bool()

    @torch.no_grad()
    def logits_positions(self, batch: Any, anchors: Anchors) -> Tensor:
        """bool ``[B, T]``: where the target's logits are needed (anchor + j - 1 for every valid slot j)."""
        input_ids, _, _ = _batch_tensors(batch)
        B, T = input_ids.shape
        valid = self.chain_valid(batch, anchors)
        pos = _label_positions(anchors.positions, self.block_size) - 1  # [B, A, k]
        flat = (torch.arange(B, device=pos.device)[:, None, None] * T + pos.clamp(0, T - 1))[valid]
        at = torch.zeros(B * T, dtype=torch.bool, device=input_ids.device)
        at[flat] = True
        return at.view(B, T)

    def training_forward(
        self,
        batch: Any,
        tout: TargetOutput,
        anchors: Anchors | None = None,
        *,
        num_anchors: int | None = None,
        generator: torch.Generator | None = None,
        with_logits: bool = True,
    ) -> DraftOutput:
        """All blocks of the batch in one pass -> DraftOutput with chains ``[B, A]`` and k = B - 1.

        ``batch``: input_ids / attention_mask / loss_mask ``[B, T]`` (attributes or keys).
        ``tout``: features ``[B, T, n*H_t]`` of ``target_layer_ids``; logits either ``[N, V]`` at
        ``logits_positions(batch, anchors)`` or ``[B, T, V]``. Without ``anchors``, samples
        ``num_anchors`` per sequence (then pass full logits or the matching ``logits_at``).

        Returns logits ``[B, A, k, V]`` (float32), hidden ``[B, A, k, H]`` = the drafter's last
        hidden state after the final norm (the accept head's input), target_logits ``[B, A, k, V]``
        (the target's logits at anchor + j - 1, i.e. predicting the token at anchor + j), valid
        ``[B, A, k]``. ``with_logits=False`` (the chunked loss path, ``vatspec.chunked``): no logits and
        no gathered target logits; ``lm_head`` is the target's lm_head weight (``softcap`` its final
        logit soft-capping), ``target_logits`` the target's rows ``tout.logits`` ([N, V], or [B, T, V]
        as [B*T, V]; or, run without logits, ``tout.hidden`` as [B*T, H] with ``target_head`` = the
        target's ``logits``) and ``target_index [B, A, k]`` the row each position reads.
        """
        input_ids, attn, _ = _batch_tensors(batch)
        B, T = input_ids.shape
        Bs, k = self.block_size, self.k
        if anchors is None:
            if num_anchors is None:
                raise ValueError("training_forward needs anchors or num_anchors")
            anchors = self.sample_anchors(batch, num_anchors, generator)
        pos, avalid = anchors
        A = pos.shape[1]
        feats = tout.features
        n_feat = len(self.target_layer_ids) * self.config.target_hidden_size
        assert feats is not None and feats.shape == (B, T, n_feat), (
            f"tout.features must be [B, T, n*H_t] = {(B, T, n_feat)} (layers {self.target_layer_ids}), "
            f"got {None if feats is None else tuple(feats.shape)}"
        )
        assert pos.shape == avalid.shape == (B, A), f"anchors must be [B, A], got {tuple(pos.shape)}"
        dev = input_ids.device

        # 1. blocks: [anchor token, MASK x (B-1)] at positions anchor + 0..Bs-1
        ids = torch.full((B, A, Bs), self.mask_token_id, dtype=torch.long, device=dev)
        ids[..., 0] = input_ids.gather(1, pos)
        qpos = (pos[..., None] + torch.arange(Bs, device=dev)).view(B, A * Bs)

        # 2. context: only positions before the last anchor can be seen by any block
        S = int(pos.max())
        ctx_pos = torch.arange(S, device=dev)[None].expand(B, S)
        ctx_kv = self.project_context(feats[:, :S], ctx_pos)

        # 3. mask: block j sees attended context < anchor_j and its own block, nothing else
        see_ctx = (ctx_pos[:, None, :] < pos[..., None]) & attn[:, None, :S]  # [B, A, S]
        see_ctx = see_ctx[:, :, None, :].expand(B, A, Bs, S).reshape(B, A * Bs, S)
        blk = torch.arange(A * Bs, device=dev) // Bs
        see_blk = (blk[:, None] == blk[None, :]).expand(B, A * Bs, A * Bs)
        mask = torch.cat([see_ctx, see_blk], dim=-1)[:, None]  # [B, 1, A*Bs, S + A*Bs]

        # 4. draft
        hidden = self.run_block(ids.view(B, A * Bs), qpos, ctx_kv, mask).view(B, A, Bs, -1)[:, :, 1:]
        hidden = hidden.contiguous()  # lm_head on a strided view runs as a 4x slower bmm on CPU

        # 5. target logits predicting anchor + j come from position anchor + j - 1
        valid = self.chain_valid(batch, anchors)  # [B, A, k]
        tpos = (_label_positions(pos, Bs) - 1).clamp(0, T - 1)
        if with_logits or tout.logits is not None:
            table, index = self._target_rows(batch, anchors, tout.logits, tpos, valid)
        else:  # the chunked path turns the target's hidden rows into logits itself
            table, index = tout.hidden.reshape(B * T, -1), torch.arange(B, device=dev)[:, None, None] * T + tpos
        if not with_logits:
            head = self.target.lm_head
            if head.bias is not None:
                raise ValueError("the chunked loss path needs a bias-free target lm_head; set loss.chunk_size=0")
            return DraftOutput(
                logits=None, hidden=hidden, target_logits=table, valid=valid, lm_head=head.weight,
                softcap=getattr(self.target.config, "final_logit_softcapping", None) or None, target_index=index,
                target_head=None if tout.logits is not None else self.target.logits,
                target_vocab_size=self.config.vocab_size,
            )
        logits = self.compute_logits(hidden)  # [B, A, k, V]
        target_logits = table[index] if table.shape[0] else table.new_zeros(B, A, k, table.shape[-1])  # [B, A, k, V]
        assert logits.shape[:3] == (B, A, k)
        return DraftOutput(logits=logits, hidden=hidden, target_logits=target_logits, valid=valid)

    forward = training_forward

    def _target_rows(
        self, batch: Any, anchors: Anchors, tl: Tensor | None, tpos: Tensor, valid: Tensor
    ) -> tuple[Tensor, Tensor]:
        """The target's logits as rows ``[P, V]`` and the row ``[B, A, k]`` each position reads."""
        B, A, k = tpos.shape
        if tl is None:
            raise ValueError("tout.logits is None: DFlash needs the target's logits (logits_at=logits_positions)")
        if tl.dim() == 3:  # full [B, T, V]
            T = tl.shape[1]
            return tl.reshape(B * T, -1), torch.arange(B, device=tpos.device)[:, None, None] * T + tpos
        at = self.logits_positions(batch, anchors)
        N = int(at.sum())
        if tl.shape[0] != N:
            raise ValueError(
                f"tout.logits has {tl.shape[0]} rows but logits_positions(batch, anchors) selects {N}: "
                "call the target with logits_at=drafter.logits_positions(batch, anchors) for these anchors"
            )
        row = at.view(-1).long().cumsum(0).view(at.shape) - 1  # [B, T] -> row of tl, -1 if not selected
        return tl, _gather_bt(row, tpos).masked_fill(~valid, 0)  # [N, V], [B, A, k]

    # ------------------------------------------------------------------ inference
    def new_session(self, head: AcceptHead | None = None, exit_threshold: float | None = None) -> DFlashSession:
        """A decoding session (batch size 1) holding the context K/V cache."""
        return DFlashSession(self, head, exit_threshold)


class DFlashSession:
    """Incremental drafting for one sequence (batch size 1).

    ``extend`` appends committed positions (their target features) and sets the pending token;
    ``propose`` drafts the block ``[pending, MASK x (B-1)]`` at positions ``n .. n+B-1`` in one pass.
    The block's own keys are never cached: only committed context is, so nothing needs cropping.
    """

    def __init__(self, drafter: DFlashDrafter, head: AcceptHead | None = None, exit_threshold: float | None = None):
        if exit_threshold is not None and head is None:
            raise ValueError("exit_threshold needs an accept head")
        self.drafter, self.head, self.exit_threshold = drafter, head, exit_threshold
        self.length = 0  # committed positions in the context cache
        self.pending: Tensor | None = None  # [1] the anchor token of the next block
        self._k: list[Tensor] = []  # per layer [1, hkv, capacity, D]
        self._v: list[Tensor] = []

    @torch.no_grad()
    def extend(self, features: Tensor, tokens: Tensor) -> None:
        """features ``[m, n*H_t]`` at the next m positions; tokens ``[m]``, tokens[j] follows position j.

        The last token is the pending one (not yet run by the target): the next block's anchor.
        """
        d = self.drafter
        n_feat = len(d.target_layer_ids) * d.config.target_hidden_size
        assert features.dim() == 2 and features.shape[1] == n_feat, (
            f"features must be [m, {n_feat}], got {tuple(features.shape)}"
        )
        m = features.shape[0]
        assert m >= 1 and tokens.shape == (m,), f"tokens must be [{m}], got {tuple(tokens.shape)}"
        pos = torch.arange(self.length, self.length + m, device=features.device)[None]
        kv = d.project_context(features[None], pos)
        for i, (k, v) in enumerate(kv):
            if i == len(self._k):
                self._k.append(k.new_empty(1, k.shape[1], 0, k.shape[3]))
                self._v.append(v.new_empty(1, v.shape[1], 0, v.shape[3]))
            self._k[i] = _append(self._k[i], k, self.length)
            self._v[i] = _append(self._v[i], v, self.length)
        self.length += m
        self.pending = tokens[-1:].to(device=features.device, dtype=torch.long)

    @torch.no_grad()
    def draft_block(self, k: int | None = None) -> tuple[Tensor, Tensor]:
        """Run the block once -> (logits ``[k, V]`` float32, hidden ``[k, H]``) for slots 1..k
        (default all B-1). The whole block runs either way (its slots attend to each other); only
        the lm_head, the costly part of a draft on a 49k vocabulary, is limited to the k slots used."""
        if self.pending is None:
            raise RuntimeError("propose before extend: the session has no pending token")
        d = self.drafter
        Bs, n = d.block_size, self.length
        dev = self.pending.device
        ids = torch.full((1, Bs), d.mask_token_id, dtype=torch.long, device=dev)
        ids[0, 0] = self.pending[0]
        pos = torch.arange(n, n + Bs, device=dev)[None]
        ctx = [(k[:, :, :n], v[:, :, :n]) for k, v in zip(self._k, self._v)]
        k = d.k if k is None else k
        hidden = d.run_block(ids, pos, ctx, mask=None)[0, 1 : 1 + k]  # everything committed is < n: no mask
        return d.compute_logits(hidden), hidden

    @torch.no_grad()
    def propose(
        self,
        k: int,
        *,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> Proposal:
        """Draft slots 1..k (k <= drafter.k = B-1). Greedy at temperature 0 (q None), else sample each slot from
        ``q = warp_logits(logits)``. With an accept head, ``head_probs`` = sigmoid(head(hidden)); with
        an exit threshold as well, keep only the leading slots whose survival under the head's rule
        (``AcceptHead.prefix_alive``) is >= threshold (k' may be 0)."""
        if not 0 <= k <= self.drafter.k:
            raise ValueError(f"k must be in [0, {self.drafter.k}] (drafter.k = block_size - 1), got {k}")
        logits, hidden = self.draft_block(k)  # [k, V], [k, H]
        head_probs = None
        if self.head is not None:
            w = next(self.head.parameters(), None)
            h = hidden.to(w.dtype) if w is not None else hidden
            head_probs = torch.sigmoid(self.head(h).float())  # [k]
            if self.exit_threshold is not None:  # the head's own rule (HEAD_RULES)
                keep = int((self.head.prefix_alive(head_probs) >= self.exit_threshold).long().cumprod(0).sum())
                logits, head_probs = logits[:keep], head_probs[:keep]
        if temperature <= 0:
            return Proposal(tokens=logits.argmax(-1), q=None, head_probs=head_probs)
        if logits.shape[0] == 0:
            return Proposal(tokens=logits.new_zeros(0, dtype=torch.long), q=logits, head_probs=head_probs)
        q = warp_logits(logits, temperature, top_k, top_p)  # [k', V]
        tokens = sample(q, generator)  # [k'], each slot from its own marginal
        return Proposal(tokens=tokens, q=q, head_probs=head_probs)


# ----------------------------------------------------------------------------- helpers
def _batch_tensors(batch: Any) -> tuple[Tensor, Tensor, Tensor]:
    """(input_ids long, attention_mask bool, loss_mask bool), each ``[B, T]``; attributes or keys."""
    input_ids = batch_field(batch, "input_ids")
    assert input_ids.dim() == 2, f"batch.input_ids must be [B, T], got {tuple(input_ids.shape)}"
    attn, loss = batch_field(batch, "attention_mask").bool(), batch_field(batch, "loss_mask").bool()
    assert attn.shape == loss.shape == input_ids.shape, "attention_mask / loss_mask must match input_ids [B, T]"
    return input_ids, attn, loss


def _label_positions(positions: Tensor, block_size: int) -> Tensor:
    """``[B, A] -> [B, A, k]``: anchor + j for slots j = 1..block_size-1."""
    return positions[..., None] + torch.arange(1, block_size, device=positions.device)


def _gather_bt(x: Tensor, idx: Tensor) -> Tensor:
    """``x [B, T, ...]`` at ``idx [B, A, k]`` (per batch row) -> ``[B, A, k, ...]``."""
    B = x.shape[0]
    return x[torch.arange(B, device=x.device)[:, None, None], idx]


def _append(buf: Tensor, new: Tensor, length: int) -> Tensor:
    """Write ``new [1, h, m, D]`` at ``buf[:, :, length:]``, growing capacity by doubling."""
    need = length + new.shape[2]
    if need > buf.shape[2]:
        grown = buf.new_empty(1, buf.shape[1], max(need, 2 * buf.shape[2], MIN_CACHE), buf.shape[3])
        grown[:, :, :length] = buf[:, :, :length]
        buf = grown
    buf[:, :, length:need] = new
    return buf


__all__ = [
    "Anchors",
    "DFlashConfig",
    "DFlashDrafter",
    "DFlashSession",
    "default_target_layer_ids",
    "pick_mask_token",
]
