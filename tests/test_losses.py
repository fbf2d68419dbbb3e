"""Position weights, configs and the objective, against hand numbers and plain-loop references."""

from __future__ import annotations

import math

import pytest
import torch

from vatspec.drafters.base import DraftOutput
from vatspec.objective.losses import (
    ABLATIONS,
    LossConfig,
    _reduce,
    dflash_gamma,
    fixed_weights,
    hard_targets,
    soft_targets,
    token_ce,
    vat_objective,
    vat_weights,
)
from vatspec.objective.verify import simulate_verification

EXACT = 1e-6  # float32 round-off on O(1) weights and losses


def logits_for(ids: list, V: int) -> torch.Tensor:
    t = torch.tensor(ids)
    out = torch.zeros(*t.shape, V)
    out.scatter_(-1, t.unsqueeze(-1), 5.0)
    return out


def random_batch(N=32, k=5, Vd=4, V=6, seed=0, grad=False):
    """A DraftOutput with d2t draft 0 1 2 3 -> target 0 2 3 5 (target 1, 4 out of vocab)."""
    g = torch.Generator().manual_seed(seed)
    d2t = torch.tensor([0, 1, 1, 2])
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[[0, 2, 3, 5]] = True
    logits = torch.randn(N, k, Vd, generator=g).requires_grad_(grad)
    target = torch.randn(N, k, V, generator=g)
    target[..., [0, 2, 3, 5]] += 0.7
    lengths = torch.randint(0, k + 1, (N,), generator=g)
    valid = torch.arange(k) < lengths.unsqueeze(-1)
    out = DraftOutput(logits=logits, hidden=torch.zeros(N, k, 1), target_logits=target, valid=valid)
    return out, d2t, t2d


# ---------------------------------------------------------------------------------------------
# weights: hand-computed


def test_fixed_weights():
    assert fixed_weights(4, "eagle3").tolist() == pytest.approx([1, 0.8, 0.64, 0.512])
    g = 7.0  # pos = 0 1 2 -> w = 1 e^-1/7 e^-2/7
    assert fixed_weights(3, "dflash", gamma=g).tolist() == pytest.approx([1, math.exp(-1 / g), math.exp(-2 / g)])
    with pytest.raises(ValueError, match="schedule"):
        fixed_weights(3, "medusa")


def test_vat_weights_hand():
    # k = 4, chains: first reject at 1, at 0, none, and at 0 with only 2 valid positions
    draft = logits_for([[1, 0, 3, 4], [0, 2, 3, 4], [1, 2, 3, 4], [0, 2, 3, 4]], 5)
    target = logits_for([[1, 2, 3, 4]] * 4, 5)
    valid = torch.tensor([[True] * 4] * 3 + [[True, True, False, False]])
    v = simulate_verification(draft, target, valid)
    assert v.first_reject.tolist() == [1, 0, 4, 0]
    w = vat_weights(v, "eagle3")
    assert w[0].tolist() == pytest.approx([1, 1, 0.8, 0.64])  # r = 1: curve restarts at 1
    assert w[1].tolist() == pytest.approx([1, 0.8, 0.64, 0.512])  # r = 0: the fixed curve
    assert w[2].tolist() == pytest.approx([1, 1, 1, 1])  # accepts all
    assert w[3].tolist() == pytest.approx([1, 0.8, 0, 0])  # invalid tail gets 0
    wd = vat_weights(v, "dflash", gamma=5.0)
    assert wd[0].tolist() == pytest.approx([1, 1, math.exp(-1 / 5), math.exp(-2 / 5)])


def test_vat_weights_expected_hand():
    # alpha_0 = 0.5 exactly: draft uniform over 2 ids, target one-hot-ish on id 0 -> min sums to 0.5
    draft = torch.zeros(2, 2)  # q = (0.5, 0.5) at both positions
    target = torch.tensor([[30.0, 0.0], [30.0, 0.0]])  # p ~ (1, 0)
    v = simulate_verification(draft, target, mode="expected")
    torch.testing.assert_close(v.accept, torch.tensor([0.5, 0.5]))
    # alive = (1, 0.5); E[w_1] = 0.5 + 0.5 * 0.8 = 0.9
    torch.testing.assert_close(vat_weights(v, "eagle3"), torch.tensor([1.0, 0.9]))


# ---------------------------------------------------------------------------------------------
# weights: plain-loop reference over the distribution of the first rejection


def base(x, schedule, decay=0.8, gamma=7.0):
    return decay**x if schedule == "eagle3" else math.exp(-x / gamma)


def loop_weights(accept, valid, schedule, expected):
    """For each chain, enumerate every possible first rejection r with its probability
    (1 for the observed r in hard modes) and average the weight curve that r induces."""
    out = []
    for a, vc in zip(accept, valid):
        n = sum(vc)
        if expected:
            dist, run = [], 1.0
            for i in range(n):
                dist.append(run * (1 - a[i]))  # reach i, reject there
                run *= a[i]
            dist.append(run)  # r = n: nothing rejected
        else:
            r = next((i for i in range(n) if not a[i]), n)
            dist = [1.0 if i == r else 0.0 for i in range(n + 1)]
        w = []
        for j in range(len(vc)):
            if j >= n:
                w.append(0.0)
                continue
            w.append(sum(pr * (1.0 if j <= r else base(j - r, schedule)) for r, pr in enumerate(dist)))
        out.append(w)
    return out


@pytest.mark.parametrize("mode", ["greedy", "sampled", "expected"])
@pytest.mark.parametrize("schedule", ["eagle3", "dflash"])
def test_vat_weights_match_loop_reference(mode, schedule):
    out, d2t, _ = random_batch(seed=1)
    g = torch.Generator().manual_seed(0)
    v = simulate_verification(out.logits, out.target_logits, out.valid, mode=mode, d2t=d2t, generator=g)
    ref = loop_weights(v.accept.tolist(), out.valid.tolist(), schedule, mode == "expected")
    torch.testing.assert_close(vat_weights(v, schedule), torch.tensor(ref), atol=EXACT, rtol=0)


@pytest.mark.parametrize("mode", ["greedy", "sampled", "expected"])
def test_vat_weights_dominate_fixed_and_carry_no_grad(mode):
    out, d2t, _ = random_batch(seed=2, grad=True)
    v = simulate_verification(out.logits, out.target_logits, out.valid, mode=mode, d2t=d2t)
    for schedule in ("eagle3", "dflash"):
        w = vat_weights(v, schedule)
        fixed = fixed_weights(w.shape[-1], schedule) * out.valid
        assert (w >= fixed - EXACT).all()
        assert not w.requires_grad


# ---------------------------------------------------------------------------------------------
# config


def test_presets_resolve_to_the_right_switches():
    e = LossConfig(kind="eagle3").resolve("eagle3")
    assert (e.weights, e.soft, e.hard, e.head, e.curve) == ("fixed", True, False, False, "eagle3")
    d = LossConfig(kind="dflash").resolve("dflash", block_size=16)
    assert (d.weights, d.soft, d.hard, d.head, d.curve, d.gamma) == ("fixed", False, True, False, "dflash", 7.0)
    for schedule in ("eagle3", "dflash"):
        vat = LossConfig(kind="vat").resolve(schedule, block_size=8)
        assert (vat.weights, vat.soft, vat.hard, vat.head, vat.beta) == ("adaptive", True, True, True, 1.0)
        assert vat.curve == schedule  # vat on eagle3 uses the 0.8 curve, on dflash the exponential
        assert vat.resolved and vat.resolve(schedule) == vat  # idempotent
    assert not LossConfig().resolved


def test_dflash_gamma_table():
    assert [dflash_gamma(b) for b in (16, 10, 8)] == [7.0, 5.0, 4.0]
    assert dflash_gamma(12) == 5.0  # round(12 / 2.3)
    with pytest.raises(ValueError, match="block_size"):
        LossConfig(kind="dflash").resolve("dflash")


def test_ablations_switch_one_part():
    base = LossConfig(kind="dflash").resolve("dflash", block_size=8)
    for part, changed in (("head", {"head"}), ("adaptive", {"weights"}), ("labels", {"soft"})):
        abl = LossConfig.ablation("dflash", part).resolve("dflash", block_size=8)
        diff = {f for f in ("weights", "soft", "hard", "head") if getattr(abl, f) != getattr(base, f)}
        assert diff == changed, part  # "labels" turns soft on; hard is already on in DFlash
    assert set(ABLATIONS) == {"head", "adaptive", "labels"}


@pytest.mark.parametrize(
    "field,value",
    [
        ("kind", "medusa"),
        ("weights", "cosine"),
        ("soft", "yes"),
        ("beta", -1.0),
        ("verify", "beam"),
        ("temperature", 0.0),
        ("decay", 1.5),
        ("gamma", 0.0),
        ("curve", "linear"),
    ],
)
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"LossConfig.{field}"):
        LossConfig(**{field: value})


def test_nothing_to_train_is_an_error():
    with pytest.raises(ValueError, match="nothing to train"):
        LossConfig(kind="eagle3", soft=False).resolve("eagle3")


# ---------------------------------------------------------------------------------------------
# objective


def eagle3_reference(out, d2t, t2d):
    """EAGLE-3's loss written step by step: at TTT step j, soft CE to the target softmax over the draft
    vocab, masked by loss mask and t2d[argmax], averaged over the supervised chains; 0.8**j sum."""
    ids = torch.arange(len(d2t)) + d2t
    total = torch.zeros(())
    for j in range(out.valid.shape[-1]):
        tl = out.target_logits[:, j]  # [N, V]
        target_p = torch.softmax(tl[:, ids], -1)
        mask = out.valid[:, j] & t2d[tl.argmax(-1)]
        logq = torch.log_softmax(out.logits[:, j], -1)
        loss_j = -(target_p * logq).sum(-1)[mask].sum() / max(int(mask.sum()), 1)
        total = total + 0.8**j * loss_j
    return total


def test_fixed_soft_no_head_equals_eagle3_reference():
    out, d2t, t2d = random_batch(seed=3)
    v = simulate_verification(out.logits, out.target_logits, out.valid, d2t=d2t)
    cfg = LossConfig(kind="vat", weights="fixed", soft=True, hard=False, kl=False, tv=False, lk=False, head=False,
                     head_label="alive", curve="eagle3")
    assert cfg.resolved  # every field set by hand: nothing for resolve to fill
    loss, parts = vat_objective(out, v, None, cfg, d2t=d2t, t2d=t2d)
    torch.testing.assert_close(loss, eagle3_reference(out, d2t, t2d), atol=EXACT, rtol=0)
    eagle3, _ = vat_objective(out, v, None, LossConfig(kind="eagle3").resolve("eagle3"), d2t=d2t, t2d=t2d)
    torch.testing.assert_close(eagle3, loss)
    assert set(parts) == {"loss", "soft", "weight_mean"}


def test_dflash_baseline_is_hard_ce_with_exponential_weights():
    out, d2t, t2d = random_batch(seed=4, k=3)
    v = simulate_verification(out.logits, out.target_logits, out.valid, d2t=d2t)
    cfg = LossConfig(kind="dflash").resolve("dflash", block_size=4)
    loss, _ = vat_objective(out, v, None, cfg, d2t=d2t, t2d=t2d)
    # block 4 = k + 1 is not in the reference table: gamma = round(4 / 2.3) = round(1.74) = 2,
    # so pos = 0 1 2 -> w = 1 e^-1/2 e^-2/2
    w = [1.0, math.exp(-0.5), math.exp(-1.0)]
    # hard labels by hand: draft 0 1 2 3 <- target 0 2 3 5; target 1 and 4 are out of vocab (no loss)
    draft_id = {0: 0, 2: 1, 3: 2, 5: 3}
    ref, oov = 0.0, 0
    for j in range(3):
        total, n = 0.0, 0
        for c in range(out.valid.shape[0]):
            label = draft_id.get(int(out.target_logits[c, j].argmax()))
            oov += bool(out.valid[c, j]) and label is None
            if not out.valid[c, j] or label is None:
                continue
            total = total - torch.log_softmax(out.logits[c, j], -1)[label]
            n += 1
        ref = ref + w[j] * total / max(n, 1)
    assert (~out.valid).any() and oov > 0  # invalid and out-of-vocab positions both occur
    torch.testing.assert_close(loss, torch.as_tensor(ref, dtype=loss.dtype), atol=EXACT, rtol=0)


def test_reduction_worked_example():
    # ce = [[1, 2], [3, 4]], w = [[1, 1], [1, 0.8]], chain 1 position 1 unsupervised:
    # j=0: (1 + 3)/2 = 2; j=1: 2/1 = 2 -> 4
    ce = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    w = torch.tensor([[1.0, 1.0], [1.0, 0.8]])
    mask = torch.tensor([[True, True], [True, False]])
    assert _reduce(w * ce, mask).item() == pytest.approx(4.0)


def test_ablation_losses_differ_only_in_their_part():
    out, d2t, t2d = random_batch(seed=5, k=4)
    head = torch.randn(out.valid.shape)
    v = simulate_verification(out.logits, out.target_logits, out.valid, d2t=d2t)
    kw = {"d2t": d2t, "t2d": t2d}

    def dflash(cfg: LossConfig) -> LossConfig:  # resolved for a DFlash drafter of block k + 1 = 5
        return cfg.resolve("dflash", block_size=5)

    base, pb = vat_objective(out, v, head, dflash(LossConfig(kind="dflash")), **kw)
    h, ph = vat_objective(out, v, head, dflash(LossConfig.ablation("dflash", "head")), **kw)
    a, pa = vat_objective(out, v, head, dflash(LossConfig.ablation("dflash", "adaptive")), **kw)
    lab, pl = vat_objective(out, v, head, dflash(LossConfig.ablation("dflash", "labels")), **kw)
    # head only: same hard term, plus beta * head
    assert set(ph) - set(pb) == {"head"}
    torch.testing.assert_close(ph["hard"], pb["hard"])
    torch.testing.assert_close(h, base + ph["head"])
    # adaptive only: same terms, hard term re-weighted upward (w >= fixed)
    assert set(pa) == set(pb) and pa["hard"] >= pb["hard"] and pa["weight_mean"] >= pb["weight_mean"]
    # soft + hard: same hard term, plus the soft one
    assert set(pl) - set(pb) == {"soft"}
    torch.testing.assert_close(pl["hard"], pb["hard"])
    torch.testing.assert_close(lab, base + pl["soft"])
    # full VAT is everything at once
    full, pf = vat_objective(out, v, head, dflash(LossConfig(kind="vat")), **kw)
    torch.testing.assert_close(full, pf["soft"] + pf["hard"] + pf["head"])


def test_head_bce_hand():
    # logit 0 -> BCE = log 2 whatever the label; averaged over the 3 valid positions
    out = DraftOutput(
        logits=logits_for([1, 0, 3], 5),
        hidden=torch.zeros(3, 1),
        target_logits=logits_for([1, 2, 3], 5),
        valid=torch.tensor([True, True, False]),
    )
    v = simulate_verification(out.logits, out.target_logits, out.valid)
    cfg = LossConfig(kind="vat", soft=False, hard=False, head=True, beta=0.5).resolve("eagle3")
    loss, parts = vat_objective(out, v, torch.zeros(3), cfg)
    assert parts["head"].item() == pytest.approx(math.log(2))
    assert loss.item() == pytest.approx(0.5 * math.log(2))
    with pytest.raises(ValueError, match="head_logits"):
        vat_objective(out, v, None, cfg)


def test_objective_refuses_an_unresolved_config():
    """The loss is resolved once, when the config loads; the objective does not resolve it again."""
    out, d2t, t2d = random_batch(seed=8)
    v = simulate_verification(out.logits, out.target_logits, out.valid, d2t=d2t)
    with pytest.raises(AssertionError, match="needs a resolved LossConfig.*resolve_loss"):
        vat_objective(out, v, None, LossConfig(kind="eagle3"), d2t=d2t, t2d=t2d)
    loss, _ = vat_objective(out, v, None, LossConfig(kind="eagle3").resolve("eagle3"), d2t=d2t, t2d=t2d)
    assert torch.isfinite(loss)


@pytest.mark.parametrize("mode", ["greedy", "expected"])
def test_masked_positions_get_zero_gradient(mode):
    out, d2t, t2d = random_batch(seed=6, grad=True)
    head = torch.randn(out.valid.shape, requires_grad=True)
    v = simulate_verification(out.logits, out.target_logits, out.valid, mode=mode, d2t=d2t)
    loss, parts = vat_objective(out, v, head, LossConfig(kind="vat").resolve("eagle3"), d2t=d2t, t2d=t2d)
    loss.backward()
    _, in_vocab = hard_targets(v, d2t, t2d, out.target_logits.shape[-1])
    unsup = ~(out.valid & in_vocab)
    assert unsup.any() and (out.valid & ~in_vocab).any()  # both kinds of masked position occur
    assert (out.logits.grad[unsup] == 0).all()
    assert (out.logits.grad[~unsup].abs().sum(-1) > 0).all()
    assert (head.grad[~out.valid] == 0).all()
    assert all(not p.requires_grad for p in parts.values())


def test_soft_targets_use_only_the_draft_vocab_and_strided_views():
    out, d2t, _ = random_batch(seed=7)
    big = torch.randn(out.target_logits.shape[0], out.target_logits.shape[1], 9)
    big[..., :6] = out.target_logits
    view = big[..., :6]  # non-contiguous view of a wider buffer
    p = soft_targets(view, d2t)
    assert p.shape == out.logits.shape
    torch.testing.assert_close(p.sum(-1), torch.ones(p.shape[:-1]))  # renormalised over the draft vocab
    ids = torch.arange(4) + d2t
    torch.testing.assert_close(p, torch.softmax(out.target_logits[..., ids], -1))


@pytest.mark.parametrize("terms", ["both", "soft", "hard"])
def test_fused_token_ce_equals_the_plain_expression_with_gradients(terms):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 5, 11, dtype=torch.float64, generator=g, requires_grad=True)
    p = torch.softmax(torch.randn(3, 5, 11, dtype=torch.float64, generator=g), -1)
    labels = torch.randint(0, 11, (3, 5), generator=g)
    ws, wh = torch.randn(3, 5, dtype=torch.float64, generator=g), torch.randn(3, 5, dtype=torch.float64, generator=g)
    use_soft, use_hard = terms != "hard", terms != "soft"

    logq = torch.log_softmax(x, -1)
    hard_ref = -logq.gather(-1, labels[..., None])[..., 0]
    ref = use_soft * (ws * -(p * logq).sum(-1)).sum() + use_hard * (wh * hard_ref).sum()
    (g_ref,) = torch.autograd.grad(ref, x)

    soft, hard = token_ce(x, p if use_soft else None, labels if use_hard else None)
    assert (soft is None) != use_soft and (hard is None) != use_hard
    got = (ws * soft).sum() if use_soft else 0
    got = got + ((wh * hard).sum() if use_hard else 0)
    (g_got,) = torch.autograd.grad(got, x)
    assert torch.allclose(got, ref, atol=1e-12) and torch.allclose(g_got, g_ref, atol=1e-12)
    assert torch.autograd.gradcheck(lambda z: token_ce(z, p, labels), (x,))
