"""``vatspec train --print-config``: every field that applies to the drafter kind, its value and its source, then
the numbers the run is sized by; nothing loaded or written."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from vatspec.cli import main
from vatspec.config import Config, config_sources

RECIPES_DIR = Path(__file__).resolve().parents[1] / "src" / "vatspec_recipes" / "configs"
RECIPES = sorted(RECIPES_DIR.glob("*.yaml"))
FIELDS = [f"{s.name}.{f.name}" for s in dataclasses.fields(Config)
          for f in dataclasses.fields(getattr(Config(), s.name))]
# the drafter fields of one kind only (written out here, not read from the config's metadata)
EAGLE3_ONLY = ["drafter.draft_vocab_size", "drafter.ttt_steps", "drafter.init_lm_head"]
DFLASH_ONLY = ["drafter.num_layers", "drafter.block_size", "drafter.num_anchors", "drafter.mask_token_id"]
SIZE_ROWS = ["world size", "global batch", "steps per epoch", "total steps", "warm-up steps"]


def fields_of(kind: str) -> list[str]:
    """Every field of every section, in order, less the other drafter kind's."""
    other = DFLASH_ONLY if kind == "eagle3" else EAGLE3_ONLY
    return [f for f in FIELDS if f not in other]


def print_config(argv: list[str], capsys, sizes: dict | None = None) -> dict[str, tuple[str, str]]:
    """Run ``vatspec train ARGV --print-config``; ``{field: (value, source)}`` from its first block of lines,
    and into ``sizes`` ``{name: (value, how)}`` from the second (the numbers the run is sized by)."""
    assert main(["train", *argv, "--print-config"]) == 0
    fields, _, derived = capsys.readouterr().out.partition("\n\n")
    rows = {}
    for line in fields.splitlines():
        key, value, source = re.split(r"\s{2,}", line.strip(), maxsplit=2)
        rows[key] = (value, source)
    for line in derived.splitlines():
        name, value, how = re.split(r"\s{2,}", line.strip(), maxsplit=2)
        if sizes is not None:
            sizes[name] = (value, how)
    return rows


def test_default_file_override_and_resolved_sources(tmp_path, capsys):
    out_dir = tmp_path / "run"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"data:\n  max_length: 1024\n  batch_size: 2\ntrain:\n  out_dir: {out_dir}\n  seed: 0\n")
    rows = print_config(["--config", str(recipe), "optim.lr=3e-4", "data.batch_size=4", "drafter=dflash"], capsys)

    assert list(rows) == fields_of("dflash")  # the fields that apply to DFlash, in order
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


# What each recipe sets of the chat template and the length: (chat_template_kwargs, chat_template_date, max_length);
# None = left to config.py's default ('' : the tokenizer's template with no arguments, the date the data records).
TEMPLATE_SETTINGS = {
    "gpt-oss-20b-eagle3-vat.yaml": ("reasoning_effort=medium", "2026-12-07", 4096),
    "llama3.1-8b-eagle3-vat.yaml": (None, None, 4096),
    "qwen3-8b-dflash-vat.yaml": ("enable_thinking=false", None, 3072),
    "qwen3-8b-eagle3-vat-thinking.yaml": ("enable_thinking=true", None, 8192),
    "qwen3-8b-eagle3-vat.yaml": ("enable_thinking=false", None, 4096),
}
# each VAT recipe's baseline: the same file with the drafter's reference objective (loss.kind) and its own out_dir
BASELINES = {"gpt-oss-20b-eagle3.yaml": "gpt-oss-20b-eagle3-vat.yaml",
             "llama3.1-8b-eagle3.yaml": "llama3.1-8b-eagle3-vat.yaml",
             "qwen3-8b-dflash.yaml": "qwen3-8b-dflash-vat.yaml", "qwen3-8b-eagle3.yaml": "qwen3-8b-eagle3-vat.yaml",
             "qwen3-8b-eagle3-thinking.yaml": "qwen3-8b-eagle3-vat-thinking.yaml"}
TEMPLATE_SETTINGS.update({base: TEMPLATE_SETTINGS[vat] for base, vat in BASELINES.items()})
# the published chat template each recipe's target renders with (tests/fixtures/chat_templates, byte for byte)
TEMPLATES = Path(__file__).resolve().parent / "fixtures" / "chat_templates"
PUBLISHED = {"gpt-oss": "openai-gpt-oss-20b.jinja", "llama3.1": "meta-llama-Llama-3.1-8B-Instruct.jinja",
             "qwen3": "Qwen-Qwen3-8B.jinja"}


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.name for p in RECIPES])
def test_every_recipe_loads(recipe, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the recipes' relative out_dir and features resolve here
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    sizes = {}
    rows = print_config(["--config", str(recipe)], capsys, sizes)
    source = str(recipe)
    for key in ("target.path", "target.dtype", "data.train", "drafter.kind", "loss.kind", "train.precision",
                "optim.lr", "data.max_length"):
        assert rows[key][1] == source, key
    assert rows["target.path"][0].startswith("/models/")
    assert rows["target.dtype"][0] == "bfloat16" and rows["train.precision"][0] == "bf16"
    assert rows["loss.kind"][0] == ("vat" if recipe.name not in BASELINES else rows["drafter.kind"][0])
    assert rows["data.features"] == ("''", "default")  # online: the target runs inside training
    assert list(rows) == fields_of(rows["drafter.kind"][0])
    assert rows["drafter.target_layer_ids"] == ("null", "default")  # the drafter's reference default
    kwargs, date, max_length = TEMPLATE_SETTINGS[recipe.name]
    assert rows["data.chat_template_kwargs"] == ((kwargs, source) if kwargs else ("''", "default"))
    assert rows["data.chat_template_date"] == ((date, source) if date else ("''", "default"))
    assert rows["data.chat_template"] == ("''", "default")  # the tokenizer's own template
    assert rows["data.max_length"][0] == str(max_length)
    # the data is not here: the steps are unknown, the batch is not
    assert list(sizes) == SIZE_ROWS and sizes["world size"][0] == "1"
    assert sizes["global batch"][0] == rows["data.batch_size"][0]
    assert sizes["total steps"] == ("unknown", f"train.epochs {rows['train.epochs'][0]} x steps per epoch")
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.name for p in RECIPES])
def test_every_recipe_s_template_settings_fit_the_published_template(recipe):
    """The arguments a recipe passes are variables its target's published template reads (a misspelt one, or
    enable_thinking given to gpt-oss, is refused by every command), and its date is a day."""
    from vatspec.data.chat import format_kwargs, load_template

    rows = {k: v for k, v, _ in config_sources(str(recipe), [])}
    family = next(f for f in PUBLISHED if recipe.name.startswith(f))
    template = load_template(None, str(TEMPLATES / PUBLISHED[family]), rows["data.chat_template_kwargs"],
                             rows["data.chat_template_date"] or None)
    kwargs, date, _ = TEMPLATE_SETTINGS[recipe.name]
    assert format_kwargs(template.kwargs) == (kwargs or "(none)")
    assert template.date == date


def test_the_thinking_recipe_changes_only_the_template_the_length_and_the_paths():
    """qwen3-8b-eagle3-vat-thinking.yaml is qwen3-8b-eagle3-vat.yaml served with thinking: every other field
    (optimizer, drafter, loss, schedule) is the non-thinking recipe's."""
    base, thinking = ({k: v for k, v, _ in config_sources(str(p), [])} for p in
                      (RECIPES_DIR / "qwen3-8b-eagle3-vat.yaml", RECIPES_DIR / "qwen3-8b-eagle3-vat-thinking.yaml"))
    changed = {k for k in base if base[k] != thinking[k]}
    assert changed == {"data.train", "data.max_length", "data.chat_template_kwargs", "train.out_dir"}
    assert (base["data.chat_template_kwargs"], thinking["data.chat_template_kwargs"]) == (
        "enable_thinking=false", "enable_thinking=true")
    assert thinking["data.max_length"] == 2 * base["data.max_length"] == 8192


def test_there_are_the_ten_recipes():
    assert [p.name for p in RECIPES] == sorted([*BASELINES, *BASELINES.values()])
    assert set(TEMPLATE_SETTINGS) == {p.name for p in RECIPES}


@pytest.mark.parametrize("baseline", sorted(BASELINES))
def test_each_baseline_is_its_vat_recipe_with_the_reference_objective(baseline):
    base, vat = ({k: v for k, v, _ in config_sources(str(RECIPES_DIR / name), [])}
                 for name in (baseline, BASELINES[baseline]))
    changed = {k for k in base if base[k] != vat[k]}  # the loss fields resolved from loss.kind change with it
    assert {"loss.kind", "train.out_dir"} <= changed
    assert all(k.startswith("loss.") or k == "train.out_dir" for k in changed)
    assert (base["loss.kind"], vat["loss.kind"]) == (base["drafter.kind"], "vat")
