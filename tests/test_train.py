"""The training loop on a tiny target: resume exactness, DDP, bad input, lockstep arms."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import COUNT_CONVS
from vatspec.config import load_config
from vatspec.train import TrainError, train, train_arms

CONVS = COUNT_CONVS


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in CONVS))
    return path


def _cfg(tiny_target_dir, data_file, out_dir, *extra):
    return load_config(None, [
        f"target.path={tiny_target_dir}", f"data.train={data_file}", f"train.out_dir={out_dir}",
        "data.batch_size=2", "data.max_length=64", "data.heldout_max=4", "drafter.draft_vocab_size=256",
        "drafter.ttt_steps=3", "drafter.block_size=4", "drafter.num_anchors=4", "train.steps=4",
        "optim.lr=1e-3", *extra,
    ])


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _killed_at_step_2(run: Path, copy: Path) -> Path:
    """A copy of a finished 4-step run folder as it was when killed right after its step-2 checkpoint."""
    import shutil

    shutil.copytree(run, copy)
    (copy / "latest").write_text("step-000002\n")
    shutil.rmtree(copy / "checkpoints" / "step-000004")
    lines = (copy / "metrics.jsonl").read_text().splitlines()[:2]
    (copy / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return copy


@pytest.mark.parametrize("kind, loss, optim", [("eagle3", "vat", "adamw"), ("dflash", "vat", "adamw"),
                                               ("eagle3", "vat", "muon"), ("dflash", "dflash", "muon")])
def test_resume_reproduces_uninterrupted_losses(tiny_target_dir, data_file, tmp_path, kind, loss, optim):
    arm = [f"drafter.kind={kind}", f"loss.kind={loss}", f"optim.kind={optim}", "train.save_every=2"]
    full = _cfg(tiny_target_dir, data_file, tmp_path / "full", *arm)
    train(full, progress=False)
    part_dir = _killed_at_step_2(tmp_path / "full", tmp_path / "part")
    resumed = _cfg(tiny_target_dir, data_file, part_dir, *arm)
    train(resumed, resume=True, progress=False)
    a, b = _losses(tmp_path / "full"), _losses(part_dir)
    assert len(a) == len(b) == 4
    assert a == pytest.approx(b, rel=1e-6, abs=1e-7)


def test_step_generator_keeps_the_cpu_stream():
    from vatspec.train import step_generator

    # seed 1, step 2, micro 3, rank 0 -> 1 * 1_000_003 + 2 * 1_009 + 3 * 101 + 0 = 1_002_324
    ref = torch.rand(5, generator=torch.Generator().manual_seed(1_002_324))
    assert torch.equal(torch.rand(5, generator=step_generator(1, 2, 3, 0)), ref)
    g = step_generator(1, 2, 3, 0, device=torch.device("cpu"))
    assert g.device == torch.device("cpu") and torch.equal(torch.rand(5, generator=g), ref)


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_sampled_verification_gets_a_generator_on_the_training_device(
    tiny_target_dir, data_file, tmp_path, monkeypatch, kind
):
    """loss.verify=sampled draws with the step generator: it must be made on the device the batch and
    logits live on (CUDA refuses a CPU generator). On a CPU-only machine the spies check that the loop
    asks for the training device; on a GPU machine the run itself is the check."""
    import vatspec.train.arms as T  # where the loop looks its pieces up

    asked, seen = [], []
    real_gen, real_verify = T.step_generator, T.simulate_verification

    def gen_spy(*args, **kw):
        asked.append(kw.get("device"))
        return real_gen(*args, **kw)

    def verify_spy(draft_logits, target_logits, valid=None, **kw):
        seen.append((kw["generator"].device, draft_logits.device))
        return real_verify(draft_logits, target_logits, valid, **kw)

    monkeypatch.setattr(T, "step_generator", gen_spy)
    monkeypatch.setattr(T, "simulate_verification", verify_spy)
    # the unchunked path, whose simulate_verification the spy sees (the chunked path checks the
    # generator in chunked_pass: tests/test_chunked.py)
    cfg = _cfg(tiny_target_dir, data_file, tmp_path / "r", f"drafter.kind={kind}", "loss.kind=vat",
               "loss.verify=sampled", "train.steps=1", "loss.chunk_size=0")
    train(cfg, progress=False)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    assert asked and all(d is not None and torch.device(d) == device for d in asked), asked
    assert seen and all(g.type == x.type == device.type for g, x in seen), seen


def test_refuses_to_overwrite_a_run(tiny_target_dir, data_file, tmp_path):
    cfg = _cfg(tiny_target_dir, data_file, tmp_path / "r", "train.steps=1")
    train(cfg, progress=False)
    before = (tmp_path / "r" / "metrics.jsonl").read_text()
    with pytest.raises(TrainError, match="already holds a run"):
        train(cfg, progress=False)
    assert (tmp_path / "r" / "metrics.jsonl").read_text() == before


def test_bad_data_is_named(tiny_target_dir, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(Exception, match="empty.jsonl"):
        train(_cfg(tiny_target_dir, empty, tmp_path / "x"), progress=False)
    no_sup = tmp_path / "nosup.jsonl"
    no_sup.write_text(json.dumps({"id": "a", "conversations": [
        {"from": "human", "value": "x " * 200}, {"from": "gpt", "value": "y"}]}) + "\n")
    with pytest.raises(TrainError, match="nosup.jsonl"):
        train(_cfg(tiny_target_dir, no_sup, tmp_path / "y"), progress=False)
    assert not (tmp_path / "x" / "latest").exists() and not (tmp_path / "y" / "latest").exists()


def test_lockstep_arms_equal_separate_runs(tiny_target_dir, data_file, tmp_path):
    """Sharing the target pass changes nothing: each arm's losses equal its run alone."""
    a = _cfg(tiny_target_dir, data_file, tmp_path / "a", "drafter.kind=eagle3", "loss.kind=eagle3")
    b = _cfg(tiny_target_dir, data_file, tmp_path / "b", "drafter.kind=dflash", "loss.kind=vat")
    finals = train_arms([a, b], progress=False)
    a2 = _cfg(tiny_target_dir, data_file, tmp_path / "a2", "drafter.kind=eagle3", "loss.kind=eagle3")
    b2 = _cfg(tiny_target_dir, data_file, tmp_path / "b2", "drafter.kind=dflash", "loss.kind=vat")
    train(a2, progress=False)
    train(b2, progress=False)
    assert _losses(tmp_path / "a") == pytest.approx(_losses(tmp_path / "a2"), rel=1e-5)
    assert _losses(tmp_path / "b") == pytest.approx(_losses(tmp_path / "b2"), rel=1e-5)
    # the held-out chains are kept per chain (for paired comparisons) and not logged per step
    for final, run in zip(finals, ("a", "b")):
        chains = final["chain_accepted"]
        assert len(chains) == final["chains"] and sum(chains) / len(chains) == pytest.approx(final["mean_first_reject"])
        saved = json.loads((tmp_path / run / "heldout_chains.json").read_text())
        assert saved["chain_accepted"] == chains
        assert all("eval/chain_accepted" not in json.loads(line)
                   for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines())


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_loss_on_all_trains_every_position_and_scores_the_answers(tiny_target_dir, data_file, tmp_path, monkeypatch,
                                                                   kind):
    """data.loss_on=all: training batches supervise every real position after the first; the held-out split is
    still scored on the answer tokens, and the draft vocabulary is still counted on them."""
    import vatspec.train.arms as T  # where the loop looks its pieces up

    seen: dict[str, list] = {"train": [], "held": []}
    step, evaluate = T.arm_step, T.evaluate_arms

    def spy_step(model, drafter, batch, *a, **kw):
        if model.training:
            seen["train"].append((batch.loss_mask.clone(), batch.attention_mask.clone()))
        return step(model, drafter, batch, *a, **kw)

    def spy_evaluate(arms, target, examples, *a, **kw):
        seen["held"].append([list(e.loss_mask) for e in examples])
        return evaluate(arms, target, examples, *a, **kw)

    monkeypatch.setattr(T, "arm_step", spy_step)
    monkeypatch.setattr(T, "evaluate_arms", spy_evaluate)
    arm = [f"drafter.kind={kind}", "loss.kind=vat"]
    train(_cfg(tiny_target_dir, data_file, tmp_path / "answers", *arm), progress=False)
    answers = dict(seen)
    seen.update(train=[], held=[])
    train(_cfg(tiny_target_dir, data_file, tmp_path / "all", *arm, "data.loss_on=all"), progress=False)
    assert seen["train"] and answers["train"]
    for mask, attn in seen["train"]:
        expect = attn.bool().clone()
        expect[:, 0] = False  # nothing predicts the first token
        assert torch.equal(mask, expect)
    for mask, attn in answers["train"]:  # the default supervises the answers only: a strict subset
        assert mask.sum() < (attn.sum() - attn.shape[0])
    assert seen["held"] == answers["held"] and any(not all(m[1:]) for m in seen["held"][0])
    if kind == "eagle3":
        from safetensors.torch import load_file

        def d2t(run: str):
            ck = tmp_path / run / "checkpoints" / (tmp_path / run / "latest").read_text().strip()
            return load_file(ck / "drafter.safetensors")["d2t"]

        assert torch.equal(d2t("answers"), d2t("all"))


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_feature_noise_reaches_training_steps_only(tiny_target_dir, data_file, tmp_path, monkeypatch, kind):
    """train.feature_noise: an arm's training steps read noisy features, its held-out evaluation the clean
    ones (equal to a clean arm's in the same lockstep); a noisy run resumes exactly."""
    import vatspec.train.arms as T  # where the loop looks its pieces up

    seen: list[tuple[str, bool, torch.Tensor]] = []
    step = T.arm_step

    def spy_step(model, drafter, batch, tout, *a, **kw):
        seen.append((Path(model.cfg_dir).name, model.training, tout.features.clone()))
        return step(model, drafter, batch, tout, *a, **kw)

    build = T.build_arm

    def tag(cfg, *a, **kw):  # name each arm's module, so the spy knows whose step it sees
        arm = build(cfg, *a, **kw)
        arm.model.cfg_dir = cfg.train.out_dir
        return arm

    monkeypatch.setattr(T, "arm_step", spy_step)
    monkeypatch.setattr(T, "build_arm", tag)
    arm = [f"drafter.kind={kind}", "loss.kind=vat", "train.save_every=2"]
    cfgs = [_cfg(tiny_target_dir, data_file, tmp_path / name, *arm, f"train.feature_noise={s}")
            for name, s in (("clean", 0), ("noisy", 0.3))]
    train_arms(cfgs, progress=False)
    by = {(n, t): [f for m, tr, f in seen if (m, tr) == (n, t)] for n in ("clean", "noisy") for t in (True, False)}
    assert len(by["clean", True]) == len(by["noisy", True]) == 4 and by["clean", False]
    for c, n in zip(by["clean", True], by["noisy", True]):
        rel = (n - c).float().pow(2).mean().sqrt() / c.float().pow(2).mean().sqrt()
        assert 0.2 < rel.item() < 0.4  # noise of 0.3 x the RMS, on every training step
    assert all(torch.equal(c, n) for c, n in zip(by["clean", False], by["noisy", False]))
    assert _losses(tmp_path / "clean") != _losses(tmp_path / "noisy")
    # resumed from its step-2 checkpoint, the noisy arm draws the same noise as it did uninterrupted
    part = _killed_at_step_2(tmp_path / "noisy", tmp_path / "noisy-part")
    monkeypatch.setattr(T, "arm_step", step)
    train(_cfg(tiny_target_dir, data_file, part, *arm, "train.feature_noise=0.3"), resume=True, progress=False)
    assert _losses(part) == pytest.approx(_losses(tmp_path / "noisy"), rel=1e-6, abs=1e-7)


OBJECTIVES = ("kl", "tv", "lk", "dpace", "specauf", "dspark")


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_lockstep_objectives_share_batches_and_initialisation(tiny_target_dir, data_file, tmp_path, monkeypatch, kind):
    """Every objective arm of `vatspec ablate --arms` starts from the same weights as the drafter's baseline
    and sees the same batches: its losses in lockstep equal its run alone."""
    import vatspec.train.arms as T  # where the loop looks its pieces up

    init = {}
    build = T.build_arm

    def spy(cfg, *a, **kw):
        arm = build(cfg, *a, **kw)
        init[cfg.loss.kind] = {n: p.detach().clone() for n, p in arm.drafter.named_parameters()}
        return arm

    monkeypatch.setattr(T, "build_arm", spy)
    arms = [kind, *OBJECTIVES]
    cfgs = [_cfg(tiny_target_dir, data_file, tmp_path / a, f"drafter.kind={kind}", f"loss.kind={a}") for a in arms]
    finals = train_arms(cfgs, progress=False)
    base = init[kind]
    for a in OBJECTIVES:
        assert init[a].keys() == base.keys() and all(torch.equal(init[a][n], base[n]) for n in base), a
    assert all(f["chains"] == finals[0]["chains"] for f in finals)  # the same held-out chains
    for a in OBJECTIVES:
        train(_cfg(tiny_target_dir, data_file, tmp_path / f"{a}-alone", f"drafter.kind={kind}", f"loss.kind={a}"),
              progress=False)
        assert _losses(tmp_path / a) == pytest.approx(_losses(tmp_path / f"{a}-alone"), rel=1e-5), a
    # the objectives train differently (kl on EAGLE-3 is soft CE less a constant: its own loss values)
    assert len({tuple(_losses(tmp_path / a)) for a in arms}) == len(arms)


def test_checkpoint_loads_for_decoding(tiny_target_dir, data_file, tmp_path):
    from vatspec.drafts import open_draft
    from vatspec.target import Target

    cfg = _cfg(tiny_target_dir, data_file, tmp_path / "run", "loss.kind=vat", "train.steps=1")
    train(cfg, progress=False)
    target = Target.from_pretrained(tiny_target_dir)
    drafter, head = open_draft(tmp_path / "run", target)
    assert drafter.kind == "eagle3" and head is not None
    saved = (tmp_path / "run" / "checkpoints" / "step-000001" / "config.yaml").read_text()
    assert "kind: vat" in saved
    # the loaded weights are the saved ones, and the draft decodes: T = 0 output equals the AR
    # baseline (the same loop without a drafter), with drafts proposed
    from safetensors.torch import load_file

    from vatspec.eval.decode import generate

    files = load_file(tmp_path / "run" / "checkpoints" / "step-000001" / "drafter.safetensors")
    state = drafter.state_dict()
    assert set(files) == set(state) and all(torch.equal(state[k].cpu(), files[k]) for k in files)
    assert not drafter.training and not head.training
    prompt = [5, 6, 7, 8]
    ref = generate(target, prompt, None, max_new_tokens=8)
    res = generate(target, prompt, drafter, head=head, max_new_tokens=8)
    assert res.tokens == ref.tokens and res.rounds[0].drafted > 0


def test_ddp_two_cpu_processes_hold_identical_weights(tiny_target_dir, data_file, tmp_path):
    script = tmp_path / "ddp.py"
    # every rank saves its live parameters after training; DDP must have kept them identical
    script.write_text(
        "import os, sys, torch, torch.distributed as dist\n"
        "from vatspec.config import load_config\n"
        "import vatspec.train as T\n"
        "import vatspec.train.arms as A\n"
        "cfg = load_config(None, sys.argv[2:])\n"
        "captured = {}\n"
        "orig = A.build_arm\n"
        "def spy(*a, **k):\n"
        "    arm = orig(*a, **k); captured['arm'] = arm\n"
        "    init = {n: p.detach().clone() for n, p in arm.module.named_parameters()}\n"
        "    torch.save(init, sys.argv[1] + f'.init.{dist.get_rank()}')  # before any optimiser step\n"
        "    return arm\n"
        "A.build_arm = spy\n"
        "T.train(cfg, progress=False)\n"
        "assert not dist.is_initialized()  # train destroys the group it started\n"
        "m = captured['arm'].module\n"
        "flat = torch.cat([p.detach().flatten() for p in m.parameters()])\n"
        "torch.save(flat, sys.argv[1] + f'.{os.environ[\"RANK\"]}')\n"
    )
    out = tmp_path / "w"
    args = [f"target.path={tiny_target_dir}", f"data.train={data_file}", f"train.out_dir={tmp_path / 'ddp'}",
            "data.batch_size=2", "data.max_length=64", "drafter.draft_vocab_size=256", "drafter.ttt_steps=3",
            "train.steps=2", "optim.lr=1e-2", "loss.kind=vat"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29533", str(script),
         str(out), *args],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    w0, w1 = torch.load(f"{out}.0"), torch.load(f"{out}.1")
    assert torch.equal(w0, w1)
    # the checkpoint holds them, and every trained tensor (drafter and accept head, loss.kind=vat)
    # moved away from the initialisation, which both ranks shared
    from safetensors.torch import load_file

    init0, init1 = torch.load(f"{out}.init.0"), torch.load(f"{out}.init.1")
    assert init0.keys() == init1.keys() and all(torch.equal(init0[n], init1[n]) for n in init0)
    ckpt = tmp_path / "ddp" / "checkpoints" / (tmp_path / "ddp" / "latest").read_text().strip()
    saved = {f"drafter.{n}": t for n, t in load_file(ckpt / "drafter.safetensors").items()}
    saved.update({f"head.{n}": t for n, t in load_file(ckpt / "head.safetensors").items()})
    assert set(init0) <= set(saved) and any(n.startswith("head.") for n in init0)
    assert torch.equal(torch.cat([saved[n].flatten() for n in init0]), w0)  # named_parameters order
    unmoved = [n for n in init0 if torch.equal(saved[n], init0[n])]
    assert not unmoved, f"weights equal to their initial values after training: {unmoved}"


@pytest.mark.parametrize("loss", ["vat", "dspark"])
@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_trained_drafter_decodes_losslessly_with_and_without_early_exit(tiny_target_dir, data_file, tmp_path, kind,
                                                                        loss):
    """T = 0 output equals HF generate() greedy for a drafter trained with a head (VAT's, or DSpark's
    confidence head, which the checkpoint opens with its own exit rule), early exit on and off."""
    from vatspec.drafts import open_draft
    from vatspec.eval.decode import generate
    from vatspec.target import Target

    cfg = _cfg(tiny_target_dir, data_file, tmp_path / "run", f"drafter.kind={kind}", f"loss.kind={loss}",
               "train.steps=6", "optim.lr=1e-2", "drafter.mask_token_id=16")
    train(cfg, progress=False)
    target = Target.from_pretrained(tiny_target_dir)
    drafter, head = open_draft(tmp_path / "run", target)
    assert head is not None and head.label == {"vat": "alive", "dspark": "alpha"}[loss]
    tok = target.tokenizer
    for text in ["Count from 3 to 8, please.", "Say hello.", "Count from 11 to 16, please."]:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        ref = target.model.generate(ids, max_new_tokens=20, do_sample=False,
                                    eos_token_id=target.eos_token_ids, pad_token_id=0)[0, ids.shape[1]:].tolist()
        for threshold in (None, 0.5):
            res = generate(target, ids[0].tolist(), drafter, head=head, exit_threshold=threshold, max_new_tokens=20)
            assert res.tokens == ref, (text, threshold)


def test_cli_reports_bad_input_in_one_line(tmp_path, capsys):
    from vatspec.cli import main

    assert main(["train", "target.path=default", f"data.train={tmp_path / 'missing.jsonl'}",
                 f"train.out_dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err
    assert "missing.jsonl: no such file or folder" in err and "Traceback" not in err
    assert main(["train", "train.stepz=3"]) == 2
    assert "unknown field 'train.stepz'" in capsys.readouterr().err
    assert main(["train", f"data.train={tmp_path / 'missing.jsonl'}", f"train.out_dir={tmp_path / 'r'}"]) == 2
    assert "target.path is required" in capsys.readouterr().err  # no silent fallback to the embedded target
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["drafter=eagle3", "loss=dflash"], "drafter.kind=eagle3 with loss.kind=dflash: the dflash curve"),
        (["loss=vat", "loss.curve=dflash"], "drafter.kind=eagle3 with loss.curve=dflash"),
        (["loss=eagle3", "loss.soft=false"], "there is nothing to train"),
        (["target.dtype=fp8"], "target.dtype 'fp8' is not one of float32, bfloat16, float16 (or fp32"),
        (["target.device=gpu"], "target.device 'gpu' is not a device"),
        (["train.feature_noise=-0.1"], "train.feature_noise: must be >= 0, got -0.1"),
    ],
)
def test_cli_rejects_a_bad_config_in_one_line_before_loading_anything(tmp_path, capsys, overrides, message):
    """As a user runs it: exit 2, one line on stderr, no traceback. The data file and the target do
    not exist, so an error about either would mean they were opened first."""
    from vatspec.cli import main

    rc = main(["train", f"data.train={tmp_path / 'missing.jsonl'}", f"target.path={tmp_path / 'no_model'}",
               f"train.out_dir={tmp_path / 'r'}", *overrides])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("vatspec train: error: ") and message in err, err
    assert not (tmp_path / "r").exists()


def test_cli_takes_dtype_aliases_and_saves_a_loadable_config(tiny_target_dir, data_file, tmp_path, capsys):
    from vatspec.cli import main

    args = [f"target.path={tiny_target_dir}", f"data.train={data_file}", "data.batch_size=2", "data.max_length=64",
            "data.heldout_max=2", "drafter=dflash", "drafter.block_size=4", "drafter.num_anchors=4", "loss=vat",
            "train.steps=1", "target.device=cpu"]
    assert main(["train", *args, "target.dtype=fp32", f"train.out_dir={tmp_path / 'r'}", "--no-progress"]) == 0
    assert "held-out: tau_sim=" in capsys.readouterr().out
    saved = load_config(tmp_path / "r" / "config.yaml")  # the resolved config, as saved, loads back
    want = load_config(None, [*args, "target.dtype=float32", f"train.out_dir={tmp_path / 'r'}"])
    assert saved.target.dtype == "float32" and saved.loss == want.loss and saved.loss.gamma == 2.0  # block 4 -> 2
    assert saved.drafter == want.drafter and saved.data == want.data


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_bf16_autocast_losses_track_float32(tiny_target_dir, data_file, tmp_path, kind):
    """train.precision=bf16: the forward and loss under bfloat16 autocast (CPU autocast here), weights
    and optimizer state float32. The losses follow the float32 run's within bf16 rounding, and the
    saved weights stay float32."""
    from safetensors.torch import load_file

    runs = {}
    for precision in ("fp32", "bf16"):
        runs[precision] = tmp_path / precision
        train(_cfg(tiny_target_dir, data_file, runs[precision], f"drafter.kind={kind}", "loss.kind=vat",
                   f"train.precision={precision}", "drafter.mask_token_id=16"), progress=False)
    a, b = _losses(runs["fp32"]), _losses(runs["bf16"])
    assert len(a) == len(b) == 4 and a != b  # autocast did run in bfloat16
    assert b == pytest.approx(a, rel=0.03)  # bf16 keeps 8 bits of mantissa: ~0.4% per op
    ckpt = runs["bf16"] / "checkpoints" / (runs["bf16"] / "latest").read_text().strip()
    assert {t.dtype for t in load_file(ckpt / "drafter.safetensors").values() if t.is_floating_point()} == \
        {torch.float32}


# reduce-scatter and all-reduce sum the two ranks' gradients in other orders (~1e-7); Adam divides by
# sqrt(v), so after 4 steps at lr 1e-2 (updates ~4e-2) the weights differ by up to ~3e-5
WEIGHT_ATOL = 1e-4
FSDP_SCRIPT = (
    "import sys, torch, torch.distributed as dist\n"
    "from vatspec.config import load_config\n"
    "import vatspec.train as T\n"
    "resume = sys.argv[1] == 'resume'\n"
    "cfg = load_config(None, sys.argv[2:])\n"
    "T.train(cfg, progress=False, resume=resume)\n"
)


def _torchrun(script: Path, *args: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29541",
                           str(script), *args], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _final_weights(run: Path) -> dict:
    from safetensors.torch import load_file

    ckpt = run / "checkpoints" / (run / "latest").read_text().strip()
    return {**load_file(ckpt / "drafter.safetensors"), **{f"head.{k}": v for k, v in
                                                          load_file(ckpt / "head.safetensors").items()}}


@pytest.mark.slow
def test_fsdp_two_cpu_processes_train_as_ddp_and_resume_across_the_switch(tiny_target_dir, data_file, tmp_path):
    """train.parallel=fsdp (FSDP2 fully_shard, gloo on CPU) computes what DDP computes: same losses and
    final weights within float tolerance; a run checkpointed under fsdp resumes under ddp (and the
    reverse) and ends where the uninterrupted run ends."""
    script = tmp_path / "run.py"
    script.write_text(FSDP_SCRIPT)
    common = [f"target.path={tiny_target_dir}", f"data.train={data_file}", "data.batch_size=2", "data.max_length=64",
              "drafter.draft_vocab_size=256", "drafter.ttt_steps=3", "train.steps=4", "optim.lr=1e-2",
              "loss.kind=vat", "train.save_every=2"]
    runs = {}
    for mode in ("ddp", "fsdp"):
        runs[mode] = tmp_path / mode
        _torchrun(script, "fresh", *common, f"train.out_dir={runs[mode]}", f"train.parallel={mode}")
    assert _losses(runs["fsdp"]) == pytest.approx(_losses(runs["ddp"]), rel=1e-5)
    wd, wf = _final_weights(runs["ddp"]), _final_weights(runs["fsdp"])
    assert wd.keys() == wf.keys() and all(torch.allclose(wd[k], wf[k], atol=WEIGHT_ATOL) for k in wd)
    # the switch: steps 1-2 in one mode, 3-4 resumed in the other
    for first, second in (("fsdp", "ddp"), ("ddp", "fsdp")):
        run = tmp_path / f"{first}-{second}"
        _torchrun(script, "fresh", *common, f"train.out_dir={run}", f"train.parallel={first}", "train.steps=4",
                  "train.save_every=2")
        # cut back to step 2 as a kill would leave it, then resume in the other mode
        import shutil

        shutil.rmtree(run / "checkpoints" / "step-000004")
        (run / "latest").write_text("step-000002\n")
        _torchrun(script, "resume", *common, f"train.out_dir={run}", f"train.parallel={second}")
        w = _final_weights(run)
        assert all(torch.allclose(w[k], wd[k], atol=WEIGHT_ATOL) for k in wd), (first, second)
        assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


def test_a_device_map_target_trains_as_the_plain_load(tiny_target_dir, data_file, tmp_path):
    """target.device_map=auto (accelerate spreads the layers over the visible GPUs; on this CPU-only
    machine all of them land on the CPU): the target outputs are brought to the drafter's device and
    the run equals the plain load's. The moves between GPUs themselves have not run here."""
    runs = {}
    for name, extra in (("plain", []), ("mapped", ["target.device_map=auto"])):
        runs[name] = tmp_path / name
        for kind in ("eagle3", "dflash"):
            train(_cfg(tiny_target_dir, data_file, runs[name] / kind, f"drafter.kind={kind}", "loss.kind=vat",
                       "drafter.mask_token_id=16", *extra), progress=False)
    for kind in ("eagle3", "dflash"):
        assert _losses(runs["mapped"] / kind) == _losses(runs["plain"] / kind)


def test_heldout_pool_draws_the_split_from_the_first_items_only():
    from vatspec.train import heldout_split

    plain = load_config(None, ["data.heldout_fraction=0.1", "data.heldout_max=16"]).data
    pooled = load_config(None, ["data.heldout_fraction=0.1", "data.heldout_max=16", "data.heldout_pool=200"]).data
    items = list(range(700))
    train, held = heldout_split(items, pooled, seed=3)
    # the split a file of the first 200 items alone gets: the same held-out set, the rest all train
    assert held == heldout_split(items[:200], plain, seed=3)[1] and len(held) == 16
    assert sorted(train + held) == items and set(range(200, 700)) <= set(train)
    assert heldout_split(items, plain, seed=3)[1] != held  # without the pool the split spans all 700
    assert heldout_split(items[:50], pooled, seed=3) == heldout_split(items[:50], plain, seed=3)  # pool > items


def test_template_settings_saved_and_refused_on_resume(tiny_target_dir, data_file, tmp_path):
    """Every checkpoint records the chat template's sha256 and arguments; resuming with another template is
    refused naming both, and eval / export read the same record (``recorded_template``)."""
    from vatspec.data import DataError
    from vatspec.data.chat import check_settings, template_sha256
    from vatspec.export.record import recorded_template

    run = tmp_path / "run"
    train(_cfg(tiny_target_dir, data_file, run, "train.steps=2", "train.save_every=1"))
    from transformers import AutoTokenizer

    own = AutoTokenizer.from_pretrained(tiny_target_dir).chat_template
    rec = recorded_template(run)
    assert rec == {"chat_template_sha256": template_sha256(own), "chat_template_kwargs": {}}
    other = tmp_path / "other.jinja"
    other.write_text(own + "{# another template #}")
    with pytest.raises(DataError, match=r"run resumed\) was made with chat template sha256 .* this run renders with"):
        train(_cfg(tiny_target_dir, data_file, run, "train.steps=4", "train.save_every=1",
                   f"data.chat_template={other}"), resume=True)
    with pytest.raises(DataError, match="--draft .* was made with chat template sha256"):
        check_settings(rec, {"chat_template_sha256": template_sha256(other.read_text()), "chat_template_kwargs": {}},
                       f"--draft {run}", "this eval")


def test_resume_with_another_config_is_refused_or_recorded(tiny_target_dir, data_file, tmp_path, capsys):
    """--resume continues the steps a run took: a config that computes otherwise is refused, listing each change,
    before anything is written; --resume-with-changes continues and records them; saving and logging fields
    may change freely."""
    from vatspec.cli import main

    train(_cfg(tiny_target_dir, data_file, tmp_path / "full", "train.save_every=2"), progress=False)
    run = _killed_at_step_2(tmp_path / "full", tmp_path / "run")  # a 4-step run killed after step 2
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    base = [f"target.path={tiny_target_dir}", f"data.train={data_file}", f"train.out_dir={run}", "data.batch_size=2",
            "data.max_length=64", "data.heldout_max=4", "drafter.draft_vocab_size=256", "drafter.ttt_steps=3",
            "drafter.block_size=4", "drafter.num_anchors=4", "optim.lr=1e-3", "train.save_every=2"]
    assert main(["train", *base, "train.steps=4", "optim.lr=0.5", "train.seed=3", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "optim.lr 0.001 -> 0.5; train.seed 0 -> 3. Pass the checkpoint's values, or --resume-with-changes" \
        in err and "Traceback" not in err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before  # nothing written
    assert main(["train", *base, "train.steps=5", "train.log_every=2", "--resume-with-changes", "--no-progress"]) == 0
    history = [json.loads(line) for line in (run / "config_history.jsonl").read_text().splitlines()]
    assert [h["changes"] for h in history] == [{"train.steps": [4, 5]}] and history[0]["step"] == 2
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()][-1] == 5
