"""``vatspec prepare-target``: convert the embedded default once and say where it is."""

from __future__ import annotations

import argparse
import time


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--force", action="store_true", help="convert again even if the folder exists")


def run(args: argparse.Namespace) -> int:
    from vatspec.target import open_target, prepare_default_target

    t0 = time.time()
    path = prepare_default_target(force=args.force)
    t1 = time.time()
    target = open_target(path, device="cpu", dtype="float32")
    t2 = time.time()
    print(f"default target: {path}")
    print(f"  layers={target.num_layers} hidden={target.hidden_size} vocab={target.vocab_size}")
    print(f"  prepare {t1 - t0:.1f}s, load {t2 - t1:.2f}s")
    return 0
