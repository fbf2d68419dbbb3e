"""Experiment trackers (``train.report_to``, ``--report-to``), read back with each tracker's own library, offline:
what a run logged equals ``metrics.jsonl``; a killed and resumed run holds each step once, in the same tracked
run; a report's tables and plots arrive; a tracker that is not installed is refused in one line before any work.
Every store is under the test's tmp folder (wandb offline, trackio's $TRACKIO_DIR, mlflow in the run folder)."""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from tests.conftest import COUNT_CONVS
from tests.test_train import _cfg as train_cfg
from vatspec.cli import main
from vatspec.config import TRACKERS, ConfigError, load_config
from vatspec.train import tracking, train

FLOAT32_REL = 1e-6  # TensorBoard keeps scalars as float32: 2^-24 ~ 6e-8 relative, with room
RESUME_REL = 1e-6  # a resumed step recomputes the uninterrupted one (tests/test_train.py's tolerance)
MEASURED = ("tokens_per_s", "peak_memory_mib")  # timings and memory, not computed: a step run again differs


class Killed(Exception):
    """Stands for a kill: raised after step 3 is logged, past the step-2 checkpoint."""


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """Every tracker's store under tmp, offline, for the whole module (nothing touches ~/)."""
    root = tmp_path_factory.mktemp("stores")
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": root / "wandb",
           "WANDB_CONFIG_DIR": root / "wandb-config", "WANDB_CACHE_DIR": root / "wandb-cache",
           "WANDB_DATA_DIR": root / "wandb-data", "TRACKIO_DIR": root / "trackio"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            if isinstance(v, Path):
                v.mkdir()
            mp.setenv(k, str(v))
        for k in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_DISABLE_TELEMETRY", "WANDB_PROJECT",
                  "WANDB_ENTITY", "WANDB_API_KEY", "TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL"):
            mp.delenv(k, raising=False)
        import trackio  # noqa: F401  its modules read $TRACKIO_DIR once, when first imported: set them all

        for name, mod in list(sys.modules.items()):
            if name.startswith("trackio"):
                for attr, sub in (("TRACKIO_DIR", "."), ("MEDIA_DIR", "media"), ("ARTIFACTS_DIR", "artifacts")):
                    if hasattr(mod, attr):
                        mp.setattr(mod, attr, (root / "trackio" / sub).resolve())
        yield root


def _cfg(tiny_target_dir, data_file, out_dir, *extra):
    """test_train's tiny run, VAT, every tracker, a checkpoint and a held-out evaluation every 2 of its 4 steps."""
    return train_cfg(tiny_target_dir, data_file, out_dir, "loss.kind=vat", f"train.report_to={','.join(TRACKERS)}",
                     "train.save_every=2", "train.eval_every=2", *extra)


@pytest.fixture(scope="module")
def runs(stores, tiny_target_dir, tmp_path_factory):
    """``full``: 4 steps, held-out evaluations at 2 and 4. ``part``: the same run killed after logging step 3
    (its last checkpoint: step 2), then resumed. ``ids``: part's trackers.json after the kill and at the end."""
    root = tmp_path_factory.mktemp("runs")
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in COUNT_CONVS))
    train(_cfg(tiny_target_dir, data, root / "full"), progress=False)

    def kill_after_step_3(arm, record):
        if record["step"] == 3:
            raise Killed

    part = root / "part"
    with pytest.raises(Killed):
        train(_cfg(tiny_target_dir, data, part), progress=False, on_log=kill_after_step_3)
    killed = json.loads((part / tracking.STATE_FILE).read_text())
    assert [json.loads(line)["step"] for line in (part / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    train(_cfg(tiny_target_dir, data, part), resume=True, progress=False)
    return {"full": root / "full", "part": part,
            "ids": (killed, json.loads((part / tracking.STATE_FILE).read_text()))}


# ----------------------------------------------------------------------------- readers, one per tracker
def _state(run: Path, kind: str) -> dict:
    return json.loads((run / tracking.STATE_FILE).read_text())[kind]


def _tb(folder: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(folder / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    ea.Reload()  # purges what a restart (purge_step) dropped
    return ea


def _wandb_records(run: Path, kind: str):
    """The records of every offline run folder of ``run``'s wandb id (a resume adds one), in order. The
    transaction log is LevelDB's log format (32 KiB blocks of [crc32 u32, length u16, type u8, data]; type
    1 = whole, 2-4 = first / middle / last piece) after a 7-byte header; each record is wandb's own protobuf
    ``Record``. wandb 0.31 ships no Python reader for it (wandb-core, in Go, reads it)."""
    import os

    from wandb.proto.wandb_internal_pb2 import Record

    rid = _state(run, "wandb")["id"]
    files = sorted(Path(os.environ["WANDB_DIR"], "wandb").glob(f"offline-run-*-{rid}/run-{rid}.wandb"))
    assert files, f"no offline wandb run {rid}"
    for f in files:
        data, pos, piece = f.read_bytes(), 7, b""
        assert data[:4] == b":W&B", f
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
                pos += 32768 - pos % 32768
                continue
            _, length, kind_ = struct.unpack("<IHB", data[pos : pos + 7])
            piece += data[pos + 7 : pos + 7 + length]
            pos += 7 + length
            if kind_ in (1, 4):
                rec = Record()
                rec.ParseFromString(piece)
                piece = b""
                if rec.WhichOneof("record_type") == kind:
                    yield f, getattr(rec, kind)


def read_tensorboard(run: Path) -> list[tuple]:
    ea = _tb(run)
    return [(e.step, tag, e.value) for tag in ea.Tags()["scalars"] for e in ea.Scalars(tag)]


def _wandb_key(item) -> str:
    return item.key or "/".join(item.nested_key)  # wandb may keep "a/b" as the nested key [a, b]


def read_wandb(run: Path) -> list[tuple]:
    return [(h.step.num, _wandb_key(i), json.loads(i.value_json)) for _, h in _wandb_records(run, "history")
            for i in h.item if not _wandb_key(i).startswith("_")]


def read_trackio(run: Path) -> list[tuple]:
    from trackio.sqlite_storage import SQLiteStorage

    rows = SQLiteStorage.get_logs(tracking.PROJECT, run_id=_state(run, "trackio")["id"])
    return [(r["step"], k, v) for r in rows for k, v in r.items() if k not in ("step", "timestamp")]


def _mlflow(run: Path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{(run / 'mlflow' / 'mlflow.db').resolve()}"  # where the run folder keeps it by default
    return MlflowClient(tracking_uri=uri), _state(run, "mlflow")["id"]


def read_mlflow(run: Path) -> list[tuple]:
    client, rid = _mlflow(run)
    return [(m.step, k, m.value) for k in client.get_run(rid).data.metrics for m in client.get_metric_history(rid, k)]


READERS = {"tensorboard": read_tensorboard, "wandb": read_wandb, "trackio": read_trackio, "mlflow": read_mlflow}


def hyperparameters(kind: str, run: Path) -> tuple[object, str]:
    """(``train.steps``, the run folder) as the tracker holds the config."""
    if kind == "tensorboard":
        from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

        start = HParamsPluginData.FromString(_tb(run).PluginTagToContent("hparams")["_hparams_/session_start_info"])
        hp = start.session_start_info.hparams
        text = _tb(run).Tensors("run/text_summary")[0].tensor_proto.string_val[0].decode()
        return hp["train.steps"].number_value, text
    if kind == "wandb":
        cfg = {u.key: json.loads(u.value_json) for _, r in _wandb_records(run, "run") for u in r.config.update}
        return cfg["train"]["steps"], cfg["run_dir"]
    if kind == "trackio":
        from trackio.sqlite_storage import SQLiteStorage

        s = _state(run, "trackio")
        cfg = SQLiteStorage.get_run_config(tracking.PROJECT, s["name"], run_id=s["id"])
        return cfg["train"]["steps"], cfg["run_dir"]
    client, rid = _mlflow(run)
    data = client.get_run(rid).data
    return data.params["train.steps"], data.tags["run_dir"]


def _by_step_and_key(entries: list[tuple]) -> dict[tuple[int, str], list[float]]:
    held = defaultdict(list)
    for step, key, value in entries:
        held[(int(step), key)].append(value)
    return held


def _logged(run: Path) -> dict[tuple[int, str], float]:
    """What metrics.jsonl holds, as the trackers get it (``tracking.scalars``)."""
    from vatspec.train.checkpointer import read_metrics

    records = read_metrics(run / "metrics.jsonl")
    return {(r["step"], k): v for r in records for k, v in tracking.scalars(r).items()}


def _same(a: float, b: float, rel: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=rel, abs=0)


# ----------------------------------------------------------------------------- tests
def test_a_record_is_flattened_to_one_scalar_per_position():
    record = {"step": 3, "loss": 0.5, "train/acc": [0.9, 0.7], "chains": 12, "note": "x", "ok": True}
    assert tracking.scalars(record) == {"loss": 0.5, "train/acc/0": 0.9, "train/acc/1": 0.7, "chains": 12.0}


def test_report_to_reads_a_list_or_commas_and_refuses_an_unknown_name():
    assert load_config(None, ["train.report_to=tensorboard,wandb"]).train.report_to == ("tensorboard", "wandb")
    assert load_config(None, ["train.report_to=[mlflow, trackio]"]).train.report_to == ("mlflow", "trackio")
    assert load_config(None, ["train.report_to=none"]).train.report_to == () == load_config().train.report_to
    with pytest.raises(ConfigError, match=r"train.report_to: unknown tracker 'tensorbord' \(choose from "
                                          r"tensorboard, wandb, trackio, mlflow, or none\)"):
        load_config(None, ["train.report_to=tensorbord"])


@pytest.mark.parametrize("kind", TRACKERS)
def test_each_tracker_holds_what_metrics_jsonl_holds(runs, kind):
    """Every number of every logged step (losses and their parts, lr, tau_sim, per-position acceptance, held-out
    evaluations, tokens/s, peak memory) once, at its step, equal to metrics.jsonl's; the config and run folder."""
    run = runs["full"]
    want, held = _logged(run), _by_step_and_key(READERS[kind](run))
    assert {"loss", "lr", "train/tau_sim", "train/acc/2", "train/cond_acc/0", "eval/tau_sim", "tokens_per_s",
            "peak_memory_mib"} <= {k for _, k in want}
    assert sorted(held) == sorted(want)
    assert [k for k, v in held.items() if len(v) != 1] == []
    rel = FLOAT32_REL if kind == "tensorboard" else 0
    assert [k for k, v in want.items() if not _same(held[k][0], v, rel)] == []
    steps, where = hyperparameters(kind, run)
    assert float(steps) == 4 and str(run) in where
    if kind == "mlflow":  # MLflow's usage reports online are off unless the user turns them on
        assert os.environ["MLFLOW_DISABLE_TELEMETRY"] == "true"


@pytest.mark.parametrize("kind", TRACKERS)
def test_a_killed_and_resumed_run_holds_each_step_once_in_the_same_tracked_run(runs, kind):
    """Killed after step 3 (checkpoint at 2), resumed: steps 1-4 once each. TensorBoard drops 3 and takes it again;
    wandb, Trackio and MLflow keep the step 3 they hold, which the resumed run computes to the same values."""
    killed, resumed = runs["ids"]
    assert killed[kind] == resumed[kind]  # the same tracked run (its id in trackers.json)
    run = runs["part"]
    want, held = _logged(run), _by_step_and_key(READERS[kind](run))
    assert sorted(held) == sorted(want)
    assert {s for s, _ in held} == {1, 2, 3, 4}
    assert [k for k, v in held.items() if len(v) != 1] == []
    assert [k for k, v in want.items() if k[1] not in MEASURED and not _same(held[k][0], v, RESUME_REL)] == []
    full = _logged(runs["full"])  # and the uninterrupted run's values
    assert [k for k, v in full.items() if k[1] not in MEASURED and not _same(held[k][0], v, RESUME_REL)] == []


@pytest.mark.parametrize("kind", TRACKERS)
def test_a_report_s_tables_and_plots_reach_each_tracker(stores, tmp_path, kind):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = tmp_path / "eval-report"
    (folder / "eval").mkdir(parents=True)
    table = ("# speed\n\n| method | tau | speedup |\n| --- | ---: | ---: |\n| vat | 2.50 | 1.80 |\n"
             "| base | 2.10 | 1.50 |\n")
    (folder / "results.md").write_text(table)
    fig, ax = plt.subplots(figsize=(2, 1), dpi=50)
    ax.plot([0, 1], [1, 2])
    fig.savefig(folder / "eval" / "tau.png")
    plt.close(fig)
    tracking.log_report([kind], folder, tracking.report_files(folder), {"temperature": 0.0})

    if kind == "tensorboard":
        ea = _tb(folder)
        assert ea.Tensors("results/text_summary")[0].tensor_proto.string_val[0].decode() == table
        image = ea.Images("eval/tau")[0]
        assert (image.width, image.height) == (100, 50)
    elif kind == "wandb":
        items = {_wandb_key(i): json.loads(i.value_json) for _, h in _wandb_records(folder, "history") for i in h.item}
        assert items["results/_type"] == "table-file" and items["eval/tau/_type"] == "image-file"
        run_folder = next(_wandb_records(folder, "history"))[0].parent
        saved = json.loads((run_folder / "files" / items["results/path"]).read_text())
        assert saved["columns"] == ["method", "tau", "speedup"]
        assert saved["data"] == [["vat", "2.50", "1.80"], ["base", "2.10", "1.50"]]
    elif kind == "trackio":
        from trackio.sqlite_storage import SQLiteStorage

        rows = SQLiteStorage.get_logs(tracking.PROJECT, run_id=_state(folder, "trackio")["id"])
        (text,) = [r["results"] for r in rows if "results" in r]
        (image,) = [r["eval/tau"] for r in rows if "eval/tau" in r]
        assert text == {"_type": "trackio.markdown", "_value": table}, rows
        assert image["_type"] == "trackio.image" and (stores / "trackio" / "media" / image["file_path"]).is_file()
    else:
        client, rid = _mlflow(folder)
        assert client.download_artifacts(rid, "results.md", str(tmp_path)) and \
            (tmp_path / "results.md").read_text() == table
        assert [f.path for f in client.list_artifacts(rid, "eval")] == ["eval/tau.png"]


def test_a_tracker_that_is_not_installed_is_refused_in_one_line_before_any_work(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` finds where it is not installed
    run = tmp_path / "run"
    rc = main(["train", "target.path=default", f"data.train={tmp_path / 'absent.jsonl'}", f"train.out_dir={run}",
               "train.report_to=tensorboard,wandb", "--no-progress"])
    assert rc == 2
    assert capsys.readouterr().err == ("vatspec train: error: train.report_to: wandb is not installed (no module "
                                       "'wandb'); pip install 'vatspec[wandb]'\n")
    assert not run.exists()
    for command in (["eval", "--target", "default"], ["demo"], ["ablate"]):
        with pytest.raises(SystemExit) as e:
            main([*command, "--report-to", "wandb"])
        assert e.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1] == (
            f"vatspec {command[0]}: error: argument --report-to: wandb is not installed (no module 'wandb'); "
            "pip install 'vatspec[wandb]'")


def test_demo_and_ablate_arms_log_to_the_trackers_asked_for(tmp_path):
    from vatspec_recipes.demo import with_trackers
    from vatspec_recipes.experiment import arm_configs
    from vatspec_recipes.recipe import load_recipe

    recipe = load_recipe("demo-quick")
    cfgs = arm_configs(with_trackers(recipe, ("tensorboard", "mlflow")).arms, recipe.size, tmp_path / "d.jsonl",
                       tmp_path / "runs")
    assert [c.train.report_to for c in cfgs] == [("tensorboard", "mlflow")] * len(recipe.arms)
    assert with_trackers(recipe, ()) is recipe


def test_a_tracked_run_that_cannot_be_reopened_is_named_in_one_line(monkeypatch, tmp_path):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / tracking.STATE_FILE).write_text(json.dumps({"mlflow": {"id": "f00d"}}))
    with pytest.raises(tracking.TrackingError, match=r"^mlflow could not open its run \(reopening \{'id': 'f00d'\} of "
                                                     rf"{tmp_path / tracking.STATE_FILE}\): MlflowException: "):
        tracking.open_trackers(["mlflow"], tmp_path, name="run", config={}, first_step=3, resume=True, logged=4)


# each tracker's own environment variable for its project (Trackio reads none), written out here
PROJECT_ENV = {"wandb": "WANDB_PROJECT", "trackio": None, "mlflow": "MLFLOW_EXPERIMENT_NAME"}


def held_project(kind: str, folder: Path) -> tuple[str, str | None]:
    """(project, entity) of the run the tracker's own store holds for ``folder`` (MLflow: the experiment)."""
    if kind == "wandb":
        (run,) = [r for _, r in _wandb_records(folder, "run")][-1:]
        return run.project, run.entity or None
    if kind == "trackio":
        from trackio.sqlite_storage import SQLiteStorage

        s = _state(folder, "trackio")
        (project,) = [p for p in SQLiteStorage.get_projects()
                      if SQLiteStorage.get_run_config(p, s["name"], run_id=s["id"])]
        return project, None
    client, rid = _mlflow(folder)
    return client.get_experiment(client.get_run(rid).info.experiment_id).name, None


def log_one_step(trackers, step: int = 1) -> None:
    """A step logged (a Trackio run without one is not stored), then the trackers closed."""
    trackers.log({"step": step, "loss": 0.5})
    trackers.close()


@pytest.mark.parametrize("kind", ["wandb", "trackio", "mlflow"])
def test_the_project_is_the_config_s_else_the_tracker_s_environment_variable_else_vatspec(stores, tmp_path, kind,
                                                                                         monkeypatch):
    env = PROJECT_ENV[kind]
    cases = [("", None, "vatspec"), ("", "from-env", "from-env" if env else "vatspec"),
             ("from-config", "from-env", "from-config")]
    for i, (project, from_env, want) in enumerate(cases):
        if env and from_env:
            monkeypatch.setenv(env, from_env)
        folder = tmp_path / f"{kind}-{i}"
        folder.mkdir()
        log_one_step(tracking.open_trackers([kind], folder, name=folder.name, config={"x": 1}, project=project))
        assert held_project(kind, folder)[0] == want, (project, from_env)


def test_wandb_takes_its_entity_from_the_config_else_wandb_entity(stores, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_ENTITY", "team-from-env")
    for name, entity, want in (("env", "", "team-from-env"), ("config", "team-from-config", "team-from-config")):
        (tmp_path / name).mkdir()
        log_one_step(tracking.open_trackers(["wandb"], tmp_path / name, name=name, config={}, entity=entity))
        assert held_project("wandb", tmp_path / name)[1] == want


def test_a_training_run_logs_to_train_project(stores, tiny_target_dir, tmp_path, monkeypatch):
    """``train.project`` reaches the trackers of a training run, over $MLFLOW_EXPERIMENT_NAME."""
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-env")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in COUNT_CONVS))
    run = tmp_path / "run"
    train(train_cfg(tiny_target_dir, data, run, "train.report_to=mlflow", "train.project=from-config",
                    "train.steps=1"), progress=False)
    assert held_project("mlflow", run)[0] == "from-config"


def test_a_reopened_run_stays_in_its_project(stores, tmp_path, monkeypatch):
    """A resumed run reopens its tracked run in the project it was made in, whatever the environment says now."""
    monkeypatch.setenv("WANDB_PROJECT", "first")
    log_one_step(tracking.open_trackers(["wandb", "trackio"], tmp_path, name="run", config={}, project=""))
    made = json.loads((tmp_path / tracking.STATE_FILE).read_text())
    monkeypatch.setenv("WANDB_PROJECT", "second")
    log_one_step(tracking.open_trackers(["wandb", "trackio"], tmp_path, name="run", config={}, project="other",
                                        resume=True, logged=0), step=2)
    assert json.loads((tmp_path / tracking.STATE_FILE).read_text()) == made  # the same runs
    assert held_project("wandb", tmp_path)[0] == "first" and held_project("trackio", tmp_path)[0] == "vatspec"
