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

Training flow (what ``plan_batch`` and the loop do)
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

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vatspec.drafters.base import AcceptHead, Drafter, DrafterPlan, DraftOutput, batch_field
from vatspec.drafters.dflash.config import DFlashConfig, default_target_layer_ids
from vatspec.drafters.dflash.formats import DFLASH
from vatspec.drafters.dflash.session import DFlashSession
from vatspec.drafters.layers import DRAFT_ACT, MLP, RMSNorm, apply_rope, rope_cos_sin, rope_init
from vatspec.target import Target, TargetOutput


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
        self.q_proj = nn.Linear(c.hidden_size, self.h * self.d, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.hkv * self.d, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.hkv * self.d, bias=False)
        self.o_proj = nn.Linear(self.h * self.d, c.hidden_size, bias=False)
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
        self.mlp = MLP(c.hidden_size, c.intermediate_size, DRAFT_ACT)  # z-lab's and the engines' Qwen3 layer: SiLU
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(
        self, h: Tensor, k_ctx: Tensor, v_ctx: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None
    ) -> Tensor:
        h = h + self.self_attn(self.input_layernorm(h), k_ctx, v_ctx, cos, sin, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


# ----------------------------------------------------------------------------- drafter
class DFlashDrafter(Drafter):
    """The DFlash draft model. Build with ``DFlashDrafter(config)``, then ``attach_target(target)``."""

    kind = "dflash"
    title = "DFlash"
    config_class = DFlashConfig
    schedule = "dflash"  # fixed-weight curve of the losses: exp(-j / gamma), gamma from the block
    baseline_loss = "dflash"  # hard CE on that curve (z-lab)
    reference_optim = {"lr": 6e-4, "warmup_ratio": 0.04, "grad_clip": 1.0}  # z-lab's recipe
    formats = (DFLASH,)

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
        self.fc = nn.Linear(len(c.target_layer_ids) * c.target_hidden_size, c.hidden_size, bias=False)
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

    @classmethod
    def build(cls, cfg, target, token_counts: Tensor | None = None) -> DFlashDrafter:
        """A new drafter of ``cfg.num_layers`` layers and ``cfg.block_size`` (drafting over the target's
        vocabulary: ``token_counts`` is not read)."""
        conf = DFlashConfig.from_target(
            target, num_layers=cfg.num_layers, block_size=cfg.block_size,
            target_layer_ids=list(cfg.target_layer_ids) if cfg.target_layer_ids else None,
            mask_token_id=cfg.mask_token_id,
        )
        drafter = cls(conf)
        drafter.attach_target(target)
        return drafter

    @classmethod
    def default_layer_ids(cls, num_target_layers: int, num_layers: int = 1) -> list[int]:
        """One target layer per draft layer, the reference's (``default_target_layer_ids``)."""
        return default_target_layer_ids(num_target_layers, num_layers, distinct=True)

    @classmethod
    def curve_block(cls, cfg) -> int | None:
        return cfg.block_size

    @property
    def max_k(self) -> int:
        """A round fills at most the block's k = block_size - 1 slots."""
        return self.k

    def init_mismatch(self, cfg, vocab_size: int) -> str | None:
        if self.block_size != cfg.block_size:
            return (f"has block size {self.block_size}, but drafter.block_size={cfg.block_size}; pass "
                    f"drafter.block_size={self.block_size}")
        return None

    def plan_batch(self, batch, cfg, generator: torch.Generator | None, *, with_logits: bool = True) -> DrafterPlan:
        """``cfg.num_anchors`` anchors per sequence; the target's logits only at the positions the blocks predict."""
        anchors = self.sample_anchors(batch, cfg.num_anchors, generator)
        kwargs = {"anchors": anchors} if with_logits else {"anchors": anchors, "with_logits": False}
        return DrafterPlan(logits_at=self.logits_positions(batch, anchors), kwargs=kwargs, target_logits=with_logits)

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
        """All blocks of the batch in one pass -> DraftOutput with chains ``[B, A]`` and k = B - 1. One function:
        its numbered steps (anchors, context K/V, masks, draft, target rows) hand their tensors straight on.

        ``batch``: input_ids / attention_mask / loss_mask ``[B, T]`` (attributes or keys).
        ``tout``: features ``[B, T, n*H_t]`` of ``target_layer_ids``; logits either ``[N, V]`` at
        ``logits_positions(batch, anchors)`` or ``[B, T, V]``. Without ``anchors``, samples
        ``num_anchors`` per sequence (then pass full logits or the matching ``logits_at``).

        Returns logits ``[B, A, k, V]`` (float32), hidden ``[B, A, k, H]`` = the drafter's last
        hidden state after the final norm (the accept head's input), target_logits ``[B, A, k, V]``
        (the target's logits at anchor + j - 1, i.e. predicting the token at anchor + j), valid
        ``[B, A, k]``. ``with_logits=False`` (the chunked loss path, ``vatspec.objective.chunked``): no logits and
        no gathered target logits; ``lm_head`` is the target's lm_head weight (``logit_scale`` and
        ``softcap`` what its forward does after it: ``vatspec.target.families.logit_transform``), ``target_logits``
        the target's rows ``tout.logits`` ([N, V], or [B, T, V] as [B*T, V]; or, run without logits,
        ``tout.hidden`` as [B*T, H] with ``target_head`` = the target's ``logits``) and ``target_index
        [B, A, k]`` the row each position reads.
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
        hidden = hidden.contiguous()  # on a strided view the lm_head runs as a slower bmm on CPU (docs/LOG.md)

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
                softcap=self.target.logit_softcap, logit_scale=self.target.logit_scale, target_index=index,
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

