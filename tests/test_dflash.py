"""DFlash drafter: reference layer ids, served parameter names, mask-token choice, anchor sampling,
the block attention mask (no leaks), and agreement between training and the inference session."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.conftest import tiny_llama
from vatspec.drafters.base import AcceptHead, DraftOutput
from vatspec.drafters.dflash import (
    Anchors,
    DFlashConfig,
    DFlashDrafter,
    default_target_layer_ids,
    pick_mask_token,
)
from vatspec.drafters.dflash import session as dflash_session
from vatspec.target import Target

BLOCK = 4  # k = 3 slots: small enough for hand-checked indices
ATOL = 1e-5  # float32: training (masked, many keys) vs session (unmasked, few keys) differ by summation order
ATOL_REAL = 1e-4  # the same on SmolLM2's 49k-way logits of magnitude ~10-30


@pytest.fixture(scope="module")
def target() -> Target:
    return Target(tiny_llama(vocab_size=64, hidden_size=32, layers=6), tokenizer=None)


def make_drafter(target: Target, *, num_layers: int = 2, seed: int = 0, **kw) -> DFlashDrafter:
    torch.manual_seed(seed)
    d = DFlashDrafter(DFlashConfig.from_target(target, num_layers=num_layers, block_size=BLOCK, **kw))
    d.attach_target(target)
    # random norm weights, so a wrong norm or a skipped layer shows up in the comparisons
    with torch.no_grad():
        for name, p in d.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return d.eval()


def make_batch(T: int = 14, B: int = 2, seed: int = 1, prompt: int = 3, V: int = 64) -> SimpleNamespace:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, T), generator=g)
    attn = torch.ones(B, T, dtype=torch.bool)
    loss = torch.zeros(B, T, dtype=torch.bool)
    loss[:, prompt:] = True
    return SimpleNamespace(input_ids=ids, attention_mask=attn, loss_mask=loss)


def features_for(target: Target, drafter: DFlashDrafter, batch, *, logits_at=None):
    return target(batch.input_ids, batch.attention_mask, drafter.target_layer_ids, logits_at=logits_at)


# ----------------------------------------------------------------------------- config
def test_target_layer_ids_follow_reference_formula():
    # SmolLM2-135M: 30 layers. n=1 -> L//2; else round(1 + i*(L-4)/(n-1)), Python round (half to even)
    assert default_target_layer_ids(30, 1) == [15]
    assert default_target_layer_ids(30, 3) == [1, 14, 27]
    assert default_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]  # 7.5 -> 8, 20.5 -> 20
    # the reference's own 5-layer checkpoint config (52-layer target): [1, 13, 25, 37, 49]
    assert default_target_layer_ids(52, 5) == [1, 13, 25, 37, 49]


def test_config_defaults_to_target_and_round_trips(target):
    c = DFlashConfig.from_target(target, num_layers=2, block_size=8)
    assert list(c.target_layer_ids) == default_target_layer_ids(6, 2) == [1, 3]
    assert DFlashConfig.from_target(target).target_layer_ids == (3,)  # L // 2
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (32, 4, 2, 8)
    assert c.intermediate_size == 64 and c.vocab_size == 64 and c.block_size == 8
    assert (c.mask_source, c.mask_token_id) == ("learned", 64)  # no tokenizer: a learned row
    assert DFlashConfig.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match="DFlashConfig: unknown keys"):
        DFlashConfig.from_dict({**c.to_dict(), "blocksize": 8})
    o = DFlashConfig.from_target(target, mask_token_id=5)
    assert (o.mask_source, o.mask_token_id) == ("override", 5)


def test_parameter_names_match_served_format(target):
    d = make_drafter(target, num_layers=2, mask_token_id=5)
    c, H, hd = d.config, 32, 8
    want = {"fc.weight": (H, 2 * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(2):
        p = f"layers.{i}."
        want |= {
            p + "self_attn.q_proj.weight": (4 * hd, H), p + "self_attn.k_proj.weight": (2 * hd, H),
            p + "self_attn.v_proj.weight": (2 * hd, H), p + "self_attn.o_proj.weight": (H, 4 * hd),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (c.intermediate_size, H), p + "mlp.up_proj.weight": (c.intermediate_size, H),
            p + "mlp.down_proj.weight": (H, c.intermediate_size),
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
        }
    assert {name: tuple(v.shape) for name, v in d.state_dict().items()} == want  # no target weights, no buffers
    assert (d.kind, d.schedule, d.d2t, d.t2d, d.block_size, d.hidden_size) == ("dflash", "dflash", None, None, 4, 32)
    assert d.k == d.config.k == 3  # block 4 = the anchor + 3 drafted slots
    learned = make_drafter(target)
    assert set(learned.state_dict()) == set(want) | {"mask_embedding"}


def test_attach_target_checks_shape(target):
    d = DFlashDrafter(DFlashConfig.from_target(target, block_size=BLOCK))
    other = Target(tiny_llama(vocab_size=64, hidden_size=48, layers=6), tokenizer=None)
    with pytest.raises(ValueError, match="does not match"):
        d.attach_target(other)
    with pytest.raises(RuntimeError, match="attach_target"):
        d.embed(torch.tensor([1]))


class FakeTokenizer:
    """Just what pick_mask_token reads: length, special ids, added tokens, a chat template."""

    def __init__(self, n, specials, *, mask=None, template_ids=()):
        self.n, self.mask_token_id, self.mask_token = n, mask, None if mask is None else "<mask>"
        self.all_special_ids = [0, 1, 2]  # unk, bos, eos
        self.added_tokens_decoder = {i: SimpleNamespace(content=f"<s{i}>", special=True) for i in specials}
        self.template_ids = list(template_ids)
        self.chat_template = "x" if template_ids else None

    def __len__(self):
        return self.n

    def apply_chat_template(self, conversation, tokenize=True, add_generation_prompt=False):
        return {"input_ids": self.template_ids}


def test_mask_token_choice_order():
    V = 100
    assert pick_mask_token(FakeTokenizer(100, [0, 1, 2, 7], mask=9), V) == (9, "tokenizer", "<mask>")
    assert pick_mask_token(FakeTokenizer(90, [0, 1, 2, 7]), V) == (90, "unused_row", "<|MASK|>")  # padded embedding
    # full vocabulary: the highest special the template and eos/bos/unk never use
    tok = FakeTokenizer(100, [0, 1, 2, 5, 6, 7], template_ids=[1, 7, 40, 2])
    assert pick_mask_token(tok, V) == (6, "special", "<s6>")
    assert pick_mask_token(tok, V, exclude=[6]) == (5, "special", "<s5>")
    assert pick_mask_token(FakeTokenizer(100, [0, 1, 2]), V) == (100, "learned", None)
    assert pick_mask_token(None, V) == (100, "learned", None)


# ----------------------------------------------------------------------------- anchors and validity
def test_sample_anchors_inside_supervised_span(target):
    d = make_drafter(target)
    b = make_batch(T=12, B=3)
    b.loss_mask[1] = False
    b.loss_mask[1, 8:10] = True  # one candidate: 8 (9's successor is unsupervised)
    b.loss_mask[2] = False  # none
    b.attention_mask[0, 11] = False
    a = d.sample_anchors(b, 100, torch.Generator().manual_seed(0))
    assert a.positions.shape == (3, 7)  # row 0: candidates 3..9 (10's successor is padding)
    assert a.positions[0].tolist() == list(range(3, 10)) and a.valid[0].all()
    assert a.positions[1].tolist() == [8, 0, 0, 0, 0, 0, 0] and a.valid[1].tolist() == [True] + [False] * 6
    assert not a.valid[2].any()
    few = d.sample_anchors(b, 3, torch.Generator().manual_seed(0))
    assert few.positions.shape == (3, 3)
    row = few.positions[0].tolist()
    assert row == sorted(set(row)) and all(3 <= p <= 9 for p in row)
    again = d.sample_anchors(b, 3, torch.Generator().manual_seed(0))
    assert torch.equal(few.positions, again.positions)  # reproducible from the generator


def test_chain_valid_and_logit_positions_against_loops(target):
    d = make_drafter(target)
    b = make_batch(T=10, B=2)
    b.loss_mask[0, 7] = False  # a hole: the chain stops before it
    b.attention_mask[1, 9] = False
    b.loss_mask[1, 9] = False
    a = Anchors(torch.tensor([[3, 5, 8], [4, 6, 0]]), torch.tensor([[True, True, True], [True, True, False]]))
    valid, at = d.chain_valid(b, a), d.logits_positions(b, a)
    want_at = torch.zeros(2, 10, dtype=torch.bool)
    for i in range(2):
        for j in range(3):
            alive = bool(a.valid[i, j])
            for slot in range(1, BLOCK):
                p = int(a.positions[i, j]) + slot
                alive = alive and p < 10 and bool(b.loss_mask[i, p]) and bool(b.attention_mask[i, p])
                assert bool(valid[i, j, slot - 1]) == alive, (i, j, slot)
                if alive:
                    want_at[i, p - 1] = True
    assert torch.equal(at, want_at)
    assert valid[0, 1].tolist() == [True, False, False]  # anchor 5: label 6 ok, 7 is the hole
    assert valid[0, 2].tolist() == [True, False, False]  # anchor 8: label 9 ok, 10 is past the end


def test_training_forward_shapes_and_compact_target_logits(target):
    d = make_drafter(target)
    b = make_batch()
    anchors = d.sample_anchors(b, 5, torch.Generator().manual_seed(3))
    at = d.logits_positions(b, anchors)
    full = features_for(target, d, b)
    compact = features_for(target, d, b, logits_at=at)
    assert compact.logits.shape == (int(at.sum()), 64)
    out = d.training_forward(b, compact, anchors)
    ref = d.training_forward(b, full, anchors)
    B, A, k = 2, 5, BLOCK - 1
    assert isinstance(out, DraftOutput)
    assert out.logits.shape == (B, A, k, 64) and out.logits.dtype == torch.float32
    assert out.hidden.shape == (B, A, k, 32) and out.valid.shape == (B, A, k)
    v = out.valid
    torch.testing.assert_close(out.target_logits[v], ref.target_logits[v], rtol=0, atol=0)
    torch.testing.assert_close(out.logits, ref.logits)
    # target_logits[b, a, s-1] = the target's logits at anchor + s - 1 (predicting anchor + s), at
    # every valid slot s: tensor index i (slot i + 1) reads position anchor + i
    assert v.sum() > B  # more than one slot per sequence is checked
    for row, anchor, i in v.nonzero().tolist():
        p = int(anchors.positions[row, anchor]) + i
        torch.testing.assert_close(ref.target_logits[row, anchor, i], full.logits[row, p], rtol=0, atol=0)
    # hidden is what the logits read: the final-normed state
    torch.testing.assert_close(out.logits, d.compute_logits(out.hidden))


def test_gradients_reach_drafter_only(target):
    d = make_drafter(target).train()
    b = make_batch()
    out = d.training_forward(b, features_for(target, d, b), num_anchors=4, generator=torch.Generator().manual_seed(0))
    loss = torch.nn.functional.cross_entropy(out.logits[out.valid], out.target_logits[out.valid].softmax(-1))
    loss.backward()
    for name, p in d.named_parameters():  # incl. the learned mask row
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert all(p.grad is None for p in target.model.parameters())


# ----------------------------------------------------------------------------- no leak
def test_block_sees_only_its_anchor_and_earlier_context(target):
    d = make_drafter(target)
    T, B = 16, 1
    b = make_batch(T=T, B=B)
    anchors = Anchors(torch.tensor([[4, 6, 9, 12]]), torch.ones(1, 4, dtype=torch.bool))
    g = torch.Generator().manual_seed(5)
    feats = torch.randn(B, T, 2 * 32, generator=g)
    logits = torch.randn(B, T, 64, generator=g)

    def run(ids=None, f=None, a=anchors):
        batch = SimpleNamespace(**{**vars(b), "input_ids": b.input_ids if ids is None else ids})
        tout = SimpleNamespace(features=feats if f is None else f, logits=logits)
        return d.training_forward(batch, tout, a).logits[0]  # [A, k, V]

    base = run()
    for j, a in enumerate(anchors.positions[0].tolist()):
        for p in range(T):  # any token but the anchor: labels, later tokens, other blocks' anchors
            if p == a:
                continue
            ids = b.input_ids.clone()
            ids[0, p] = (ids[0, p] + 1) % 64
            assert torch.equal(run(ids=ids)[j], base[j]), f"block {j} (anchor {a}) saw token {p}"
        f = feats.clone()
        f[0, a:] += 10.0  # context at or after the anchor
        assert torch.equal(run(f=f)[j], base[j]), f"block {j} saw features at or after its anchor"
        # allowed inputs do change it: the anchor token, and context before the anchor
        ids = b.input_ids.clone()
        ids[0, a] = (ids[0, a] + 1) % 64
        assert not torch.allclose(run(ids=ids)[j], base[j])
        f = feats.clone()
        f[0, a - 1] += 10.0
        assert not torch.allclose(run(f=f)[j], base[j])
        # and alone it computes what it computed next to the others (no cross-block attention)
        alone = run(a=Anchors(anchors.positions[:, j : j + 1], anchors.valid[:, j : j + 1]))[0]
        torch.testing.assert_close(alone, base[j], rtol=0, atol=ATOL)


# ----------------------------------------------------------------------------- inference
def test_session_matches_training_forward(target, monkeypatch):
    monkeypatch.setattr(dflash_session, "MIN_CACHE", 2)  # so the context cache has to grow
    d = make_drafter(target)
    b = make_batch(T=16, B=1)
    tout = features_for(target, d, b)
    ids, feats = b.input_ids[0], tout.features[0]
    anchors = Anchors(torch.tensor([[5, 11]]), torch.ones(1, 2, dtype=torch.bool))
    train = d.training_forward(b, tout, anchors)
    s = d.new_session()
    # prefill 0..2, then two rounds; tokens[j] = the token after position j, the last one pending
    s.extend(feats[:3], ids[1:4])
    s.extend(feats[3:5], ids[4:6])
    assert s.length == 5 and int(s.pending[0]) == int(ids[5])
    logits, hidden = s.draft_block()
    torch.testing.assert_close(logits, train.logits[0, 0], rtol=0, atol=ATOL)
    torch.testing.assert_close(hidden, train.hidden[0, 0], rtol=0, atol=ATOL)
    s.extend(feats[5:11], ids[6:12])  # positions continue from 5
    torch.testing.assert_close(s.draft_block()[0], train.logits[0, 1], rtol=0, atol=ATOL)
    big = d.new_session()
    for p in range(11):  # one position per round exercises the append path
        big.extend(feats[p : p + 1], ids[p + 1 : p + 2])
    torch.testing.assert_close(big.draft_block()[0], train.logits[0, 1], rtol=0, atol=ATOL)


class ScriptedHead(AcceptHead):
    """An accept head whose logits are fixed per slot: the exit rule is tested without training."""

    def __init__(self, logits, label: str = "alive"):
        super().__init__(1, label)
        self.logits = torch.tensor(logits)

    def forward(self, hidden):  # [k, H] -> [k]
        return self.logits[: hidden.shape[0]]


def test_propose_greedy_sampled_and_early_exit(target):
    d = make_drafter(target)
    b = make_batch(T=8, B=1)
    feats = features_for(target, d, b).features[0]
    s = d.new_session()
    s.extend(feats, torch.cat([b.input_ids[0, 1:], torch.tensor([9])]))
    logits, hidden = s.draft_block()
    few = s.draft_block(2)  # the whole block runs; only its first 2 slots reach the lm_head
    assert few[0].shape == (2, logits.shape[1]) and torch.equal(few[1], hidden[:2])
    torch.testing.assert_close(few[0], logits[:2], rtol=1e-6, atol=1e-6)
    p = s.propose(3)
    assert torch.equal(p.tokens, logits.argmax(-1)) and p.q is None and p.head_probs is None
    assert len(s.propose(2)) == 2 and len(s.propose(0)) == 0
    with pytest.raises(ValueError, match="block_size - 1"):
        s.propose(BLOCK)
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    p1 = s.propose(3, temperature=0.8, top_k=10, generator=g1)
    p2 = s.propose(3, temperature=0.8, top_k=10, generator=g2)
    assert p1.q.shape == (3, 64) and torch.equal(p1.tokens, p2.tokens)
    torch.testing.assert_close(p1.q.sum(-1), torch.ones(3))
    assert bool((p1.q.gather(1, p1.tokens[:, None]) > 0).all())  # sampled where q has mass
    assert (p1.q > 0).sum(-1).le(10).all()
    # the head keeps the leading slots with prob >= threshold: probs ~ [.88, .73, .27] -> keeps 2
    h = d.new_session(ScriptedHead([2.0, 1.0, -1.0]), exit_threshold=0.5)
    h.extend(feats, torch.cat([b.input_ids[0, 1:], torch.tensor([9])]))
    ph = h.propose(3, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert len(ph) == 2 and ph.q.shape == (2, 64)
    torch.testing.assert_close(ph.head_probs, torch.sigmoid(torch.tensor([2.0, 1.0])))
    h0 = d.new_session(ScriptedHead([-1.0, 3.0, 3.0]), exit_threshold=0.5)
    h0.extend(feats, torch.cat([b.input_ids[0, 1:], torch.tensor([9])]))
    assert len(h0.propose(3)) == 0  # cut at the first slot below: nothing kept
    no_exit = d.new_session(ScriptedHead([-1.0, 3.0, 3.0]))
    no_exit.extend(feats, torch.cat([b.input_ids[0, 1:], torch.tensor([9])]))
    assert len(no_exit.propose(3).head_probs) == 3
    with pytest.raises(ValueError, match="accept head"):
        d.new_session(exit_threshold=0.5)


def test_confidence_head_exits_on_the_running_product(target):
    """DSpark's confidence head (label "alpha"): a slot is kept while the product of the sigmoids so far
    stays >= the threshold; VAT's head (label "alive") thresholds each sigmoid as it is."""
    d = make_drafter(target)
    b = make_batch(T=8, B=1)
    feats = features_for(target, d, b).features[0]
    kept = {}
    for label in ("alive", "alpha"):
        s = d.new_session(ScriptedHead([2.0, 2.0, 2.0], label), exit_threshold=0.7)
        s.extend(feats, torch.cat([b.input_ids[0, 1:], torch.tensor([9])]))
        kept[label] = len(s.propose(3))
    # sigmoid(2) = 0.881 each; running product 0.881 0.776 0.684: the third falls below 0.7
    assert kept == {"alive": 3, "alpha": 2}


def test_scaled_rope_builds(target):
    c = DFlashConfig.from_target(
        target, block_size=BLOCK,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64},
    )
    d = DFlashDrafter(c)
    plain = DFlashDrafter(DFlashConfig.from_target(target, block_size=BLOCK))
    assert d.inv_freq.shape == plain.inv_freq.shape == (4,)
    assert not torch.allclose(d.inv_freq, plain.inv_freq)  # low frequencies stretched


@pytest.mark.slow
def test_default_smollm2_target(default_target_path):
    t = Target.from_pretrained(default_target_path)
    c = DFlashConfig.from_target(t, block_size=16)
    assert c.target_layer_ids == (15,)
    assert (c.mask_token_id, c.mask_source, c.mask_token) == (16, "special", "<empty_output>")  # never templated
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (576, 9, 3, 64)
    assert (c.rope_theta, c.rope_scaling, c.vocab_size) == (100000.0, None, 49152)
    torch.manual_seed(0)
    d = DFlashDrafter(c)
    d.attach_target(t)
    d.eval()
    chat = [{"role": "user", "content": "Name three colours."}, {"role": "assistant", "content": "Red, green, blue."}]
    ids = torch.tensor(t.tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"])[None]
    T = ids.shape[1]
    b = SimpleNamespace(input_ids=ids, attention_mask=torch.ones(1, T, dtype=torch.bool),
                        loss_mask=torch.arange(T)[None] >= T - 8)
    anchors = Anchors(torch.tensor([[T - 7]]), torch.ones(1, 1, dtype=torch.bool))
    tout = t(ids, b.attention_mask, d.target_layer_ids, logits_at=d.logits_positions(b, anchors))
    train = d.training_forward(b, tout, anchors)
    s = d.new_session()
    s.extend(tout.features[0, : T - 7], ids[0, 1 : T - 6])
    torch.testing.assert_close(s.draft_block()[0], train.logits[0, 0], rtol=0, atol=ATOL_REAL)


def test_registry_flow(target):
    # the loop's three calls (vatspec.drafters docstring), through the registry
    from vatspec.config import DrafterConfig
    from vatspec.drafters import build_drafter, drafter_from_dict, plan_batch

    cfg = DrafterConfig(kind="dflash", num_layers=1, block_size=BLOCK, num_anchors=3)
    d = build_drafter(cfg, target)
    b = make_batch()
    plan = plan_batch(d, b, cfg, torch.Generator().manual_seed(0))
    tout = target(b.input_ids, b.attention_mask, d.target_layer_ids, logits_at=plan.logits_at)
    out = d.training_forward(b, tout, **plan.kwargs)
    assert out.valid.shape == (2, 3, BLOCK - 1) and out.valid.any()
    again = drafter_from_dict("dflash", d.config.to_dict(), target)
    assert again.config == d.config
