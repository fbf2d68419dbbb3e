"""scripts/gpu_check.py, the one GPU check, runs here on tiny shapes: the same code path (targets
built in code, every arm's training step, decoding against HF generate, the JSON) as on a GPU."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


def test_gpu_check_runs_on_tiny_shapes(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "gpu_check.json"
    assert mod.main(["--small", "--device", "cpu", "--steps", "2", "--warmup", "0", "--decode-prompts", "1",
                     "--decode-tokens", "8", "--targets", "qwen3-8b-shaped", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    t = rep["targets"]["qwen3-8b-shaped"]
    assert set(t["arms"]) == {"eagle3/eagle3", "eagle3/vat", "dflash/dflash", "dflash/vat"}
    for name, arm in t["arms"].items():
        assert arm["finite"] and len(arm["losses"]) == 2 and arm["tokens_per_s"] > 0, name
        if name.endswith("/vat"):
            assert arm["decode"] == {**arm["decode"], "prompts": 1, "equal_to_hf_generate": 1}
    assert t["eagle3_vat_over_baseline_step_time"] > 0 and t["dflash_vat_over_baseline_step_time"] > 0
    assert (Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh").is_file()
