"""Every experiment recipe (``experiments/*.yaml`` of vatspec_recipes) loads and builds a config per arm: a
typo in a recipe fails here, not after a regeneration."""

from __future__ import annotations

from pathlib import Path

import pytest

from vatspec_recipes.experiment import arm_configs
from vatspec_recipes.recipe import ExperimentError, load_recipe, recipe_dir

RECIPES = sorted(p.stem for p in recipe_dir().glob("*.yaml"))


def test_the_recipes_are_found():
    assert {"demo", "demo-quick", "demo-full", "ablation", "objectives"} <= set(RECIPES)


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("drafter", ["eagle3", "dflash"])
def test_each_recipe_builds_a_config_per_arm(name, drafter, tmp_path):
    recipe = load_recipe(name, drafter=drafter, arms=[drafter, "vat", "kl"])
    cfgs = arm_configs(recipe.arms, recipe.size, tmp_path / "data.jsonl", tmp_path / "runs")
    assert [Path(c.train.out_dir).parent for c in cfgs] == [tmp_path / "runs"] * len(recipe.arms)
    assert set(recipe.pairs) <= set(recipe.arms) and set(recipe.pairs.values()) <= set(recipe.arms)
    for c in cfgs:
        assert c.train.steps == recipe.size.steps_of(c.drafter.kind)


def test_the_long_recipe_is_the_demo_at_a_larger_size():
    demo, full = load_recipe("demo"), load_recipe("demo-full")
    assert full.arms == demo.arms and full.pairs == demo.pairs
    assert (full.size.prompts, full.size.steps, full.size.seeds) == (512, 400, 4)
    assert full.size.optim == demo.size.optim and full.size.max_length == demo.size.max_length


def test_a_bad_recipe_is_one_line_naming_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("arms:\n  a: [drafter.kind=eagle3]\npairs:\n  a: b\ndecode: sometimes\n")
    with pytest.raises(ExperimentError, match=r"bad.yaml: decode 'sometimes' is not one of .*; pairs: a -> b"):
        load_recipe(bad)
    with pytest.raises(ExperimentError, match="nope: no such recipe file"):
        load_recipe("nope")
    typo = tmp_path / "typo.yaml"
    typo.write_text("base: " + str(recipe_dir() / "demo.yaml") + "\nsize:\n  stepz: 3\n")
    with pytest.raises(ExperimentError, match="typo.yaml: size: .*stepz"):
        load_recipe(typo)
    base = "base: " + str(recipe_dir() / "demo.yaml") + "\n"
    for text, message in [("arsm:\n  a: [loss.kind=vat]\n", r"unknown key\(s\) arsm \(a recipe has arm_template"),
                          ('hf_baseline: "false"\n', r"hf_baseline must be true or false, got 'false'"),
                          ("arms:\n  ../../x: [loss.kind=vat]\n", r"arm '../../x': an arm is a name without '/'"),
                          ("arms:\n  a: loss.kind=vat\n", r"arm 'a': an arm's overrides are a list, got 'loss.kind=")]:
        typo.write_text(base + text)
        with pytest.raises(ExperimentError, match="typo.yaml: " + message):
            load_recipe(typo)


def test_demo_refuses_a_recipe_it_cannot_size_or_fill(tmp_path, capsys):
    from vatspec.cli import main

    assert main(["demo", "--recipe", "ablation", "--quick", "--out", str(tmp_path / "a")]) == 2
    assert "--recipe ablation brings its own size: drop --quick / --full" in capsys.readouterr().err
    assert main(["demo", "--recipe", "ablation", "--out", str(tmp_path / "b")]) == 2
    assert "its arms name {drafter}: run it with a drafter" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_objectives_must_decode(tmp_path):
    bad = tmp_path / "obj.yaml"
    bad.write_text("base: " + str(recipe_dir() / "objectives.yaml") + "\ndecode: none\n")
    with pytest.raises(ExperimentError, match="report objectives compares decoded arms: decode none"):
        load_recipe(bad, drafter="eagle3", arms=["eagle3", "vat"])


def test_a_full_disk_keeps_the_cache_written_so_far(tmp_path, monkeypatch):
    """prepare_features rebuilds a cache written for other settings, never one a full disk interrupted."""
    import vatspec_recipes.experiment as E
    from vatspec.features import writer
    from vatspec.features.format import CacheWriteError

    class T:
        num_layers = 30

    cfgs = E.arm_configs(load_recipe("demo-quick").arms, load_recipe("demo-quick").size, tmp_path / "d.jsonl",
                         tmp_path / "runs")
    data = tmp_path / "d.jsonl"
    data.write_text('{"id": "a", "messages": [{"role": "user", "content": "hi"}, '
                    '{"role": "assistant", "content": "hello"}]}\n')
    out = tmp_path / "d.features-m128"
    out.mkdir()
    (out / "shard-00000.safetensors").write_text("written before")

    def full(*a, **k):
        raise CacheWriteError("shard-00001.safetensors: could not be written (No space left on device)")

    monkeypatch.setattr(writer, "write_cache", full)
    monkeypatch.setattr("vatspec.features.write_cache", full)
    with pytest.raises(CacheWriteError, match="No space left"):
        E.prepare_features(T(), data, cfgs, progress=False)
    assert (out / "shard-00000.safetensors").read_text() == "written before"
