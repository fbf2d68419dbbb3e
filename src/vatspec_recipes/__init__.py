"""The recipes beside the library: training configs for real targets and the experiments on the embedded one.

    configs/       ``vatspec train --config NAME`` files for real targets (qwen3-8b-eagle3-vat, ...)
    experiments/   experiment recipes: size, arms, pairs, decoding, report (demo, ablation, objectives)
    recipe.py      an experiment recipe read from YAML
    experiment.py  the one runner: data -> feature cache -> arms in lockstep per seed -> calibrated decoding
    report.py      the reports it writes
    demo.py        the ``vatspec demo`` command
    ablate.py      the ``vatspec ablate`` command

This package uses ``vatspec`` and is never imported by it: it hands the ``vatspec`` command its two commands
and its config folder through entry points (``pyproject.toml``: ``vatspec.commands``, ``vatspec.configs``),
the way any other package can.
"""

from pathlib import Path

# command name -> (module, one-line help); read by ``vatspec --help`` without importing the modules
COMMANDS = {
    "demo": ("vatspec_recipes.demo", "the main job: baselines vs VAT on the embedded default target"),
    "ablate": ("vatspec_recipes.ablate",
               "the paper's ablation on one drafter, or (--arms) draft objectives side by side"),
}

CONFIGS = Path(__file__).resolve().parent / "configs"
