"""One writer per output: ``outputs.write_lock`` and the commands that hold it."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest

from vatspec.outputs import OutputError, write_lock


def test_a_second_writer_fails_at_once_naming_the_first(tmp_path, monkeypatch):
    monkeypatch.setenv("VATSPEC_HOME", str(tmp_path / "home"))
    out = tmp_path / "run"
    with write_lock(out, "train.out_dir", "train"):
        busy = rf"train.out_dir {out} is being written by vatspec train \(pid {os.getpid()} on .*, since .*\); wait"
        with pytest.raises(OutputError, match=busy), write_lock(out, "train.out_dir", "train"):
            pass
        with write_lock(out, "--out", "cache-features", part="1/2"):  # another share of the output: allowed
            pass
    with write_lock(out, "train.out_dir", "train"):  # released
        pass
    assert not any(p.name != "locks" for p in (tmp_path / "home").iterdir())
    assert not out.exists()  # the output holds nothing of the lock


def test_a_dead_holders_lock_is_taken_over_and_said(tmp_path, monkeypatch, caplog):
    import hashlib
    import socket

    monkeypatch.setenv("VATSPEC_HOME", str(tmp_path / "home"))
    out = tmp_path / "regen.jsonl"
    with write_lock(out, "--out", "regenerate"):
        pass
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    lock = tmp_path / "home" / "locks" / (hashlib.sha256(f"{out.resolve()}\0".encode()).hexdigest()[:32] + ".lock")
    lock.write_text(json.dumps({"pid": int(dead), "host": socket.gethostname(), "command": "regenerate",
                                "since": "earlier"}))
    with caplog.at_level(logging.WARNING), write_lock(out, "--out", "regenerate"):
        pass
    assert f"taking over the lock of pid {dead} (regenerate since earlier), which is no longer running" in caplog.text


@pytest.mark.slow
def test_two_trainings_into_one_run_folder(tmp_path, default_target_path):
    """A double launch: the second `vatspec train` into the same train.out_dir exits 2 at once, naming the first,
    and the first finishes and owns its files."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Say {w}."},
                                                     {"role": "assistant", "content": f"{w} {w} {w}, as asked."}]})
                            + "\n" for w in ("one", "two", "three", "four", "five", "six", "seven", "eight")))
    run = tmp_path / "run"
    args = [sys.executable, "-m", "vatspec.cli", "train", f"target.path={default_target_path}", f"data.train={data}",
            f"train.out_dir={run}", "train.steps=40", "drafter.draft_vocab_size=512", "drafter.ttt_steps=2",
            "data.max_length=48", "--no-progress"]
    env = dict(os.environ, VATSPEC_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1")
    first = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    locks = tmp_path / "home" / "locks"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not any(p.stat().st_size for p in locks.glob("*.lock")):
        time.sleep(0.1)
    second = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    out, err = first.communicate(timeout=600)
    assert first.returncode == 0, err[-2000:]
    assert second.returncode == 2
    assert f"vatspec train: error: train.out_dir {run} is being written by vatspec train (pid {first.pid}" in \
        second.stderr
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == 40  # one run's steps, once each
