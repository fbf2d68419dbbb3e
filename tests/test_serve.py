"""Regeneration through a real OpenAI-compatible server: ``transformers serve`` with the embedded target
on the loopback address, started here and stopped after the module. Checks the records, resume after a
Ctrl-C, and the agreement with in-process generation (``--verify-sample``)."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("fastapi")  # transformers serve's own dependencies (`make setup` installs them)
pytest.importorskip("uvicorn")

PROMPTS = ["Name a primary colour.", "What is 2 + 3?", "Say hello in French.", "Name a planet.",
           "What is the capital of Italy?", "Count to three."]
START_S = 180  # loading the target on a busy 2-core machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(default_target_path, tmp_path_factory):
    """``(url, model name)`` of a ``transformers serve`` process serving the embedded target in float32."""
    with transformers_serve(default_target_path, tmp_path_factory.mktemp("serve")) as served:
        yield served


@contextlib.contextmanager
def transformers_serve(model_dir, log_dir: Path):
    """``(url, model name)`` of ``transformers serve MODEL_DIR`` on a free loopback port (float32, CPU), started
    here and stopped (SIGINT, then kill) on leaving; its log in ``LOG_DIR/serve.log``."""
    port = _free_port()
    log = log_dir / "serve.log"
    exe = Path(sys.executable).with_name("transformers")
    cmd = [str(exe), "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
           "--device", "cpu", "--dtype", "float32", "--log-level", "warning"]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_S
    model = None
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
                model = json.loads(r.read())["data"][0]["id"]
            break
        except OSError:
            time.sleep(1)
    if model is None:
        proc.kill()
        pytest.fail(f"transformers serve did not start: {log.read_text()[-2000:]}")
    try:
        yield url, model
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _cmd(default_target_path, data, out, url, model, *extra):
    return [sys.executable, "-m", "vatspec.cli", "regenerate", str(data), "--out", str(out), "--target",
            str(default_target_path), "--endpoint", url, "--model", model, "--max-new-tokens", "16",
            "--concurrency", "1", "--threads", "1", *extra]


def test_regenerate_through_transformers_serve(served, default_target_path, tmp_path):
    url, model = served
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"id": f"p{k}", "prompt": p}) + "\n" for k, p in enumerate(PROMPTS)))
    out = tmp_path / "regen.jsonl"
    # 1. killed (Ctrl-C) once the first record is written, then resumed: every prompt once
    # SIGINT at its default, so Ctrl-C interrupts: a test run launched in the background (`make test &`) would
    # otherwise hand the child an ignored SIGINT, and it would answer every prompt
    proc = subprocess.Popen(_cmd(default_target_path, data, out, url, model), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (out.exists() and out.read_text().count("\n") >= 1):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    proc.wait(60)
    first = out.read_text().count("\n")
    assert 1 <= first < len(PROMPTS), proc.stdout.read()
    res = subprocess.run(_cmd(default_target_path, data, out, url, model, "--verify-sample", "4"),
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in recs) == [f"p{k}" for k in range(len(PROMPTS))]  # no duplicate, none lost
    assert f"{first} already done" in res.stdout and "0 failed" in res.stdout
    for r in recs:
        assert r["meta"]["endpoint"] == url and r["meta"]["model"] == model
        assert r["messages"][1]["content"] and r["meta"]["finish"][0] in ("stop", "length")
    # 2. the server's answers against in-process greedy generation of the same prompts
    summary = json.loads(Path(f"{out}.summary.json").read_text())
    v = summary["verify_sample"]
    print(f"transformers serve vs in-process: {v['identical']} of {v['sampled']} answers token-identical, "
          f"first differences {v['first_difference']}")
    assert v["sampled"] == 4 and v["identical"] >= 3  # float32 on both sides: equal but for a rare near-tie
    assert "token ids identical to in-process generation" in res.stdout
