"""The chunked lm_head + CE path (loss.chunk_size > 0) against the unchunked one: same losses, parts,
metrics and gradients of every drafter parameter; gradcheck of the autograd function itself."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import tiny_llama
from vatspec.config import load_config
from vatspec.drafters import build_drafter, plan_batch
from vatspec.drafters.base import AcceptHead
from vatspec.objective.chunked import chunked_token_ce, head_logits
from vatspec.objective.losses import token_ce
from vatspec.target import Target
from vatspec.train import TrainModule, arm_step, shared_target_pass, step_generator

pytestmark = pytest.mark.usefixtures("one_thread")

# float64: both paths are the same math summed in another order, so they agree to ~1e-15; float32
# logits of a sum over V (log-softmax, the dot with p) keep ~1e-7 relative, grads ~1e-6
RTOL64, RTOL32 = 1e-10, 1e-5
# KL = soft CE - H(p) is a small difference of two O(log V) = O(5) numbers: float32 rounding of the
# terms (~1e-7 relative) leaves ~5e-7 absolute on a KL of ~0.03, so losses compare to this as well
ATOL_LOSS = 2e-6
V = 96


def _case(dtype: torch.dtype, N: int = 11, H: int = 8, Vd: int = 24, P: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=dtype).requires_grad_()
    weight = torch.randn(Vd, H, generator=g, dtype=dtype).requires_grad_()
    p = torch.softmax(torch.randn(P, Vd, generator=g, dtype=dtype), -1)
    p_index = torch.randint(0, P, (N,), generator=g)
    labels = torch.randint(0, Vd, (N,), generator=g)
    gs, gh = torch.rand(N, generator=g, dtype=dtype), torch.rand(N, generator=g, dtype=dtype)
    return hidden, weight, p, p_index, labels, gs, gh


@pytest.mark.parametrize("dtype,rtol", [(torch.float64, RTOL64), (torch.float32, RTOL32)])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("chunk", [1, 4, 100])
def test_chunked_ce_equals_token_ce_values_and_grads(dtype, rtol, softcap, chunk):
    hidden, weight, p, p_index, labels, gs, gh = _case(dtype)
    soft, hard, _, argmax = chunked_token_ce(hidden, weight, p, p_index, labels, chunk_size=chunk, softcap=softcap)
    grads = torch.autograd.grad((soft * gs).sum() + (hard * gh).sum(), (hidden, weight))

    # the reference: full logits through the unchunked fused CE
    x = head_logits(hidden, weight, softcap)
    ref_soft, ref_hard = token_ce(x, p[p_index], labels)
    ref_grads = torch.autograd.grad((ref_soft * gs).sum() + (ref_hard * gh).sum(), (hidden, weight))

    torch.testing.assert_close(soft, ref_soft, rtol=rtol, atol=0)
    torch.testing.assert_close(hard, ref_hard, rtol=rtol, atol=0)
    assert torch.equal(argmax, x.argmax(-1))
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * b.abs().max().item())


@pytest.mark.parametrize("dtype,rtol", [(torch.float64, RTOL64), (torch.float32, RTOL32)])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_chunked_alpha_equals_acceptance_values_and_grads(dtype, rtol, softcap):
    from vatspec.objective.losses import acceptance

    hidden, weight, p, p_index, labels, gs, gh = _case(dtype)
    ga = torch.randn(hidden.shape[0], dtype=dtype, generator=torch.Generator().manual_seed(1))
    soft, hard, alpha, _ = chunked_token_ce(hidden, weight, p, p_index, labels, chunk_size=4, softcap=softcap,
                                            alpha=True)
    grads = torch.autograd.grad((soft * gs).sum() + (hard * gh).sum() + (alpha * ga).sum(), (hidden, weight))

    x = head_logits(hidden, weight, softcap)
    ref_soft, ref_hard = token_ce(x, p[p_index], labels)
    ref_alpha = acceptance(p[p_index], x)
    ref = (ref_soft * gs).sum() + (ref_hard * gh).sum() + (ref_alpha * ga).sum()
    ref_grads = torch.autograd.grad(ref, (hidden, weight))
    torch.testing.assert_close(alpha, ref_alpha, rtol=rtol, atol=rtol)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * b.abs().max().item())
    # alpha alone (tv): the soft labels are read, the CE gradients are not
    _, _, alpha, _ = chunked_token_ce(hidden, weight, p, p_index, None, chunk_size=3, alpha=True)
    (dh,) = torch.autograd.grad(alpha.sum(), hidden)
    (ref_dh,) = torch.autograd.grad(acceptance(p[p_index], head_logits(hidden, weight)).sum(), hidden)
    torch.testing.assert_close(dh, ref_dh, rtol=rtol, atol=rtol * ref_dh.abs().max().item())


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_gradcheck(softcap):
    hidden, weight, p, p_index, labels, _, _ = _case(torch.float64, N=5, H=3, Vd=7, P=3)

    def f(h, w):
        soft, hard, alpha, _ = chunked_token_ce(h, w, p, p_index, labels, chunk_size=2, softcap=softcap, alpha=True)
        return soft, hard, alpha

    assert torch.autograd.gradcheck(f, (hidden, weight))


def test_only_the_terms_asked_for():
    hidden, weight, p, p_index, labels, _, _ = _case(torch.float64)
    soft, hard, _, _ = chunked_token_ce(hidden, weight, None, None, labels, chunk_size=3)
    assert soft is None and hard is not None
    (dh,) = torch.autograd.grad(hard.sum(), hidden)
    ref = token_ce(head_logits(hidden, weight), None, labels)[1]
    torch.testing.assert_close(dh, torch.autograd.grad(ref.sum(), hidden)[0], rtol=RTOL64, atol=1e-14)


# ----------------------------------------------------------------------------- one training step


@pytest.fixture(scope="module")
def target() -> Target:
    return Target(tiny_llama(vocab_size=V, layers=8, seed=0), tokenizer=None)


def _batch():
    """Two sequences: a 3-token prompt (unsupervised), the second padded by 4: invalid positions in
    the middle of the chains' rows, so the pass that skips them is exercised."""
    from vatspec.data import Batch

    g = torch.Generator().manual_seed(3)
    B, T = 2, 24
    ids = torch.randint(3, V, (B, T), generator=g)
    am = torch.ones(B, T, dtype=torch.long)
    am[1, -4:] = 0
    lm = am.bool()
    lm[:, :3] = False
    return Batch(input_ids=ids, attention_mask=am, loss_mask=lm)


def _step(target, kind: str, overrides: list[str], chunk: int, target_logits: bool = False):
    """One step as the loop runs it; ``target_logits``: the target computes its logits even when
    chunked (the chunked path then reads their rows instead of turning hidden rows into logits)."""
    cfg = load_config(None, [f"drafter.kind={kind}", "drafter.draft_vocab_size=40", "drafter.ttt_steps=4",
                             "drafter.block_size=5", "drafter.num_anchors=6", *overrides, f"loss.chunk_size={chunk}"])
    counts = torch.arange(V) % 7  # a non-identity EAGLE-3 draft vocabulary: some target ids outside it
    torch.manual_seed(0)
    drafter = build_drafter(cfg.drafter, target, counts)
    head = AcceptHead(drafter.hidden_size) if cfg.loss.head else None
    module = TrainModule(drafter, head, head_grad=cfg.loss.head_grad)
    batch = _batch()
    plan = plan_batch(drafter, batch, cfg.drafter, step_generator(0, 0, 0, 0), with_logits=not chunk)
    if target_logits:
        tout = target(batch.input_ids, batch.attention_mask, drafter.target_layer_ids, logits_at=plan.logits_at)
    else:
        tout = shared_target_pass(target, batch, [drafter], [plan])[0]
        assert (tout.logits is None) == bool(chunk)
    res = arm_step(module, drafter, batch, tout, plan, cfg.loss, step_generator(0, 1, 0, 0))
    res.loss.backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    return res, grads


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
@pytest.mark.parametrize("overrides", [
    ["loss.kind=vat"],
    ["loss.kind=vat", "loss.verify=sampled", "loss.temperature=0.7"],
    ["loss.kind=vat", "loss.verify=expected"],
    ["loss.kind=eagle3"],
    ["loss.kind=dflash", "loss.gamma=3"],
    ["loss.kind=kl"],
    ["loss.kind=tv"],
    ["loss.kind=lk"],
    ["loss.kind=lk", "loss.lk_kl=0", "loss.weights=adaptive"],
    ["loss.kind=dpace", "loss.gamma=3"],
    ["loss.kind=specauf", "loss.gamma=3"],
    ["loss.kind=dspark", "loss.gamma=3", "loss.verify=expected"],
], ids=["vat", "vat-sampled", "vat-expected", "eagle3", "dflash", "kl", "tv", "lk", "lk-nll-adaptive", "dpace",
        "specauf", "dspark"])
@pytest.mark.parametrize("target_logits", [False, True], ids=["from-hidden", "from-logits"])
def test_training_step_equals_unchunked(target, kind, overrides, target_logits):
    ref, ref_grads = _step(target, kind, overrides, chunk=0)
    res, grads = _step(target, kind, overrides, chunk=7, target_logits=target_logits)
    torch.testing.assert_close(res.loss, ref.loss, rtol=RTOL32, atol=ATOL_LOSS)
    assert res.parts.keys() == ref.parts.keys()
    for name in ref.parts:
        torch.testing.assert_close(res.parts[name], ref.parts[name], rtol=RTOL32, atol=ATOL_LOSS)
    assert res.metrics.keys() == ref.metrics.keys()
    for name, want in ref.metrics.items():  # accept counts, tau_sim, head accuracy
        assert res.metrics[name] == pytest.approx(want, nan_ok=True), name
    assert torch.equal(res.metrics.chain_accepted, ref.metrics.chain_accepted)
    assert grads.keys() == ref_grads.keys() and "drafter.fc.weight" in grads
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=RTOL32, atol=RTOL32 * g.abs().max().item(), msg=name)


@pytest.mark.parametrize("target_logits", [False, True], ids=["from-hidden", "from-logits"])
def test_dflash_step_equals_unchunked_on_a_scaled_and_capped_head(target, target_logits):
    """DFlash drafts through the target's head: the chunked path applies what the target's forward does after it
    (``logit_transform``: a Falcon-H1 / Cohere / Granite scale, a Gemma soft cap) as ``Target.logits`` does."""
    scaled = Target(tiny_llama(vocab_size=V, layers=8, seed=0), tokenizer=None)
    scaled.logit_scale, scaled.logit_softcap = 4.0, 0.5  # both far from a no-op on these logits
    ref, ref_grads = _step(scaled, "dflash", ["loss.kind=vat"], chunk=0)
    res, grads = _step(scaled, "dflash", ["loss.kind=vat"], chunk=7, target_logits=target_logits)
    torch.testing.assert_close(res.loss, ref.loss, rtol=RTOL32, atol=ATOL_LOSS)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=RTOL32, atol=RTOL32 * g.abs().max().item(), msg=name)
    plain, _ = _step(target, "dflash", ["loss.kind=vat"], chunk=7, target_logits=target_logits)  # the same weights
    assert not torch.allclose(plain.loss, ref.loss, rtol=1e-3)  # unscaled: another loss, so the scale is exercised


def test_lockstep_arms_share_their_teacher_and_train_the_same(target, monkeypatch):
    """The four demo arms on one batch, as ``arms_micro_step`` runs them: with a shared teacher the
    target side is computed twice (once per drafter kind) instead of four times, three times when
    the soft labels are not kept for later arms, and every arm's loss, parts and gradients are
    exactly those of the arm run alone."""
    import vatspec.objective.chunked as chunked

    arms = [("eagle3", "eagle3"), ("eagle3", "vat"), ("dflash", "dflash"), ("dflash", "vat")]
    built = []
    for kind, loss in arms:
        cfg = load_config(None, [f"drafter.kind={kind}", f"loss.kind={loss}", "drafter.draft_vocab_size=40",
                                 "drafter.ttt_steps=4", "drafter.block_size=5", "drafter.num_anchors=6",
                                 "loss.chunk_size=7"])
        torch.manual_seed(0)
        drafter = build_drafter(cfg.drafter, target, torch.arange(V) % 7)
        module = TrainModule(drafter, AcceptHead(drafter.hidden_size) if cfg.loss.head else None)
        built.append((cfg, drafter, module))
    batch = _batch()
    plans = [plan_batch(d, batch, c.drafter, step_generator(0, 0, 0, 0), with_logits=False) for c, d, _ in built]
    touts = shared_target_pass(target, batch, [d for _, d, _ in built], plans)
    calls = []
    real = chunked.teacher
    monkeypatch.setattr(chunked, "teacher", lambda *a, **kw: calls.append(1) or real(*a, **kw))

    def run(shared):
        results = []
        for (cfg, drafter, module), tout, plan in zip(built, touts, plans):
            module.zero_grad()
            res = arm_step(module, drafter, batch, tout, plan, cfg.loss, step_generator(0, 1, 0, 0), shared)
            res.loss.backward()
            results.append((res, {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}))
        return results

    alone = run(None)
    assert len(calls) == 4
    calls.clear()
    apart = run(chunked.TeacherShare(keep_soft=False))  # DFlash's baseline reads no soft labels, its VAT arm does
    assert len(calls) == 3
    calls.clear()
    together = run(chunked.TeacherShare(keep_soft=True))
    assert len(calls) == 2
    for (ref, _), (res, _) in zip(alone, apart):
        assert torch.equal(res.loss, ref.loss)
    for (ref, ref_grads), (res, grads) in zip(alone, together):
        assert torch.equal(res.loss, ref.loss)
        assert all(torch.equal(res.parts[n], ref.parts[n]) for n in ref.parts)
        assert torch.equal(res.metrics.chain_accepted, ref.metrics.chain_accepted)
        assert grads.keys() == ref_grads.keys() and all(torch.equal(grads[n], g) for n, g in ref_grads.items())


def test_chunk_size_is_checked():
    from vatspec.config import ConfigError
    from vatspec.objective.losses import LossConfig

    with pytest.raises(ValueError, match="chunk_size"):
        dataclasses.replace(LossConfig(), chunk_size=-1)
    with pytest.raises(ConfigError, match="chunk_size"):
        load_config(None, ["loss.chunk_size=abc"])


def test_sampled_mode_refuses_a_generator_on_another_device(target):
    from vatspec.objective.chunked import chunked_pass

    cfg = load_config(None, ["drafter.kind=dflash", "drafter.block_size=5", "drafter.num_anchors=4",
                             "loss.verify=sampled"])
    torch.manual_seed(0)
    drafter = build_drafter(cfg.drafter, target)
    batch = _batch()
    plan = plan_batch(drafter, batch, cfg.drafter, None, with_logits=False)
    out = drafter.training_forward(batch, shared_target_pass(target, batch, [drafter], [plan])[0], **plan.kwargs)
    elsewhere = SimpleNamespace(device=torch.device("cuda", 0))  # all the check reads of a generator
    with pytest.raises(ValueError, match="generator is on cuda:0"):
        chunked_pass(out, cfg.loss, generator=elsewhere)


def test_runs_under_bf16_autocast_as_the_unchunked_expression_does():
    """Under bf16 autocast the chunked matmuls multiply bf16 copies (autocast itself would cast into
    the float32 buffers, which refuse): values and gradients are those of the unchunked expression
    under the same autocast (bf16 logits, then the CE in float32), not the float32 ones."""
    hidden, weight, p, p_index, labels, gs, gh = _case(torch.float32, N=40, H=64, Vd=300)
    ref32 = chunked_token_ce(hidden, weight, p, p_index, labels, chunk_size=16)[:2]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        soft, hard, _, _ = chunked_token_ce(hidden, weight, p, p_index, labels, chunk_size=16)
        x = head_logits(hidden, weight)  # the linear under autocast; the CE below in float32
    grads = torch.autograd.grad((soft * gs).sum() + (hard * gh).sum(), (hidden, weight))
    ref_soft, ref_hard = token_ce(x, p[p_index], labels)
    ref_grads = torch.autograd.grad((ref_soft * gs).sum() + (ref_hard * gh).sum(), (hidden, weight))
    assert soft.dtype == hard.dtype == torch.float32 and not torch.equal(soft, ref32[0])  # bf16 did run
    torch.testing.assert_close(soft, ref_soft, rtol=RTOL32, atol=ATOL_LOSS)
    torch.testing.assert_close(hard, ref_hard, rtol=RTOL32, atol=ATOL_LOSS)
    for g, r in zip(grads, ref_grads):
        assert g.dtype == torch.float32
        # bf16 products (8 bits), dW's rounded per chunk here and once there: within 1% of the largest entry
        torch.testing.assert_close(g, r.float(), rtol=0, atol=1e-2 * r.abs().max().item())


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_head_grad_off_trains_the_head_alone(target, kind):
    """loss.head_grad=false: the draft's gradients are those of the same loss without the head's term
    (beta = 0), the head's are those of beta = 1; with it on (the paper) the head reaches the draft."""
    _, off = _step(target, kind, ["loss.kind=vat", "loss.head_grad=false"], 7)
    _, on = _step(target, kind, ["loss.kind=vat"], 7)
    _, no_term = _step(target, kind, ["loss.kind=vat", "loss.beta=0"], 7)
    draft = [n for n in off if n.startswith("drafter.")]
    assert draft and all(torch.allclose(off[n], no_term[n], atol=1e-6) for n in draft)
    assert any(not torch.allclose(on[n], no_term[n], atol=1e-6) for n in draft)
    heads = [n for n in off if n.startswith("head.")]
    assert heads and all(torch.allclose(off[n], on[n], atol=1e-6) for n in heads)
