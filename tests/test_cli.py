"""The ``vatspec`` command: every subcommand has the one shape, and the library holds no CLI."""

from __future__ import annotations

import argparse
import ast
import json
import math
import re
from pathlib import Path

import pytest

from vatspec.cli import COMMANDS, all_commands, command_module, main

SRC = Path(__file__).resolve().parents[1] / "src" / "vatspec"


@pytest.mark.parametrize("name", list(all_commands()))
def test_every_command_is_a_module_with_configure_and_run(name, capsys):
    module = command_module(name)
    want = f"vatspec.commands.{name.replace('-', '_')}" if name in COMMANDS else f"vatspec_recipes.{name}"
    assert module.__name__ == want
    assert callable(module.configure) and callable(module.run)
    parser = argparse.ArgumentParser(prog=f"vatspec {name}")
    module.configure(parser)
    with pytest.raises(SystemExit) as e:
        main([name, "--help"])
    assert e.value.code == 0 and f"usage: vatspec {name}" in capsys.readouterr().out


def test_the_library_never_imports_the_recipes():
    """Arrows point one way: vatspec_recipes uses vatspec; vatspec finds the recipes' commands and configs
    through entry points only."""
    offenders = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
                 if re.search(r"^\s*(from|import) vatspec_recipes\b", p.read_text(), re.M)]
    assert offenders == []
    assert {"demo", "ablate"} <= set(all_commands()) and not {"demo", "ablate"} & set(COMMANDS)


def test_library_modules_hold_no_command_line_code():
    """argparse, SystemExit and configure/run live in commands/ and cli.py only."""
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel == "cli.py" or rel.startswith("commands/"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
                if "argparse" in names:
                    offenders.append(f"{rel}:{node.lineno} imports argparse")
            elif isinstance(node, ast.Name) and node.id == "SystemExit":
                offenders.append(f"{rel}:{node.lineno} raises SystemExit")
        top = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        if {"configure", "run"} <= top:
            offenders.append(f"{rel} defines configure / run")
    assert not offenders, offenders


def test_unknown_command_and_help(capsys):
    assert main(["nope"]) == 2 and "unknown command 'nope'" in capsys.readouterr().err
    assert main([]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in all_commands())


def test_dtype_flags_take_aliases_and_name_the_bad_one(capsys):
    parser = argparse.ArgumentParser()
    command_module("eval").configure(parser)
    assert parser.parse_args(["--target", "default", "--dtype", "bf16"]).dtype == "bfloat16"
    assert parser.parse_args(["--target", "default"]).dtype is None  # bfloat16 on a GPU, float32 on a CPU
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "fp8"])
    assert "dtype 'fp8' is not one of float32, bfloat16, float16" in capsys.readouterr().err
    parser = argparse.ArgumentParser()
    command_module("cache-features").configure(parser)
    for flag in ("--dtype", "--feature-dtype"):
        with pytest.raises(SystemExit):
            parser.parse_args([flag, "int8"])
        assert f"argument {flag}: dtype 'int8' is not one of" in capsys.readouterr().err


def test_export_takes_k_and_its_speculators_name():
    parser = argparse.ArgumentParser()
    command_module("export").configure(parser)
    for flag in ("--k", "--speculative-tokens"):
        assert parser.parse_args(["run", "--out", "served", flag, "4"]).k == 4
    assert parser.parse_args(["run", "--out", "served"]).k is None  # the draft's own k


def test_demo_refuses_a_foreign_folder_in_one_line(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("mine")
    assert main(["demo", "--quick", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vatspec demo: error: ") and "not made by vatspec demo" in err and "Traceback" not in err
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_demo_redecode_refuses_a_size_and_needs_a_finished_demo(tmp_path, capsys):
    assert main(["demo", "--redecode", "--full", "--steps", "5", "--out", str(tmp_path)]) == 2
    assert main(["demo", "--redecode", "--precision", "bf16", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vatspec demo: error: ") and "drop --full --steps" in err and "drop --precision" in err
    assert main(["demo", "--redecode", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "demo.json: not the record of a finished demo" in err and "Traceback" not in err


def test_demo_sizes_full_and_seeds(capsys):
    """--quick / --full pick the recipe (demo-quick, demo-full: the long recipe); the size flags change it."""
    from vatspec_recipes.recipe import load_recipe

    mod = command_module("demo")
    parser = argparse.ArgumentParser()
    mod.configure(parser)

    def size(*argv):
        args = parser.parse_args(list(argv))
        return load_recipe(args.recipe or mod.size_name(args), size=mod.size_changes(args)).size

    assert size() == load_recipe("demo").size and size("--quick") == load_recipe("demo-quick").size
    full = size("--full")
    assert full.seeds == 4 and full.prompts == 512  # the long recipe reports a mean over 4 seeds
    assert size("--quick", "--seeds", "2").seeds == 2
    assert full.original_answers == 0
    assert size("--full", "--original-answers", "1024").original_answers == 1024
    assert size().precision == "auto" and size("--precision", "fp32").precision == "fp32"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quick", "--full"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_ablate_takes_no_seeds_nor_redecode(tmp_path, capsys):
    """The ablation's arms share one seed, and it has no redecode: neither is offered (demo has both)."""
    for flag in (["--seeds", "2"], ["--redecode"]):
        with pytest.raises(SystemExit) as e:
            main(["ablate", "--quick", *flag, "--out", str(tmp_path / "ab")])
        assert e.value.code == 2 and f"unrecognized arguments: {' '.join(flag)}" in capsys.readouterr().err
    assert not (tmp_path / "ab").exists()  # refused before anything was written


def test_outputs_are_strict_json(tmp_path):
    """A NaN or inf (a diverged loss, an empty held-out metric) is written as null: jq, JavaScript and Go refuse the
    bare ``NaN`` Python writes by default. ``read_metrics`` reads it back as NaN."""
    from vatspec.outputs import strict_json
    from vatspec.train.checkpointer import read_metrics

    text = strict_json({"step": 3, "loss": float("nan"), "eval/tau_sim": float("inf"), "cond": [1.0, float("-inf")]})
    assert json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c}")) == {
        "step": 3, "loss": None, "eval/tau_sim": None, "cond": [1.0, None]}
    (tmp_path / "metrics.jsonl").write_text(text + "\n")
    (curve,) = read_metrics(tmp_path / "metrics.jsonl")
    assert curve["step"] == 3 and math.isnan(curve["loss"])
