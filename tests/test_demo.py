"""The main job, end to end at its --quick size (the CI smoke run), and the ablation command.

These check the report's structure and that every figure is a real measured number; they do
not check the direction of a result (at this scale VAT may or may not win)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from vatspec.target.precision import native_bf16
from vatspec_recipes.experiment import redecode, run
from vatspec_recipes.recipe import ExperimentError, load_recipe, recipe_size

QUICK = load_recipe("demo-quick")
ARMS = QUICK.arms

pytestmark = pytest.mark.slow


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def test_quick_demo_writes_a_complete_report(tmp_path):
    out = tmp_path / "demo"
    size = QUICK.size
    run(QUICK, out, progress=False)

    for f in ["report.md", "demo.json", "training_curves.png", "eval/results.json", "eval/results.md",
              "eval/tau.png", "eval/acceptance.png", *(f"config-{n}.yaml" for n in
                                                        ("eagle3", "eagle3_vat", "dflash", "dflash_vat"))]:
        assert (out / f).is_file() and (out / f).stat().st_size > 0, f
    assert (out / "training_curves.png").read_bytes()[:4] == b"\x89PNG"

    report = (out / "report.md").read_text()
    assert "small-scale" in report and "A100" in report  # says what scale the paper used
    for name in ARMS:
        assert f"| {name} |" in report
    assert report.count("| Δ vs EAGLE-3 |") == 1 and report.count("| Δ vs DFlash |") == 1
    assert "Draft length chosen on held-out calibration prompts" in report
    assert "95% interval" in report and "Held-out accepted length per chain" in report

    data = json.loads((out / "demo.json").read_text())
    assert set(data["train_final"]) == set(ARMS)
    # "auto" is recorded as what ran, and every arm's config says the same
    precision = "bf16" if native_bf16(torch.device("cpu")) else "fp32"
    assert data["size"]["precision"] == precision
    assert all(f"precision: {precision}" in (out / f"config-{n}.yaml").read_text()
               for n in ("eagle3", "eagle3_vat", "dflash", "dflash_vat"))
    for name, m in data["train_final"].items():
        assert _finite(m["tau_sim"]) and 1.0 <= m["tau_sim"] <= size.ttt_steps + 1, name
        assert m["chains"] > 0
    # DFlash's pair trains on the same sequences at its own batch: twice the steps of half the batch
    for n, kind in (("eagle3_vat", "eagle3"), ("dflash_vat", "dflash")):
        cfg = (out / f"config-{n}.yaml").read_text()
        assert f"batch_size: {size.batch_of(kind)}\n" in cfg and f"steps: {size.steps_of(kind)}\n" in cfg, n
    assert size.batch_of("dflash") * size.steps_of("dflash") == size.batch_size * size.steps
    # each kind's optimizer, the same for both arms of a pair
    for n, kind in (("eagle3", "eagle3"), ("eagle3_vat", "eagle3"), ("dflash", "dflash"), ("dflash_vat", "dflash")):
        cfg = (out / f"config-{n}.yaml").read_text()
        assert f"kind: {size.optim}\n" in cfg and f"muon_lr_scale: {size.optim_of(kind)[1].split('=')[1]}" in cfg, n
        assert f"loss_on: {size.loss_on}\n" in cfg, n  # every arm supervised on the same positions
    assert size.batch_of("dflash") < size.batch_size
    for vat, base in (("EAGLE-3 + VAT", "EAGLE-3"), ("DFlash + VAT", "DFlash")):
        paired = data["train_paired"][vat]
        assert paired["vs"] == base and paired["units"] == data["train_final"][vat]["chains"]
        assert paired["low"] <= paired["estimate"] <= paired["high"]
    results = json.loads((out / "eval" / "results.json").read_text())
    cal, ks = results["calibration"], results["config"]["k"]
    assert {n: ks[n] for n in ARMS} == {n: cal[n]["k"] for n in ARMS}  # decoded with the calibrated k
    # a baseline's chosen k > 1 decodes at k = 1 beside it; the report says whether the choice held
    assert results["config"]["recheck"] == {n: f"{n} @ k=1" for n in ("EAGLE-3", "DFlash") if cal[n]["k"] > 1}
    assert "re-checked against k = 1" in report
    # every method's speedup with its interval, and the pairs' differences, in the JSON and in words
    intervals = results["speedup_intervals"]
    assert set(intervals["speedup"]) >= {*ARMS, "hf_generate"}
    assert set(intervals["difference"]) >= {"EAGLE-3 + VAT vs EAGLE-3", "DFlash + VAT vs DFlash"}
    for name in ARMS:
        iv = intervals["speedup"][name]["average"]
        assert iv["estimate"] == pytest.approx(data["decode"][name]["average"]["speedup"])
    assert "Speedup over the AR baseline with 95% intervals" in report and "the AR baseline" in report
    assert "nan" not in report.lower().replace("nanos", "") and "inf×" not in report  # eval_report.check_finite too
    assert ks["EAGLE-3"] == ks["EAGLE-3 + VAT"] and ks["DFlash"] == ks["DFlash + VAT"]  # same settings per pair
    assert set(results["paired_tau"]) == {"EAGLE-3 + VAT", "DFlash + VAT"}
    benches = set(size.benches)
    assert set(data["benchmarks"]) == benches
    for name in ["ar", *ARMS]:
        rows = data["decode"][name]
        assert set(rows) == benches | {"average"}
        for bench, r in rows.items():
            assert _finite(r["tau"]) and r["tau"] >= 1.0, (name, bench)
            assert _finite(r["speedup"]) and r["speedup"] > 0, (name, bench)
            assert _finite(r["tokens_per_s"]) and r["tokens_per_s"] > 0, (name, bench)
    assert data["decode"]["ar"]["average"]["tau"] == 1.0
    for k in ("target", "data", "train", "eval", "total"):
        assert _finite(data["timings_s"][k]) and data["timings_s"][k] >= 0
    # T = 0 decoding is lossless (test_decode checks it strictly); here allow a rare float near-tie
    runs = json.loads((out / "eval" / "results.json").read_text())["runs"]
    checks = [r["matches_ar"] for name in ARMS for rs in runs[name].values() for r in rs]
    assert checks and sum(checks) >= 0.9 * len(checks)


def test_demo_refuses_a_foreign_folder(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(ExperimentError, match="not made by vatspec demo"):
        run(QUICK, tmp_path, progress=False)
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_ablation_table(tmp_path):
    recipe = load_recipe("ablation", drafter="dflash", size={**recipe_size("demo-quick"), "steps": 2, "eval_every": 2})
    run(recipe, tmp_path / "ab", progress=False)
    res = json.loads((tmp_path / "ab" / "ablation.json").read_text())
    assert list(res) == ["baseline", "head only", "adaptive weights only", "soft+hard only", "all three (VAT)"]
    table = (tmp_path / "ab" / "ablation.md").read_text()
    for name in res:
        assert f"| {name} |" in table
        assert _finite(res[name]["tau_sim"])
    assert "head_first_reject_mae" in res["head only"] and "head_first_reject_mae" not in res["baseline"]
    assert "paired_vs_baseline" in res["all three (VAT)"] and "paired_vs_baseline" not in res["baseline"]
    assert "chain_accepted" not in json.loads((tmp_path / "ab" / "ablation.json").read_text())["baseline"]


def test_seeds_report_the_vat_difference_across_seeds(tmp_path):
    """--seeds N (the long recipe's 3): every arm trained per seed, decoded, and each VAT arm's per-seed
    paired differences summarised by their mean and t-interval."""
    out = tmp_path / "demo"
    recipe = load_recipe("demo-quick", size={"steps": 2, "eval_every": 2, "seeds": 2, "benches": ["gsm8k"]})
    data = run(recipe, out, progress=False)

    names = [f"{arm} (seed {s})" for s in (0, 1) for arm in ARMS]
    assert set(data["train_final"]) == set(names)
    assert (out / "runs" / "seed1" / "eagle3_vat" / "metrics.jsonl").is_file()
    assert (out / "config-eagle3_vat_seed1.yaml").is_file()
    results = json.loads((out / "eval" / "results.json").read_text())
    ks = results["config"]["k"]
    for s in (0, 1):  # each seed's pair decodes with the k chosen on its own baseline
        assert ks[f"EAGLE-3 + VAT (seed {s})"] == ks[f"EAGLE-3 (seed {s})"]
        assert ks[f"DFlash + VAT (seed {s})"] == ks[f"DFlash (seed {s})"]
    for vat, base in (("EAGLE-3 + VAT", "EAGLE-3"), ("DFlash + VAT", "DFlash")):
        row = data["across_seeds"][vat]
        assert row["vs"] == base and row["seeds"] == [0, 1]
        per = [data["train_paired"][f"{vat} (seed {s})"]["estimate"] for s in (0, 1)]
        assert row["tau_sim_per_seed"] == per
        assert row["tau_sim"]["estimate"] == pytest.approx(sum(per) / 2)
        assert row["decode_tau"]["low"] <= row["decode_tau"]["estimate"] <= row["decode_tau"]["high"]
        fast = [results["speedup_intervals"]["difference"][f"{vat} (seed {s}) vs {base} (seed {s})"]["average"]
                for s in (0, 1)]
        assert row["speedup_per_seed"] == pytest.approx([d["estimate"] for d in fast])
        assert row["speedup"]["estimate"] == pytest.approx(sum(row["speedup_per_seed"]) / 2)
    report = (out / "report.md").read_text()
    assert "## VAT vs baseline across training seeds" in report
    assert "mean over seeds" in report and report.count("| EAGLE-3 + VAT (seed ") >= 1

    # --redecode: steps 4-5 again on the same drafts; training figures and checkpoints untouched
    ckpts = {p: p.read_bytes() for p in (out / "runs").rglob("*.safetensors")}
    again = redecode(out, progress=False)
    assert ckpts and all(p.read_bytes() == b for p, b in ckpts.items())
    for key in ("train_final", "train_paired", "regeneration", "features"):
        assert again[key] == json.loads(json.dumps(data[key], default=float)), key
    assert again["timings_s"]["train"] == data["timings_s"]["train"]
    assert again["across_seeds"]["EAGLE-3 + VAT"]["tau_sim"] == data["across_seeds"]["EAGLE-3 + VAT"]["tau_sim"]
    assert set(again["decode"]) == set(data["decode"])
    report = (out / "report.md").read_text()
    assert "vatspec demo --redecode" in report and "## VAT vs baseline across training seeds" in report


def test_redecode_needs_a_finished_demo(tmp_path):
    with pytest.raises(ExperimentError, match="demo.json: not the record of a finished demo"):
        redecode(tmp_path, progress=False)


def test_original_answers_follow_the_regenerated_set(tmp_path):
    from vatspec import data as D
    from vatspec.benchmarks import prepare_prompts
    from vatspec_recipes.experiment import add_original_answers

    # a "regenerated" set of the first four conversations the original answers draw: each must be skipped
    drawn = prepare_prompts(4, seed=1, sources=("sharegpt",), max_turns=1, max_chars=600, answers=True)
    regen_path = tmp_path / "regen.jsonl"
    regen_path.write_text("".join(json.dumps({"id": c.id, "messages": [
        *(m for m in c.messages if m["role"] != "assistant"), {"role": "assistant", "content": "an answer"}]}) + "\n"
        for c in drawn))
    regen = D.load_conversations(regen_path)
    size = dataclasses.replace(QUICK.size, prompts=4, seed=0, original_answers=6)
    out, info = add_original_answers(regen_path, size)
    convs = D.load_conversations(out)
    assert info["regenerated"] == 4 and info["original_answers"] == 6 and len(convs) == 10
    assert [c.to_json() for c in convs[:4]] == [c.to_json() for c in regen]
    extra = convs[4:]
    assert {c.id for c in extra}.isdisjoint(c.id for c in regen)
    assert {tuple(c.prompts()) for c in extra}.isdisjoint(tuple(c.prompts()) for c in regen)
    assert all(c.has_assistant for c in extra) and len({c.id for c in extra}) == 6
    stamp = out.stat().st_mtime_ns
    assert add_original_answers(regen_path, size)[0] == out and out.stat().st_mtime_ns == stamp  # unchanged
    with pytest.raises(ExperimentError, match="regen.jsonl: 4 conversations, not the 5"):
        add_original_answers(regen_path, dataclasses.replace(size, prompts=5))
