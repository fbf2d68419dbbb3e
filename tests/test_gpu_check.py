"""tools/gpu_check.py, the one GPU check, runs here on tiny shapes: the same code path (targets
built in code, every arm's training step, decoding against HF generate, the JSON) as on a GPU."""

from __future__ import annotations

import json

import pytest

from tests.conftest import TOOLS, load_script

pytestmark = pytest.mark.usefixtures("one_thread")


def test_gpu_check_runs_on_tiny_shapes(tmp_path):
    mod = load_script("gpu_check")
    out = tmp_path / "gpu_check.json"
    assert mod.main(["--small", "--device", "cpu", "--steps", "2", "--warmup", "0", "--decode-prompts", "1",
                     "--decode-tokens", "8", "--targets", "qwen3-8b-shaped", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    t = rep["targets"]["qwen3-8b-shaped"]
    assert set(t["arms"]) == {"eagle3/eagle3", "eagle3/vat", "dflash/dflash", "dflash/vat"}
    for name, arm in t["arms"].items():
        assert arm["finite"] and len(arm["losses"]) == 2 and arm["tokens_per_s"] > 0, name
        if name.endswith("/vat"):
            d = arm["decode"]
            assert (d["dtype"], d["prompts"], d["equal_to_hf_generate"], d["divergences"]) == ("float32", 1, 1, []), d
            assert "decode_fp32" not in arm  # the target trained in float32: that decode is the exact one
    assert t["eagle3_vat_over_baseline_step_time"] > 0 and t["dflash_vat_over_baseline_step_time"] > 0
    assert (TOOLS / "gpu_check.sh").is_file()


def test_gpu_check_bf16_decode_parts_only_at_ties_and_float32_is_exact(tmp_path):
    """The bf16 path the GPU runs, here on the CPU: verification's k + 1-position forward and
    generate's one-position forward round differently in bf16, so greedy outputs may part, but only
    where the two tokens' logits are (nearly) tied; with the target cast to float32 they are equal."""
    mod = load_script("gpu_check")
    out = tmp_path / "gpu_check.json"
    assert mod.main(["--small", "--device", "cpu", "--precision", "bf16", "--steps", "1", "--warmup", "0",
                     "--decode-prompts", "4", "--decode-tokens", "24", "--targets", "qwen3-8b-shaped",
                     "--out", str(out)]) == 0
    t = json.loads(out.read_text())["targets"]["qwen3-8b-shaped"]
    assert not t["errors"]
    for name in ("eagle3/vat", "dflash/vat"):
        bf16, fp32 = t["arms"][name]["decode"], t["arms"][name]["decode_fp32"]
        assert bf16["dtype"] == "bfloat16" and fp32["dtype"] == "float32"
        assert fp32["equal_to_hf_generate"] == fp32["prompts"] == 4 and not fp32["divergences"], fp32
        assert len(bf16["divergences"]) == 4 - bf16["equal_to_hf_generate"]
        for div in bf16["divergences"]:
            assert div["hf_token"] != div["ours_token"] and div["gap_in_bf16_ulps"] <= 4, div
