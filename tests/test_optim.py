"""optim.py: Muon with AdamW stepped, scheduled and saved as one optimizer, the groups ``build_optimizer``
makes of a drafter, the config checks (a Muon run's exact resume is in tests/test_train.py)."""

import copy

import pytest
import torch
from torch import nn

from vatspec.config import ConfigError, OptimConfig, load_config
from vatspec.train.optim import MuonWithAdamW, build_optimizer


def _twins(seed=0):
    torch.manual_seed(seed)
    a = nn.Sequential(nn.Linear(16, 32, bias=False), nn.LayerNorm(32), nn.Linear(32, 8, bias=False))
    b = nn.Sequential(nn.Linear(16, 32, bias=False), nn.LayerNorm(32), nn.Linear(32, 8, bias=False))
    b.load_state_dict(a.state_dict())
    return a, b


def _steps(models_opts, n=5, scheds=()):
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(1))
    for _ in range(n):
        for model, opt in models_opts:
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        for s in scheds:
            s.step()


def _combined(model, lr=1e-2):
    hidden = [model[0].weight]
    rest = [model[1].weight, model[1].bias, model[2].weight]
    return MuonWithAdamW(torch.optim.Muon(hidden, lr=3 * lr, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
                         torch.optim.AdamW(rest, lr=lr, betas=(0.9, 0.95), weight_decay=0.1))


def _resumes_exactly(a, oa, saved, n):
    """A fresh twin of ``a`` with ``a``'s weights and the optimizer state ``saved`` steps as ``a`` does."""
    c, _ = _twins()
    c.load_state_dict(a.state_dict())
    oc = _combined(c)
    oc.load_state_dict(saved)
    _steps([(a, oa), (c, oc)], n=n)
    for p, q in zip(a.parameters(), c.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0)


def test_one_optimizer_is_torchs_muon_and_adamw_under_one_schedule():
    """Stepped and scheduled as one, each parameter moves exactly as torch's own optimizer moves it alone."""
    ours, ref = _twins()
    opt = _combined(ours)
    muon = torch.optim.Muon([ref[0].weight], lr=3e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([ref[1].weight, ref[1].bias, ref[2].weight], lr=1e-2, betas=(0.9, 0.95),
                              weight_decay=0.1)
    half = lambda s: 0.5 ** s  # noqa: E731
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, half) for o in (opt, muon, adamw)]
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(1))
    for _ in range(4):
        for model, opts in ((ours, [opt]), (ref, [muon, adamw])):
            for o in opts:
                o.zero_grad()
            model(x).square().mean().backward()
            for o in opts:
                o.step()
        for s in scheds:
            s.step()
    for p, q in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([3e-2 / 16, 1e-2 / 16])


def test_the_state_dict_round_trips_and_resumes_exactly():
    a, b = _twins()
    oa, ob = _combined(a), _combined(b)
    _steps([(a, oa), (b, ob)], n=3)
    saved = copy.deepcopy(oa.state_dict())  # as a checkpoint holds it: not the live tensors
    assert [len(g["params"]) for g in saved["param_groups"]] == [1, 3] and sorted(saved["state"]) == [0, 1, 2, 3]
    _resumes_exactly(a, oa, saved, 3)


def test_build_optimizer_groups_of_an_eagle3_drafter(tiny_target):
    from vatspec.drafters.eagle3 import Eagle3Config, Eagle3Drafter

    drafter = Eagle3Drafter(Eagle3Config.from_target(tiny_target, draft_vocab_size=64, ttt_steps=2))
    opt = build_optimizer(drafter, OptimConfig(kind="muon", lr=1e-3, muon_lr_scale=3.0))
    names = {id(p): n for n, p in drafter.named_parameters()}
    muon, rest = opt.param_groups
    assert isinstance(opt.muon, torch.optim.Muon) and isinstance(opt.adamw, torch.optim.AdamW)
    assert muon["lr"] == pytest.approx(3e-3) and rest["lr"] == pytest.approx(1e-3)
    assert sorted(names[id(p)] for p in muon["params"]) == sorted(
        [f"midlayer.self_attn.{x}_proj.weight" for x in "qkvo"]
        + [f"midlayer.mlp.{x}_proj.weight" for x in ("gate", "up", "down")] + ["fc.weight"])
    assert "lm_head.weight" in {names[id(p)] for p in rest["params"]}
    assert isinstance(build_optimizer(drafter, OptimConfig(lr=1e-3)), torch.optim.AdamW)


def test_config_muon_fields_checked():
    assert load_config(None, ["optim.kind=muon", "optim.muon_lr_scale=3"]).optim.muon_lr_scale == 3
    with pytest.raises(ConfigError, match="optim.kind"):
        load_config(None, ["optim.kind=sgd"])
    with pytest.raises(ConfigError, match="optim.muon_lr_scale"):
        load_config(None, ["optim.muon_lr_scale=0"])
    with pytest.raises(ConfigError, match="fsdp"):
        load_config(None, ["optim.kind=muon", "train.parallel=fsdp"])


def test_a_state_dict_keyed_by_name_or_missing_torchs_fields_loads():
    """What a sharded run saves (parameter names, not positions) and what an earlier optimizer saved (groups
    without Muon's nesterov / ns_coefficients / adjust_lr_fn) both load and step."""
    a, b = _twins()
    oa = _combined(a)
    _steps([(a, oa)], n=2)
    saved = copy.deepcopy(oa.state_dict())
    names = ["0.weight", "1.weight", "1.bias", "2.weight"]
    named = {"state": {names[i]: v for i, v in saved["state"].items()},
             "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in saved["param_groups"]]}
    ob = _combined(b)
    ob.load_state_dict(named)
    assert set(ob.muon.state) == {b[0].weight} and len(ob.adamw.state) == 3
    old = copy.deepcopy(saved)
    for key in ("nesterov", "ns_coefficients", "adjust_lr_fn"):
        del old["param_groups"][0][key]
    _resumes_exactly(a, oa, old, 1)


def test_float32_orthogonalisation_is_torch_s_iteration():
    """``newton_schulz_fp32`` (Muon's orthogonalisation on a CPU without bf16 hardware) is torch's own iteration
    in float32: it agrees with torch's bf16 result to bf16's precision, and with a float64 run of the same
    iteration to float32's, tall and wide."""
    from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _zeropower_via_newtonschulz

    from vatspec.train.optim import newton_schulz_fp32

    coef = (DEFAULT_A, DEFAULT_B, DEFAULT_C)
    torch.manual_seed(0)
    for shape in ((48, 16), (16, 48)):
        g = torch.randn(*shape)
        ours = newton_schulz_fp32(g, coef, 5, EPS)
        assert ours.dtype == torch.float32 and ours.shape == g.shape
        assert torch.allclose(ours, _zeropower_via_newtonschulz(g, coef, 5, EPS).float(), atol=0.03)  # bf16 rounding
        x = g.double().T if shape[0] > shape[1] else g.double()  # the iteration by hand, in float64
        x = x / x.norm()
        for _ in range(5):
            gram = x @ x.T
            x = DEFAULT_A * x + (DEFAULT_B * gram + DEFAULT_C * gram @ gram) @ x
        x = x.T if shape[0] > shape[1] else x
        assert torch.allclose(ours.double(), x, atol=1e-5)
