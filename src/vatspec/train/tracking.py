"""Experiment trackers: what a run logs also goes to TensorBoard, Weights & Biases, Trackio or MLflow.

    vatspec train ... train.report_to=tensorboard,wandb     # metrics.jsonl is written as always
    vatspec eval ... --report-to mlflow                      # the report's tables and plots

Each tracker is an optional extra (``pip install 'vatspec[wandb]'``), imported only when a run asks for it;
``check_installed`` refuses a missing one in one line before any work. Per logged step every number of the
record goes as a scalar, a list (the per-position ``train/acc``) as one scalar per position
(``train/acc/0``, ``train/acc/1``, ...); the resolved config goes as hyper-parameters, with the run's name
and folder. Where each one writes, unless the user's own settings say otherwise:

    tensorboard  RUN/tensorboard/
    wandb        RUN/wandb/ (or $WANDB_DIR), online or offline as the user's wandb settings say (WANDB_MODE=offline
                 needs no account); vatspec sets nothing that goes online
    trackio      trackio's local store (or $TRACKIO_DIR)
    mlflow       RUN/mlflow/mlflow.db and RUN/mlflow/artifacts/, or $MLFLOW_TRACKING_URI; its usage telemetry off
                 unless $MLFLOW_DISABLE_TELEMETRY says otherwise

The project a run goes to (wandb's and Trackio's project, MLflow's experiment) and wandb's entity: the config's
``train.project`` / ``train.entity`` when set, else the tracker's own environment variable (``PROJECT_ENV``,
``ENTITY_ENV``: $WANDB_PROJECT, $MLFLOW_EXPERIMENT_NAME, $WANDB_ENTITY; Trackio reads none), else ``PROJECT``
and the account's default entity. A resumed run reopens its tracked run where it was (``trackers.json``).

Resume: each tracker's run id is kept in ``RUN/trackers.json`` and ``--resume`` reopens that run. Every step
reads back once. TensorBoard purges the steps after the checkpoint (``purge_step``) and takes them again, as
``metrics.jsonl`` does. wandb, Trackio and MLflow cannot drop a step they hold: they keep what the killed run
gave them (the steps ``metrics.jsonl`` held, ``logged``) and take only later steps; a resumed run computes
those steps again to the same values (tests/test_train.py), ``tokens_per_s`` and ``peak_memory_mib`` aside.
A step a tracker had queued but not written when the process died is missing there, never doubled.
"""

from __future__ import annotations

import abc
import contextlib
import importlib.util
import json
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path

# the modules each tracker imports: all present, or `pip install 'vatspec[NAME]'`
NEEDS = {"tensorboard": ("tensorboard",), "wandb": ("wandb",), "trackio": ("trackio",),
         "mlflow": ("mlflow", "sqlalchemy", "alembic")}  # mlflow's local store is SQLite (its file store is retired)
PROJECT = "vatspec"  # the project (MLflow: experiment) when neither the config nor the environment names one
# each tracker's own environment variable for its project, and for its entity (a team or user)
PROJECT_ENV = {"wandb": "WANDB_PROJECT", "mlflow": "MLFLOW_EXPERIMENT_NAME"}
ENTITY_ENV = {"wandb": "WANDB_ENTITY"}
STATE_FILE = "trackers.json"


class TrackingError(RuntimeError):
    """A tracker that cannot be used: not installed, or its run cannot be reopened."""


def project_name(kind: str, project: str = "") -> str:
    """The project (MLflow: experiment) a ``kind`` tracker logs to: ``project`` (``train.project``) when set, else
    the tracker's own environment variable, else ``PROJECT``."""
    return project or os.environ.get(PROJECT_ENV.get(kind, ""), "") or PROJECT


def entity_name(kind: str, entity: str = "") -> str | None:
    """The entity (team or user) a ``kind`` tracker logs to: ``entity`` when set, else its environment variable;
    None: the account's default (or a tracker without entities)."""
    return entity or os.environ.get(ENTITY_ENV.get(kind, ""), "") or None


def check_installed(names: Sequence[str], where: str) -> None:
    """Every tracker of ``names`` can be imported, else a ``TrackingError`` naming the extra to install."""
    for n in names:
        missing = [m for m in NEEDS[n] if importlib.util.find_spec(m) is None]
        if missing:
            raise TrackingError(f"{where}: {n} is not installed (no module {missing[0]!r}); "
                                f"pip install 'vatspec[{n}]'")


def scalars(record: dict) -> dict[str, float]:
    """The numbers of a logged record, ``step`` aside; a list as one scalar per position:

        {"step": 3, "loss": 0.5, "train/acc": [0.9, 0.7]} -> {"loss": 0.5, "train/acc/0": 0.9, "train/acc/1": 0.7}
    """
    out: dict[str, float] = {}
    for k, v in record.items():
        if k == "step":
            continue
        if isinstance(v, (list, tuple)):
            out.update({f"{k}/{i}": float(x) for i, x in enumerate(v) if _number(x)})
        elif _number(v):
            out[k] = float(v)
    return out


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def flat_config(config: dict, prefix: str = "") -> dict[str, object]:
    """A nested config as ``{"train.steps": 4, ...}``; lists and None as their text (what every tracker takes)."""
    out: dict[str, object] = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(flat_config(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, (int, float, str, bool)) else json.dumps(v)
    return out


def markdown_tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """The pipe tables of a markdown text as ``(columns, rows)``: what wandb shows as tables."""
    tables, block = [], []
    for line in [*text.splitlines(), ""]:
        if line.strip().startswith("|"):
            block.append([c.strip() for c in line.strip().strip("|").split("|")])
            continue
        if len(block) >= 2 and all(re.fullmatch(r":?-+:?", c) for c in block[1]):
            width = len(block[0])
            tables.append((block[0], [(r + [""] * width)[:width] for r in block[2:]]))
        block = []
    return tables


# ----------------------------------------------------------------------------- one class per tracker
class Tracker(abc.ABC):
    """One tracked run: ``log`` a step's scalars, ``log_text`` a markdown report, ``log_image`` a PNG plot,
    ``close``. ``state`` is what ``trackers.json`` keeps to reopen it. ``rewrites``: a reopened run takes the
    steps after the checkpoint again (it dropped them); else it keeps the ones it holds. Each is built as
    ``Kind(run_dir, name, config, first_step, state, project, entity)`` (``project`` / ``entity``: the config's,
    "" when unset: ``project_name``, ``entity_name``)."""

    kind = ""
    rewrites = False

    @abc.abstractmethod
    def log(self, step: int, values: dict[str, float]) -> None:
        """``values`` (from ``scalars``) at ``step``."""

    @abc.abstractmethod
    def log_text(self, key: str, text: str, step: int) -> None:
        """A markdown report (its tables) under ``key``."""

    @abc.abstractmethod
    def log_image(self, key: str, path: Path, step: int) -> None:
        """A PNG plot under ``key``."""

    @abc.abstractmethod
    def close(self, ok: bool) -> None:
        """Flush and end the run (``ok``: finished, else failed)."""

    def state(self) -> dict:
        return {}


class TensorBoard(Tracker):
    """Event files in RUN/tensorboard; ``purge_step`` makes a reader drop the steps a resumed run takes again."""

    kind, rewrites = "tensorboard", True

    def __init__(self, run_dir: Path, name: str, config: dict, first_step: int, state: dict | None, project: str = "",
                 entity: str = ""):
        from tensorboard.compat.proto.summary_pb2 import Summary
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self._summary = Summary
        self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=first_step)
        self.writer.add_text("run", f"{name}: `{run_dir}`", first_step)
        for s in hparams(flat_config(config), {}):  # the HParams tab of this run (add_hparams would make another)
            self.writer.file_writer.add_summary(s)

    def log(self, step: int, values: dict[str, float]) -> None:
        # one event per step holding every scalar: what add_scalar writes, without an event per value
        summary = self._summary(value=[self._summary.Value(tag=k, simple_value=v) for k, v in values.items()])
        self.writer.file_writer.add_summary(summary, step)

    def log_text(self, key: str, text: str, step: int) -> None:
        self.writer.add_text(key, text, step)

    def log_image(self, key: str, path: Path, step: int) -> None:
        from matplotlib.image import imread

        self.writer.add_image(key, imread(path)[..., :3], step, dataformats="HWC")  # [H, W, 3] of [0, 1]

    def close(self, ok: bool) -> None:
        self.writer.close()


class WandB(Tracker):
    """A wandb run in $WANDB_DIR or RUN/wandb; its mode (online, offline) is the user's wandb settings'."""

    kind = "wandb"

    def __init__(self, run_dir: Path, name: str, config: dict, first_step: int, state: dict | None, project: str = "",
                 entity: str = ""):
        import wandb

        self.wandb = wandb
        state = state or {}  # a reopened run: in the project and entity it was made in
        self.run = wandb.init(
            project=state.get("project") or project_name(self.kind, project),
            entity=state.get("entity") or entity_name(self.kind, entity), name=name, id=state.get("id"),
            resume="allow" if state else None, dir=os.environ.get("WANDB_DIR") or str(run_dir),
            config={**config, "run_dir": str(run_dir)}, allow_val_change=True,  # a resume may change the config
            settings=wandb.Settings(reinit="create_new", console="off"))  # arms in lockstep: one run each

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def log_text(self, key: str, text: str, step: int) -> None:
        tables = markdown_tables(text)
        self.run.log({f"{key}/{i}" if len(tables) > 1 else key: self.wandb.Table(columns=cols, data=rows)
                      for i, (cols, rows) in enumerate(tables)}, step=step)

    def log_image(self, key: str, path: Path, step: int) -> None:
        self.run.log({key: self.wandb.Image(str(path))}, step=step)

    def close(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)

    def state(self) -> dict:
        return {"id": self.run.id, "project": self.run.project, "entity": self.run.entity}


class Trackio(Tracker):
    """A run of a Trackio project in trackio's local store (or where $TRACKIO_SPACE_ID / $TRACKIO_SERVER_URL send
    it); trackio reopens a run by its name, so the id is checked."""

    kind = "trackio"

    def __init__(self, run_dir: Path, name: str, config: dict, first_step: int, state: dict | None, project: str = "",
                 entity: str = ""):
        import trackio
        from trackio import context_vars

        self.trackio = trackio
        self.project = (state or {}).get("project") or project_name(self.kind, project)
        with contextlib.redirect_stdout(sys.stderr):  # its banner is not the command's output
            self.run = trackio.init(project=self.project, name=state["name"] if state else name,
                                    config={**config, "run_dir": str(run_dir)}, resume="must" if state else "never",
                                    auto_log_cpu=False, auto_log_gpu=False, embed=False)
        # trackio.init finishes the run it made last: arms trained in lockstep each keep their own
        context_vars.current_run.set(None)
        if state and self.run.id != state["id"]:
            raise TrackingError(f"{run_dir / STATE_FILE}: trackio run {state['name']!r} of project {self.project!r} is "
                                f"now {self.run.id}, not {state['id']} (another run took its name)")

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def log_text(self, key: str, text: str, step: int) -> None:
        self.run.log({key: self.trackio.Markdown(text)}, step=step)

    def log_image(self, key: str, path: Path, step: int) -> None:
        self.run.log({key: self.trackio.Image(str(path))}, step=step)

    def close(self, ok: bool) -> None:
        with contextlib.redirect_stdout(sys.stderr):
            self.run.finish()

    def state(self) -> dict:
        return {"id": self.run.id, "name": self.run.name, "project": self.project}


class MLflow(Tracker):
    """An MLflow run in RUN/mlflow (SQLite, artifacts beside it) or at $MLFLOW_TRACKING_URI. Parameters are
    logged once: MLflow refuses to change one, so a resumed run's config changes are in config_history.jsonl."""

    kind = "mlflow"

    def __init__(self, run_dir: Path, name: str, config: dict, first_step: int, state: dict | None, project: str = "",
                 entity: str = ""):
        # MLflow reports its usage online unless told not to (read when it is imported); the user's own setting wins
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._metric = Metric
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        local = run_dir / "mlflow"
        if not uri:
            local.mkdir(exist_ok=True)
            uri = f"sqlite:///{(local / 'mlflow.db').resolve()}"
        self.client = MlflowClient(tracking_uri=uri)
        if state:
            self.id = state["id"]
            self.client.update_run(self.id, status="RUNNING")
            return
        experiment = project_name(self.kind, project)
        found = self.client.get_experiment_by_name(experiment)
        eid = found.experiment_id if found else self.client.create_experiment(
            experiment, artifact_location=None if os.environ.get("MLFLOW_TRACKING_URI")
            else (local / "artifacts").resolve().as_uri())
        self.id = self.client.create_run(eid, run_name=name, tags={"run_dir": str(run_dir)}).info.run_id
        params = [Param(k, str(v)) for k, v in flat_config(config).items()]
        for i in range(0, len(params), 100):  # MLflow takes 100 parameters a call
            self.client.log_batch(self.id, params=params[i : i + 100])

    def log(self, step: int, values: dict[str, float]) -> None:
        ms = int(time.time() * 1000)
        # queued, written by MLflow's logging thread: a synchronous SQLite write would hold up every step
        self.client.log_batch(self.id, metrics=[self._metric(k, v, ms, step) for k, v in values.items()],
                              synchronous=False)

    def log_text(self, key: str, text: str, step: int) -> None:
        self.client.log_text(self.id, text, f"{key}.md")

    def log_image(self, key: str, path: Path, step: int) -> None:
        self.client.log_artifact(self.id, str(path), str(Path(key).parent) if "/" in key else None)

    def close(self, ok: bool) -> None:
        self.client.set_terminated(self.id, "FINISHED" if ok else "FAILED")  # waits for the queued metrics

    def state(self) -> dict:
        return {"id": self.id}


BACKENDS: dict[str, type[Tracker]] = {"tensorboard": TensorBoard, "wandb": WandB, "trackio": Trackio,
                                      "mlflow": MLflow}


# ----------------------------------------------------------------------------- a run folder's trackers
class Trackers:
    """The trackers of one run folder. ``done[kind]``: the last step a reopened tracker already holds
    (it takes only later steps, unless it ``rewrites``)."""

    def __init__(self, items: list[Tracker], done: dict[str, int] | None = None):
        self.items, self.done = items, done or {}

    def log(self, record: dict) -> None:
        """One logged record of ``metrics.jsonl`` (its ``step`` and numbers) to every tracker."""
        if not self.items:
            return
        step, values = int(record["step"]), scalars(record)
        for t in self.items:
            if t.rewrites or step > self.done.get(t.kind, -1):
                t.log(step, values)

    def log_report(self, files: Sequence[Path], root: Path, step: int = 0) -> None:
        """A report's markdown tables (``.md``) and plots (``.png``), each keyed by its path under ``root``
        without the suffix (``eval/results``)."""
        for path in files:
            key = path.relative_to(root).with_suffix("").as_posix()
            for t in self.items:
                if path.suffix == ".md":
                    t.log_text(key, path.read_text(encoding="utf-8"), step)
                elif path.suffix == ".png":
                    t.log_image(key, path, step)

    def close(self, ok: bool = True) -> None:
        for t in self.items:
            t.close(ok)
        self.items = []


def open_trackers(names: Sequence[str], run_dir: Path, *, name: str, config: dict, first_step: int = 0,
                  resume: bool = False, logged: int = 0, project: str = "", entity: str = "") -> Trackers:
    """The trackers ``names`` for the run folder ``run_dir`` (its run ``name``; ``config`` as hyper-parameters).
    ``first_step``: the first step this session logs. ``resume``: reopen the runs ``trackers.json`` names
    (a tracker it does not name starts a new run), ``logged`` the last step ``metrics.jsonl`` held before it
    was cut back. ``project`` / ``entity``: ``train.project`` / ``train.entity`` ("": each tracker's environment
    variable, else the default; ``project_name``). Writes ``trackers.json``."""
    if not names:
        return Trackers([])
    check_installed(names, "report_to")
    run_dir = Path(run_dir)
    path = run_dir / STATE_FILE
    saved = {}
    if resume and path.is_file():
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise TrackingError(f"{path}: unreadable ({e}); delete it to start new tracked runs") from None
    opened: list[Tracker] = []
    try:
        for n in names:
            try:
                opened.append(BACKENDS[n](run_dir, name, config, first_step, saved.get(n), project, entity))
            except TrackingError:
                raise
            except Exception as e:  # the library's own error (a store, a login, a lost run), said in one line
                again = f" (reopening {saved[n]} of {path})" if n in saved else ""
                raise TrackingError(f"{n} could not open its run{again}: {type(e).__name__}: {e}") from e
    except BaseException:
        for t in opened:
            t.close(ok=False)
        raise
    # a resumed run keeps the ids of trackers it does not use now, to reopen them later
    path.write_text(json.dumps({**saved, **{t.kind: t.state() for t in opened}}, indent=1) + "\n")
    return Trackers(opened, {n: logged for n in saved if n in names})


def log_report(names: Sequence[str], folder: Path, files: Sequence[Path], config: dict) -> None:
    """A report folder's tables and plots (``files``, under ``folder``) as one tracked run named after it."""
    trackers = open_trackers(names, folder, name=Path(folder).resolve().name, config=config)
    ok = False
    try:
        trackers.log_report(files, folder)
        ok = True
    finally:
        trackers.close(ok)


def report_files(folder: Path) -> list[Path]:
    """The markdown reports and PNG plots of a report folder and its ``eval/``."""
    folder = Path(folder)
    return sorted(p for pattern in ("*.md", "*.png", "eval/*.md", "eval/*.png") for p in folder.glob(pattern))
