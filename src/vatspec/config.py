"""Run configuration: frozen dataclasses with defaults, YAML files of overrides, and
``section.field=value`` overrides on the command line.

    cfg = load_config("my.yaml", ["loss.kind=vat", "train.steps=200"])
    save_config(cfg, run_dir / "config.yaml")          # the resolved config, saved with every run

Unknown sections or fields and values of the wrong type fail with a ``ConfigError`` that names
the source (file or command-line item) and the field. Once every override is in, the loss is
resolved for the drafter (``resolve_loss``): a drafter / loss pair the loss cannot serve is a
``ConfigError`` here, before any data or model loads; then every numeric field is checked against
its range (``check``, the table ``RANGES``): ``train.steps: must be >= 0, got -1``.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Literal

import yaml

from vatspec.drafters import DEFAULT_TTT_STEPS
from vatspec.objective.losses import LossConfig


class ConfigError(ValueError):
    """A configuration file or override is invalid."""


TRACKERS = ("tensorboard", "wandb", "trackio", "mlflow")  # what train.report_to may name (vatspec.train.tracking)


def parse_report_to(value: str | Sequence[str], where: str) -> tuple[str, ...]:
    """``"tensorboard,wandb"`` or a list -> the tracker names, each once, in order; ``""`` and ``"none"``: none.
    An unknown name is a ValueError naming ``where`` and the choices."""
    items = value.split(",") if isinstance(value, str) else list(value)
    names = tuple(dict.fromkeys(str(n).strip() for n in items if str(n).strip()))
    if names == ("none",):
        return ()
    if "none" in names:
        raise ValueError(f"{where}: none means no tracker, and cannot be given with {', '.join(set(names) - {'none'})}")
    for n in names:
        if n not in TRACKERS:
            raise ValueError(f"{where}: unknown tracker {n!r} (choose from {', '.join(TRACKERS)}, or none)")
    return names


@dataclass(frozen=True)
class TargetConfig:
    path: str = ""  # required: a local HF folder, or "default" = the embedded SmolLM2-135M-Instruct
    # auto = bfloat16 on a GPU, float32 elsewhere (resolved when training starts); float32 | bfloat16 | float16
    # (fp32, bf16, fp16 are stored as these)
    dtype: str = "auto"
    device: str = "auto"  # auto = cuda if available, else cpu
    # a target larger than one GPU, trained online (data.train): accelerate's device_map ("auto",
    # "balanced", ...) spreads its layers over the visible GPUs; the drafter trains on target.device.
    # One process only; from a feature cache it is not needed (only the embedding and lm_head load).
    device_map: str | None = None

    def __post_init__(self):
        from vatspec.target import device_name, dtype_name

        if self.dtype != "auto":
            object.__setattr__(self, "dtype", dtype_name(self.dtype, "target.dtype"))
        device_name(self.device, "target.device")


@dataclass(frozen=True)
class DataConfig:
    train: str = ""  # conversations: JSONL / JSON / HF dataset folder / parquet
    features: str = ""  # a feature cache (vatspec cache-features): no target forward; `train` then optional
    heldout: str = ""  # optional separate held-out file (a feature cache with `features`); else a split
    heldout_fraction: float = 0.05
    heldout_max: int = 64  # at most this many held-out conversations
    # the held-out split draws from the first N training conversations only (0: from all): for a training file
    # whose first rows are the kind to score on (the long recipe: regenerated answers before original ones)
    heldout_pool: int = 0
    max_length: int = 2048
    batch_size: int = 1
    skip_bad: bool = False  # skip malformed records (counted) instead of failing
    # which positions of a training sequence supervise the drafter: "assistant" (the reference trainers': the
    # answer tokens) or "all" (every position after the first, prompt and template too: the labels are the
    # target's own prediction there, so each sequence's forward pass trains on all of it). The held-out split
    # is always scored on the answer tokens, and the draft vocabulary is counted on them.
    loss_on: Literal["assistant", "all"] = "assistant"
    # the chat template every conversation is rendered with, as the serving engine renders it: a Jinja file
    # ("" = the target tokenizer's own), and its arguments as `key=value,...` (e.g. enable_thinking=false).
    # Recorded in regenerated data, feature caches, checkpoints and exports; a mismatch is refused.
    chat_template: str = ""
    chat_template_kwargs: str = ""
    # the day (YYYY-MM-DD) a template that stamps today's date renders (gpt-oss, Llama-3.2, Granite); "" = the
    # one recorded with the data or the feature cache (regenerate pins it), else today's
    chat_template_date: str = ""


EAGLE3_ONLY, DFLASH_ONLY = {"drafter": "eagle3"}, {"drafter": "dflash"}  # a field of one drafter kind only


@dataclass(frozen=True)
class DrafterConfig:
    """The drafter's fields under the reference trainers' names; the drafted length they set,
    ``ttt_steps`` (EAGLE-3) or ``block_size - 1`` (DFlash), is ``drafter.k`` from then on. A field
    of one kind only says so in its metadata (``fields_for``)."""

    kind: str = "eagle3"  # eagle3 | dflash
    target_layer_ids: tuple[int, ...] | None = None  # None = the drafter's reference default
    # EAGLE-3
    draft_vocab_size: int = field(default=32000, metadata=EAGLE3_ONLY)
    ttt_steps: int = field(default=DEFAULT_TTT_STEPS, metadata=EAGLE3_ONLY)  # k, the TTT unroll
    # start lm_head / norm from the target's (draft-vocab rows) instead of random
    init_lm_head: bool = field(default=False, metadata=EAGLE3_ONLY)
    # DFlash
    num_layers: int = field(default=1, metadata=DFLASH_ONLY)
    block_size: int = field(default=16, metadata=DFLASH_ONLY)  # k + 1: the anchor and k drafted slots
    num_anchors: int = field(default=512, metadata=DFLASH_ONLY)  # anchors (blocks) per sequence
    # None = pick an unused target id, else a learned row
    mask_token_id: int | None = field(default=None, metadata=DFLASH_ONLY)

    def __post_init__(self):
        from vatspec.drafters import check_kind

        check_kind(self.kind, "DrafterConfig")

    @classmethod
    def fields_for(cls, kind: str) -> list[str]:
        """The fields that shape a drafter of ``kind``: those of every kind and its own, in order."""
        return [f.name for f in dataclasses.fields(cls) if f.metadata.get("drafter", kind) == kind]


@dataclass(frozen=True)
class OptimConfig:
    # adamw | muon: Muon on the drafter's hidden matrices, AdamW on the rest (vatspec/train/optim.py)
    kind: Literal["adamw", "muon"] = "adamw"
    lr: float | None = None  # None = reference: 1e-4 (eagle3), 6e-4 (dflash)
    muon_lr_scale: float = 1.0  # optim.kind=muon: the hidden matrices' lr is lr x this
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    warmup_ratio: float | None = None  # None = reference: 0.015 (eagle3), 0.04 (dflash)
    grad_clip: float | None = None  # None = reference: 0.5 (eagle3), 1.0 (dflash)
    grad_accum: int = 1
    min_lr_ratio: float = 0.0  # cosine floor, as a fraction of lr


@dataclass(frozen=True)
class TrainConfig:
    out_dir: str = "runs/default"
    steps: int = 0  # optimizer steps; 0 = epochs over the data
    epochs: int = 1
    seed: int = 0
    log_every: int = 1
    eval_every: int = 0  # 0 = only at the end
    save_every: int | None = None  # checkpoint every N steps; None = a tenth of the run; 0 = only the final one
    save_minutes: float = 30.0  # also checkpoint when this many minutes passed since the last; 0 = never
    keep_checkpoints: int = 2
    # bf16: the forward passes and the loss under bfloat16 autocast; weights, gradients and optimizer
    # state stay float32 (set target.dtype=bfloat16 too for a bf16 target); auto = bf16 on a GPU, else fp32
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    # Gaussian noise on the target's features while training (not in held-out evaluation), as a
    # fraction of each layer's per-token RMS; 0 = none (the reference trainers' choice)
    feature_noise: float = 0.0
    # under torchrun: ddp replicates the drafter on every rank; fsdp shards its parameters, gradients
    # and optimizer state across ranks (FSDP2 fully_shard). Checkpoints of either resume in either.
    parallel: Literal["ddp", "fsdp"] = "ddp"
    # experiment trackers that get every logged step too (metrics.jsonl is always written): any of tensorboard,
    # wandb, trackio, mlflow, as a list or comma-separated (train.report_to=tensorboard,wandb); each an extra
    # (pip install 'vatspec[wandb]'). Where each writes: vatspec/train/tracking.py
    report_to: tuple[str, ...] = ()
    # the trackers' project (wandb's and Trackio's; MLflow's experiment) and wandb's entity (a team or user); "" = the
    # tracker's own environment variable ($WANDB_PROJECT, $MLFLOW_EXPERIMENT_NAME, $WANDB_ENTITY), else "vatspec" and
    # the account's default entity
    project: str = ""
    entity: str = ""

    def __post_init__(self):
        object.__setattr__(self, "report_to", parse_report_to(self.report_to, "train.report_to"))


@dataclass(frozen=True)
class Config:
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


# ----------------------------------------------------------------------------- loading
def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults <- YAML file <- ``section.field=value`` overrides, each checked.

    ``drafter=dflash`` and ``loss=vat`` are shorthands for ``drafter.kind=...`` / ``loss.kind=...``.
    """
    cfg = Config()
    if path:
        path = find_config(path)
        try:
            data = yaml.load(path.read_text(), Loader=_UniqueKeys) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of sections, got {type(data).__name__}")
        cfg = merge(cfg, data, source=str(path))
    for item in overrides:
        cfg = merge(cfg, parse_override(item), source=f"override {item!r}")
    return check(resolve_loss(cfg))


def installed_configs() -> dict[str, Path]:
    """Every config the installed packages offer by name: ``NAME -> NAME.yaml`` of each folder registered under
    the ``vatspec.configs`` entry point group (vatspec_recipes registers its ``configs/``)."""
    found: dict[str, Path] = {}
    for ep in entry_points(group="vatspec.configs"):
        for file in sorted(Path(ep.load()).glob("*.yaml")):
            found.setdefault(file.stem, file)  # the first package to offer a name keeps it
    return found


def find_config(name: str | Path) -> Path:
    """The config file ``name`` stands for: that path if it is a file, else the installed config ``NAME`` (or
    ``NAME.yaml``). A ``ConfigError`` listing the installed names otherwise."""
    path = Path(name)
    if path.is_file():
        return path
    installed = installed_configs()
    if path.parent == Path(".") and path.name.removesuffix(".yaml") in installed:
        return installed[path.name.removesuffix(".yaml")]
    names = ", ".join(sorted(installed)) or "none"
    raise ConfigError(f"config {name} does not exist: it is neither a file nor an installed config (installed: "
                      f"{names})")


def parse_override(item: str) -> dict:
    """``"section.field=value"`` -> ``{section: {field: value}}`` (the value read as YAML);
    ``drafter=dflash`` and ``loss=vat`` are short for the section's ``kind``."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if sep and "." not in key and hasattr(getattr(Config(), key, None), "kind"):
        key += ".kind"  # `drafter=dflash`, `loss=vat`: shorthand for the section's kind
    if not sep or "." not in key:
        raise ConfigError(f"override {item!r}: expected section.field=value (or drafter=KIND, loss=KIND)")
    section, _, name = key.partition(".")
    return {section: {name: yaml.load(raw, Loader=_UniqueKeys) if raw.strip() else ""}}


class _UniqueKeys(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (a section written twice would silently
    lose its first half)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"{key!r} is given twice (line "
                                                        f"{key_node.start_mark.line + 1})", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


# a day stays the text it was written as (data.chat_template_date=2026-01-05): YAML would make it a date, or raise
# a ValueError naming no field for 2026-13-01; the field's own check says what a day must be
_UniqueKeys.add_constructor("tag:yaml.org,2002:timestamp", lambda loader, node: loader.construct_scalar(node))


def resolve_loss(cfg: Config) -> Config:
    """``cfg`` with ``cfg.loss`` resolved for ``cfg.drafter`` (``LossConfig.resolve``): the fields the loss
    kind leaves open filled from its preset, the curve from the drafter's schedule, DFlash's gamma from
    its block. A pair the loss cannot serve is a one-line ``ConfigError``. Idempotent."""
    from vatspec.drafters import drafter_class

    d, loss = cfg.drafter, cfg.loss
    kind = drafter_class(d.kind)
    schedule, block = kind.schedule, kind.curve_block(d)  # only a drafter with blocks (DFlash: k + 1) has one
    if loss.gamma is None and block is None and loss.curve_for(schedule) == "dflash":
        what = "loss.curve=dflash" if loss.curve else "loss.kind=dflash"
        raise ConfigError(f"drafter.kind={d.kind} with {what}: the dflash curve exp(-j/gamma) takes its gamma from "
                          f"a DFlash block, and an {d.kind} drafter has none; set loss.gamma, or use "
                          "loss.kind=eagle3 or vat, or drafter.kind=dflash")
    try:
        return dataclasses.replace(cfg, loss=loss.resolve(schedule, block_size=block))
    except ValueError as e:
        raise ConfigError(f"drafter.kind={d.kind} with loss.kind={loss.kind}: {e}") from e


def _at_least(n: int | float, optional: bool = False):
    return (lambda v: (optional and v is None) or (v is not None and v >= n)), f">= {n}" + (" (or null)" * optional)


def _within(lo: float, hi: float, closed: str, optional: bool = False):
    def ok(v):
        if v is None:
            return optional
        return (lo <= v if closed[0] == "[" else lo < v) and (v <= hi if closed[1] == "]" else v < hi)

    return ok, f"in {closed[0]}{lo:g}, {hi:g}{closed[1]}" + (" (or null)" * optional)


def _is_day(v: str) -> bool:
    import datetime

    try:
        return datetime.date.fromisoformat(v).isoformat() == v
    except (TypeError, ValueError):
        return False


# field -> (test, what it must be): every numeric range, checked once all overrides are in
RANGES: dict[str, tuple] = {
    "data.heldout_fraction": _within(0, 1, "[)"),
    "data.heldout_max": _at_least(0),
    "data.heldout_pool": _at_least(0),
    "data.max_length": _at_least(2),
    "data.chat_template_date": (lambda v: v == "" or _is_day(v), "a day as YYYY-MM-DD (or empty)"),
    "data.batch_size": _at_least(1),
    "drafter.draft_vocab_size": _at_least(1),
    "drafter.ttt_steps": _at_least(1),
    "drafter.num_layers": _at_least(1),
    "drafter.block_size": _at_least(2),  # the anchor and at least one drafted slot
    "drafter.num_anchors": _at_least(1),
    "drafter.mask_token_id": _at_least(0, optional=True),
    "optim.lr": (lambda v: v is None or 0 < v < math.inf, "> 0 (or null: the drafter's reference lr)"),
    "optim.muon_lr_scale": (lambda v: 0 < v < math.inf, "> 0"),
    "optim.betas": (lambda v: all(0 <= b < 1 for b in v), "two numbers in [0, 1)"),
    "optim.weight_decay": _at_least(0),
    "optim.warmup_ratio": _within(0, 1, "[]", optional=True),
    "optim.grad_clip": (lambda v: v is None or v > 0, "> 0 (or null)"),
    "optim.grad_accum": _at_least(1),
    "optim.min_lr_ratio": _within(0, 1, "[]"),
    "train.steps": _at_least(0),
    "train.epochs": _at_least(1),
    "train.log_every": _at_least(1),
    "train.eval_every": _at_least(0),
    "train.save_every": _at_least(0, optional=True),
    "train.save_minutes": _at_least(0),
    "train.keep_checkpoints": _at_least(0),
    "train.feature_noise": _at_least(0),
}


def check(cfg: Config) -> Config:
    """``cfg`` if every field of ``RANGES`` is in its range, else a ``ConfigError`` naming the field:
    ``train.steps: must be >= 0, got -1``."""
    for key, (ok, want) in RANGES.items():
        section, _, name = key.partition(".")
        value = getattr(getattr(cfg, section), name)
        if not ok(value):
            raise ConfigError(f"{key}: must be {want}, got {value!r}")
    if cfg.optim.kind == "muon" and cfg.train.parallel == "fsdp":  # Newton-Schulz needs whole matrices
        raise ConfigError("optim.kind=muon: not with train.parallel=fsdp (Muon orthogonalises whole matrices, "
                          "FSDP shards them); use train.parallel=ddp")
    ids = cfg.drafter.target_layer_ids
    if ids is not None and (not ids or min(ids) < 0):
        raise ConfigError(f"drafter.target_layer_ids: must be a non-empty list of layer ids >= 0, got {list(ids)}")
    if ids is not None and len(set(ids)) < len(ids):  # the engines capture each layer once: export would refuse it
        raise ConfigError(f"drafter.target_layer_ids: {list(ids)} repeats a layer; the engines capture each layer "
                          "once")
    if cfg.data.heldout_fraction == 0 and not cfg.data.heldout:  # the split would still hold one out
        raise ConfigError("data.heldout_fraction=0 holds nothing out, but training measures held-out conversations: "
                          "give data.heldout (a file or feature cache) or a fraction > 0")
    return cfg


def merge(cfg: Any, data: dict, *, source: str, prefix: str = "") -> Any:
    """Return ``cfg`` (a dataclass) with the fields in ``data`` replaced, recursively, type-checked."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: {prefix.rstrip('.') or 'config'} must be a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    hints = typing.get_type_hints(type(cfg))
    changes = {}
    for key, value in data.items():
        where = f"{prefix}{key}"
        if key not in fields:
            raise ConfigError(f"{source}: unknown field {where!r} (known: {', '.join(sorted(fields))})")
        current = getattr(cfg, key)
        if dataclasses.is_dataclass(current):
            changes[key] = merge(current, value, source=source, prefix=where + ".")
        else:
            changes[key] = _coerce(value, hints[key], where, source)
    try:
        return dataclasses.replace(cfg, **changes)
    except (ValueError, TypeError) as e:  # __post_init__ validation of the section
        raise ConfigError(f"{source}: {e}") from e


def _coerce(value: Any, tp: Any, where: str, source: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, where, source)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{source}: {where}: bad value {value!r}")
    if origin is tuple:
        if isinstance(value, str) and args == (str, Ellipsis):  # a list of names may be written a,b,c
            value = value.split(",")
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{source}: {where} expects a list, got {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], where, source) for v in value)
        if len(args) != len(value):
            raise ConfigError(f"{source}: {where} expects {len(args)} values, got {len(value)}")
        return tuple(_coerce(v, a, where, source) for v, a in zip(value, args))
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{source}: {where} must be one of {list(args)}, got {value!r}")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{source}: {where} expects true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{source}: {where} expects an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{source}: {where} expects a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{source}: {where} expects a string, got {value!r}")
    raise ConfigError(f"{source}: {where}: unsupported field type {tp}")


# ----------------------------------------------------------------------------- saving
def to_dict(cfg: Any) -> dict:
    """Plain nested dict (tuples as lists) of a config, for YAML / JSON."""

    def plain(v):
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        return v

    return {
        f.name: to_dict(getattr(cfg, f.name)) if dataclasses.is_dataclass(getattr(cfg, f.name))
        else plain(getattr(cfg, f.name))
        for f in dataclasses.fields(cfg)
    }


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(dump_config(cfg))


def config_from_dict(data: dict, *, source: str = "checkpoint") -> Config:
    return check(resolve_loss(merge(Config(), data, source=source)))


# ----------------------------------------------------------------------------- provenance
def config_sources(path: str | Path | None = None,
                   overrides: list[str] | tuple[str, ...] = ()) -> list[tuple[str, Any, str]]:
    """Where each field of ``load_config(path, overrides)`` came from: ``(section.field, value, source)`` for
    every field, in the dataclasses' order. ``source`` is ``default``, the file's path, ``override ITEM`` (the
    last to name the field wins, as in ``load_config``), or ``resolved (loss.kind=K, drafter=D)`` for a loss
    field that ``resolve_loss`` filled when the config loaded. Errors are ``load_config``'s ``ConfigError``s.
    With ``path="qwen3-8b-eagle3-vat"`` (an installed config) the file is the one ``find_config`` finds:

        ("data.max_length", 4096, ".../vatspec_recipes/configs/qwen3-8b-eagle3-vat.yaml"),
        ("loss.soft", True, "resolved (...)")
    """
    cfg = load_config(path, overrides)  # every check and error message comes from here
    path = find_config(path) if path else None
    layers = [(str(path), yaml.load(path.read_text(), Loader=_UniqueKeys) or {})] if path else []
    layers += [(f"override {item}", parse_override(item)) for item in overrides]
    given, source = Config(), {}  # given: the config before resolve_loss
    for where, data in layers:
        given = merge(given, data, source=where)
        source.update(dict.fromkeys(_dotted(data), where))
    derived = f"resolved (loss.kind={cfg.loss.kind}, drafter={cfg.drafter.kind})"
    rows = []
    for section in dataclasses.fields(cfg):
        for f in dataclasses.fields(getattr(cfg, section.name)):
            key = f"{section.name}.{f.name}"
            value, before = (getattr(getattr(c, section.name), f.name) for c in (cfg, given))
            if value != before:  # load_config resolves only the loss; anything else is named plainly
                rows.append((key, value, derived if section.name == "loss" else "resolved when the config loaded"))
            else:
                rows.append((key, value, source.get(key, "default")))
    return rows


def _dotted(data: dict, prefix: str = "") -> list[str]:
    """The leaf keys of a nested mapping as ``a.b`` names."""
    return [k for key, v in data.items()
            for k in (_dotted(v, f"{prefix}{key}.") if isinstance(v, dict) else [f"{prefix}{key}"])]


def resolve_hardware(cfg: Config, device) -> Config:
    """``cfg`` with ``target.dtype=auto`` and ``train.precision=auto`` resolved for ``device`` (a
    ``torch.device``): bfloat16 and bf16 autocast on a GPU, float32 elsewhere. The saved config holds
    the resolved values, so a resumed run keeps them."""
    gpu = getattr(device, "type", str(device)) == "cuda"
    target = cfg.target if cfg.target.dtype != "auto" else dataclasses.replace(
        cfg.target, dtype="bfloat16" if gpu else "float32")
    train = cfg.train if cfg.train.precision != "auto" else dataclasses.replace(
        cfg.train, precision="bf16" if gpu else "fp32")
    return dataclasses.replace(cfg, target=target, train=train)
