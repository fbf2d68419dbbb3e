"""scripts/more_seeds.py's own logic (its training is the demo's ``arm_configs`` + ``train_lockstep``,
tested elsewhere): the --arm parser, reading an earlier run's pair, and the across-seeds summary."""

from __future__ import annotations

import json

import pytest

from tests.conftest import load_script


@pytest.fixture(scope="module")
def ms():
    return load_script("more_seeds")


def test_arm_names_and_overrides(ms):
    assert ms.parse_arm('no_head=loss.head=false loss.beta=0.5') == ("no_head", ["loss.head=false", "loss.beta=0.5"])
    for bad in ("loss.head=false", "=loss.head=false", "no head=loss.head=false", "no_head"):
        with pytest.raises(SystemExit, match="--arm"):
            ms.parse_arm(bad)


def test_an_earlier_pair_must_match_size_and_kind(ms, tmp_path):
    rows = [{"seed": 5, "EAGLE-3": {"tau_sim": 1.5}, "EAGLE-3 + VAT": {"tau_sim": 1.4}, "diff": {}}]
    (tmp_path / "summary.json").write_text(json.dumps({"size": "full", "kind": "eagle3", "seeds": rows}))
    assert ms.earlier_pair(tmp_path, "full", "eagle3") == {5: rows[0]}
    want = r"summary\.json: size 'full', kind 'eagle3'; this run is --size full --kind dflash"
    with pytest.raises(SystemExit, match=want):
        ms.earlier_pair(tmp_path, "full", "dflash")


def test_summary_is_the_mean_of_per_seed_differences_with_a_t_interval(ms):
    base, vat = "EAGLE-3", "EAGLE-3 + VAT"
    # per-seed no_head - baseline: 0.02, 0.04, 0.06 -> mean 0.04, [-0.0097, +0.0897] (stats.across_seeds' example)
    rows = [{base: {"tau_sim": b}, vat: {"tau_sim": b + d}, "diff": {"estimate": d},
             "no_head": {"vs": {base: x, vat: x - d}}}
            for b, d, x in ((1.5, -0.01, 0.02), (1.6, 0.0, 0.04), (1.4, -0.02, 0.06))]
    assert ms.summarise(rows[:1], base, vat, ["no_head"]) == {}
    s = ms.summarise(rows, base, vat, ["no_head"])
    assert s["across_seeds"]["estimate"] == pytest.approx(-0.01)
    nh = s["arms_across_seeds"]["no_head"]
    assert (nh[base]["estimate"], nh[base]["low"], nh[base]["high"]) == pytest.approx((0.04, -0.0097, 0.0897), abs=1e-4)
    assert nh[vat]["estimate"] == pytest.approx(0.05)
    assert nh[base]["base"] == pytest.approx(1.5)


def test_a_later_run_into_the_same_out_adds_its_seeds(ms, tmp_path):
    path = tmp_path / "summary.json"
    assert ms.kept_rows(path, "full", "eagle3", {"no_head": "loss.head=false"}, range(5, 10)) == []
    rows = [{"seed": s} for s in (5, 6, 7)]
    path.write_text(json.dumps({"size": "full", "kind": "eagle3", "arms": {"no_head": "loss.head=false"},
                                "seeds": rows}))
    assert ms.kept_rows(path, "full", "eagle3", {"no_head": "loss.head=false"}, range(7, 10)) == rows[:2]
    with pytest.raises(SystemExit, match="choose another --out"):  # other arms: their seeds do not pool
        ms.kept_rows(path, "full", "eagle3", {"no_head": "loss.head=false loss.beta=0.5"}, range(7, 10))
