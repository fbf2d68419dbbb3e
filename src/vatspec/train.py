"""The training loop: one loop for every drafter and every loss.

The loop does no math: per micro-batch it asks the drafter what the target must compute, runs
the frozen target (online mode, under no_grad), lets the drafter build its k-position chains,
simulates verification (``verify.py``) and hands everything to the objective (``losses.py``).
Runs unchanged under ``torchrun --nproc_per_node=N`` (DDP: gloo on CPU, NCCL on GPUs).

    cfg = load_config("run.yaml", ["drafter=eagle3", "loss=vat", "train.steps=200"])
    metrics = train(cfg)            # `vatspec train --config run.yaml drafter=eagle3 loss=vat ...`
    train(cfg, resume=True)         # `... --resume`: continue the run in cfg.train.out_dir

A run folder holds ``.vatspec-owner`` (``vatspec.outputs``), ``config.yaml``, ``data_stats.json`` (what
was read, skipped and dropped), ``metrics.jsonl``, ``checkpoints/`` and, at the end,
``heldout_chains.json``. Checkpoints are periodic by default (``train.save_every``, ``train.save_minutes``),
so a killed run resumes; on resume ``metrics.jsonl`` is cut back to the checkpoint's step.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from vatspec import checkpoint as ckpt_io
from vatspec.chunked import TeacherShare, chunked_pass
from vatspec.config import Config, OptimConfig, dump_config, resolve_hardware
from vatspec.drafters import DrafterPlan, build_drafter, plan_batch
from vatspec.drafters.base import AcceptHead
from vatspec.features import CachedTarget
from vatspec.losses import head_alive_logits, vat_objective
from vatspec.metrics import MetricAccumulator, chain_metrics
from vatspec.optim import build_optimizer
from vatspec.outputs import OutputError, check_apart, check_folder, claim_folder, mark_folder, owner, write_lock
from vatspec.target import TargetOutput, feature_noise
from vatspec.verify import simulate_verification

REFERENCE = {  # the reference recipes' optimiser defaults per drafter (EAGLE-3, DFlash)
    "eagle3": {"lr": 1e-4, "warmup_ratio": 0.015, "grad_clip": 0.5},
    "dflash": {"lr": 6e-4, "warmup_ratio": 0.04, "grad_clip": 1.0},
}


class TrainError(RuntimeError):
    """Bad training input (data, checkpoint, config) detected before anything is overwritten."""


# ----------------------------------------------------------------------------- pieces
class TrainModule(nn.Module):
    """Drafter + accept head as one module, so DDP syncs both; forward = drafter forward + head.
    ``head_grad=False`` (``loss.head_grad``): the head reads detached hidden states, so its loss
    trains the head alone."""

    def __init__(self, drafter: nn.Module, head: AcceptHead | None, head_grad: bool = True):
        super().__init__()
        self.drafter = drafter
        self.head = head
        self.head_grad = head_grad

    def forward(self, batch, tout, plan: DrafterPlan):
        out = self.drafter.training_forward(batch, tout, **plan.kwargs)
        if self.head is None:
            return out, None
        return out, self.head(out.hidden if self.head_grad else out.hidden.detach())  # [..., k]


def lr_lambda(total: int, warmup: int, min_ratio: float):
    """Linear warmup to 1, then cosine to ``min_ratio``."""

    def f(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def step_generator(seed: int, step: int, micro: int, rank: int, device: torch.device | str = "cpu") -> torch.Generator:
    """Per-micro-batch RNG for anchors and sampled verification: resume-exact by construction.

    ``device``: where the batch and logits live; CUDA draws refuse a CPU generator. On CPU the stream
    is the same as a plain ``torch.Generator()``'s; another device draws a different (but as seeded)
    stream, so CPU and GPU runs pick different anchors and samples."""
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + step * 1_009 + micro * 101 + rank) % (2**63))
    return g


@dataclass
class StepResult:
    loss: torch.Tensor
    parts: dict
    metrics: dict


def shared_target_pass(target, batch, drafters, plans) -> list[TargetOutput]:
    """One target forward serving every drafter: the union of their layers, and logits wherever
    any of them needs them (none when every arm is chunked: those take the hidden state). Returns
    one TargetOutput per drafter, shaped as if run alone."""
    layer_ids = list(dict.fromkeys(i for d in drafters for i in d.target_layer_ids))
    masks = [p.logits_at for p in plans if p.target_logits]
    union = None if any(m is None for m in masks) else torch.stack(masks).any(0) if masks else None
    tout = target(batch.input_ids, batch.attention_mask, layer_ids, logits=bool(masks), logits_at=union)
    H = target.hidden_size
    outs = []
    for d, plan in zip(drafters, plans):
        if list(d.target_layer_ids) == layer_ids:
            feats = tout.features
        else:
            cols = [layer_ids.index(i) for i in d.target_layer_ids]
            feats = torch.cat([tout.features[..., c * H : (c + 1) * H] for c in cols], dim=-1)
        logits = tout.logits if plan.target_logits else None
        if logits is not None and plan.logits_at is not None:
            if union is None:
                logits = logits[plan.logits_at]  # [N, V] rows this drafter asked for
            elif not torch.equal(plan.logits_at, union):
                logits = logits[plan.logits_at[union]]
        dev = batch.input_ids.device  # the drafters' device; a device_map target ends on its last GPU
        outs.append(TargetOutput(None if logits is None else logits.to(dev), tout.hidden.to(dev),
                                 None if feats is None else feats.to(dev)))
    return outs


def arm_step(model, drafter, batch, tout, plan, loss_cfg, generator, shared: TeacherShare | None = None) -> StepResult:
    """The drafter's chains -> verification -> objective, for one arm on one micro-batch. ``shared``:
    the teacher results of the batch's other arms (``chunked.shared_teacher``), or None."""
    out, head_logits = model(batch, tout, plan)
    terms = draft_argmax = None
    if out.logits is None:  # loss.chunk_size > 0: the vocabulary-wide work chunk by chunk
        ver, terms, draft_argmax = chunked_pass(out, loss_cfg, d2t=drafter.d2t, t2d=drafter.t2d, generator=generator,
                                                shared=shared)
    else:
        ver = simulate_verification(
            out.logits, out.target_logits, out.valid,
            mode=loss_cfg.verify, temperature=loss_cfg.temperature, d2t=drafter.d2t, generator=generator,
        )
    loss, parts = vat_objective(out, ver, head_logits, loss_cfg, d2t=drafter.d2t, t2d=drafter.t2d, terms=terms,
                                draft_argmax=draft_argmax)
    alive = None if head_logits is None else head_alive_logits(head_logits, loss_cfg.head_label)
    metrics = chain_metrics(out, ver, alive, d2t=drafter.d2t, draft_argmax=draft_argmax)
    return StepResult(loss, parts, metrics)


def arms_micro_step(arms, target, batch, generators) -> Iterator[StepResult]:
    """One micro-batch for every arm: plans, one shared target pass, then each arm's step.
    A generator, so the caller's backward frees one arm's graph before the next arm runs."""
    autocast = precision_context(batch.input_ids.device, arms[0].cfg.train.precision)
    with autocast:
        plans = [plan_batch(a.drafter, batch, a.cfg.drafter, g, with_logits=not a.loss_cfg.chunk_size)
                 for a, g in zip(arms, generators)]
        touts = shared_target_pass(target, batch, [a.drafter for a in arms], plans)
    shared = None  # arms reading the same target rows share their teacher
    if len(arms) > 1:
        shared = TeacherShare(keep_soft=any(a.loss_cfg.chunk_size and a.loss_cfg.uses_soft_labels for a in arms))
    for a, t, p, g in zip(arms, touts, plans, generators):
        sigma = a.cfg.train.feature_noise
        if sigma and a.model.training and t.features is not None:
            t = replace(t, features=feature_noise(t.features, sigma, len(a.drafter.target_layer_ids), g))
        with autocast:  # the forward and the loss; the caller's backward runs outside it
            res = arm_step(a.model, a.drafter, batch, t, p, a.loss_cfg, g, shared)
        yield res


def precision_context(device: torch.device, precision: str):
    """bfloat16 autocast for ``train.precision=bf16`` (float32 master weights and optimizer state), else a no-op."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bfloat16 in hardware, so that ``train.precision=bf16`` is faster:
    a GPU that supports it, or a CPU with AVX512-BF16 or AMX (read from /proc/cpuinfo; False where
    there is none). Without them a CPU emulates bf16 products, slower than float32."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return False
    return bool({"avx512_bf16", "amx_bf16"} & set(flags.split()))


@dataclass
class Arm:
    """One drafter being trained: its own config, optimiser, schedule and run folder."""

    cfg: Config
    module: TrainModule
    model: nn.Module  # module, DDP(module), or module itself sharded by fully_shard (fsdp)
    loss_cfg: object
    optim_cfg: OptimConfig
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    params: list
    run_dir: Path
    config_yaml: str
    fsdp: bool = False  # parameters are sharded DTensors: full state dicts are gathered collectively

    @property
    def drafter(self):
        return self.module.drafter

    @property
    def name(self) -> str:
        return f"{self.cfg.drafter.kind}/{self.loss_cfg.kind}"


# ----------------------------------------------------------------------------- distributed
def _dist_setup(device_pref: str) -> tuple[int, int, torch.device, bool]:
    """``(rank, world, device, owned)``: ``owned`` when this call started the process group (under torchrun
    without one), which ``train_arms`` then destroys before it returns."""
    from vatspec.target import resolve_device

    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        device = resolve_device(device_pref, "target.device")
    except ValueError as e:
        raise TrainError(str(e)) from None
    owned = world > 1 and not dist.is_initialized()
    if owned:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    if device.type == "cuda" and device.index is None:  # one GPU per rank
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return rank, world, torch.device("cuda", local), owned
    return rank, world, device, owned


def _all_reduce_mean(values: dict, world: int) -> dict:
    """Mean over ranks of every number in ``values`` (scalars and lists of numbers)."""
    if world == 1 or not values:
        return values
    keys = sorted(values)
    flat = [float(x) for k in keys for x in (values[k] if isinstance(values[k], list) else [values[k]])]
    t = torch.tensor(flat, dtype=torch.float64)
    dist.all_reduce(t)
    means, out, i = (t / world).tolist(), {}, 0
    for k in keys:
        n = len(values[k]) if isinstance(values[k], list) else 1
        out[k] = means[i : i + n] if isinstance(values[k], list) else means[i]
        i += n
    return out


# ----------------------------------------------------------------------------- the run
SHARED_SECTIONS = ("target", "data")
SHARED_TRAIN_FIELDS = ("steps", "epochs", "seed", "eval_every", "save_every", "save_minutes", "log_every", "precision",
                       "parallel")


def lockstep_key(cfg: Config) -> str:
    """What arms trained together by ``train_arms`` must share, as one comparable value: configs with
    equal keys can train in lockstep."""
    return repr(([getattr(cfg, s) for s in SHARED_SECTIONS], [getattr(cfg.train, f) for f in SHARED_TRAIN_FIELDS],
                 cfg.optim.grad_accum))


SAVES_PER_RUN = 10  # train.save_every unset: a checkpoint every total // 10 steps


def save_interval(cfg: Config, total: int) -> int:
    """Steps between periodic checkpoints: ``train.save_every``, or (unset) a tenth of the run; 0 = none."""
    if cfg.train.save_every is not None:
        return cfg.train.save_every
    return max(1, total // SAVES_PER_RUN)


def finished(cfg: Config, *, trust_pickle: bool = False) -> int | None:
    """The step of the run in ``cfg.train.out_dir`` if its latest checkpoint is its last (a ``--resume``
    would do nothing), else None."""
    d = Path(cfg.train.out_dir)
    if not (d / "latest").is_file():
        return None
    state = ckpt_io.load_trainer_state(ckpt_io.resolve_checkpoint(d), trust_pickle=trust_pickle)
    total = cfg.train.steps or state.get("total")
    return state["step"] if total is not None and state["step"] >= total else None


def train(cfg: Config, **kw) -> dict:
    """Train one drafter; return its final held-out metrics."""
    return train_arms([cfg], **kw)[0]


def train_arms(cfgs: list[Config], **kw) -> list[dict]:
    """``_train_arms`` holding each run folder's one-writer lock (``outputs.write_lock``) on the rank that
    writes: a second training into the same ``train.out_dir`` fails at once, naming the first."""
    with ExitStack() as locks:
        return _train_arms(cfgs, locks, **kw)


def _train_arms(cfgs: list[Config], locks: ExitStack, *, resume: bool = False, init_from: str | None = None,
                target=None, progress: bool = True, on_log=None, trust_pickle: bool = False,
                with_changes: bool = False) -> list[dict]:
    """Train several drafters in lockstep on the same batches, sharing one target forward per
    micro-batch. Equivalent to separate runs with the same data, steps and seed (each arm has its
    own optimiser, schedule, RNG stream and run folder); the target's cost is paid once.
    ``target`` may be passed in to reuse a loaded model. Returns each arm's final held-out metrics.

    ``resume``: continue each run folder from its latest checkpoint (from step 0 if it has none yet); a
    run already at its last step is left as it is. ``trust_pickle``: read an older checkpoint's pickled
    trainer state (``checkpoint.load_trainer_state``)."""
    from vatspec import data as D
    from vatspec.target import open_target

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

    rank, world, device, owned_group = _dist_setup(base.target.device)
    is_main = rank == 0
    if not base.target.path:
        raise TrainError("target.path is required: a local HF model folder, or 'default' for the embedded "
                         "SmolLM2-135M-Instruct")
    auto = [f for f, v in (("target.dtype", base.target.dtype), ("train.precision", base.train.precision))
            if v == "auto"]
    cfgs = [resolve_hardware(c, device) for c in cfgs]
    base = cfgs[0]
    if is_main and progress:
        why = f" ({' and '.join(auto)} auto: {'a GPU' if device.type == 'cuda' else 'no GPU'})" if auto else ""
        print(f"target {base.target.path} on {device}: {base.target.dtype}, training precision "
              f"{base.train.precision}{why}", file=sys.stderr)
    # 0. one writer per run folder; refuse to clobber: a run folder with checkpoints needs --resume (or a new
    # out_dir); a folder vatspec train did not make is never written into; no input lies in, or holds, a run folder
    if is_main:
        for d in dirs:
            try:
                locks.enter_context(write_lock(d, "train.out_dir", "train"))
            except OutputError as e:
                raise TrainError(str(e)) from None
    dcfg = base.data
    inputs = {"data.train": dcfg.train, "data.heldout": dcfg.heldout, "data.features": dcfg.features,
              "--init-from": init_from}
    if Path(base.target.path).exists():
        inputs["target.path"] = base.target.path
    states: list[dict | None] = [None for _ in dirs]
    for i, d in enumerate(dirs):
        try:
            check_apart(d, inputs, "train.out_dir")
            if (d / "latest").exists():  # a run (an older version's run folders have no owner file)
                if not resume:
                    raise TrainError(f"{d} already holds a run (found {d / 'latest'}); pass --resume to continue "
                                     "it or choose another train.out_dir")
                ck = ckpt_io.resolve_checkpoint(d)
                states[i] = ckpt_io.load_trainer_state(ck, trust_pickle=trust_pickle)
                states[i]["checkpoint"] = ck
            else:
                if resume and owner(d) != "train":
                    raise TrainError(f"--resume: {d} holds no run to resume (no {d / 'latest'})")
                check_folder(d, "train", "train.out_dir")
        except OutputError as e:
            raise TrainError(str(e)) from None

    # 1. data, shared by every arm: conversations tokenized here, or the rows of a feature cache
    # (data.features: the same conversations in the same order, so the held-out split is the same)
    if not dcfg.train and not dcfg.features:
        raise TrainError("data.train is empty: name a conversations file (JSONL/JSON/HF dataset folder) "
                         "or a feature cache (data.features)")
    stats: dict = {}  # what was read, skipped and dropped: printed by the command, saved as data_stats.json
    if dcfg.train:  # before the model
        stats["data.train"] = read = {}
        convs = D.load_conversations(dcfg.train, skip_bad=dcfg.skip_bad, stats=read)
    else:
        convs = None
    if target is None:  # from a cache the target's layers never run: its embedding and lm_head are all it reads
        if base.target.device_map and world > 1:
            raise TrainError("target.device_map spreads one target over the visible GPUs: run one process "
                             "(not torchrun), or train from a feature cache (data.features)")
        target = open_target(base.target.path, device=device, dtype=base.target.dtype,
                             heads_only=bool(dcfg.features),
                             device_map=None if dcfg.features else base.target.device_map)
    tok = target.tokenizer
    # the template every sequence is rendered with (as served); recorded in config.yaml, checked against the data's
    template = D.attach_template(target, dcfg.chat_template, dcfg.chat_template_kwargs)
    settings = template.settings(tok)  # saved in every checkpoint; a resumed run must render as it did
    for d, state in zip(dirs, states):
        if state is not None:
            D.check_settings(state.get("chat_template"), settings, f"{d} (the run resumed)", "this run")
    if convs is not None:
        D.check_data_template(convs, settings, f"data.train={dcfg.train}")
        convs = D.split_turns(convs, tok, template)
    train_cache = _open_cache(dcfg.features, "data.features", target, cfgs, convs) if dcfg.features else None
    held_cache = train_cache
    items = list(range(len(train_cache))) if train_cache else convs  # cache rows stand for the conversations
    if dcfg.heldout:
        if train_cache:
            if Path(dcfg.heldout).resolve() == Path(dcfg.features).resolve():
                raise TrainError(f"data.heldout={dcfg.heldout} is data.features: held-out metrics would score the "
                                 "training conversations")
            held_cache = _open_cache(dcfg.heldout, "data.heldout", target, cfgs, None)
            held_items = list(range(len(held_cache)))
        else:
            stats["data.heldout"] = read = {}
            held_items = D.load_conversations(dcfg.heldout, skip_bad=dcfg.skip_bad, stats=read)
            D.check_data_template(held_items, settings, f"data.heldout={dcfg.heldout}")
            _check_disjoint(convs, held_items, dcfg)
            held_items = D.split_turns(held_items, tok, template)
        train_items = items
    else:
        train_items, held_items = heldout_split(items, dcfg, base.train.seed)
    train_src = f"data.features={dcfg.features}" if train_cache else dcfg.train
    held_src = ((f"data.heldout={dcfg.heldout}" if train_cache else dcfg.heldout) if dcfg.heldout
                else f"the held-out split of {train_src} (data.heldout_fraction={dcfg.heldout_fraction})")
    stats["train"], stats["heldout"] = {}, {}
    train_ex = _tokenize(train_items, tok, dcfg.max_length, train_src, train_cache, stats["train"], template)
    held_ex = _tokenize(held_items, tok, dcfg.max_length, held_src, held_cache, stats["heldout"], template)
    if not train_ex:
        raise TrainError(f"{train_src}: no conversation has a supervised (assistant) token")
    counts = D.token_counts(train_ex, target.vocab_size)  # the draft vocabulary: from the answer tokens
    if dcfg.loss_on == "all":
        train_ex = [ex.supervise_all() for ex in train_ex]
    if world > 1:  # each rank its own equal share, same seeded order: every rank takes the same steps
        share = len(train_ex) // world
        if share < base.data.batch_size:
            raise TrainError(f"{len(train_ex)} examples are too few for {world} ranks of batch {base.data.batch_size}")
        train_ex = train_ex[rank * share : (rank + 1) * share]
    source = target  # what the loop asks for target outputs: the model, or the cache (then only the lm_head runs)
    cached = [(train_cache, train_src), (held_cache, held_src)] if train_cache else []
    if cached:
        source = CachedTarget(target, list({id(c): c for c, _ in cached}.values()))
        for (cache, src), exs in zip(cached, (train_ex, held_ex)):  # the shards this rank reads: sha256, finite
            _checked(cache.verify_rows, exs, where=src, root=cache.root)
    batches = D.BatchIterator(train_ex, base.data.batch_size, pad_id=_pad_id(target), seed=base.train.seed)
    accum = base.optim.grad_accum
    total = base.train.steps or max(1, len(batches) // accum) * base.train.epochs

    # 2. one arm per config
    arms = [_build_arm(c, target, counts, total, world, device, init_from) for c in cfgs]
    for cache, src in cached:  # the drafters as built (--init-from may bring other layers)
        who = {f"the {a.drafter.kind} drafter of {a.run_dir}": a.drafter.target_layer_ids for a in arms}
        _checked(cache.check_run, target, who, dcfg.max_length, where=src, root=cache.root)
    # a resumed run continues the steps it took: a config that computes otherwise is refused, or (with_changes)
    # recorded in RUN/config_history.jsonl, never silently written over
    drift = [(arm, state, config_changes(state["checkpoint"] / "config.yaml", arm.config_yaml))
             for arm, state in zip(arms, states) if state is not None]
    for arm, state, changes in drift:
        if changes and not with_changes:
            raise TrainError(f"--resume: {arm.run_dir}'s config differs from its checkpoint's "
                             f"({state['checkpoint'] / 'config.yaml'}): "
                             + "; ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changes.items())
                             + ". Pass the checkpoint's values, or --resume-with-changes to continue with these "
                             "(recorded in config_history.jsonl)")
    step = 0
    steps = [s["step"] if s else 0 for s in states]
    if len(set(steps)) != 1:
        raise TrainError(f"arms' latest checkpoints are at different steps {steps}: cannot resume in lockstep")
    if states[0] is not None:
        if steps[0] >= total:  # a finished run: nothing to do, nothing written
            _release_group(owned_group)
            return [{k.removeprefix("eval/"): v for k, v in s.get("metrics", {}).items() if k.startswith("eval/")}
                    for s in states]
        for arm, state in zip(arms, states):
            _restore_arm(arm, state)
        step = steps[0]
        batches.load_state_dict(states[0]["data"])
        _set_rng(states[0]["rng"])
    if is_main:
        for arm, state in zip(arms, states):
            if state is None:
                claim_folder(arm.run_dir, "train")
            else:  # a run folder (``latest``), an older version's too
                mark_folder(arm.run_dir, "train")
            for changed, state, changes in drift:
                if changed is arm and changes:
                    with open(arm.run_dir / "config_history.jsonl", "a", encoding="utf-8") as f:
                        f.write(json.dumps({"step": state["step"], "checkpoint": str(state["checkpoint"]),
                                            "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                                            "changes": {k: list(v) for k, v in changes.items()}}) + "\n")
            (arm.run_dir / "config.yaml").write_text(arm.config_yaml)
            (arm.run_dir / "data_stats.json").write_text(json.dumps(stats, indent=1) + "\n")
            _cut_metrics(arm.run_dir / "metrics.jsonl", step)  # a rerun or resume logs each step once
    save_every = save_interval(base, total)
    t_saved = time.monotonic()

    # 3. loop
    bars = [_progress(total, step, progress and is_main, desc=arm.name, position=i) for i, arm in enumerate(arms)]
    for arm in arms:
        arm.model.train()
    t_last = time.perf_counter()
    finals: list[dict] = [{} for _ in arms]
    while step < total:
        accs = [MetricAccumulator() for _ in arms]
        parts_sum: list[dict[str, float]] = [{} for _ in arms]
        for arm in arms:
            arm.opt.zero_grad(set_to_none=True)
        n_tokens = 0
        for micro in range(accum):
            batch = next(batches).to(device)
            n_tokens += int(batch.attention_mask.sum())
            gens = [step_generator(base.train.seed, step, micro, rank, device=device) for _ in arms]
            for i, res in enumerate(arms_micro_step(arms, source, batch, gens)):
                (res.loss / accum).backward()
                accs[i].add(res.metrics)
                for k, v in res.parts.items():
                    parts_sum[i][k] = parts_sum[i].get(k, 0.0) + float(v) / accum
        now = time.perf_counter()
        tokens_per_s = n_tokens * world / max(now - t_last, 1e-9)  # training only, not eval
        step += 1
        last = step == total
        grad_norms = []
        for arm in arms:
            norm = torch.nn.utils.clip_grad_norm_(arm.params, arm.optim_cfg.grad_clip)
            grad_norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))  # fsdp: a DTensor
            arm.opt.step()
            arm.sched.step()
        do_eval = last or (base.train.eval_every and step % base.train.eval_every == 0)
        evals = evaluate_arms(arms, source, held_ex, base, device) if do_eval else [{} for _ in arms]
        records = []
        for i, arm in enumerate(arms):
            grad_norm = grad_norms[i]
            record = {"step": step, "lr": arm.sched.get_last_lr()[0], "grad_norm": grad_norm,
                      "tokens_per_s": tokens_per_s, **parts_sum[i]}
            record.update({f"train/{k}": v for k, v in accs[i].summary().items()})
            record = _all_reduce_mean(record, world)
            record.update({f"eval/{k}": v for k, v in evals[i].items() if k != CHAINS_KEY})
            records.append(record)
            if last:
                finals[i] = evals[i]
                if is_main and CHAINS_KEY in evals[i]:
                    (arm.run_dir / "heldout_chains.json").write_text(json.dumps(
                        {"step": step, "tau_sim": evals[i].get("tau_sim"), CHAINS_KEY: evals[i][CHAINS_KEY]}))
            if is_main:
                if step % base.train.log_every == 0 or last or do_eval:
                    with open(arm.run_dir / "metrics.jsonl", "a") as f:
                        f.write(json.dumps(record) + "\n")
                    if on_log:
                        on_log(arm, record)
                bars[i].set_postfix(loss=f"{record.get('loss', float('nan')):.3f}",
                                    tau=f"{record.get('train/tau_sim', float('nan')):.2f}")
                bars[i].update(1)
        # periodic checkpoints: every save_every steps, and when save_minutes passed since the last
        # (rank 0 decides by its clock; only rank 0 writes)
        minutes = base.train.save_minutes and time.monotonic() - t_saved >= 60 * base.train.save_minutes
        due = bool(last or (save_every and step % save_every == 0) or minutes)
        if world > 1:  # rank 0's clock decides; under fsdp every rank takes part in gathering the state
            flag = torch.tensor([float(due)])
            dist.broadcast(flag, 0)
            due = bool(flag.item())
        if due:
            for arm, record in zip(arms, records):
                drafter_state, head_state, optim_state = _full_states(arm)
                if is_main:
                    ckpt_io.save_checkpoint(
                        arm.run_dir, step, drafter=arm.drafter, head=arm.module.head, config_yaml=arm.config_yaml,
                        keep=arm.cfg.train.keep_checkpoints, drafter_state=drafter_state, head_state=head_state,
                        trainer_state={"optimizer": optim_state, "scheduler": arm.sched.state_dict(),
                                       "data": batches.state_dict(), "rng": _get_rng(), "metrics": record,
                                       "total": total, "chat_template": settings},
                    )
            t_saved = time.monotonic()
        if world > 1:
            dist.barrier()
        t_last = time.perf_counter()
    for bar in bars:
        bar.close()
    _release_group(owned_group)
    return finals


def _release_group(owned: bool) -> None:
    """Destroy the process group ``_dist_setup`` started (``owned``), after every rank got here: one left
    to the interpreter's exit can abort it there (gloo: "terminate called without an active exception")."""
    if owned:
        dist.barrier()
        dist.destroy_process_group()


def heldout_split(items: list, data_cfg, seed: int) -> tuple[list, list]:
    """(train, held-out) items as training splits them when ``data.heldout`` is not given:
    ``heldout_fraction`` of the first ``heldout_pool`` items (0: of all), at most ``heldout_max``, at
    least 1 (none of a single item); the items after the pool all train."""
    from vatspec import data as D

    pool = min(data_cfg.heldout_pool or len(items), len(items))
    n_held = min(data_cfg.heldout_max, max(1, round(pool * data_cfg.heldout_fraction)))
    train, held = D.split_heldout(items[:pool], n_held if pool > 1 else 0, seed=seed)
    return train + list(items[pool:]), held


def _build_arm(cfg: Config, target, counts, total: int, world: int, device, init_from) -> Arm:
    ref = REFERENCE[cfg.drafter.kind]
    optim_cfg = replace(
        cfg.optim,
        lr=cfg.optim.lr if cfg.optim.lr is not None else ref["lr"],
        warmup_ratio=cfg.optim.warmup_ratio if cfg.optim.warmup_ratio is not None else ref["warmup_ratio"],
        grad_clip=cfg.optim.grad_clip if cfg.optim.grad_clip is not None else ref["grad_clip"],
    )
    torch.manual_seed(cfg.train.seed)  # same init for every arm of a kind: a fair comparison
    if init_from:  # a training checkpoint, a run folder, or an exported served draft
        from vatspec.drafts import open_draft

        drafter, _ = open_draft(init_from, target, k=cfg.drafter.ttt_steps)  # EAGLE-3 k; DFlash ignores it
        drafter.train()
        _check_init_from(drafter, cfg, init_from, target.vocab_size)
    else:
        drafter = build_drafter(cfg.drafter, target, counts)
    vd = getattr(drafter.config, "draft_vocab_size", None)
    if vd is not None and vd != cfg.drafter.draft_vocab_size:  # clamped to the target's vocabulary: say so
        cfg = replace(cfg, drafter=replace(cfg.drafter, draft_vocab_size=vd))
    drafter.to(device)
    loss_cfg = cfg.loss  # resolved with the config (config.resolve_loss)
    head = AcceptHead(drafter.hidden_size, label=loss_cfg.head_label).to(device) if loss_cfg.head else None
    module = TrainModule(drafter, head, head_grad=loss_cfg.head_grad)
    fsdp = world > 1 and cfg.train.parallel == "fsdp"
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # the root only, kept unsharded from forward to backward: the loss may read parameters the
        # forward returned (the chunked lm_head), and a one- or few-layer drafter gains nothing from
        # per-layer resharding
        fully_shard(module, mesh=init_device_mesh(device.type, (world,)), reshard_after_forward=False)
        model = module
    else:
        model = nn.parallel.DistributedDataParallel(module) if world > 1 else module
    params = [p for p in module.parameters() if p.requires_grad]  # fsdp: the sharded parameters
    opt = build_optimizer(module, optim_cfg, cfg.train.precision)
    warmup = int(round(optim_cfg.warmup_ratio * total))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total, warmup, optim_cfg.min_lr_ratio))
    config_yaml = dump_config(replace(cfg, optim=optim_cfg))
    return Arm(cfg, module, model, loss_cfg, optim_cfg, opt, sched, params, Path(cfg.train.out_dir), config_yaml,
               fsdp=fsdp)


def _check_init_from(drafter, cfg: Config, init_from: str, vocab_size: int) -> None:
    """The loss was resolved for ``cfg.drafter``: the draft started from must be that drafter, with the
    draft vocabulary the config asks for (at most the target's)."""
    if drafter.kind != cfg.drafter.kind:
        raise TrainError(f"--init-from {init_from} is a {drafter.kind} draft, but drafter.kind={cfg.drafter.kind}; "
                         f"pass drafter.kind={drafter.kind}")
    if drafter.kind == "dflash" and drafter.block_size != cfg.drafter.block_size:
        raise TrainError(f"--init-from {init_from} has block size {drafter.block_size}, but "
                         f"drafter.block_size={cfg.drafter.block_size}; pass drafter.block_size={drafter.block_size}")
    have, want = getattr(drafter.config, "draft_vocab_size", None), min(cfg.drafter.draft_vocab_size, vocab_size)
    if drafter.kind == "eagle3" and have is not None and have != want:
        raise TrainError(f"--init-from {init_from} drafts over {have} tokens, but drafter.draft_vocab_size={want}; "
                         f"pass drafter.draft_vocab_size={have}")


def _restore_arm(arm: Arm, state: dict) -> None:
    ck = state["checkpoint"]
    full = {f"drafter.{k}": v for k, v in _load_tensors(ck / "drafter.safetensors").items()}
    if arm.module.head is not None:
        if not (ck / "head.safetensors").is_file():
            raise TrainError(f"{ck}: no head.safetensors, but loss.head is on")
        full |= {f"head.{k}": v for k, v in _load_tensors(ck / "head.safetensors").items()}
    _check_shapes(arm, full, state)
    osd = state["optimizer"]
    by_name = bool(osd["param_groups"]) and all(isinstance(i, str) for g in osd["param_groups"] for i in g["params"])
    if arm.fsdp or by_name:  # an fsdp run, or a checkpoint one wrote: named, full state dicts
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True)
        set_model_state_dict(arm.module, full, options=opts)
        set_optimizer_state_dict(arm.module, arm.opt, osd if by_name else _named_optim_state(arm, osd), options=opts)
    else:
        arm.module.drafter.load_state_dict({k[8:]: v for k, v in full.items() if k.startswith("drafter.")})
        if arm.module.head is not None:
            arm.module.head.load_state_dict({k[5:]: v for k, v in full.items() if k.startswith("head.")})
        arm.opt.load_state_dict(osd)
    arm.sched.load_state_dict(state["scheduler"])


def _check_shapes(arm: Arm, full: dict, state: dict) -> None:
    """A checkpoint's tensors load only into the modules they were saved from: another drafter kind, number
    of layers or vocabulary is refused in one line (``--resume-with-changes`` changes the steps, not the model)."""
    want = {k: tuple(v.shape) for k, v in arm.module.state_dict().items()}
    have = {k: tuple(v.shape) for k, v in full.items()}
    if want == have:
        return
    ck = state["checkpoint"]
    diff = [f"{k} {list(have[k])} -> {list(want[k])}" for k in want if k in have and want[k] != have[k]]
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    changed = [f"{k} {a!r} -> {b!r}" for k, (a, b) in config_changes(ck / "config.yaml", arm.config_yaml).items()
               if k.startswith(("drafter.", "loss.head", "target."))]
    raise TrainError(
        f"--resume: {ck}'s weights do not fit the drafter this config builds"
        + (f" ({'; '.join(changed)})" if changed else "")
        + f": {len(missing)} tensors missing, {len(extra)} unexpected, {len(diff)} of another shape"
        + (f" (first: {(diff or missing or extra)[0]})" if diff or missing or extra else "")
        + ". A checkpoint continues only as the drafter it was trained as: start a new run (train.out_dir)")


def _full_states(arm: Arm) -> tuple[dict | None, dict | None, dict]:
    """(drafter, head, optimizer) state dicts to save. fsdp: gathered whole from every rank's shards
    (collective; rank 0 gets the tensors, on the CPU) with the optimizer keyed by parameter name;
    else None, None (the modules' own) and the optimizer's own state dict."""
    if not arm.fsdp:
        return None, None, arm.opt.state_dict()
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(arm.module, options=opts)
    optim = get_optimizer_state_dict(arm.module, arm.opt, options=opts)
    drafter = {k[8:]: v for k, v in full.items() if k.startswith("drafter.")}
    head = {k[5:]: v for k, v in full.items() if k.startswith("head.")} or None
    return drafter, head, optim


def _named_optim_state(arm: Arm, osd: dict) -> dict:
    """An optimizer state dict keyed by position (``opt.state_dict()``, ddp or one process) -> keyed by
    parameter name, the form ``set_optimizer_state_dict`` reads (positions follow ``arm.params``)."""
    names = [n for n, p in arm.module.named_parameters() if p.requires_grad]
    return {"state": {names[int(i)]: v for i, v in osd["state"].items()},
            "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in osd["param_groups"]]}


def _cut_metrics(path: Path, step: int) -> None:
    """Keep the records of ``metrics.jsonl`` up to ``step`` (a partial last line from a kill goes too)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            continue
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)


CHAINS_KEY = "chain_accepted"  # per held-out chain accepted lengths: kept with the final metrics, not logged


@torch.no_grad()
def evaluate_arms(arms: list[Arm], target, examples, cfg: Config, device) -> list[dict]:
    """Held-out pass for every arm (shared target passes): the loss and the chain metrics
    (tau_sim, accuracies, first rejection, post-rejection match, head MAE)."""
    if not examples:
        return [{} for _ in arms]
    from vatspec import data as D

    modes = [a.model.training for a in arms]
    for a in arms:
        a.model.eval()
    accs = [MetricAccumulator() for _ in arms]
    losses = [0.0 for _ in arms]
    chains: list[list[torch.Tensor]] = [[] for _ in arms]
    n = 0
    bs = cfg.data.batch_size
    for i in range(0, len(examples), bs):
        batch = D.collate(examples[i : i + bs], _pad_id(target)).to(device)
        gens = [step_generator(cfg.train.seed, -1, i, 0, device=device) for _ in arms]
        for j, res in enumerate(arms_micro_step(arms, target, batch, gens)):
            accs[j].add(res.metrics)
            chains[j].append(res.metrics.chain_accepted)
            losses[j] += float(res.loss)
        n += 1
    for a, m in zip(arms, modes):
        a.model.train(m)
    return [{"loss": losses[j] / max(n, 1), **accs[j].summary(), CHAINS_KEY: torch.cat(chains[j]).tolist()}
            for j in range(len(arms))]


# ----------------------------------------------------------------------------- helpers
# fields a resumed run may change: they say where, how often and how much to save or log, not what is computed
RESUME_FREE = ("target.device", "target.device_map", "train.out_dir", "train.log_every", "train.eval_every",
               "train.save_every", "train.save_minutes", "train.keep_checkpoints", "train.parallel")


def config_changes(saved: Path, config_yaml: str) -> dict[str, tuple]:
    """``{field: (checkpoint's value, this run's)}`` for each field that differs between the config saved in a
    checkpoint and this run's (both as training saves them: reference values filled), ``RESUME_FREE`` aside."""
    import yaml

    def flat(d: dict, prefix: str = "") -> dict:
        out = {}
        for key, val in d.items():
            out.update(flat(val, f"{prefix}{key}.") if isinstance(val, dict) else {f"{prefix}{key}": val})
        return out

    old, new = flat(yaml.safe_load(saved.read_text()) or {}), flat(yaml.safe_load(config_yaml))
    return {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new))
            if k not in RESUME_FREE and old.get(k) != new.get(k)}


MIN_SUPERVISED = 2  # a conversation with one supervised token has nothing to draft after it


def _tokenize(convs, tok, max_length: int, source: str, cache=None, stats: dict | None = None, template=None):
    """The examples worth training on: ``convs`` tokenized, or (``cache``) the cache rows ``convs``,
    without those that keep fewer than ``MIN_SUPERVISED`` supervised tokens; ``stats`` gets the counts."""
    from vatspec import data as D

    if cache is not None:
        examples = _checked(cache.examples, convs, where=source, root=cache.root)
    else:
        examples = [D.tokenize_conversation(conv, tok, max_length, template) for conv in convs]
    out = [ex for ex in examples if sum(ex.loss_mask) >= MIN_SUPERVISED]
    if stats is not None:
        at_max = [len(ex) >= max_length for ex in examples]
        dropped = [sum(ex.loss_mask) < MIN_SUPERVISED for ex in examples]
        stats.update(conversations=len(examples), kept=len(out),
                     dropped_over_length=sum(d and m for d, m in zip(dropped, at_max)),  # the answer lay beyond
                     dropped_too_short=sum(d and not m for d, m in zip(dropped, at_max)),
                     kept_truncated=sum(m and not d for d, m in zip(dropped, at_max)))
    if convs and not out:
        raise TrainError(f"{source}: none of {len(convs)} conversations keeps {MIN_SUPERVISED} supervised "
                         f"(assistant) tokens within data.max_length={max_length}")
    return out


def _open_cache(path: str, field: str, target, cfgs: list[Config], convs):
    """The feature cache at ``path``, checked against the run: the target, every arm's layers, the max
    length, and (``convs``: data.train given too) the conversations it was built from."""
    from vatspec.features import FeatureCache, config_layer_ids
    from vatspec.features.format import conversations_sha256

    def layers(c: Config):
        try:
            return config_layer_ids(c.drafter, target.num_layers)
        except ValueError as e:
            raise TrainError(f"drafter.target_layer_ids: {e}") from None

    cache = _checked(FeatureCache, path, where=f"{field}={path}", root=Path(path))
    if cache.precision != cfgs[0].train.precision:  # the cached features would not be the ones online training sees
        raise TrainError(f"{field}={path}: the cache's target pass ran in {cache.precision}, the run trains in "
                         f"train.precision={cfgs[0].train.precision}; rebuild it with cache-features --precision "
                         f"{cfgs[0].train.precision}, or set train.precision={cache.precision}")
    who = {f"the {c.drafter.kind} drafter of {c.train.out_dir}": layers(c) for c in cfgs}
    _checked(cache.check_run, target, who, cfgs[0].data.max_length, where=f"{field}={path}", root=cache.root)
    src = cache.manifest["source"]
    if convs is not None and conversations_sha256(convs) != src["sha256"]:
        raise TrainError(f"data.train={cfgs[0].data.train}: not the conversations the cache was built from "
                         f"({field}={path} holds {src['conversations']} conversations of {src['path']}); "
                         "leave data.train empty or rebuild the cache")
    return cache


def _check_disjoint(train_convs, held_convs, dcfg) -> None:
    """A ``TrainError`` when the held-out conversations share ids or first prompts with the training ones:
    held-out metrics would score conversations the drafter trained on."""
    def key(c):
        return next((m["content"].strip() for m in c.messages if m["role"] == "user"), "")

    ids, prompts = {c.id for c in train_convs}, {key(c) for c in train_convs}
    shared = [c for c in held_convs if c.id in ids or key(c) in prompts]
    if shared:
        raise TrainError(f"data.heldout={dcfg.heldout} shares {len(shared)} of {len(held_convs)} conversations with "
                         f"data.train={dcfg.train} (by id or first prompt, e.g. {shared[0].id!r}): held-out metrics "
                         "would score training conversations; hold out others, or leave data.heldout empty for a split")


def _checked(fn, *args, where: str, root=None):
    """``fn(*args)``, a feature-cache error turned into a one-line TrainError: ``WHERE: what`` (the
    cache's own ``ROOT: `` prefix replaced by ``where``, e.g. ``data.features=DIR``)."""
    from vatspec.features import FeatureCacheError

    try:
        return fn(*args)
    except FeatureCacheError as e:
        msg = str(e).removeprefix(f"{root}: ") if root is not None else str(e)
        raise TrainError(f"{where}: {msg}") from None


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


def _progress(total: int, initial: int, enabled: bool, desc: str, position: int = 0):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, desc=desc, dynamic_ncols=True, position=position,
                file=sys.stderr)
