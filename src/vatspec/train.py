"""``vatspec train``: one loop for every drafter and every loss.

The loop does no math: per micro-batch it asks the drafter what the target must compute, runs
the frozen target (online mode, under no_grad), lets the drafter build its K-position chains,
simulates verification (``verify.py``) and hands everything to the objective (``losses.py``).
Runs unchanged under ``torchrun --nproc_per_node=N`` (DDP: gloo on CPU, NCCL on GPUs).

    vatspec train data.train=prompts.jsonl drafter.kind=eagle3 loss.kind=vat train.steps=200
    vatspec train --config run.yaml --resume
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from vatspec import checkpoint as ckpt_io
from vatspec.config import Config, ConfigError, dump_config, load_config
from vatspec.drafters import DrafterPlan, build_drafter, plan_batch
from vatspec.drafters.base import AcceptHead
from vatspec.losses import vat_objective
from vatspec.metrics import MetricAccumulator, chain_metrics
from vatspec.verify import simulate_verification

REFERENCE = {  # RESEARCH.md: reference optimiser defaults per drafter
    "eagle3": {"lr": 1e-4, "warmup_ratio": 0.015, "grad_clip": 0.5},
    "dflash": {"lr": 6e-4, "warmup_ratio": 0.04, "grad_clip": 1.0},
}


class TrainError(RuntimeError):
    """Bad training input (data, checkpoint, config) detected before anything is overwritten."""


# ----------------------------------------------------------------------------- pieces
class TrainModule(nn.Module):
    """Drafter + accept head as one module, so DDP syncs both; forward = drafter forward + head."""

    def __init__(self, drafter: nn.Module, head: AcceptHead | None):
        super().__init__()
        self.drafter = drafter
        self.head = head

    def forward(self, batch, tout, plan: DrafterPlan):
        out = self.drafter.training_forward(batch, tout, **plan.kwargs)
        head_logits = self.head(out.hidden) if self.head is not None else None  # [..., K]
        return out, head_logits


def lr_lambda(total: int, warmup: int, min_ratio: float):
    """Linear warmup to 1, then cosine to ``min_ratio``."""

    def f(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def step_generator(seed: int, step: int, micro: int, rank: int) -> torch.Generator:
    """Per-micro-batch RNG for anchors and sampled verification: resume-exact by construction."""
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + step * 1_009 + micro * 101 + rank) % (2**63))
    return g


@dataclass
class StepResult:
    loss: torch.Tensor
    parts: dict
    metrics: dict


def forward_step(model, target, batch, cfg: Config, loss_cfg, generator) -> StepResult:
    """One micro-batch: target -> drafter chains -> verification -> objective."""
    module = model.module if hasattr(model, "module") else model
    drafter = module.drafter
    plan = plan_batch(drafter, batch, cfg.drafter, generator)
    tout = target(batch.input_ids, batch.attention_mask, drafter.target_layer_ids, logits_at=plan.logits_at)
    out, head_logits = model(batch, tout, plan)
    ver = simulate_verification(
        out.logits, out.target_logits, out.valid,
        mode=loss_cfg.verify, temperature=loss_cfg.temperature, d2t=drafter.d2t, generator=generator,
    )
    loss, parts = vat_objective(
        out, ver, head_logits, loss_cfg, schedule=drafter.schedule, d2t=drafter.d2t, t2d=drafter.t2d
    )
    metrics = chain_metrics(out, ver, head_logits, d2t=drafter.d2t)
    return StepResult(loss, parts, metrics)


# ----------------------------------------------------------------------------- distributed
def _dist_setup(device_pref: str) -> tuple[int, int, torch.device]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if device_pref == "auto":
        device_pref = "cuda" if torch.cuda.is_available() else "cpu"
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device_pref == "cuda" else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    if device_pref == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return rank, world, torch.device("cuda", local)
    return rank, world, torch.device(device_pref)


def _all_reduce_mean(values: dict[str, float], world: int) -> dict[str, float]:
    if world == 1 or not values:
        return values
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(t)
    return {k: v / world for k, v in zip(keys, t.tolist())}


# ----------------------------------------------------------------------------- the run
def train(cfg: Config, *, resume: bool = False, init_from: str | None = None, target=None,
          progress: bool = True, on_log=None) -> dict:
    """Train one drafter; return the final held-out metrics. ``target`` may be passed in to
    reuse a loaded model across runs (the demo trains four drafts on one target)."""
    from vatspec import data as D
    from vatspec.target import Target

    rank, world, device = _dist_setup(cfg.target.device)
    run_dir = Path(cfg.train.out_dir)
    is_main = rank == 0

    # 0. refuse to clobber: a run folder with checkpoints needs --resume (or a new out_dir)
    if not resume and run_dir.is_dir() and (run_dir / "latest").exists():
        raise TrainError(
            f"{run_dir} already holds a run (found {run_dir / 'latest'}); pass --resume to continue it "
            "or choose another train.out_dir"
        )
    resume_from = ckpt_io.resolve_checkpoint(run_dir) if resume else None

    # 1. data
    if not cfg.data.train:
        raise TrainError("data.train is empty: name a conversations file (JSONL/JSON/HF dataset folder)")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.target.dtype]
    if target is None:
        target = Target.load(cfg.target.path, dtype=dtype, device=device)
    tok = target.tokenizer
    convs = D.load_conversations(cfg.data.train, skip_bad=cfg.data.skip_bad)
    if cfg.data.heldout:
        train_convs, held_convs = convs, D.load_conversations(cfg.data.heldout, skip_bad=cfg.data.skip_bad)
    else:
        train_convs, held_convs = D.split_heldout(
            convs, fraction=cfg.data.heldout_fraction, max_n=cfg.data.heldout_max, seed=cfg.train.seed
        )
    train_ex = _tokenize(train_convs, tok, cfg.data.max_length, cfg.data.train)
    held_ex = _tokenize(held_convs, tok, cfg.data.max_length, cfg.data.heldout or cfg.data.train)
    if not train_ex:
        raise TrainError(f"{cfg.data.train}: no conversation has a supervised (assistant) token")

    # 2. drafter, head, optimiser
    ref = REFERENCE[cfg.drafter.kind]
    optim_cfg = replace(
        cfg.optim,
        lr=cfg.optim.lr if cfg.optim.lr is not None else ref["lr"],
        warmup_ratio=cfg.optim.warmup_ratio if cfg.optim.warmup_ratio is not None else ref["warmup_ratio"],
        grad_clip=cfg.optim.grad_clip if cfg.optim.grad_clip is not None else ref["grad_clip"],
    )
    torch.manual_seed(cfg.train.seed)
    counts = D.token_counts(train_ex, target.vocab_size)
    if init_from:
        drafter, _ = ckpt_io.load_draft(init_from, target)
        drafter.train()
    else:
        drafter = build_drafter(cfg.drafter, target, counts)
    drafter.to(device)
    loss_cfg = cfg.loss.resolve(drafter.schedule, block_size=getattr(drafter, "block_size", None))
    head = AcceptHead(drafter.hidden_size).to(device) if loss_cfg.head else None
    module = TrainModule(drafter, head)
    model = nn.parallel.DistributedDataParallel(module) if world > 1 else module
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=optim_cfg.lr, betas=optim_cfg.betas, weight_decay=optim_cfg.weight_decay)

    batches = D.BatchIterator(train_ex, cfg.data.batch_size, seed=cfg.train.seed, rank=rank, world=world)
    per_epoch = max(1, len(batches) // optim_cfg.grad_accum)
    total = cfg.train.steps or per_epoch * cfg.train.epochs
    warmup = int(round(optim_cfg.warmup_ratio * total))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total, warmup, optim_cfg.min_lr_ratio))
    config_yaml = dump_config(replace(cfg, optim=optim_cfg, loss=loss_cfg))

    step = 0
    if resume_from is not None:
        state = ckpt_io.load_trainer_state(resume_from)
        module.drafter.load_state_dict(_load_tensors(resume_from / "drafter.safetensors"))
        if head is not None:
            if not (resume_from / "head.safetensors").is_file():
                raise TrainError(f"{resume_from}: no head.safetensors, but loss.head is on")
            head.load_state_dict(_load_tensors(resume_from / "head.safetensors"))
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        batches.load_state_dict(state["data"])
        _set_rng(state["rng"])
        step = state["step"]

    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(config_yaml)
    log_path = run_dir / "metrics.jsonl"

    # 3. loop
    bar = _progress(total, step, progress and is_main, desc=f"{cfg.drafter.kind}/{loss_cfg.kind}")
    model.train()
    t_last = time.perf_counter()
    final_eval: dict = {}
    while step < total:
        opt.zero_grad(set_to_none=True)
        acc = MetricAccumulator()
        parts_sum: dict[str, float] = {}
        n_tokens = 0
        for micro in range(optim_cfg.grad_accum):
            batch = batches.next().to(device)
            n_tokens += int(batch.attention_mask.sum())
            g = step_generator(cfg.train.seed, step, micro, rank)
            res = forward_step(model, target, batch, cfg, loss_cfg, g)
            (res.loss / optim_cfg.grad_accum).backward()
            acc.add(res.metrics)
            for k, v in res.parts.items():
                parts_sum[k] = parts_sum.get(k, 0.0) + float(v) / optim_cfg.grad_accum
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, optim_cfg.grad_clip))
        opt.step()
        sched.step()
        step += 1

        now = time.perf_counter()
        record = {"step": step, "lr": sched.get_last_lr()[0], "grad_norm": grad_norm,
                  "tokens_per_s": n_tokens * world / max(now - t_last, 1e-9), **parts_sum}
        record.update({f"train/{k}": v for k, v in acc.summary().items()})
        record = _all_reduce_mean(record, world) if world > 1 else record
        t_last = now
        if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < total:
            record.update({f"eval/{k}": v for k, v in evaluate(model, target, held_ex, cfg, loss_cfg, device).items()})
        if step == total:
            final_eval = evaluate(model, target, held_ex, cfg, loss_cfg, device)
            record.update({f"eval/{k}": v for k, v in final_eval.items()})
        if is_main:
            if step % cfg.train.log_every == 0 or step == total or any(k.startswith("eval/") for k in record):
                with open(log_path, "a") as f:
                    f.write(json.dumps(record) + "\n")
                if on_log:
                    on_log(record)
            bar.set_postfix(loss=f"{record.get('loss', float('nan')):.3f}",
                            tau=f"{record.get('train/tau_sim', float('nan')):.2f}")
            bar.update(1)
        if is_main and (step == total or (cfg.train.save_every and step % cfg.train.save_every == 0)):
            ckpt_io.save_checkpoint(
                run_dir, step, drafter=module.drafter, head=head, config_yaml=config_yaml,
                keep=cfg.train.keep_checkpoints,
                trainer_state={"optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                               "data": batches.state_dict(), "rng": _get_rng(), "metrics": record},
            )
        if world > 1:
            dist.barrier()
    bar.close()
    return final_eval


@torch.no_grad()
def evaluate(model, target, examples, cfg: Config, loss_cfg, device) -> dict:
    """Held-out pass: chain metrics (tau_sim, accuracies, first rejection, head MAE) and the loss."""
    if not examples:
        return {}
    from vatspec import data as D

    was_training = model.training
    model.eval()
    acc = MetricAccumulator()
    loss_sum, n = 0.0, 0
    for i in range(0, len(examples), cfg.data.batch_size):
        batch = D.collate(examples[i : i + cfg.data.batch_size], _pad_id(target)).to(device)
        g = step_generator(cfg.train.seed, -1, i, 0)
        res = forward_step(model, target, batch, cfg, loss_cfg, g)
        acc.add(res.metrics)
        loss_sum += float(res.loss)
        n += 1
    model.train(was_training)
    return {"loss": loss_sum / max(n, 1), **acc.summary()}


# ----------------------------------------------------------------------------- helpers
def _tokenize(convs, tok, max_length: int, source: str):
    from vatspec import data as D

    out = []
    for conv in convs:
        ex = D.tokenize_conversation(conv, tok, max_length)
        if any(ex.loss_mask):
            out.append(ex)
    if convs and not out:
        raise TrainError(f"{source}: none of {len(convs)} conversations keeps a supervised token "
                         f"within data.max_length={max_length}")
    return out


def _pad_id(target) -> int:
    tok = target.tokenizer
    return tok.pad_token_id if tok.pad_token_id is not None else target.eos_token_ids[0]


def _load_tensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(path)


def _get_rng() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def _set_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def _progress(total: int, initial: int, enabled: bool, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, desc=desc, dynamic_ncols=True,
                file=sys.stderr)


# ----------------------------------------------------------------------------- CLI
def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", help="section.field=value overrides (e.g. loss.kind=vat)")
    parser.add_argument("--config", help="YAML file of overrides")
    parser.add_argument("--resume", action="store_true", help="continue the run in train.out_dir")
    parser.add_argument("--init-from", help="start from an existing draft (checkpoint or exported folder)")
    parser.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config, args.overrides)
        metrics = train(cfg, resume=args.resume, init_from=args.init_from, progress=not args.no_progress)
    except (ConfigError, TrainError, ckpt_io.CheckpointError) as e:
        print(f"vatspec train: error: {e}", file=sys.stderr)
        return 2
    if metrics:
        keys = ["tau_sim", "mean_first_reject", "post_reject_match", "loss"]
        print("held-out: " + ", ".join(f"{k}={metrics[k]:.4f}" for k in keys if k in metrics))
    return 0
