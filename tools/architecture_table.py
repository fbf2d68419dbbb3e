"""The architecture table of docs/architectures.md: each family of the matrix (``tests/arch_targets.py``) with its
target summary (``vatspec.target.architecture``: layer kinds, how verification takes its cache back, the engines that
serve its drafts) and the matrix's results per stage, from a JUnit report of ``tests/test_architectures.py``.

    .venv/bin/python -m pytest tests/test_architectures.py --junitxml=matrix.xml
    .venv/bin/python tools/architecture_table.py matrix.xml > table.md
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's tests/ (the tiny targets)

STAGES = [("logits", "logits"), ("greedy_ar", "T=0 AR"), ("greedy_speculative", "T=0 spec"),
          ("regenerate_rows", "regen"), ("cache_features", "cache"), ("train", "train"), ("export", "export"),
          ("check", "check")]
SHORT = {"attention": "attn", "sliding window": "sliding", "chunked attention": "chunked",
         "linear attention / SSM": "linear/SSM", "short convolution": "conv", "attention + SSM in parallel": "attn+SSM",
         "MLP only": "MLP", "MoE only": "MoE"}


def results(junit: Path) -> dict[str, dict[str, list[int]]]:
    """``{arch: {stage: [passed, run]}}`` from the report."""
    out: dict = {}
    for case in ET.parse(junit).iter("testcase"):
        test, _, params = case.get("name", "").partition("[")
        if params:
            ok = not any(case.find(t) is not None for t in ("failure", "error", "skipped"))
            cell = out.setdefault(params.rstrip("]").split("-")[0], {}).setdefault(test.removeprefix("test_"), [0, 0])
            cell[0], cell[1] = cell[0] + ok, cell[1] + 1
    return out


def row(name: str, s: dict, res: dict) -> str:
    kinds = ", ".join(f"{SHORT.get(k, k)} {n}" for k, n in s["kinds"].items())
    kinds += (", MoE" if s["experts"] else "") + (", MLA" if s["mla"] else "")
    kinds += (f", RoPE {s['rope_scaling']}" if s["rope_scaling"] else "")
    kinds += (f", logits {' '.join(s['logits'])}" if s["logits"] else "")
    how = {part.rsplit(": ", 1)[1] for part in s["rollback"].split(", ")}
    cells = []
    for stage, _ in STAGES:
        ok, n = res.get(stage, [0, 0])
        cells.append("—" if n == 0 else ("✓" if n == 1 else f"✓ {ok}/{n}") if ok == n else f"✗ {ok}/{n}")
    engines = [f"{'yes' if e['eagle3'] else 'no'} / {'yes' if e['dflash'] else 'no'}" for e in s["engines"].values()]
    rollback = " + ".join(h for h in ("crop", "record", "replay") if h in how)
    return f"| {name} ({'/'.join(s['architectures'])}) | {kinds} | {rollback} | " + " | ".join(cells + engines) + " |"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("junit", type=Path)
    ap.add_argument("--tokenizer", type=Path, default=None, help="the SmolLM2 folder (default: prepare it)")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    from tests.arch_targets import ARCHS, build_target
    from transformers import AutoTokenizer

    from vatspec.target import Target, prepare_default_target
    from vatspec.target.architecture import engine_support, summary

    tok = AutoTokenizer.from_pretrained(args.tokenizer or prepare_default_target())
    res = results(args.junit)
    engines = [f"{e} {info['version']} E3 / DF" for e, info in engine_support().items() if "version" in info]
    head = ["architecture", "layers", "rollback"] + [label for _, label in STAGES] + engines
    print("| " + " | ".join(head) + " |\n" + "|---" * len(head) + "|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in ARCHS:
            target = Target.from_pretrained(build_target(name, Path(tmp) / name, tok))
            print(row(name, summary(target), res.get(name, {})))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
