"""The demo's four lockstep arms with and without a shared teacher (``chunked.shared_teacher``).

In lockstep every arm reads the same target rows: EAGLE-3 and EAGLE-3 + VAT the same rows through
the same draft vocabulary, the two DFlash arms the same anchors. Shared, the target side of the
chunked loss (the target's lm_head over the full vocabulary on those rows, argmax and soft labels)
runs once per drafter kind instead of once per arm. Both modes train the same arms on the same
batches from the demo's feature cache, alternating, and print the median seconds of one optimizer
step of the four arms and the ratio.

    .venv/bin/python scripts/bench_shared_teacher.py [--threads 2] [--steps 8]

Needs the demo's feature cache (``vatspec demo`` makes it).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from vatspec import data as D
from vatspec.chunked import TeacherShare
from vatspec.data import BatchIterator
from vatspec.demo import ARMS, SIZES, arm_configs
from vatspec.drafters import plan_batch
from vatspec.features import CachedTarget, FeatureCache
from vatspec.target import open_target, vatspec_home
from vatspec.train import MIN_SUPERVISED, _build_arm, _pad_id, arm_step, shared_target_pass, step_generator


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per mode")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    size = SIZES["default"]
    home = vatspec_home() / "demo"
    stem = f"regen-n{size.prompts}-t{size.regen_tokens}-s{size.seed}"
    data, cache_dir = home / f"{stem}.jsonl", home / f"{stem}.features-m{size.max_length}"
    if not cache_dir.is_dir():
        raise SystemExit(f"{cache_dir}: no feature cache; run `vatspec demo` first")
    target = open_target("default", device="cpu", dtype="float32")
    cfgs = arm_configs(list(ARMS), size, data, Path(tempfile.mkdtemp()) / "runs")
    cache = FeatureCache(cache_dir)
    examples = [e for e in cache.examples(range(len(cache.rows))) if sum(e.loss_mask) >= MIN_SUPERVISED]
    cached = CachedTarget(target, [cache])
    arms = [_build_arm(c, target, D.token_counts(examples, target.vocab_size), 100, 1, target.device, None)
            for c in cfgs]
    batches = BatchIterator(examples, size.batch_size, _pad_id(target), seed=0)
    times: dict[str, list[float]] = {"alone": [], "shared": []}
    for step in range(1 + args.steps):  # step 0 warms up
        batch = next(batches)
        modes = ["alone", "shared"] if step % 2 == 0 else ["shared", "alone"]
        for mode in modes:
            gens = [step_generator(0, step, 0, 0) for _ in arms]
            t0 = time.perf_counter()
            plans = [plan_batch(a.drafter, batch, a.cfg.drafter, g, with_logits=not a.loss_cfg.chunk_size)
                     for a, g in zip(arms, gens)]
            touts = shared_target_pass(cached, batch, [a.drafter for a in arms], plans)
            shared = TeacherShare() if mode == "shared" else None
            for a, tout, plan, g in zip(arms, touts, plans, gens):
                a.opt.zero_grad(set_to_none=True)
                res = arm_step(a.model, a.drafter, batch, tout, plan, a.loss_cfg, g, shared)
                res.loss.backward()
                a.opt.step()
            if step:
                times[mode].append(time.perf_counter() - t0)
    med = {m: statistics.median(v) for m, v in times.items()}
    print(f"{size.batch_size} x {size.max_length} tokens, {len(arms)} arms ({', '.join(ARMS)}), "
          f"{args.threads} threads, median of {args.steps} steps")
    print(f"  each arm its own teacher: {med['alone']:.2f} s/step")
    print(f"  shared teacher:           {med['shared']:.2f} s/step")
    print(f"  ratio alone / shared:     {med['alone'] / med['shared']:.2f}x")


if __name__ == "__main__":
    main()
