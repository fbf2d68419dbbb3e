"""Recipes beside the library (as torchtune keeps its ``recipes/``): the experiments on the embedded target.

    recipe.py      an experiment recipe read from YAML (experiments/*.yaml): size, arms, pairs, decoding, report
    experiment.py  the one runner: data -> feature cache -> arms in lockstep per seed -> calibrated decoding
    report.py      the reports it writes: demo, ablation, objectives

The real-target configs in this folder (qwen3-8b-*.yaml, llama3.1-8b-*.yaml) are ``vatspec train --config``
files; ``vatspec demo`` and ``vatspec ablate`` run the experiments here.
"""
