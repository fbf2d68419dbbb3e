"""scripts/pilot_domain_mix.py's code prompts: HumanEval-wrapped standard-library functions cut after their
docstrings, seeded, and disjoint from the bundled benchmarks."""

from __future__ import annotations

import ast
import re

from tests.conftest import load_script
from vatspec.benchmarks import benchmark_prompts, normalize


def test_code_prompts_are_functions_cut_after_their_docstrings():
    mix = load_script("pilot_domain_mix")
    prompts = mix.code_prompts(40)
    assert [c.id for c in prompts] == [c.id for c in mix.code_prompts(40)]  # seeded: the same draw again
    assert len({c.id for c in prompts}) == 40
    bench = benchmark_prompts()
    for conv in prompts:
        (text,) = conv.prompts()
        assert text.startswith("Complete the following Python function.\n\n```python\n") and text.endswith("```")
        assert normalize(text) not in bench
        src = re.search(r"```python\n(.*)```", text, re.S).group(1)
        (fn,) = ast.parse(src).body  # one function, its body only the docstring
        assert isinstance(fn, ast.FunctionDef) and not fn.name.startswith("_") and not fn.decorator_list
        assert len(fn.body) == 1 and 60 <= len(ast.get_docstring(fn, clean=False)) <= 700
        path = conv.id.removeprefix("stdlib/").split(":")[0]
        assert path.endswith(".py") and not any(s in path for s in mix.SKIP)
