"""EAGLE-3 drafter: served names, RoPE, the TTT alignment and attention pattern, and agreement
between the training unroll and the inference session. Tiny random models only."""

from __future__ import annotations

import copy
import json
import math
from types import SimpleNamespace

import pytest
import torch
from torch import Tensor

from tests.conftest import tiny_llama
from vatspec.drafters.base import AcceptHead
from vatspec.drafters.eagle3 import (
    DEFAULT_TTT_STEPS,
    Eagle3Config,
    Eagle3Drafter,
    Eagle3Session,
    default_layer_ids,
    rope_from_config,
)
from vatspec.drafters.layers import rope_init
from vatspec.drafters.sampling import warp_logits
from vatspec.drafters.vocab import build_draft_vocab, target_ids
from vatspec.target import Target, TargetOutput

# float32 everywhere; the unroll and the cached session do the same math batched differently
ATOL = 1e-5
# a perturbation that must not reach a logit leaves it bit-identical (masked keys get exactly 0
# weight); one that must reach it moves it far more than float32 noise
SAME, MOVED = 1e-6, 1e-5
V, VD, k, T = 96, 48, 4, 16  # target vocab, draft vocab, k = TTT steps, sequence length
TK = T - 2  # chain starts kept by training_forward: every t whose step-0 label x_{t+2} exists

SERVED = {
    "fc.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.post_attention_layernorm.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
}


@pytest.fixture(scope="module")
def target() -> Target:
    return Target(tiny_llama(vocab_size=V, layers=8, seed=0), tokenizer=None)


def make_drafter(target: Target, seed: int = 0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    d = Eagle3Drafter.from_target(target, draft_vocab_size=VD, ttt_steps=k)
    counts = torch.randint(0, 50, (V,), generator=torch.Generator().manual_seed(seed))
    d.set_vocab(*build_draft_vocab(counts, VD))  # a non-identity d2t
    with torch.no_grad():  # non-unit norms, so a swapped or missing norm shows
        for name, p in d.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return d.eval()


@pytest.fixture(scope="module")
def drafter(target: Target) -> Eagle3Drafter:
    return make_drafter(target)


def make_batch(B: int = 2, length: int = T, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(3, V, (B, length), generator=g),
        "attention_mask": torch.ones(B, length, dtype=torch.bool),
        "loss_mask": torch.ones(B, length, dtype=torch.bool),
    }


def run(drafter: Eagle3Drafter, target: Target, batch: dict):
    tout = target(batch["input_ids"], batch["attention_mask"], drafter.target_layer_ids)
    return drafter.training_forward(batch, tout), tout


# ----------------------------------------------------------------------------- config and format
def test_config_from_target(target: Target):
    c = Eagle3Config.from_target(target, draft_vocab_size=10_000)
    assert c.target_layer_ids == (1, 3, 4)  # 8 layers: 1, L//2 - 1, L - 4
    assert c.draft_vocab_size == V  # capped by the target vocabulary
    assert c.ttt_steps == c.k == DEFAULT_TTT_STEPS == 7  # the reference unroll
    tc = target.config
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (4, 2, 8)
    assert (c.hidden_size, c.target_hidden_size, c.vocab_size) == (32, 32, V)
    assert c.intermediate_size == tc.intermediate_size and c.rms_norm_eps == tc.rms_norm_eps
    assert c.rope_theta == 10000.0 and c.rope_scaling is None and c.hidden_act == "silu"
    assert Eagle3Config.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    assert "k" not in c.to_dict()  # derived from ttt_steps, never saved
    with pytest.raises(ValueError, match=r"Eagle3Config: unknown keys \['k'\]"):
        Eagle3Config.from_dict({**c.to_dict(), "k": 3})
    with pytest.raises(ValueError, match="unknown keys"):
        Eagle3Config.from_dict({**c.to_dict(), "draft_vocab": 5})
    with pytest.raises(ValueError, match="too shallow"):
        default_layer_ids(3)
    with pytest.raises(ValueError, match="out of range"):
        Eagle3Config.from_target(target, target_layer_ids=[1, 2, 8])


def test_state_dict_is_the_served_format(drafter: Eagle3Drafter, target: Target):
    sd = drafter.state_dict()
    assert set(sd) == SERVED
    c = drafter.config
    H = c.hidden_size
    assert sd["fc.weight"].shape == (H, 3 * c.target_hidden_size)
    assert sd["midlayer.self_attn.q_proj.weight"].shape == (c.num_heads * c.head_dim, 2 * H)
    assert sd["midlayer.self_attn.k_proj.weight"].shape == (c.num_kv_heads * c.head_dim, 2 * H)
    assert sd["lm_head.weight"].shape == (VD, H)
    assert sd["d2t"].dtype == torch.int64 and sd["d2t"].shape == (VD,)
    assert sd["t2d"].dtype == torch.bool and sd["t2d"].shape == (V,)
    # the target's embedding is used but not owned
    emb = target.embed_tokens
    assert all(p is not emb.weight for p in drafter.parameters())
    assert all(m is not emb for m in drafter.modules())


def test_deepcopy_shares_the_target_embedding(drafter: Eagle3Drafter, target: Target):
    twin = copy.deepcopy(drafter)
    assert twin._embed is target.embed_tokens
    assert twin.fc.weight is not drafter.fc.weight and torch.equal(twin.fc.weight, drafter.fc.weight)


def test_set_vocab_checks(drafter: Eagle3Drafter):
    d2t, t2d = build_draft_vocab(torch.arange(V), VD)
    with pytest.raises(ValueError, match="do not fit"):
        drafter.set_vocab(d2t[:-1], t2d)
    bad = t2d.clone()
    bad[0] = ~bad[0]
    with pytest.raises(ValueError, match="t2d"):
        drafter.set_vocab(d2t, bad)


def test_registry_and_checkpoint_round_trip(target: Target):
    from vatspec.config import DrafterConfig
    from vatspec.drafters import build_drafter, drafter_from_dict

    d = build_drafter(DrafterConfig(kind="eagle3", ttt_steps=3), target, torch.randint(0, 9, (V,)))
    assert d.kind == "eagle3" and d.schedule == "eagle3" and d.config.draft_vocab_size == V
    again = drafter_from_dict("eagle3", json.loads(json.dumps(d.config.to_dict())), target)
    again.load_state_dict(d.state_dict(), strict=True)
    assert torch.equal(again.d2t, d.d2t) and torch.equal(again.t2d, d.t2d)


# ----------------------------------------------------------------------------- RoPE
@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
)
def test_rope_matches_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    params = {"rope_type": "default", **(scaling or {}), "rope_theta": 500000.0}
    hf_cfg = LlamaConfig(hidden_size=128, num_attention_heads=2, rope_parameters=params)
    theta, ours_scaling = rope_from_config(hf_cfg)
    assert theta == 500000.0 and ours_scaling == scaling
    ref = LlamaRotaryEmbedding(hf_cfg)
    inv, _ = rope_init(64, theta, ours_scaling, hf_cfg.max_position_embeddings)
    assert torch.allclose(inv, ref.inv_freq, rtol=1e-6, atol=0)
    c = Eagle3Config(
        hidden_size=16, target_hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=64, intermediate_size=32,
        rms_norm_eps=1e-6, rope_theta=theta, vocab_size=10, draft_vocab_size=10, target_layer_ids=(0, 1, 2),
        rope_scaling=ours_scaling,
    )
    pos = torch.arange(6) + 5  # positions advanced by a TTT step
    cos, sin = Eagle3Drafter(c)._rope(pos)
    ref_cos, ref_sin = ref(torch.zeros(1, 6, 64), pos[None])
    assert torch.allclose(cos, ref_cos[0], atol=1e-6) and torch.allclose(sin, ref_sin[0], atol=1e-6)


# YaRN targets with their published RoPE: gpt-oss (truncate false; attention factor 0.1 ln 32 + 1) and
# DeepSeek-V3 (mscale = mscale_all_dim = 1: attention factor 1, where 0.1 ln 40 + 1 would be 1.37)
DEEPSEEK_V3_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0,
                    "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}


def yarn_target(family: str) -> Target:
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    from tests.gptoss_target import gptoss_config

    if family == "gpt-oss":
        cfg = gptoss_config(V, layers=8)
    else:
        cfg = DeepseekV3Config(
            vocab_size=V, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=8,
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
            first_k_dense_replace=1, max_position_embeddings=163840, rope_parameters=dict(DEEPSEEK_V3_ROPE))
    torch.manual_seed(0)
    return Target(AutoModelForCausalLM.from_config(cfg).eval(), tokenizer=None)


@pytest.mark.parametrize("family", ["gpt-oss", "deepseek-v3"])
def test_yarn_draft_rotates_as_the_target_in_training_export_and_check(family, tmp_path):
    from vatspec.eval.check import convention_findings
    from vatspec.export import export_draft, import_draft

    target = yarn_target(family)
    c = Eagle3Config.from_target(target, draft_vocab_size=V, ttt_steps=2)
    assert c.rope_scaling["rope_type"] == "yarn" and c.head_dim == target.model.model.rotary_emb.inv_freq.numel() * 2
    d = Eagle3Drafter(c)
    # the target's own rotary embedding (transformers' YaRN: frequencies and attention factor), far past the
    # pretraining context too
    pos = torch.tensor([0, 1, 5, 127, 4095, 4096, 50_000])
    ref_cos, ref_sin = (x[0] for x in target.model.model.rotary_emb(torch.zeros(1, len(pos), c.head_dim), pos[None]))
    if ref_cos.shape[-1] == c.head_dim // 2:  # gpt-oss returns the half table its rotation reads for both halves
        ref_cos, ref_sin = torch.cat([ref_cos, ref_cos], -1), torch.cat([ref_sin, ref_sin], -1)
    cos, sin = d._rope(pos)
    want = 1 + 0.1 * math.log(32) if family == "gpt-oss" else 1.0
    assert ref_cos[0].max().item() == pytest.approx(want, rel=1e-6)  # cos(0) = the attention factor
    torch.testing.assert_close(cos, ref_cos, atol=1e-6, rtol=0)  # values up to 1.35 in float32
    torch.testing.assert_close(sin, ref_sin, atol=1e-6, rtol=0)
    # export -> config.json rope_scaling as the engines read it -> import: the same RoPE; check agrees
    d.attach_target(target)
    for fmt in ("eagle3-hf", "speculators"):
        out = export_draft(d, target, tmp_path / fmt, fmt=fmt)
        cfg = json.loads((out / "config.json").read_text())
        lc = cfg.get("transformer_layer_config", cfg)
        assert lc["rope_scaling"] == c.rope_scaling and lc["rope_theta"] == c.rope_theta
        back = import_draft(out, target, k=2)
        assert back.config.rope_scaling == c.rope_scaling
        assert all(torch.equal(a, b) for a, b in zip(back._rope(pos), d._rope(pos)))
        rope = next(f for f in convention_findings(out, target)[1] if f.what == "rope")
        assert rope.ok and "= the target's" in rope.detail, rope.detail


# ----------------------------------------------------------------------------- training unroll
def test_training_forward_shapes_views_and_hidden(drafter: Eagle3Drafter, target: Target):
    out, tout = run(drafter, target, make_batch())
    H = drafter.hidden_size
    assert drafter.k == drafter.config.k == k  # chains of k = ttt_steps positions
    assert out.logits.shape == (2, TK, k, VD) and out.hidden.shape == (2, TK, k, H)
    assert out.target_logits.shape == (2, TK, k, V) and out.valid.shape == (2, TK, k)
    # [b, t, i] = logits[b, t + 1 + i] wherever that row exists (later rows are padding, never valid)
    for t in range(TK):
        for i in range(k):
            if t + 1 + i < T:
                assert torch.equal(out.target_logits[:, t, i], tout.logits[:, t + 1 + i])
    # a view of at most one padded copy of the logits' T + k - 3 rows, never a [B, T', k, V] gather
    rows = 2 * (T + k - 3) * V * tout.logits.element_size()
    assert out.target_logits.untyped_storage().nbytes() <= rows
    # hidden is the post-norm state the lm_head reads
    assert torch.allclose(drafter.lm_head(out.hidden), out.logits, atol=ATOL)
    # all supervised: step i of chain t is valid iff its label position t + 2 + i is inside the sequence
    want = torch.zeros(2, TK, k, dtype=torch.bool)
    for t in range(TK):
        for i in range(k):
            want[:, t, i] = t + 2 + i < T
    assert torch.equal(out.valid, want)
    assert out.valid[:, :, 0].all()  # every chain start, the last one (t = T - 3, label T - 1) included


def test_every_supervised_label_gets_a_step0_chain(drafter: Eagle3Drafter, target: Target):
    """Each supervised token that the draft can predict (it has two real tokens before it: the
    feature position and the teacher-forced token) is step 0 of exactly one valid chain, the tail
    of the sequence (its end-of-turn tokens) included."""
    batch = make_batch(B=3)
    am, lm = batch["attention_mask"], batch["loss_mask"]
    am[1, 12:] = False  # right padding
    lm[:, :4] = False  # the prompt
    lm[2, 7] = False  # a hole in the supervised span
    lm &= am
    out, _ = run(drafter, target, batch)
    want = set()  # (b, label position)
    for b in range(3):
        for s in range(2, T):
            if am[b, s] and lm[b, s] and am[b, s - 1] and am[b, s - 2]:
                want.add((b, s))
    got = set()
    for b, t in out.valid[:, :, 0].nonzero().tolist():
        got.add((b, t + 2))  # step 0 of chain t predicts the token at t + 2
    assert got == want, f"labels without a step-0 chain: {sorted(want - got)}; extra: {sorted(got - want)}"
    assert {(0, T - 1), (2, T - 1), (1, 11)} <= want  # the last real token of every sequence is supervised


def test_valid_is_the_prefix_of_supervised_labels(drafter: Eagle3Drafter, target: Target):
    batch = make_batch()
    am, lm = batch["attention_mask"], batch["loss_mask"]
    am[1, 11:] = False  # right padding
    lm[:, :5] = False  # the prompt
    lm[0, 9] = False  # a hole in the supervised span
    lm &= am
    out, _ = run(drafter, target, batch)
    for b in range(2):
        for t in range(TK):
            for i in range(k):
                ok = bool(am[b, t] and am[b, t + 1])
                for j in range(i + 1):  # step j predicts the token at t + 2 + j
                    s = t + 2 + j
                    ok = ok and s < T and bool(am[b, s] and lm[b, s])
                assert bool(out.valid[b, t, i]) == ok, (b, t, i)


def test_batch_may_be_an_object_and_bad_input_fails(drafter: Eagle3Drafter, target: Target):
    batch = make_batch()
    out, tout = run(drafter, target, batch)
    out2 = drafter.training_forward(SimpleNamespace(**batch), tout)
    assert torch.equal(out.logits, out2.logits)
    with pytest.raises(ValueError, match="loss_mask"):
        drafter.training_forward({name: v for name, v in batch.items() if name != "loss_mask"}, tout)
    with pytest.raises(ValueError, match="at least 3"):
        short = {name: v[:, :2] for name, v in batch.items()}
        drafter.training_forward(short, TargetOutput(tout.logits[:, :2], tout.hidden, tout.features[:, :2]))
    # shorter than the unroll is fine: 3 tokens give one chain whose step 0 alone has a label
    short = {name: v[:, :3] for name, v in batch.items()}
    out3 = drafter.training_forward(short, TargetOutput(tout.logits[:, :3], tout.hidden, tout.features[:, :3]))
    assert out3.valid.shape == (2, 1, k) and out3.valid[:, 0].tolist() == [[True] + [False] * (k - 1)] * 2
    with pytest.raises(ValueError, match="features"):
        drafter.training_forward(batch, TargetOutput(tout.logits, tout.hidden, tout.features[..., :-1]))


def _moved(rows: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """rows [R, T', k, Vd] vs base [T', k, Vd] -> max |difference| per [R, T', k]."""
    return (rows - base).abs().amax(-1)


def _check_dependence(diff: torch.Tensor, allowed: torch.Tensor, inert: torch.Tensor | None = None) -> None:
    """Forbidden inputs leave logits bit-identical; allowed ones move them, except where
    ``inert`` marks an allowed input that cannot matter (a query's only key)."""
    must_move = allowed if inert is None else allowed & ~inert
    assert (diff[must_move] > MOVED).all(), "an allowed input did not reach the logits"
    assert (diff[~allowed] <= SAME).all(), "a forbidden input leaked into the logits"


def test_step_logits_read_only_allowed_tokens_and_features(drafter: Eagle3Drafter, target: Target):
    """Row s perturbs one input; logits[t, i] may change iff the reference lets (t, i) read it:
    features f_0..f_t (step-0 keys, causal) and tokens x_1..x_{t+1+i} (keys, own chain)."""
    batch = make_batch(B=1)
    out, tout = run(drafter, target, batch)
    base = out.logits[0]
    t = torch.arange(TK)[:, None]  # [T', 1]
    i = torch.arange(k)[None, :]  # [1, k]
    R = T  # one row per perturbed position s = 0..T-1
    rows = {name: v.expand(R, -1).clone() for name, v in batch.items()}
    # tokens: row s replaces x_s (features kept, so only the token path changes)
    s = torch.arange(R)
    rows["input_ids"][s, s] = 3 + (rows["input_ids"][s, s] - 3 + 1) % (V - 3)
    feats = tout.features.expand(R, -1, -1)
    by_token = drafter.training_forward(rows, TargetOutput(tout.logits.expand(R, -1, -1), None, feats))
    allowed = (s[:, None, None] >= 1) & (s[:, None, None] <= t + 1 + i)  # [R, T', k]
    _check_dependence(_moved(by_token.logits, base), allowed)
    # features: row s moves f_s
    g = torch.Generator().manual_seed(1)
    feats = feats.clone()
    feats[s, s] += torch.randn(R, feats.shape[-1], generator=g)
    rows = {name: v.expand(R, -1) for name, v in batch.items()}
    by_feat = drafter.training_forward(rows, TargetOutput(tout.logits.expand(R, -1, -1), None, feats))
    allowed = (s[:, None, None] <= t).expand(R, TK, k)
    _check_dependence(_moved(by_feat.logits, base), allowed)


@pytest.mark.parametrize("step", list(range(k)))
def test_attention_pattern_diagonal_keys(drafter: Eagle3Drafter, target: Target, step: int):
    """Row r moves the step-`step` key at index r (a k_proj hook). Step-0 keys are seen by every
    later index (causal); a step-j key (j >= 1) only by its own index at steps >= j."""
    batch = make_batch(B=1)
    out, tout = run(drafter, target, batch)
    R = TK
    rows = {name: v.expand(R, -1) for name, v in batch.items()}
    tout_r = TargetOutput(tout.logits.expand(R, -1, -1), None, tout.features.expand(R, -1, -1))
    kv = drafter.config.num_kv_heads * drafter.config.head_dim
    noise = torch.zeros(R, TK, kv)
    r = torch.arange(R)
    noise[r, r] = torch.randn(R, kv, generator=torch.Generator().manual_seed(2))
    calls = []

    def hook(_module, _inputs, output):
        calls.append(None)
        return output + noise if len(calls) - 1 == step else output

    handle = drafter.midlayer.self_attn.k_proj.register_forward_hook(hook)
    try:
        moved = drafter.training_forward(rows, tout_r)
    finally:
        handle.remove()
    assert len(calls) == k  # one k_proj call per step
    t = torch.arange(TK)[None, :, None]
    i = torch.arange(k)[None, None, :]
    rr = r[:, None, None]
    allowed = (rr <= t) if step == 0 else ((rr == t) & (i >= step))
    only_key = (t + i == 0).expand(R, TK, k)  # query (0, 0) sees one key: its score cannot matter
    _check_dependence(_moved(moved.logits, out.logits[0]), allowed.expand(R, TK, k), only_key)


def test_gradients_reach_the_draft_not_the_embedding(target: Target):
    d = make_drafter(target).train()
    out, _ = run(d, target, make_batch())
    (out.logits.logsumexp(-1).sum() + out.hidden.sum()).backward()
    for name, p in d.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert target.embed_tokens.weight.grad is None


# ----------------------------------------------------------------------------- inference session
@torch.no_grad()
def teacher_forced(s: Eagle3Session, tokens: Tensor) -> Tensor:
    """Draft logits [j+1, Vd] after the session's committed context when the chain is fed
    ``tokens`` [j] (target ids) instead of its own drafts: row 0 is the first proposal's logits,
    row i those of draft step i. Leaves no speculative keys behind."""
    d = s.drafter
    s._cache.crop(s.committed)
    out, h = [s._logits], s._h
    for j in range(tokens.shape[0]):
        h, hn = s._step(d.embed(tokens[j : j + 1][None]), h)
        out.append(d.lm_head(hn[0, 0]))
    s._cache.crop(s.committed)
    return torch.stack(out)


def test_session_equals_training_unroll(drafter: Eagle3Drafter, target: Target):
    """Context ending at t, then the chain fed x_{t+2}.. (teacher forcing): step i of the session
    must give training_forward's logits[t, i] (its 'diagonal' keys are the session's own drafts).
    The tail chains (t + k >= T) are checked on the steps whose inputs exist: the padding the
    unroll reads past the sequence end must not reach them."""
    batch = make_batch(B=1)
    out, tout = run(drafter, target, batch)
    ids, f = batch["input_ids"][0], tout.features[0]
    for t in range(TK):
        s = drafter.new_session()
        s.extend(f[: t + 1], ids[1 : t + 2])  # tokens[j] follows position j
        got = teacher_forced(s, ids[t + 2 : t + k + 1])  # [min(k, T - 1 - t), Vd]
        n = got.shape[0]
        assert n == min(k, T - 1 - t)
        assert torch.allclose(got, out.logits[0, t, :n], atol=ATOL), t


def test_session_incremental_extend_drops_speculative_keys(drafter: Eagle3Drafter, target: Target):
    batch = make_batch(B=1, seed=3)
    out, tout = run(drafter, target, batch)
    ids, f = batch["input_ids"][0], tout.features[0]
    s = drafter.new_session()
    s.extend(f[:3], ids[1:4])
    s.propose(3)
    s.extend(f[3:4], ids[4:5])
    s.propose(2, temperature=1.0, generator=torch.Generator().manual_seed(0))
    teacher_forced(s, ids[:2])
    s.extend(f[4:9], ids[5:10])
    assert s.committed == 9
    assert torch.allclose(teacher_forced(s, ids[10 : 9 + k]), out.logits[0, 8], atol=ATOL)


def test_session_cache_grows_past_its_capacity(drafter: Eagle3Drafter, target: Target):
    n = 270  # initial capacity is 256 slots
    batch = make_batch(B=1, length=n, seed=4)
    out, tout = run(drafter, target, batch)
    ids, f = batch["input_ids"][0], tout.features[0]
    s = drafter.new_session()
    for a, b in [(0, 100), (100, 200), (200, 261)]:
        s.extend(f[a:b], ids[a + 1 : b + 1])
    assert torch.allclose(teacher_forced(s, ids[262 : 261 + k]), out.logits[0, 260], atol=ATOL)


def test_greedy_propose_is_the_training_argmax_chain(drafter: Eagle3Drafter, target: Target):
    """Feed the greedy proposal back as the data: the unroll's argmax and accept-head probability
    at each step reproduce the proposal (head on the post-norm hidden state)."""
    batch = make_batch(B=1, seed=5)
    tout = target(batch["input_ids"], batch["attention_mask"], drafter.target_layer_ids)
    ids, f = batch["input_ids"][0], tout.features[0]
    torch.manual_seed(0)
    head = AcceptHead(drafter.hidden_size)
    t = 6
    s = drafter.new_session(head=head)
    s.extend(f[: t + 1], ids[1 : t + 2])
    p = s.propose(k)
    assert p.tokens.shape == (k,) and p.q is None and p.head_probs.shape == (k,)
    assert drafter.t2d[p.tokens].all()
    fed = {name: v.clone() for name, v in batch.items()}
    fed["input_ids"][0, t + 2 : t + 1 + k] = p.tokens[:-1]
    out, _ = run(drafter, target, fed)  # features at <= t do not depend on later tokens
    assert torch.equal(target_ids(drafter.d2t)[out.logits[0, t].argmax(-1)], p.tokens)
    assert torch.allclose(torch.sigmoid(head(out.hidden[0, t])), p.head_probs, atol=ATOL)


def test_sampled_propose_q(drafter: Eagle3Drafter, target: Target):
    batch = make_batch(B=1, seed=6)
    tout = target(batch["input_ids"], batch["attention_mask"], drafter.target_layer_ids)
    s = drafter.new_session()
    s.extend(tout.features[0, :8], batch["input_ids"][0, 1:9])
    kw = {"temperature": 0.8, "top_k": 10, "top_p": 0.9}
    p = s.propose(k, **kw, generator=torch.Generator().manual_seed(0))
    assert p.q.shape == (k, V) and p.tokens.shape == (k,)
    assert torch.allclose(p.q.sum(-1), torch.ones(k), atol=ATOL)
    assert (p.q[:, ~drafter.t2d] == 0).all()  # mass only at draft-vocabulary ids
    assert (p.q.gather(1, p.tokens[:, None]) > 0).all()
    assert ((p.q > 0).sum(-1) <= 10).all()  # top-k
    # row j is the warped draft distribution of step j, given the sampled tokens before it
    lg = teacher_forced(s, p.tokens[:-1])  # [k, Vd]
    assert torch.allclose(p.q[:, target_ids(drafter.d2t)], warp_logits(lg, **kw), atol=ATOL)
    again = s.propose(k, **kw, generator=torch.Generator().manual_seed(0))
    assert torch.equal(again.tokens, p.tokens)
    greedy = s.propose(k)
    assert torch.equal(s.propose(k, temperature=1.0, top_k=1).tokens, greedy.tokens)


@pytest.mark.parametrize("label", ["alive", "alpha"])
def test_early_exit_on_head_probability(drafter: Eagle3Drafter, target: Target, label: str):
    """VAT's head ("alive") is thresholded as it is; DSpark's confidence head ("alpha") by the running
    product of its sigmoids."""
    batch = make_batch(B=1, seed=7)
    tout = target(batch["input_ids"], batch["attention_mask"], drafter.target_layer_ids)
    f, ids = tout.features[0, :8], batch["input_ids"][0, 1:9]
    torch.manual_seed(1)
    head = AcceptHead(drafter.hidden_size, label=label)
    torch.nn.init.normal_(head.proj.weight, std=1.0)
    full = drafter.new_session(head=head)
    full.extend(f, ids)
    ref = full.propose(k)
    probs = ref.head_probs.tolist()
    # what the exit compares with the threshold, by the head's rule (a float32 product, as decoding's)
    alive = probs if label == "alive" else ref.head_probs.cumprod(0).tolist()
    for thr in sorted(alive) + [0.0, 1.1]:
        s = drafter.new_session(head=head, exit_threshold=thr)
        s.extend(f, ids)
        p = s.propose(k)
        cut = next((j for j, x in enumerate(alive) if x < thr), k)  # first position below: dropped
        assert len(p) == cut, (thr, probs)
        assert torch.equal(p.tokens, ref.tokens[:cut]) and torch.allclose(p.head_probs, ref.head_probs[:cut])
    with pytest.raises(ValueError, match="head"):
        drafter.new_session(exit_threshold=0.5)


def test_bfloat16_drafter_runs(target: Target):
    d = make_drafter(target).to(torch.bfloat16)
    assert d._inv_freq.dtype == torch.float32  # RoPE frequencies are not rounded
    out, tout = run(d, target, make_batch())
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.logits.float()).all()
    s = d.new_session()
    s.extend(tout.features[0, :5], make_batch()["input_ids"][0, 1:6])
    p = s.propose(3, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert p.tokens.shape == (3,) and p.q.dtype == torch.float32
