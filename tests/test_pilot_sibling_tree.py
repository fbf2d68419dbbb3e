"""scripts/pilot_sibling_tree.py: what each tree commits and costs per recorded round."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import load_script

# verify[n]: a target pass over n tokens; draft[k]: the drafter's work for a chain of k (AR steps)
COST = {"verify": [0.0, 1.0, 1.1, 1.5, 1.3, 1.6], "draft": [0.05, 0.07, 0.12]}
ROWS = [
    {"p": "a/0", "top": [5, 6, 7], "y": 5, "drafted": 2, "acc": 2},  # the chain of 2 accepted
    {"p": "a/0", "top": [5, 6, 7], "y": 6, "drafted": 2, "acc": 0},  # the second candidate was right
    {"p": "a/1", "top": [5, 6, 7], "y": 7, "drafted": 2, "acc": 0},  # the third
    {"p": "a/1", "top": [5, 6, 7], "y": 9, "drafted": 2, "acc": 0},  # none
    {"p": "a/1", "top": [5, 6, 7], "y": 5, "drafted": 1, "acc": 1},  # a last round, one draft allowed
]


@pytest.fixture(scope="module")
def pilot():
    return load_script("pilot_sibling_tree")  # it imports its sibling pilot by name, as when run from scripts/


@pytest.mark.parametrize(
    ("m", "depth", "committed", "cost"),
    [
        # chain k = 1: the top-1 candidate only, a 2-token pass
        (1, 1, [2, 1, 1, 1, 2], [0.07 + 1.1] * 5),
        # chain k = 2: a 3-token pass, the last round capped at one draft
        (1, 2, [3, 1, 1, 1, 2], [0.12 + 1.5] * 4 + [0.07 + 1.1]),
        # 3 siblings: any of the top 3 commits the slot, a 4-token pass, the drafter's k = 1 work
        (3, 1, [2, 2, 2, 1, 2], [0.07 + 1.3] * 5),
        # 2 siblings + the second token under the top-1: 4 tokens; the capped round drops the grandchild
        (2, 2, [3, 2, 1, 1, 2], [0.12 + 1.3] * 4 + [0.07 + 1.5]),
    ],
)
def test_tree_commits_and_costs(pilot, m, depth, committed, cost):
    com, cst = pilot.tree(ROWS, COST, m, depth)
    np.testing.assert_array_equal(com, committed)
    np.testing.assert_allclose(cst, cost)


def test_shapes_only_trees_whose_pass_was_timed(pilot):
    names = [s[0] for s in pilot.shapes(4, 4)]  # passes timed up to 4 tokens (DFlash block 4)
    assert names == ["chain 1", "chain 2", "siblings 2", "siblings 3", "siblings 2 + 1"]


def test_difference_is_the_pooled_speedup_difference(pilot):
    a, b = pilot.tree(ROWS, COST, 3, 1), pilot.tree(ROWS, COST, 1, 1)
    est, lo, hi = pilot.per_prompt_difference(ROWS, a, b)
    assert est == pytest.approx(pilot.speedup(*a) - pilot.speedup(*b))
    assert est == pytest.approx(9 / (5 * 1.37) - 7 / (5 * 1.17))
    assert lo <= est <= hi
    assert pilot.per_prompt_difference(ROWS, a, a) == (0.0, 0.0, 0.0)
