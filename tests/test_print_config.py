"""``vatspec train --print-config``: every field, its value and its source; nothing loaded or written."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from vatspec.cli import main
from vatspec.config import Config, config_sources

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))
FIELDS = [f"{s.name}.{f.name}" for s in dataclasses.fields(Config)
          for f in dataclasses.fields(getattr(Config(), s.name))]


def print_config(argv: list[str], capsys) -> dict[str, tuple[str, str]]:
    """Run ``vatspec train ARGV --print-config``; ``{field: (value, source)}`` from its lines."""
    assert main(["train", *argv, "--print-config"]) == 0
    rows = {}
    for line in capsys.readouterr().out.splitlines():
        key, value, source = re.split(r"\s{2,}", line.strip(), maxsplit=2)
        rows[key] = (value, source)
    return rows


def test_default_file_override_and_resolved_sources(tmp_path, capsys):
    out_dir = tmp_path / "run"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"data:\n  max_length: 1024\n  batch_size: 2\ntrain:\n  out_dir: {out_dir}\n  seed: 0\n")
    rows = print_config(["--config", str(recipe), "optim.lr=3e-4", "data.batch_size=4", "drafter=dflash"], capsys)

    assert list(rows) == FIELDS  # every field of every section, in order
    assert rows["train.epochs"] == (str(Config().train.epochs), "default")
    assert rows["data.max_length"] == ("1024", str(recipe))
    assert rows["train.seed"] == ("0", str(recipe))  # named by the file, though equal to the default
    assert rows["optim.lr"] == ("0.0003", "override optim.lr=3e-4")
    assert rows["data.batch_size"] == ("4", "override data.batch_size=4")  # the override wins over the file
    assert rows["drafter.kind"] == ("dflash", "override drafter=dflash")  # the shorthand names drafter.kind
    # filled by resolve_loss when the config loaded, not defaults: VAT's switches, gamma from the DFlash block
    assert rows["loss.soft"] == ("true", "resolved (loss.kind=vat, drafter=dflash)")
    assert rows["loss.gamma"] == ("7.0", "resolved (loss.kind=vat, drafter=dflash)")
    assert rows["loss.kind"] == ("vat", "default")
    # a null optim field: the reference value the trainer puts there
    assert rows["optim.grad_clip"][0] == "null" and rows["optim.grad_clip"][1].startswith("default (null: 1,")
    assert not out_dir.exists()  # nothing written


def test_a_loss_field_set_explicitly_is_not_resolved(capsys):
    rows = print_config(["loss.weights=fixed"], capsys)
    assert rows["loss.weights"] == ("fixed", "override loss.weights=fixed")
    assert rows["loss.hard"] == ("true", "resolved (loss.kind=vat, drafter=eagle3)")
    assert rows["train.keep_checkpoints"] == (str(Config().train.keep_checkpoints), "default")
    assert rows["data.heldout"] == ("''", "default")  # an empty string shows as ''
    assert rows["drafter.target_layer_ids"] == ("null", "default")


def test_a_config_error_is_the_usual_line_with_status_2(tmp_path, capsys):
    assert main(["train", "train.steps=-1", "--print-config"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err == "vatspec train: error: train.steps: must be >= 0, got -1\n"
    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  max_lenght: 10\n")
    assert main(["train", "--config", str(bad), "--print-config"]) == 2
    assert "unknown field 'data.max_lenght'" in capsys.readouterr().err


def test_config_sources_is_the_library_call():
    rows = {k: (v, s) for k, v, s in config_sources(None, ["train.steps=5"])}
    assert rows["train.steps"] == (5, "override train.steps=5")
    assert rows["optim.betas"] == ((0.9, 0.95), "default")


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.name for p in RECIPES])
def test_every_recipe_loads(recipe, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the recipes' relative out_dir and features resolve here
    rows = print_config(["--config", str(recipe)], capsys)
    source = str(recipe)
    for key in ("target.path", "target.dtype", "data.features", "drafter.kind", "loss.kind", "train.precision",
                "optim.lr"):
        assert rows[key][1] == source, key
    assert rows["target.path"][0].startswith("/models/")
    assert rows["target.dtype"][0] == "bfloat16" and rows["train.precision"][0] == "bf16"
    assert rows["loss.kind"][0] == "vat"
    assert rows["drafter.target_layer_ids"] == ("null", "default")  # the drafter's reference default
    qwen3 = recipe.name.startswith("qwen3")
    assert rows["data.chat_template_kwargs"] == (("enable_thinking=false", source) if qwen3 else ("''", "default"))
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_there_are_the_three_recipes():
    assert [p.name for p in RECIPES] == ["llama3.1-8b-eagle3-vat.yaml", "qwen3-8b-dflash-vat.yaml",
                                         "qwen3-8b-eagle3-vat.yaml"]
