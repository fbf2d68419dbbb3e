"""The arms: one drafter being trained each, and its step (the drafter's chains -> verification -> objective).

Public, so a benchmark or a pilot builds and steps an arm as training does (``build_arm(..., init=)``
changes a drafter's initialisation without patching anything).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from vatspec.config import Config, OptimConfig, dump_config
from vatspec.drafters import DrafterPlan, build_drafter, drafter_class, plan_batch
from vatspec.drafters.base import AcceptHead
from vatspec.objective.chunked import TeacherShare, chunked_pass
from vatspec.objective.losses import vat_objective
from vatspec.objective.metrics import MetricAccumulator, chain_metrics
from vatspec.objective.terms import head_alive_logits
from vatspec.objective.verify import simulate_verification
from vatspec.target import TargetOutput
from vatspec.target.precision import precision_context
from vatspec.train.data import pad_id
from vatspec.train.errors import TrainError
from vatspec.train.optim import build_optimizer


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


def feature_noise(features: torch.Tensor, sigma: float, n_layers: int, generator: torch.Generator) -> torch.Tensor:
    """``features`` [B, T, n*H] plus Gaussian noise with standard deviation ``sigma`` times each
    layer's per-token RMS (the captured layers' outputs differ in scale, so one absolute scale would
    drown one and miss another). A training-time regulariser
    (``train.feature_noise``); returns a new tensor in ``features``' dtype."""
    B, T, nH = features.shape
    if nH % n_layers:
        raise ValueError(f"feature_noise: features width {nH} is not a multiple of {n_layers} layers")
    x = features.float().reshape(B, T, n_layers, nH // n_layers)  # [B, T, n, H]
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()  # [B, T, n, 1]
    z = torch.randn(x.shape, generator=generator, device=x.device)
    return (x + sigma * rms * z).reshape(B, T, nH).to(features.dtype)


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


def reference_optim(cfg: Config) -> OptimConfig:
    """``cfg.optim`` with the fields left unset (None) filled from the drafter's reference recipe."""
    ref = drafter_class(cfg.drafter.kind).reference_optim
    return replace(cfg.optim, **{f: getattr(cfg.optim, f) if getattr(cfg.optim, f) is not None else ref[f]
                                 for f in ("lr", "warmup_ratio", "grad_clip")})


def build_arm(cfg: Config, target, counts, total: int, *, world: int = 1, device=None, init_from: str | None = None,
              init: Callable | None = None) -> Arm:
    """One arm for ``cfg``: its drafter (built, or ``init_from`` a draft), accept head, optimiser over
    ``total`` steps and schedule, wrapped for DDP or FSDP when ``world > 1``. ``counts``: the answer tokens'
    counts (the EAGLE-3 draft vocabulary). ``init(cfg, drafter, target)``: changes the new drafter's
    initial weights (a pilot's initialisation) before anything reads them."""
    device = device if device is not None else target.device
    optim_cfg = reference_optim(cfg)
    torch.manual_seed(cfg.train.seed)  # same init for every arm of a kind: a fair comparison
    if init_from:  # a training checkpoint, a run folder, or an exported served draft
        from vatspec.drafts import open_draft

        drafter, _ = open_draft(init_from, target, k=cfg.drafter.ttt_steps)  # EAGLE-3 k; DFlash ignores it
        drafter.train()
        _check_init_from(drafter, cfg, init_from, target.vocab_size)
    else:
        drafter = build_drafter(cfg.drafter, target, counts)
        if init is not None:  # a new drafter's initial weights; an --init-from draft keeps its own
            init(cfg, drafter, target)
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
    mismatch = drafter.init_mismatch(cfg.drafter, vocab_size)
    if mismatch:
        raise TrainError(f"--init-from {init_from} {mismatch}")


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
        batch = D.collate(examples[i : i + bs], pad_id(target)).to(device)
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
