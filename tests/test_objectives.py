"""The draft objectives beside VAT (loss.kind = kl, tv, lk, dpace, specauf, dspark): each pure function
against a plain-loop reference written here and its docstring's worked example, the whole objective of
every kind against a loop over chains and positions, the presets, their compositions and the
combinations that cannot train."""

from __future__ import annotations

import math

import pytest
import torch

from tests.test_losses import loop_weights, random_batch
from vatspec.config import ConfigError, load_config
from vatspec.drafters.base import AcceptHead
from vatspec.objective.losses import (
    KINDS,
    LossConfig,
    acceptance,
    dpace_weights,
    entropy,
    first_failure,
    head_bce,
    kl_divergence,
    lk_loss,
    token_ce,
    truncated_weights,
    tv_loss,
    vat_objective,
)
from vatspec.objective.terms import head_alive_logits
from vatspec.objective.verify import simulate_verification

EXACT = 1e-6  # float32 round-off on O(1) values
LOOP = 2e-5  # float32 tensors against a float64 Python loop over up to 7-way sums of logs


def rows(n=6, V=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(n, V, generator=g) * 2, -1)
    logits = torch.randn(n, V, generator=g)
    return p, logits


def softmax_list(xs):
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [x / sum(e) for x in e]


# ---------------------------------------------------------------------------------------------
# pure functions against loops


def test_acceptance_kl_tv_lk_match_loops():
    p, logits = rows()
    soft, _ = token_ce(logits, p, None)
    alpha, kl = acceptance(p, logits), kl_divergence(soft, entropy(p))
    for n in range(p.shape[0]):
        pn, qn = p[n].tolist(), softmax_list(logits[n].tolist())
        a = sum(min(x, y) for x, y in zip(pn, qn))
        d = sum(x * (math.log(x) - math.log(y)) for x, y in zip(pn, qn) if x > 0)
        assert alpha[n].item() == pytest.approx(a, abs=EXACT)
        assert tv_loss(alpha)[n].item() == pytest.approx(1 - a, abs=EXACT)
        assert kl[n].item() == pytest.approx(d, abs=LOOP)
        for share in (0.0, 0.3, 1.0):
            want = share * d + (1 - share) * -math.log(a)
            assert lk_loss(alpha, kl, share)[n].item() == pytest.approx(want, abs=LOOP)


def test_worked_examples():
    # acceptance: p = (0.7, 0.3), q = (0.4, 0.6) -> 0.7; TV 0.3
    a = acceptance(torch.tensor([0.7, 0.3]), torch.log(torch.tensor([0.4, 0.6])))
    assert a.item() == pytest.approx(0.7) and tv_loss(a).item() == pytest.approx(0.3)
    # KL: p = (0.5, 0.5), q = (0.25, 0.75) -> 0.144
    p, x = torch.tensor([[0.5, 0.5]]), torch.log(torch.tensor([[0.25, 0.75]]))
    assert kl_divergence(token_ce(x, p, None)[0], entropy(p)).item() == pytest.approx(0.1438, abs=1e-4)
    # lk: alpha 0.5, KL 0.2, share 0.5 -> 0.447
    assert lk_loss(torch.tensor(0.5), torch.tensor(0.2), 0.5).item() == pytest.approx(0.1 + 0.5 * math.log(2))
    # D-PACE: ce = 0, ln 2, inf -> w = 2.125 1.125 0.375
    w = dpace_weights(torch.tensor([0.0, math.log(2), math.inf]), torch.ones(3, dtype=torch.bool))
    assert w.tolist() == pytest.approx([2.125, 1.125, 0.375])
    # first failure: draft a b x d vs target a b c d -> 2; Spec-AUF weights at f = 1 and f = 4
    assert first_failure(torch.tensor([0, 1, 9, 3]), torch.tensor([0, 1, 2, 3]), None).item() == 2
    v4 = torch.ones(2, 4, dtype=torch.bool)
    assert truncated_weights(torch.tensor([1, 4]), v4, "eagle3").tolist() == \
        [pytest.approx([1, 0.8, 0, 0]), pytest.approx([1, 0.8, 0.64, 0.512])]
    # the confidence head: c = 0.9 0.8 0.5 -> alive (for the metrics) 1 0.9 0.72, decoding's product 0.9 0.72 0.36
    c = torch.tensor([0.9, 0.8, 0.5])
    assert torch.sigmoid(head_alive_logits(torch.logit(c), "alpha")).tolist() == pytest.approx([1, 0.9, 0.72], abs=1e-5)
    assert AcceptHead(2, label="alpha").prefix_alive(c).tolist() == pytest.approx([0.9, 0.72, 0.36])
    assert AcceptHead(2).prefix_alive(c).tolist() == pytest.approx(c.tolist())
    # head BCE: logit 0 -> log 2 whatever the label
    assert head_bce(torch.zeros(3), torch.tensor([0.2, 1.0, 0.0]), torch.ones(3, dtype=torch.bool)).item() == \
        pytest.approx(math.log(2))


def test_dpace_weights_match_loop():
    g = torch.Generator().manual_seed(1)
    ce = torch.rand(8, 5, generator=g) * 3
    ce[0, 2] = math.inf  # a target outside the draft vocabulary
    valid = torch.arange(5) < torch.randint(0, 6, (8,), generator=g)[:, None]
    w = dpace_weights(ce, valid)
    for c in range(8):
        n = int(valid[c].sum())
        s = [0.5 * math.exp(-float(x)) + 0.5 for x in ce[c, :n]]
        for k in range(5):
            want = sum(math.prod(s[: m + 1]) for m in range(k, n)) if k < n else 0.0
            assert w[c, k].item() == pytest.approx(want, abs=EXACT), (c, k)
    assert not w.requires_grad


@pytest.mark.parametrize("schedule", ["eagle3", "dflash"])
def test_truncated_weights_match_loop(schedule):
    g = torch.Generator().manual_seed(2)
    draft, target = torch.randint(0, 3, (10, 4), generator=g), torch.randint(0, 3, (10, 4), generator=g)
    valid = torch.arange(4) < torch.randint(0, 5, (10,), generator=g)[:, None]
    f = first_failure(draft, target, None)
    w = truncated_weights(f, valid, schedule, gamma=3.0)
    for c in range(10):
        ff = next((j for j in range(4) if draft[c, j] != target[c, j]), 4)
        assert f[c].item() == ff
        for j in range(4):
            base = 0.8**j if schedule == "eagle3" else math.exp(-j / 3.0)
            assert w[c, j].item() == pytest.approx(base if j <= ff and valid[c, j] else 0.0)


# ---------------------------------------------------------------------------------------------
# the whole objective of every kind against a loop over chains and positions


def loop_objective(out, d2t, t2d, cfg, head_logits=None, v=None):
    """The loss written position by position from the definitions: per position the enabled terms of
    p (target softmax over the draft vocab's ids, renormalised) and q, the weights, the mean over the
    supervised chains at each j summed over j, and the head's BCE averaged over valid positions."""
    ids = (torch.arange(len(d2t)) + d2t).tolist()  # target id of each draft id
    draft_of = {t: i for i, t in enumerate(ids)}
    N, k = out.valid.shape
    base = [cfg.decay**j if cfg.curve == "eagle3" else math.exp(-j / cfg.gamma) for j in range(k)]
    per, sup, head_terms = [], [], []
    for c in range(N):
        n = int(out.valid[c].sum())
        terms, sups, ces, fail = [], [], [], None
        for j in range(k):
            tl = out.target_logits[c, j].tolist()
            t_arg = max(range(len(tl)), key=tl.__getitem__)
            p = softmax_list([tl[i] for i in ids])
            q = softmax_list(out.logits[c, j].tolist())
            d_arg = max(range(len(q)), key=q.__getitem__)
            if fail is None and (j >= n or ids[d_arg] != t_arg):
                fail = j
            in_vocab = bool(t2d[t_arg])
            soft = -sum(a * math.log(b) for a, b in zip(p, q))
            hard = -math.log(q[draft_of[t_arg]]) if in_vocab else math.inf
            kl = sum(a * (math.log(a) - math.log(b)) for a, b in zip(p, q) if a > 0)
            alpha = sum(min(a, b) for a, b in zip(p, q))
            term = (cfg.soft * soft + (cfg.hard * hard if cfg.hard else 0.0) + cfg.kl * kl + cfg.tv * (1 - alpha)
                    + (cfg.lk * (cfg.lk_kl * kl + (1 - cfg.lk_kl) * -math.log(alpha)) if cfg.lk else 0.0))
            terms.append(term)
            sups.append(j < n and in_vocab)
            ces.append((hard if cfg.hard else soft) if in_vocab else math.inf)
            if head_logits is not None and j < n:
                y = alpha * in_vocab if cfg.head_label == "alpha" else float(v.alive[c, j])
                x = float(head_logits[c, j])
                head_terms.append(-(y * math.log(1 / (1 + math.exp(-x))) + (1 - y) * math.log(1 / (1 + math.exp(x)))))
        fail = k if fail is None else fail
        if cfg.weights == "fixed":
            w = base
        elif cfg.weights == "truncated":
            w = [b if j <= fail else 0.0 for j, b in enumerate(base)]
        elif cfg.weights == "dpace":
            s = [0.5 * math.exp(-x) + 0.5 for x in ces[:n]]
            w = [sum(math.prod(s[: m + 1]) for m in range(j, n)) for j in range(k)]
        else:  # adaptive: the VAT weights' own loop reference
            w = loop_weights([v.accept[c].tolist()], [out.valid[c].tolist()], cfg.curve, v.mode == "expected")[0]
        per.append([w[j] * terms[j] for j in range(k)])
        sup.append(sups)
    loss = 0.0
    for j in range(k):
        xs = [per[c][j] for c in range(N) if sup[c][j]]
        loss += sum(xs) / max(len(xs), 1)
    if head_logits is not None:
        loss += cfg.beta * sum(head_terms) / max(len(head_terms), 1)
    return loss


CASES = {  # name -> (drafter schedule, overrides)
    "kl": ("eagle3", {}),
    "tv": ("eagle3", {}),
    "lk": ("eagle3", {}),
    "lk-nll": ("eagle3", {"lk_kl": 0.0}),
    "dpace": ("eagle3", {}),
    "dpace-dflash": ("dflash", {}),
    "specauf": ("eagle3", {}),
    "specauf-dflash": ("dflash", {}),
    "dspark": ("eagle3", {}),
    "dspark-dflash": ("dflash", {}),
    "lk+adaptive": ("eagle3", {"weights": "adaptive"}),
    # gamma 7: the VAT weights' loop reference (test_losses.loop_weights) uses the reference gamma
    "tv+adaptive-expected": ("dflash", {"weights": "adaptive", "verify": "expected", "gamma": 7.0}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_objective_matches_loop_reference(case):
    schedule, overrides = CASES[case]
    kind = case.split("+")[0].split("-")[0]
    cfg = LossConfig(kind=kind, **overrides).resolve(schedule, block_size=4)
    out, d2t, t2d = random_batch(seed=11, k=4)
    v = simulate_verification(out.logits, out.target_logits, out.valid, mode=cfg.verify, d2t=d2t)
    head = torch.randn(out.valid.shape, generator=torch.Generator().manual_seed(5)) if cfg.head else None
    loss, parts = vat_objective(out, v, head, cfg, d2t=d2t, t2d=t2d)
    assert loss.item() == pytest.approx(loop_objective(out, d2t, t2d, cfg, head, v), abs=LOOP * 10, rel=LOOP)
    assert parts["loss"].item() == pytest.approx(loss.item())
    named = {"kl", "tv", "lk", "soft", "hard", "head"} & set(parts)
    assert named == {n for n in ("soft", "hard", "kl", "tv", "lk", "head") if getattr(cfg, n)}


@pytest.mark.parametrize("kind", [k for k in KINDS if k not in ("eagle3", "dflash", "vat")])
def test_masked_positions_get_zero_gradient(kind):
    out, d2t, t2d = random_batch(seed=6, grad=True)
    cfg = LossConfig(kind=kind).resolve("eagle3")
    v = simulate_verification(out.logits, out.target_logits, out.valid, d2t=d2t)
    head = torch.randn(out.valid.shape, requires_grad=True)
    loss, parts = vat_objective(out, v, head if cfg.head else None, cfg, d2t=d2t, t2d=t2d)
    loss.backward()
    from vatspec.objective.losses import hard_targets

    _, in_vocab = hard_targets(v, d2t, t2d, out.target_logits.shape[-1])
    unsup = ~(out.valid & in_vocab)
    assert unsup.any() and (out.logits.grad[unsup] == 0).all()
    assert (out.logits.grad[~unsup].abs().sum(-1) > 0).any()
    assert all(not x.requires_grad for x in parts.values())


def test_kl_trains_as_soft_ce():
    """KL = soft CE - H(p), H(p) constant: on EAGLE-3 the kl kind has the eagle3 kind's gradient exactly."""
    out, d2t, t2d = random_batch(seed=12, grad=True)
    v = simulate_verification(out.logits, out.target_logits, out.valid, d2t=d2t)
    grads, losses = [], []
    for kind in ("kl", "eagle3"):
        loss, _ = vat_objective(out, v, None, LossConfig(kind=kind).resolve("eagle3"), d2t=d2t, t2d=t2d)
        (g,) = torch.autograd.grad(loss, out.logits)
        grads.append(g)
        losses.append(loss.item())
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-7)
    assert losses[0] < losses[1]  # the entropy taken off


# ---------------------------------------------------------------------------------------------
# presets, compositions, and what cannot train


def test_presets_resolve_for_each_drafter():
    def switches(kind, schedule, **kw):
        c = LossConfig(kind=kind, **kw).resolve(schedule, block_size=8)
        return c.weights, c.soft, c.hard, c.kl, c.tv, c.lk, c.head, c.head_label, c.curve

    assert switches("kl", "dflash") == ("fixed", False, False, True, False, False, False, "alive", "eagle3")
    for s in ("eagle3", "dflash"):
        own = (s == "eagle3", s == "dflash")  # the drafter's own CE: soft for EAGLE-3, hard for DFlash
        assert switches("tv", s) == ("fixed", False, False, False, True, False, False, "alive", s)
        assert switches("lk", s) == ("fixed", False, False, False, False, True, False, "alive", s)
        assert switches("dpace", s) == ("dpace", *own, False, False, False, False, "alive", s)
        assert switches("specauf", s) == ("truncated", *own, False, False, False, False, "alive", s)
        assert switches("dspark", s) == ("fixed", *own, False, False, False, True, "alpha", s)
    # compositions with the ablation switches: LK with VAT's weights, DSpark with a hard term too
    assert switches("lk", "eagle3", weights="adaptive")[0] == "adaptive"
    assert switches("dspark", "eagle3", hard=True)[1:3] == (True, True)
    for kind in KINDS:
        c = LossConfig(kind=kind).resolve("dflash", block_size=8)
        assert c.resolved and c.resolve("dflash") == c  # idempotent


@pytest.mark.parametrize("overrides, message", [
    (["loss.kind=tv", "loss.weights=dpace"], "loss.weights=dpace .* needs loss.soft or loss.hard"),
    (["loss.kind=kl", "loss.head_label=alpha"], "loss.head_label=alpha .* needs loss.head=true"),
    (["loss.kind=lk", "loss.lk_kl=1.5"], "LossConfig.lk_kl must be in \\[0, 1\\]"),
    (["loss.kind=dspark", "loss.head_label=bit"], "LossConfig.head_label must be one of"),
    (["loss.kind=tv", "loss.tv=false"], "nothing to train"),
])
def test_impossible_combinations_are_one_line_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_config(None, ["drafter.kind=eagle3", *overrides])
    assert "\n" not in str(e.value)


def test_compositions_load_from_the_command_line():
    cfg = load_config(None, ["drafter.kind=dflash", "drafter.block_size=8", "loss.kind=lk", "loss.weights=adaptive"])
    assert (cfg.loss.weights, cfg.loss.lk, cfg.loss.curve, cfg.loss.gamma) == ("adaptive", True, "dflash", 4.0)
    cfg = load_config(None, ["loss.kind=vat", "loss.head_label=alpha"])  # VAT with DSpark's head
    assert cfg.loss.head and cfg.loss.head_label == "alpha" and cfg.loss.weights == "adaptive"


# ---------------------------------------------------------------------------------------------
# `vatspec ablate --arms`


def test_arms_parsing_and_a_bad_arm_is_one_clear_error(capsys, tmp_path):
    from vatspec.cli import main
    from vatspec_recipes.ablate import parse_arms, with_baseline

    assert parse_arms("vat, kl,dspark") == ["vat", "kl", "dspark"]
    assert with_baseline(["vat", "kl"], "eagle3") == ["eagle3", "vat", "kl"]
    assert with_baseline(["kl", "dflash"], "dflash") == ["dflash", "kl"]
    with pytest.raises(ValueError, match="twice"):
        parse_arms("kl,kl")
    with pytest.raises(SystemExit) as e:
        main(["ablate", "--arms", "vat,medusa", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and "argument --arms: unknown arm 'medusa'; choose from eagle3, dflash, vat" in err
    # a kind the drafter cannot train: one line, before the target loads or anything is written
    assert main(["ablate", "--drafter", "eagle3", "--arms", "dflash", "--out", str(tmp_path / "y")]) == 2
    assert "drafter.kind=eagle3 with loss.kind=dflash" in capsys.readouterr().err
    assert not (tmp_path / "y").exists()


@pytest.mark.slow
def test_quick_objectives_run_reports_every_arm(tmp_path):
    """Two new objectives beside the DFlash baseline at a tiny size: trained in lockstep, decoded, and
    reported with paired intervals for training and decoding, and a plot (~40 s on one thread)."""
    import json

    import yaml

    from vatspec_recipes.experiment import run
    from vatspec_recipes.recipe import load_recipe, recipe_size

    size = {**recipe_size("demo-quick"), "steps": 2, "eval_every": 2, "benches": ["gsm8k"], "eval_tokens": 16}
    recipe = load_recipe("objectives", drafter="dflash", arms=["dflash", "lk", "specauf"], size=size)
    out = tmp_path / "ab"
    summary = run(recipe, out, threads=1, progress=False)
    assert list(summary["arms"]) == ["dflash", "lk", "specauf"] and summary["baseline"] == "dflash"
    for arm, row in summary["arms"].items():
        assert row["tau_sim"] >= 1.0 and row["decode_tau"] >= 1.0, arm
        if arm != "dflash":
            for key in ("vs_baseline_chains", "vs_baseline_prompts"):
                d = row[key]
                assert d["low"] <= d["estimate"] <= d["high"] and d["units"] > 0, (arm, key)
    report = (out / "objectives.md").read_text()
    assert "| lk |" in report and "| specauf |" in report and "95%" in report
    assert report.count("interval") >= 4  # every comparison in words
    assert (out / "objectives_tau_sim.png").read_bytes()[:4] == b"\x89PNG"
    saved = json.loads((out / "objectives.json").read_text())
    assert "chain_accepted" not in saved["arms"]["lk"]["heldout"]
    for arm in saved["arms"]:  # each run saved its loss kind (what decoding's head rule reads)
        assert yaml.safe_load((out / "runs" / arm / "config.yaml").read_text())["loss"]["kind"] == arm
