"""optim.py: Muon's orthogonalisation, MuonAdamW against torch's own AdamW and Muon, the groups
``build_optimizer`` makes of a drafter, the config checks (a Muon run's exact resume is in
tests/test_train.py)."""

import pytest
import torch
from torch import nn

from vatspec.config import ConfigError, OptimConfig, load_config
from vatspec.optim import MuonAdamW, build_optimizer, orthogonalize

# AdamW groups: the same float32 arithmetic as torch's, up to operation order
ADAM_ATOL = 1e-6
# torch.optim.Muon runs Newton-Schulz in bfloat16 (8 mantissa bits), ours in float32
MUON_RTOL = 3e-2


@pytest.mark.parametrize("shape", [(24, 64), (64, 24), (32, 32)])
def test_orthogonalize_brings_singular_values_near_one(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 5
    s = torch.linalg.svdvals(orthogonalize(g))
    s16 = torch.linalg.svdvals(orthogonalize(g, dtype=torch.bfloat16).float())
    assert s16.min() > 0.5 and s16.max() < 1.3, s16
    # the quintic iteration overshoots on purpose: values land near 1, not at 1 (Muon's design)
    assert s.min() > 0.5 and s.max() < 1.3, s
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    cos = torch.nn.functional.cosine_similarity(orthogonalize(g).flatten(), (u @ vh).flatten(), dim=0)
    assert cos > 0.95  # the direction of U V^T


def _twins(seed=0):
    torch.manual_seed(seed)
    a = nn.Sequential(nn.Linear(16, 32, bias=False), nn.LayerNorm(32), nn.Linear(32, 8, bias=False))
    b = nn.Sequential(nn.Linear(16, 32, bias=False), nn.LayerNorm(32), nn.Linear(32, 8, bias=False))
    b.load_state_dict(a.state_dict())
    return a, b


def _steps(models_opts, n=5):
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(1))
    for _ in range(n):
        for model, opt in models_opts:
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()


def test_adamw_groups_equal_torch_adamw():
    ours, ref = _twins()
    kw = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    _steps([(ours, MuonAdamW([{"params": list(ours.parameters())}], **kw)),
            (ref, torch.optim.AdamW(ref.parameters(), **kw))])
    for p, q in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=ADAM_ATOL, rtol=0)


def test_muon_groups_equal_torch_muon():
    # the same gradients for both (not the params' own, which drift apart by the rounding below)
    gen = torch.Generator().manual_seed(2)
    grads = [(torch.randn(32, 16, generator=gen), torch.randn(8, 32, generator=gen)) for _ in range(4)]
    start = [torch.randn(32, 16, generator=gen), torch.randn(8, 32, generator=gen)]
    ours, ref = [nn.Parameter(w.clone()) for w in start], [nn.Parameter(w.clone()) for w in start]
    opts = [MuonAdamW([{"params": ours, "muon": True}], lr=1e-2, weight_decay=0.1),
            torch.optim.Muon(ref, lr=1e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")]
    for g in grads:
        for params, opt in zip((ours, ref), opts):
            for p, gp in zip(params, g):
                p.grad = gp.clone()
            opt.step()
    for p, q, p0 in zip(ours, ref, start):
        moved, ref_moved = p.detach() - p0, q.detach() - p0
        assert ref_moved.abs().max() > 1e-3  # it did move
        assert (moved - ref_moved).norm() / ref_moved.norm() < MUON_RTOL


def test_muon_refuses_a_vector():
    with pytest.raises(ValueError, match="matrices only"):
        MuonAdamW([{"params": [nn.Parameter(torch.ones(4))], "muon": True}], lr=1e-3)


def test_build_optimizer_groups_of_an_eagle3_drafter(tiny_target):
    from vatspec.drafters.eagle3 import Eagle3Config, Eagle3Drafter

    drafter = Eagle3Drafter(Eagle3Config.from_target(tiny_target, draft_vocab_size=64, ttt_steps=2))
    opt = build_optimizer(drafter, OptimConfig(kind="muon", lr=1e-3, muon_lr_scale=3.0))
    names = {id(p): n for n, p in drafter.named_parameters()}
    muon, rest = opt.param_groups
    assert muon["muon"] and muon["lr"] == pytest.approx(3e-3) and rest["lr"] == pytest.approx(1e-3)
    assert sorted(names[id(p)] for p in muon["params"]) == sorted(
        [f"midlayer.self_attn.{x}_proj.weight" for x in "qkvo"]
        + [f"midlayer.mlp.{x}_proj.weight" for x in ("gate", "up", "down")] + ["fc.weight"])
    assert "lm_head.weight" in {names[id(p)] for p in rest["params"]}
    assert opt.ns_dtype == torch.float32
    assert build_optimizer(drafter, OptimConfig(kind="muon", lr=1e-3), precision="bf16").ns_dtype == torch.bfloat16
    assert isinstance(build_optimizer(drafter, OptimConfig(lr=1e-3)), torch.optim.AdamW)


def test_config_muon_fields_checked():
    assert load_config(None, ["optim.kind=muon", "optim.muon_lr_scale=3"]).optim.muon_lr_scale == 3
    with pytest.raises(ConfigError, match="optim.kind"):
        load_config(None, ["optim.kind=sgd"])
    with pytest.raises(ConfigError, match="optim.muon_lr_scale"):
        load_config(None, ["optim.muon_lr_scale=0"])
    with pytest.raises(ConfigError, match="fsdp"):
        load_config(None, ["optim.kind=muon", "train.parallel=fsdp"])
