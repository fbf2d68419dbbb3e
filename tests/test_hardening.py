"""Bad inputs and faults, as a user meets them (issue 19): for every case the exit status, a message
naming the field or file, no traceback, and every file that was there before byte-identical after.

Tiny Llama targets saved with the SmolLM2 tokenizer; the commands run in-process (``vatspec.cli.main``),
except the kill -9 tests, which need a process to kill."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from tests.conftest import COUNT_CONVS
from vatspec.cli import main
from vatspec.config import load_config
from vatspec.train import heldout_split, train

pytestmark = pytest.mark.usefixtures("one_thread")

CONVS = COUNT_CONVS
TINY = ["data.batch_size=2", "data.max_length=64", "drafter.draft_vocab_size=256", "drafter.ttt_steps=3",
        "drafter.block_size=4", "drafter.num_anchors=4", "optim.lr=1e-3"]


def jsonl(records) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


@pytest.fixture(scope="module")
def target_dir(smol_tokenizer_target) -> Path:
    """The shared tiny Llama with the SmolLM2 tokenizer (chat template), as a local HF folder."""
    return Path(smol_tokenizer_target.path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, target_dir):
    """Finished two-step runs of each drafter kind (copied into a test's folder before use)."""
    root = tmp_path_factory.mktemp("runs")
    (root / "train.jsonl").write_text(jsonl(CONVS))
    for kind in ("eagle3", "dflash"):
        cfg = load_config(None, [f"target.path={target_dir}", f"data.train={root / 'train.jsonl'}", *TINY,
                                 f"drafter.kind={kind}", "train.steps=2", f"train.out_dir={root / kind}"])
        train(cfg, progress=False)
    return root


@dataclass
class Env:
    tmp: Path
    target: Path
    runs: Path

    @property
    def data(self) -> Path:
        return self.tmp / "train.jsonl"

    def run(self, kind: str = "eagle3") -> Path:
        """A copy of a finished run in this test's folder."""
        dst = self.tmp / f"run-{kind}"
        if not dst.exists():
            shutil.copytree(self.runs / kind, dst)
        return dst

    def train(self, *extra: str) -> list[str]:
        return ["train", f"target.path={self.target}", f"data.train={self.data}", *TINY,
                f"train.out_dir={self.tmp / 'out'}", "--no-progress", *extra]


def checksums(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def cli(argv: list[str], capsys) -> tuple[int, str]:
    """``vatspec ARGV`` in-process -> (exit status, stdout + stderr)."""
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    cap = capsys.readouterr()
    return rc, cap.out + cap.err


# ----------------------------------------------------------------------------- the cases
def _notes(env):  # a user's file with a last line that has no newline: the first thing a careless resume cuts
    (env.tmp / "notes.txt").write_text("my notes\nthe last line, no newline")


def _complete_json_without_newline(env):  # a user's one-record file: complete, so no interrupted write
    (env.tmp / "mine.jsonl").write_text('{"id": "x", "messages": [], "meta": {"finish": []}, "note": "mine"}')


def _one_token(env):
    (env.tmp / "one.jsonl").write_text(jsonl(
        {"id": f"o{i}", "conversations": [{"from": "human", "value": f"Say {i}"}, {"from": "gpt", "value": ""}]}
        for i in range(6)))


def _not_utf8(env):
    env.data.write_bytes(env.data.read_bytes() + b'{"prompt": "caf\xe9", "response": "ok"}\n')


def _no_weights(env):
    (env.tmp / "noweights").mkdir()
    for f in env.target.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, env.tmp / "noweights" / f.name)


def _bad_config(env):
    shutil.copytree(env.target, env.tmp / "badjson")
    (env.tmp / "badjson" / "config.json").write_text('{"model_type": "llama", ')


def _truncated_drafter(env):
    f = env.run() / "checkpoints" / "step-000002" / "drafter.safetensors"
    f.write_bytes(f.read_bytes()[:100])


def _drafter_json_without_kind(env):
    f = env.run() / "checkpoints" / "step-000002" / "drafter.json"
    meta = json.loads(f.read_text())
    f.write_text(json.dumps({"config": meta["config"]}))


def _drafter_json_not_json(env):
    (env.run() / "checkpoints" / "step-000002" / "drafter.json").write_text("{not json")


def _long_heldout(env):
    """The conversation the held-out split takes gets a prompt longer than data.max_length."""
    cfg = load_config(None, [f"data.train={env.data}", *TINY])
    _, held = heldout_split(list(range(len(CONVS))), cfg.data, cfg.train.seed)
    convs = [dict(c) for c in CONVS]
    for i in held:
        convs[i] = {"id": f"long{i}", "conversations": [{"from": "human", "value": "word " * 80},
                                                        {"from": "gpt", "value": "ok"}]}
    env.data.write_text(jsonl(convs))


def _user_folder(name):
    def setup(env):
        (env.tmp / name).mkdir()
        (env.tmp / name / "results.md").write_text("my own results")
        (env.tmp / name / "config.yaml").write_text("mine: true\n")

    return setup


def _unrelated_jsonl(env):
    (env.tmp / "mine.jsonl").write_text(jsonl([{"prompt": "my own prompt"}]))


@dataclass
class Case:
    id: str
    argv: Callable[[Env], list]
    rc: int
    names: Callable[[Env], list[str]]  # what the message must name
    setup: Callable[[Env], None] | None = None
    gpu: bool = False  # only where no GPU is available
    fast: float | None = None  # seconds the command may take at most
    extra: dict = field(default_factory=dict)


CASES = [
    # security: the planted pickle has its own tests below
    # data loss
    Case("regenerate --out an unrelated file", lambda e: ["regenerate", e.data, "--out", e.tmp / "notes.txt",
                                                          "--target", e.target], 2, lambda e: ["notes.txt"], _notes),
    Case("regenerate --out a file whose last line is complete JSON", lambda e: [
        "regenerate", e.data, "--out", e.tmp / "mine.jsonl", "--target", e.target], 2, lambda e: ["mine.jsonl"],
        _complete_json_without_newline),
    Case("regenerate --out the input", lambda e: ["regenerate", e.data, "--out", e.data, "--target", e.target], 2,
         lambda e: ["train.jsonl", "is the input"]),
    Case("export RUN --out RUN --force", lambda e: ["export", e.run(), "--out", e.run(), "--force"], 2,
         lambda e: ["run-eagle3", "is the input"]),
    Case("export RUN --out inside RUN --force", lambda e: ["export", e.run(), "--out", e.run() / "checkpoints",
                                                           "--force"], 2, lambda e: ["inside the input"]),
    Case("export --force over a folder export did not make", lambda e: ["export", e.run(), "--out", e.tmp / "user",
                                                                        "--force"], 2,
         lambda e: ["user", "is not an exported draft"], _user_folder("user")),
    Case("eval --out a user's folder", lambda e: ["eval", "--target", e.target, "--bench", "gsm8k", "--out",
                                                  e.tmp / "user"], 2, lambda e: ["user", "not empty"],
         _user_folder("user")),
    Case("train into a user's folder", lambda e: [*e.train("train.steps=1")[:-2], f"train.out_dir={e.tmp / 'user'}",
                                                  "--no-progress"], 2, lambda e: ["user", "not empty"],
         _user_folder("user")),
    Case("train.out_dir is the data file", lambda e: [*e.train(), f"train.out_dir={e.data}"], 2,
         lambda e: ["train.jsonl", "is the input"]),
    Case("prepare-data --out an unrelated JSONL", lambda e: ["prepare-data", "--n", "3", "--out", e.tmp / "mine.jsonl"],
         2, lambda e: ["mine.jsonl:1"], _unrelated_jsonl),
    # silent acceptance
    Case("--init-from a draft of the other kind", lambda e: [*e.train("drafter=eagle3", "train.steps=1"),
                                                             "--init-from", e.run("dflash")], 2,
         lambda e: ["--init-from", "dflash draft", "drafter.kind"]),
    Case("train.steps=-1", lambda e: e.train("train.steps=-1"), 2, lambda e: ["train.steps", ">= 0"]),
    Case("drafter.num_anchors=0", lambda e: e.train("drafter.num_anchors=0"), 2, lambda e: ["drafter.num_anchors"]),
    Case("optim.lr=0", lambda e: e.train("optim.lr=0"), 2, lambda e: ["optim.lr", "> 0"]),
    Case("regenerate --limit -3", lambda e: ["regenerate", e.data, "--out", e.tmp / "o.jsonl", "--limit", "-3"], 2,
         lambda e: ["--limit", ">= 0"]),
    Case("regenerate --temperature -1", lambda e: ["regenerate", e.data, "--out", e.tmp / "o.jsonl",
                                                   "--temperature", "-1"], 2, lambda e: ["--temperature"]),
    Case("one-token conversations", lambda e: [*e.train(), f"data.train={e.tmp / 'one.jsonl'}"], 2,
         lambda e: ["one.jsonl", "supervised"], _one_token),
    Case("a mistyped local path without a suffix", lambda e: [*e.train(), f"data.train={e.tmp / 'trian'}"], 2,
         lambda e: ["trian", "no such file"], fast=10.0),
    Case("a mistyped relative path without a suffix", lambda e: [*e.train(), "data.train=data/trian"], 2,
         lambda e: ["data/trian", "no such file"], lambda e: (e.tmp / "data").mkdir(), fast=10.0),
    # tracebacks
    Case("non-UTF-8 input", lambda e: e.train("train.steps=1"), 2, lambda e: ["train.jsonl:25", "UTF-8"], _not_utf8),
    Case("data.batch_size=0", lambda e: e.train("data.batch_size=0"), 2, lambda e: ["data.batch_size"]),
    Case("drafter.block_size=1", lambda e: e.train("drafter=dflash", "drafter.block_size=1"), 2,
         lambda e: ["drafter.block_size"]),
    Case("drafter.ttt_steps=0", lambda e: e.train("drafter.ttt_steps=0"), 2, lambda e: ["drafter.ttt_steps"]),
    Case("optim.grad_accum=0", lambda e: e.train("optim.grad_accum=0"), 2, lambda e: ["optim.grad_accum"]),
    Case("data.heldout_fraction=1.5", lambda e: e.train("data.heldout_fraction=1.5"), 2,
         lambda e: ["data.heldout_fraction", "[0, 1)"]),
    Case("eagle3 with loss=dflash", lambda e: e.train("drafter=eagle3", "loss=dflash"), 2,
         lambda e: ["drafter.kind=eagle3 with loss.kind=dflash"]),
    Case("target.dtype=fp8", lambda e: e.train("target.dtype=fp8"), 2, lambda e: ["target.dtype"]),
    Case("target.dtype=fp16 trains", lambda e: e.train("target.dtype=fp16", "train.steps=1"), 0,
         lambda e: ["held-out: tau_sim="]),
    Case("target.device=cuda without a GPU", lambda e: e.train("target.device=cuda"), 2,
         lambda e: ["target.device", "no CUDA device"], gpu=True),
    Case("a target folder without weights", lambda e: [*e.train(), f"target.path={e.tmp / 'noweights'}"], 2,
         lambda e: ["noweights"], _no_weights),
    Case("a target folder with bad config JSON", lambda e: [*e.train(), f"target.path={e.tmp / 'badjson'}"], 2,
         lambda e: ["badjson", "config.json"], _bad_config),
    Case("a truncated drafter.safetensors", lambda e: ["export", e.run(), "--out", e.tmp / "x"], 2,
         lambda e: ["drafter.safetensors"], _truncated_drafter),
    Case("a drafter.json without kind", lambda e: ["export", e.run(), "--out", e.tmp / "x"], 2,
         lambda e: ["drafter.json"], _drafter_json_without_kind),
    Case("eval --bench nosuch", lambda e: ["eval", "--target", e.target, "--bench", "nosuch", "--out", e.tmp / "ev"],
         2, lambda e: ["nosuch"]),
    Case("regenerate --out a folder", lambda e: ["regenerate", e.data, "--out", e.tmp, "--target", e.target], 2,
         lambda e: ["is a folder"]),
    Case("regenerate --batch-size 0", lambda e: ["regenerate", e.data, "--out", e.tmp / "o.jsonl", "--batch-size",
                                                 "0"], 2, lambda e: ["--batch-size"]),
    Case("regenerate --max-new-tokens 0", lambda e: ["regenerate", e.data, "--out", e.tmp / "o.jsonl",
                                                     "--max-new-tokens", "0"], 2, lambda e: ["--max-new-tokens"]),
    Case("benchmarks --show nosuch", lambda e: ["benchmarks", "--show", "nosuch"], 2, lambda e: ["nosuch"]),
    Case("benchmarks -n 0", lambda e: ["benchmarks", "--show", "gsm8k", "-n", "0"], 2, lambda e: ["-n", ">= 1"]),
    Case("eval --max-new-tokens 0", lambda e: ["eval", "--max-new-tokens", "0"], 2, lambda e: ["--max-new-tokens"]),
    # misleading
    Case("the held-out split over data.max_length", lambda e: e.train("train.steps=1"), 2,
         lambda e: ["held-out split of", "data.max_length=64"], _long_heldout),
    Case("export of a drafter.json that is not JSON", lambda e: ["export", e.run(), "--out", e.tmp / "x"], 2,
         lambda e: ["drafter.json"], _drafter_json_not_json),
    Case("export --out .", lambda e: ["export", e.run(), "--out", "."], 2, lambda e: ["holds the input"]),
    Case("regenerate --out .", lambda e: ["regenerate", e.data, "--out", ".", "--target", e.target], 2,
         lambda e: ["is a folder"]),
    Case("an override after a flag", lambda e: ["train", "--no-progress", "train.steps=-1"], 2,
         lambda e: ["train.steps"]),
    Case("--resume of a folder with no run", lambda e: [*e.train("--resume")], 2, lambda e: ["out", "no run"]),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_and_damages_nothing(case: Case, tmp_path, target_dir, runs, capsys, monkeypatch):
    if case.gpu and torch.cuda.is_available():
        pytest.skip("a GPU is available here")
    env = Env(tmp_path, target_dir, runs)
    env.data.write_text(jsonl(CONVS))
    if case.setup:
        case.setup(env)
    argv = case.argv(env)
    monkeypatch.chdir(tmp_path)
    before = checksums(tmp_path)
    t0 = time.perf_counter()
    rc, text = cli(argv, capsys)
    seconds = time.perf_counter() - t0
    assert rc == case.rc, text
    assert "Traceback" not in text, text
    for name in case.names(env):
        assert name in text, (name, text)
    after = checksums(tmp_path)
    assert {k: after.get(k) for k in before} == before  # every file there before, byte-identical
    if case.fast is not None:
        assert seconds < case.fast, seconds


def test_export_force_replaces_an_earlier_export(tmp_path, target_dir, runs, capsys):
    env = Env(tmp_path, target_dir, runs)
    for _ in range(2):
        rc, text = cli(["export", env.run(), "--out", tmp_path / "served", "--force"], capsys)
        assert rc == 0, text


def test_eval_writes_again_into_its_own_report_folder(tmp_path, target_dir, capsys):
    """eval writes again into a folder it made (its owner file), the user's files in it kept; a folder
    it did not make (no owner file: an unowned earlier report included) is refused."""
    from vatspec.outputs import owner

    args = ["eval", "--target", target_dir, "--bench", "gsm8k", "--num-prompts", "1", "--max-new-tokens", "4",
            "--warmup", "0", "--no-hf", "--no-plots"]
    out = tmp_path / "out"
    rc, text = cli([*args, "--out", out], capsys)
    assert rc == 0, text
    assert owner(out) == "eval" and json.loads((out / "results.json").read_text())["benchmarks"] == {"gsm8k": 1}
    (out / "notes.txt").write_text("mine")  # an owned folder with the user's file in it: still eval's
    assert cli([*args, "--out", out], capsys)[0] == 0 and (out / "notes.txt").read_text() == "mine"
    old = tmp_path / "old"
    old.mkdir()
    for name in ("results.json", "results.md", "tau.png"):
        (old / name).write_text("an earlier report")
    rc, text = cli([*args, "--out", old], capsys)
    assert rc == 2 and "not made by vatspec eval" in text and (old / "results.md").read_text() == "an earlier report"


def test_debug_shows_the_traceback(tmp_path, capsys):
    with pytest.raises(Exception, match="train.steps"):
        main(["--debug", "train", "train.steps=-1"])
    with pytest.raises(Exception, match="train.steps"):
        main(["train", "train.steps=-1", "--debug"])


def test_an_unexpected_error_is_one_line_with_a_hint(monkeypatch, capsys):
    from vatspec.commands import benchmarks

    def boom(args):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(benchmarks, "run", boom)
    rc, text = cli(["benchmarks"], capsys)
    assert rc == 1 and "Traceback" not in text and "internal error (ZeroDivisionError: a bug)" in text
    assert "--debug" in text


# ----------------------------------------------------------------------------- pickles
class Planted:
    """Unpickling this writes a marker file: what a malicious trainer.pt does."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def test_a_planted_trainer_pt_is_never_unpickled(tmp_path, target_dir, runs, capsys):
    """A checkpoint whose trainer state is a pickle (what a malicious folder holds) is refused unread."""
    env = Env(tmp_path, target_dir, runs)
    env.data.write_text(jsonl(CONVS))
    run, marker = env.run(), tmp_path / "marker"
    ck = run / "checkpoints" / "step-000002"
    (ck / "trainer.json").unlink()
    (ck / "trainer.safetensors").unlink()
    torch.save({"step": 2, "payload": Planted(marker)}, ck / "trainer.pt")
    before = checksums(tmp_path)
    rc, text = cli([*env.train("train.steps=4", "--resume"), f"train.out_dir={run}"], capsys)
    assert rc == 2 and "Traceback" not in text and "trainer.json is missing: cannot resume" in text, text
    assert not marker.exists()
    assert checksums(tmp_path) == before


# ----------------------------------------------------------------------------- what runs, counted and resumed
def test_skipped_and_dropped_records_are_counted_in_the_run_folder(tmp_path, target_dir, capsys):
    env = Env(tmp_path, target_dir, None)
    long = {"id": "long", "conversations": [{"from": "human", "value": "word " * 80}, {"from": "gpt", "value": "a"}]}
    short = {"id": "short", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": ""}]}
    env.data.write_bytes(jsonl([*CONVS, long, short]).encode() + b'{"prompt": "\xff"}\n')
    rc, text = cli(env.train("train.steps=1", "data.skip_bad=true", "data.heldout_max=1"), capsys)
    assert rc == 0, text
    stats = json.loads((tmp_path / "out" / "data_stats.json").read_text())
    assert stats["data.train"]["records"] == 27 and stats["data.train"]["bad"] == 1
    split = [stats["train"], stats["heldout"]]
    assert sum(s["conversations"] for s in split) == 26
    assert sum(s["dropped_over_length"] for s in split) == 1 and sum(s["dropped_too_short"] for s in split) == 1
    assert "1 bad skipped" in text and "data_stats.json" in text


def test_a_clamped_draft_vocab_is_the_saved_one(tmp_path, target_dir, capsys):
    from vatspec.checkpoint import saved_config

    env = Env(tmp_path, target_dir, None)
    env.data.write_text(jsonl(CONVS))
    rc, text = cli([*env.train("train.steps=1"), "drafter.draft_vocab_size=10000000"], capsys)
    assert rc == 0, text
    vocab = json.loads((target_dir / "config.json").read_text())["vocab_size"]
    assert saved_config(tmp_path / "out").drafter.draft_vocab_size == vocab
    assert load_config(tmp_path / "out" / "config.yaml").drafter.draft_vocab_size == vocab


def test_resume_of_a_finished_run_is_a_no_op(tmp_path, target_dir, runs, capsys):
    env = Env(tmp_path, target_dir, runs)
    env.data.write_text(jsonl(CONVS))
    run = env.run()
    before = checksums(tmp_path)
    rc, text = cli([*env.train("train.steps=2", "--resume"), f"train.out_dir={run}"], capsys)
    assert rc == 0 and text.strip() == f"{run}: the run finished at step 2; nothing to resume"
    assert checksums(tmp_path) == before


def test_a_rerun_cuts_metrics_back_to_the_checkpoint(tmp_path, target_dir, runs, capsys):
    """A run killed after step 3 with its checkpoint at step 2: the resumed run logs each step once."""
    env = Env(tmp_path, target_dir, runs)
    env.data.write_text(jsonl(CONVS))
    run = env.run()
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join([*lines, lines[-1].replace('"step": 2', '"step": 3')]) + '\n{"st')
    rc, text = cli([*env.train("train.steps=4", "--resume"), f"train.out_dir={run}"], capsys)
    assert rc == 2 and "train.steps 2 -> 4" in text and "--resume-with-changes" in text  # a longer run: said
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 4  # nothing touched
    rc, text = cli([*env.train("train.steps=4", "--resume-with-changes"), f"train.out_dir={run}"], capsys)
    assert rc == 0, text
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_the_demo_keeps_the_users_files(tmp_path):
    from vatspec.outputs import owner
    from vatspec_recipes.experiment import prepare_out as _prepare_out

    empty = tmp_path / "empty"
    empty.mkdir()
    _prepare_out(empty)  # an existing empty folder is fine
    assert owner(empty) == "demo"
    (empty / "report.md").write_text("an earlier report")
    (empty / "runs").mkdir()
    (empty / "notes.txt").write_text("mine")
    _prepare_out(empty)  # a rerun: the demo's outputs go, the user's file stays
    assert sorted(p.name for p in empty.iterdir()) == [".vatspec-owner", "notes.txt"]
    assert (empty / "notes.txt").read_text() == "mine"


# ----------------------------------------------------------------------------- kill -9
def _vatspec(args: list, cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    return subprocess.Popen([sys.executable, "-m", "vatspec.cli", *map(str, args)], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _lines(path: Path) -> int:
    return path.read_text().count("\n") if path.is_file() else 0


def _kill_after(proc: subprocess.Popen, ready: Callable[[], bool], rng: random.Random, seconds: float) -> bool:
    """SIGKILL ``proc`` at a random moment within ``seconds`` after ``ready()``; False if it ended first.

    ``ready`` watches the run's own progress (records written), not the clock, so the kill lands mid-run
    on a fast CPU as on a slow one."""
    while not ready():
        if proc.poll() is not None:
            return False
        time.sleep(0.02)
    time.sleep(rng.uniform(0, seconds))
    if proc.poll() is not None:
        return False
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return True


@pytest.mark.slow
def test_kill_9_during_a_default_run_then_resume(tmp_path, target_dir):
    """Default checkpointing (a tenth of the run): killed at a random point after the first periodic
    checkpoint, resumed, the run ends with the uninterrupted run's losses and each step logged once."""
    data = tmp_path / "train.jsonl"
    data.write_text(jsonl(CONVS))
    steps = 60  # the first periodic checkpoint is at step 6; the kill lands between steps 7 and 50
    args = ["train", f"target.path={target_dir}", f"data.train={data}", *TINY, f"train.steps={steps}", "--no-progress"]
    full = _vatspec([*args, f"train.out_dir={tmp_path / 'full'}"], tmp_path)
    assert full.wait() == 0, full.stdout.read()
    rng = random.Random(int(os.environ.get("KILL_SEED", time.time())))
    run = tmp_path / "killed"
    proc = _vatspec([*args, f"train.out_dir={run}"], tmp_path)
    at = rng.randint(7, steps - 10)
    ready = lambda: (run / "latest").is_file() and _lines(run / "metrics.jsonl") >= at  # noqa: E731
    assert _kill_after(proc, ready, rng, 0.05), f"the run ended before the kill (after step {at})"
    resumed = _vatspec([*args, f"train.out_dir={run}", "--resume"], tmp_path)
    out = resumed.communicate()[0]
    assert resumed.returncode == 0, out
    a = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in b] == list(range(1, steps + 1))
    assert [r["loss"] for r in b] == pytest.approx([r["loss"] for r in a], rel=1e-6, abs=1e-7)


@pytest.mark.slow
def test_kill_9_during_regenerate_then_rerun(tmp_path, target_dir):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(jsonl({"id": f"p{i}", "prompt": f"Tell me about the number {i}."} for i in range(48)))
    out = tmp_path / "regen.jsonl"
    args = ["regenerate", prompts, "--out", out, "--target", target_dir, "--batch-size", "2", "--max-new-tokens", "24",
            "--threads", "1"]
    rng = random.Random(int(os.environ.get("KILL_SEED", time.time())))
    proc = _vatspec(args, tmp_path)
    at = rng.randint(1, 24)  # 24 of 48 rows at most: the kill lands before the last batches
    assert _kill_after(proc, lambda: _lines(out) >= at, rng, 0.05), f"it ended before the kill (after {at} rows)"
    again = _vatspec(args, tmp_path)
    text = again.communicate()[0]
    assert again.returncode == 0, text
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]  # every line parses
    assert sorted(ids) == sorted(f"p{i}" for i in range(48))  # each once
