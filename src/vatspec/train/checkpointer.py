"""The run folders of a lockstep group: one writer each, resume, checkpoints and metrics.

A run folder holds ``.vatspec-owner`` (``vatspec.outputs``), ``config.yaml``, ``data_stats.json`` (what
was read, skipped and dropped), ``metrics.jsonl``, ``checkpoints/``, ``config_history.jsonl`` (changes a
``--resume-with-changes`` made) and, at the end, ``heldout_chains.json``. Checkpoints are periodic by
default (``train.save_every``, ``train.save_minutes``), so a killed run resumes exactly; on resume
``metrics.jsonl`` is cut back to the checkpoint's step, so each step is logged once. With ``train.report_to``
the logged steps go to experiment trackers too (``vatspec.train.tracking``; their run ids in ``trackers.json``).
"""

from __future__ import annotations

import json
import os
import random
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import torch
import yaml

from vatspec import checkpoint as ckpt_io
from vatspec.config import Config
from vatspec.outputs import (
    OutputError,
    check_apart,
    check_folder,
    claim_folder,
    mark_folder,
    owner,
    strict_json,
    write_lock,
)
from vatspec.train import dist as D
from vatspec.train.arms import Arm
from vatspec.train.errors import TrainError
from vatspec.train.tracking import Trackers, TrackingError, check_installed, open_trackers

# fields a resumed run may change: they say where, how often and how much to save or log, not what is computed
RESUME_FREE = ("target.device", "target.device_map", "train.out_dir", "train.log_every", "train.eval_every",
               "train.save_every", "train.save_minutes", "train.keep_checkpoints", "train.parallel",
               "train.report_to", "train.project", "train.entity")
SAVES_PER_RUN = 10  # train.save_every unset: a checkpoint every total // 10 steps


class Checkpointer:
    """Owns the run folders of the arms trained together: takes each folder's one-writer lock, refuses
    folders it must not write, restores a resumed run (refusing a config that computes otherwise), writes
    the run's files, logs metrics (to ``metrics.jsonl`` and the ``train.report_to`` trackers) and saves
    checkpoints. Only rank 0 (``is_main``) writes; the trackers close when ``locks`` does."""

    def __init__(self, cfgs: list[Config], locks: ExitStack, *, is_main: bool, world: int):
        self.cfgs, self.is_main, self.world = cfgs, is_main, world
        self.dirs = [Path(c.train.out_dir) for c in cfgs]
        self.states: list[dict | None] = [None for _ in self.dirs]
        self.drift: list[tuple[Arm, dict, dict]] = []
        self.t_saved = time.monotonic()
        self.resuming = False
        self.trackers: dict[Path, Trackers] = {}
        for c in cfgs:  # every rank: a missing extra stops them all before any work
            try:
                check_installed(c.train.report_to, "train.report_to")
            except TrackingError as e:
                raise TrainError(str(e)) from None
        locks.push(self._close_trackers)  # after the run (or its error), before the folder locks go
        if is_main:  # a second training into one folder fails at once, naming the first
            for d in self.dirs:
                try:
                    locks.enter_context(write_lock(d, "train.out_dir", "train"))
                except OutputError as e:
                    raise TrainError(str(e)) from None

    def open(self, inputs: dict, resume: bool) -> None:
        """Refuse to clobber: a folder with checkpoints needs ``resume`` (then its state is read); a folder
        ``vatspec train`` did not make is never written into; no input lies in, or holds, a run folder."""
        self.resuming = resume
        for i, d in enumerate(self.dirs):
            try:
                check_apart(d, inputs, "train.out_dir")
                if (d / "latest").exists():
                    if not resume:
                        raise TrainError(f"{d} already holds a run (found {d / 'latest'}); pass --resume to continue "
                                         "it or choose another train.out_dir")
                    ck = ckpt_io.resolve_checkpoint(d)
                    self.states[i] = ckpt_io.load_trainer_state(ck)
                    self.states[i]["checkpoint"] = ck
                else:
                    if resume and owner(d) != "train":
                        raise TrainError(f"--resume: {d} holds no run to resume (no {d / 'latest'})")
                    check_folder(d, "train", "train.out_dir")
            except OutputError as e:
                raise TrainError(str(e)) from None

    def check_template(self, settings: dict) -> None:
        """A resumed run renders its sequences as it did."""
        from vatspec.data import check_settings

        for d, state in zip(self.dirs, self.states):
            if state is not None:
                check_settings(state.get("chat_template"), settings, f"{d} (the run resumed)", "this run")

    def resume(self, arms: list[Arm], batches, total: int, with_changes: bool) -> int | None:
        """The step training continues at (0 for a new run), the arms, data order and RNG restored; None when
        the run already took its ``total`` steps (nothing is written). A config that computes otherwise than
        the checkpoint's is refused, or (``with_changes``) recorded by ``start``, never silently written over."""
        self.drift = [(arm, state, config_changes(state["checkpoint"] / "config.yaml", arm.config_yaml))
                      for arm, state in zip(arms, self.states) if state is not None]
        for arm, state, changes in self.drift:
            if changes and not with_changes:
                raise TrainError(f"--resume: {arm.run_dir}'s config differs from its checkpoint's "
                                 f"({state['checkpoint'] / 'config.yaml'}): "
                                 + "; ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changes.items())
                                 + ". Pass the checkpoint's values, or --resume-with-changes to continue with these "
                                 "(recorded in config_history.jsonl)")
        steps = [s["step"] if s else 0 for s in self.states]
        if len(set(steps)) != 1:
            raise TrainError(f"arms' latest checkpoints are at different steps {steps}: cannot resume in lockstep")
        if self.states[0] is None:
            return 0
        if steps[0] >= total:
            return None
        for arm, state in zip(arms, self.states):
            restore_arm(arm, state)
        batches.load_state_dict(self.states[0]["data"])
        _set_rng(self.states[0]["rng"])
        return steps[0]

    def final_metrics(self) -> list[dict]:
        """A finished run's held-out metrics, as its last checkpoint recorded them."""
        return [{k.removeprefix("eval/"): v for k, v in s.get("metrics", {}).items() if k.startswith("eval/")}
                for s in self.states]

    def start(self, arms: list[Arm], stats: dict, step: int) -> None:
        """Claim each folder; write its config and data statistics; record a resumed run's config changes;
        cut ``metrics.jsonl`` back to ``step`` (a rerun or resume logs each step once); open its trackers (a
        resumed run's own, told which steps they already hold)."""
        self.t_saved = time.monotonic()  # train.save_minutes counts from the first step, not from the set-up
        if not self.is_main:
            return
        for arm, state in zip(arms, self.states):
            if state is None:
                claim_folder(arm.run_dir, "train")
            else:  # a run folder with checkpoints (copied without its dotfiles too) is train's
                mark_folder(arm.run_dir, "train")
            for changed, st, changes in self.drift:
                if changed is arm and changes:
                    with open(arm.run_dir / "config_history.jsonl", "a", encoding="utf-8") as f:
                        f.write(json.dumps({"step": st["step"], "checkpoint": str(st["checkpoint"]),
                                            "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                                            "changes": {k: list(v) for k, v in changes.items()}}) + "\n")
            (arm.run_dir / "config.yaml").write_text(arm.config_yaml)
            (arm.run_dir / "data_stats.json").write_text(json.dumps(stats, indent=1) + "\n")
            logged = cut_metrics(arm.run_dir / "metrics.jsonl", step)
            try:
                self.trackers[arm.run_dir] = open_trackers(
                    arm.cfg.train.report_to, arm.run_dir, name=arm.run_dir.resolve().name,
                    config=yaml.safe_load(arm.config_yaml), first_step=step + 1, resume=self.resuming, logged=logged,
                    project=arm.cfg.train.project, entity=arm.cfg.train.entity)
            except TrackingError as e:
                raise TrainError(str(e)) from None

    def log(self, arm: Arm, record: dict) -> None:
        """One step's record: a line of ``metrics.jsonl``, then the trackers (a kill between them loses the step
        there, never logs it twice)."""
        if self.is_main:
            with open(arm.run_dir / "metrics.jsonl", "a") as f:
                f.write(strict_json(record) + "\n")  # a NaN loss as null: strict JSON readers take the file
            if arm.run_dir in self.trackers:
                self.trackers[arm.run_dir].log(record)

    def _close_trackers(self, exc_type, exc, tb) -> bool:
        """``locks``' exit: every tracker ended, as finished or (an error, an interrupt) failed."""
        trackers, self.trackers = list(self.trackers.values()), {}
        for t in trackers:
            t.close(ok=exc_type is None)
        return False

    def write_chains(self, arm: Arm, step: int, metrics: dict, key: str) -> None:
        """The final held-out chains' accepted lengths (``heldout_chains.json``): paired comparisons read them."""
        if self.is_main and key in metrics:
            (arm.run_dir / "heldout_chains.json").write_text(json.dumps(
                {"step": step, "tau_sim": metrics.get("tau_sim"), key: metrics[key]}))

    def due(self, step: int, total: int) -> bool:
        """A checkpoint now: the last step, every ``save_interval`` steps, or ``train.save_minutes`` since the
        last one (rank 0's clock decides for every rank)."""
        cfg = self.cfgs[0].train
        every = save_interval(self.cfgs[0], total)
        minutes = cfg.save_minutes and time.monotonic() - self.t_saved >= 60 * cfg.save_minutes
        return D.broadcast_flag(bool(step == total or (every and step % every == 0) or minutes), self.world)

    def save(self, arms: list[Arm], records: list[dict], step: int, trainer: dict) -> None:
        """Every arm's checkpoint at ``step``: its weights, optimiser, schedule, ``trainer`` (data order,
        totals, template settings) and RNG. Under fsdp every rank takes part in gathering the state."""
        for arm, record in zip(arms, records):
            drafter_state, head_state, optim_state = _full_states(arm)
            if self.is_main:
                ckpt_io.save_checkpoint(
                    arm.run_dir, step, drafter=arm.drafter, head=arm.module.head, config_yaml=arm.config_yaml,
                    keep=arm.cfg.train.keep_checkpoints, drafter_state=drafter_state, head_state=head_state,
                    trainer_state={"optimizer": optim_state, "scheduler": arm.sched.state_dict(), "rng": _get_rng(),
                                   "metrics": record, **trainer},
                )
        self.t_saved = time.monotonic()


def save_interval(cfg: Config, total: int) -> int:
    """Steps between periodic checkpoints: ``train.save_every``, or (unset) a tenth of the run; 0 = none."""
    if cfg.train.save_every is not None:
        return cfg.train.save_every
    return max(1, total // SAVES_PER_RUN)


def finished(cfg: Config) -> int | None:
    """The step of the run in ``cfg.train.out_dir`` if its latest checkpoint is its last (a ``--resume``
    would do nothing), else None."""
    d = Path(cfg.train.out_dir)
    if not (d / "latest").is_file():
        return None
    state = ckpt_io.load_trainer_state(ckpt_io.resolve_checkpoint(d))
    total = cfg.train.steps or state.get("total")
    return state["step"] if total is not None and state["step"] >= total else None


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


def restore_arm(arm: Arm, state: dict) -> None:
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
    parameter name, the form ``set_optimizer_state_dict`` reads (positions follow the optimizer's groups)."""
    names = {p: n for n, p in arm.module.named_parameters()}
    order = [names[p] for g in arm.opt.param_groups for p in g["params"]]
    return {"state": {order[int(i)]: v for i, v in osd["state"].items()},
            "param_groups": [{**g, "params": [order[int(i)] for i in g["params"]]} for g in osd["param_groups"]]}


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a run's ``metrics.jsonl``, a number written as null (a NaN or inf: the file is strict JSON)
    read back as NaN, as it was logged."""
    def nan(v):
        return float("nan") if v is None else [nan(x) for x in v] if isinstance(v, list) else v

    lines = Path(path).read_text().splitlines()
    return [{k: nan(v) for k, v in json.loads(line).items()} for line in lines if line.strip()]


def cut_metrics(path: Path, step: int) -> int:
    """Keep the records of ``metrics.jsonl`` up to ``step`` (a partial last line from a kill goes too); return
    the last step it held before (0 if none): the steps a resumed run's trackers already hold."""
    if not path.is_file():
        return 0
    kept, last = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            s = json.loads(line)["step"]
            last = max(last, s)
            if s <= step:
                kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            continue
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)
    return last


def _load_tensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(path)


def _get_rng() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def _set_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
