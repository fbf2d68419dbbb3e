"""The training loop: one loop for every drafter and every loss, over arms trained in lockstep.

The loop does no math: per micro-batch each arm's drafter says what the target must compute, one
target pass (or the feature cache) serves every arm, each arm builds its chains, simulates
verification and hands everything to its objective (``arms.arm_step``). Runs unchanged under
``torchrun --nproc_per_node=N`` (DDP: gloo on CPU, NCCL on GPUs; ``train.parallel=fsdp``).

    cfg = load_config("run.yaml", ["drafter=eagle3", "loss=vat", "train.steps=200"])
    metrics = train(cfg)            # `vatspec train --config run.yaml drafter=eagle3 loss=vat ...`
    train(cfg, resume=True)         # `... --resume`: continue the run in cfg.train.out_dir
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch

from vatspec.config import Config, resolve_hardware
from vatspec.objective.metrics import MetricAccumulator
from vatspec.train import arms as A
from vatspec.train import dist as D
from vatspec.train.checkpointer import Checkpointer
from vatspec.train.data import TrainData, checked, load_training_data
from vatspec.train.errors import TrainError

SHARED_SECTIONS = ("target", "data")
SHARED_TRAIN_FIELDS = ("steps", "epochs", "seed", "eval_every", "save_every", "save_minutes", "log_every", "precision",
                       "parallel")


def lockstep_key(cfg: Config) -> str:
    """What arms trained together by ``train_arms`` must share, as one comparable value: configs with
    equal keys can train in lockstep."""
    return repr(([getattr(cfg, s) for s in SHARED_SECTIONS], [getattr(cfg.train, f) for f in SHARED_TRAIN_FIELDS],
                 cfg.optim.grad_accum))


def train(cfg: Config, **kw) -> dict:
    """Train one drafter; return its final held-out metrics."""
    return train_arms([cfg], **kw)[0]


def train_arms(cfgs: list[Config], *, resume: bool = False, init_from: str | None = None, target=None,
               progress: bool = True, on_log: Callable | None = None, with_changes: bool = False,
               init: Callable | None = None) -> list[dict]:
    """Train several drafters in lockstep on the same batches, sharing one target forward per
    micro-batch. Equivalent to separate runs with the same data, steps and seed (each arm has its
    own optimiser, schedule, RNG stream and run folder); the target's cost is paid once.
    ``target`` may be passed in to reuse a loaded model. Returns each arm's final held-out metrics.

    ``resume``: continue each run folder from its latest checkpoint (from step 0 if it has none yet); a
    run already at its last step is left as it is. ``with_changes``: a resumed config may differ from its
    checkpoint's (recorded in ``config_history.jsonl``). ``init(cfg, drafter, target)``: a hook that sets a
    new drafter's initial weights (``arms.build_arm``). ``on_log(arm, record)``: called per logged step."""
    _check_lockstep(cfgs)
    rank, world, device, owned = D.dist_setup(cfgs[0].target.device)
    cfgs = _resolved(cfgs, device, progress and rank == 0)
    with ExitStack() as locks:
        run = Checkpointer(cfgs, locks, is_main=rank == 0, world=world)
        dcfg = cfgs[0].data
        inputs = {"data.train": dcfg.train, "data.heldout": dcfg.heldout, "data.features": dcfg.features,
                  "--init-from": init_from}
        if Path(cfgs[0].target.path).exists():
            inputs["target.path"] = cfgs[0].target.path
        run.open(inputs, resume)
        data = load_training_data(cfgs, target, device=device, rank=rank, world=world)
        run.check_template(data.settings)
        arms = [A.build_arm(c, data.target, data.counts, data.total, world=world, device=device, init_from=init_from,
                            init=init) for c in cfgs]
        for cache, src in data.cached:  # the drafters as built (--init-from may bring other layers)
            who = {f"the {a.drafter.kind} drafter of {a.run_dir}": a.drafter.target_layer_ids for a in arms}
            checked(cache.check_run, data.target, who, dcfg.max_length, data.template, where=src, root=cache.root)
        step = run.resume(arms, data.batches, data.total, with_changes)
        if step is None:  # a finished run: nothing to do, nothing written
            finals = run.final_metrics()
        else:
            run.start(arms, data.stats, step)
            finals = _loop(arms, data, run, step, rank=rank, world=world, device=device, progress=progress,
                           on_log=on_log)
        # DDP's reducers hold the process group: they go before it is destroyed (a gloo group destroyed first can
        # hang in the reducer's destructor)
        arms.clear()
        run.drift.clear()
        gc.collect()  # DDP sits in reference cycles: collected now, not after the group is gone
    D.release_group(owned)
    return finals


def _check_lockstep(cfgs: list[Config]) -> None:
    base = cfgs[0]
    for c in cfgs:
        if not c.loss.resolved:
            raise TrainError(f"{c.train.out_dir}: the loss config is not resolved for its drafter; build the config "
                             "with vatspec.config.load_config or pass it through vatspec.config.resolve_loss")
    for c in cfgs[1:]:
        for sec in SHARED_SECTIONS:
            if getattr(c, sec) != getattr(base, sec):
                raise TrainError(f"arms must share the {sec!r} section to share target passes")
        for f in SHARED_TRAIN_FIELDS:
            if getattr(c.train, f) != getattr(base.train, f):
                raise TrainError(f"arms must share train.{f}")
        if c.optim.grad_accum != base.optim.grad_accum:
            raise TrainError("arms must share optim.grad_accum")
    dirs = [Path(c.train.out_dir) for c in cfgs]
    if len(set(dirs)) != len(dirs):
        raise TrainError(f"arms need distinct train.out_dir, got {[str(d) for d in dirs]}")
    if not base.target.path:
        raise TrainError("target.path is required: a local HF model folder, or 'default' for the embedded "
                         "SmolLM2-135M-Instruct")


def _resolved(cfgs: list[Config], device: torch.device, say: bool) -> list[Config]:
    """The configs with ``auto`` dtype and precision resolved for ``device``; said once on stderr."""
    base = cfgs[0]
    auto = [f for f, v in (("target.dtype", base.target.dtype), ("train.precision", base.train.precision))
            if v == "auto"]
    cfgs = [resolve_hardware(c, device) for c in cfgs]
    if say:
        why = f" ({' and '.join(auto)} auto: {'a GPU' if device.type == 'cuda' else 'no GPU'})" if auto else ""
        print(f"target {cfgs[0].target.path} on {device}: {cfgs[0].target.dtype}, training precision "
              f"{cfgs[0].train.precision}{why}", file=sys.stderr)
    return cfgs


def _loop(arms: list[A.Arm], data: TrainData, run: Checkpointer, step: int, *, rank: int, world: int, device,
          progress: bool, on_log) -> list[dict]:
    """Steps ``step + 1 .. data.total``: each arm's gradients over ``optim.grad_accum`` micro-batches, clipped and
    applied; held-out evaluation every ``train.eval_every`` steps and at the end; logs and checkpoints."""
    cfg = arms[0].cfg
    show = progress and rank == 0
    bars = [_progress(data.total, step, show, desc=arm.name, position=i) for i, arm in enumerate(arms)]
    for arm in arms:
        arm.model.train()
    finals: list[dict] = [{} for _ in arms]
    t_last = time.perf_counter()
    while step < data.total:
        accs, parts, n_tokens = accumulate(arms, data, step, rank, device)
        tokens_per_s = n_tokens * world / max(time.perf_counter() - t_last, 1e-9)  # training only, not eval
        step += 1
        last = step == data.total
        grad_norms = [apply_step(arm) for arm in arms]
        do_eval = last or bool(cfg.train.eval_every and step % cfg.train.eval_every == 0)
        evals = A.evaluate_arms(arms, data.source, data.held_ex, cfg, device) if do_eval else [{} for _ in arms]
        records, peak_mib = [], peak_memory_mib(device)
        for i, arm in enumerate(arms):
            record = {"step": step, "lr": arm.sched.get_last_lr()[0], "grad_norm": grad_norms[i],
                      "tokens_per_s": tokens_per_s, **parts[i]}
            record.update({f"train/{k}": v for k, v in accs[i].summary().items()})
            record = D.all_reduce_mean(record, world)
            record["peak_memory_mib"] = peak_mib  # rank 0's
            record.update({f"eval/{k}": v for k, v in evals[i].items() if k != A.CHAINS_KEY})
            records.append(record)
            if last:
                finals[i] = evals[i]
                run.write_chains(arm, step, evals[i], A.CHAINS_KEY)
            if rank == 0:
                if step % cfg.train.log_every == 0 or last or do_eval:
                    run.log(arm, record)
                    if on_log:
                        on_log(arm, record)
                bars[i].set_postfix(loss=f"{record.get('loss', float('nan')):.3f}",
                                    tau=f"{record.get('train/tau_sim', float('nan')):.2f}")
                bars[i].update(1)
        if run.due(step, data.total):
            run.save(arms, records, step, {"data": data.batches.state_dict(), "total": data.total,
                                           "chat_template": data.settings})
        D.barrier(world)
        t_last = time.perf_counter()
    for bar in bars:
        bar.close()
    return finals


def accumulate(arms: list[A.Arm], data: TrainData, step: int, rank: int, device):
    """One optimiser step's gradients for every arm: ``optim.grad_accum`` micro-batches, each loss scaled down
    by it. Returns each arm's metric accumulator and loss parts, and the tokens seen."""
    cfg, accum = arms[0].cfg, arms[0].cfg.optim.grad_accum
    accs = [MetricAccumulator() for _ in arms]
    parts: list[dict[str, float]] = [{} for _ in arms]
    for arm in arms:
        arm.opt.zero_grad(set_to_none=True)
    n_tokens = 0
    for micro in range(accum):
        batch = next(data.batches).to(device)
        n_tokens += int(batch.attention_mask.sum())
        gens = [A.step_generator(cfg.train.seed, step, micro, rank, device=device) for _ in arms]
        for i, res in enumerate(A.arms_micro_step(arms, data.source, batch, gens)):
            (res.loss / accum).backward()
            accs[i].add(res.metrics)
            for k, v in res.parts.items():
                parts[i][k] = parts[i].get(k, 0.0) + float(v) / accum
    return accs, parts, n_tokens


def apply_step(arm: A.Arm) -> float:
    """Clip the arm's gradients, step its optimiser and schedule; the gradient norm before clipping."""
    norm = torch.nn.utils.clip_grad_norm_(arm.params, arm.optim_cfg.grad_clip)
    arm.opt.step()
    arm.sched.step()
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # fsdp: a DTensor


def peak_memory_mib(device) -> float:
    """The peak memory so far, in MiB: torch's allocations on a GPU, the process's resident set on a CPU (torch
    keeps no CPU allocator statistics; the target and data are in it too)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _progress(total: int, initial: int, enabled: bool, desc: str, position: int = 0):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, desc=desc, dynamic_ncols=True, position=position,
                file=sys.stderr)
