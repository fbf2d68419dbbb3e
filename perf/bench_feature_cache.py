"""Training from a feature cache against training online, on the demo's corpus and the default target.

Prints, in one run:
  - write throughput of ``vatspec cache-features`` (tokens/s) and the disk size of the demo's corpus
    (128 regenerated conversations, max length 192) for the demo's layer set, bfloat16 and float32;
  - bytes per token on disk for each drafter's default layer set and each storage dtype;
  - the training step online (target forward + drafter step) against cached (cache read + lm_head +
    drafter step), per drafter and for the demo's four lockstep arms, on the same batches,
    alternating (``timer.SideBySide``), median seconds, and the ratio online / cached.

    OMP_NUM_THREADS=1 .venv/bin/python perf/bench_feature_cache.py [--threads 1] [--steps 6] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from timer import SideBySide

from vatspec import data as D
from vatspec.drafters import plan_batch
from vatspec.features import CachedTarget, FeatureCache, config_layer_ids, drafter_layer_ids, write_cache
from vatspec.outputs import vatspec_home
from vatspec.target import open_target
from vatspec.train import arm_step, build_arm, pad_id, shared_target_pass, step_generator, tokenize_items
from vatspec_recipes.experiment import arm_configs
from vatspec_recipes.recipe import load_recipe


def demo_corpus(target, size) -> tuple[Path, str]:
    """The demo's regenerated training set: its cached file, else the same 128 prompts taken from the
    cached 512-prompt regeneration (same prompts, greedy, same token budget), else regenerated."""
    from vatspec.benchmarks import prepare_prompts
    from vatspec_recipes.experiment import prepare_training_data

    home = vatspec_home() / "demo"
    own = home / f"regen-n{size.prompts}-t{size.regen_tokens}-s{size.seed}.jsonl"
    if own.is_file():
        return own, f"{own} (the demo's cached file)"
    big = home / f"regen-n512-t{size.regen_tokens}-s{size.seed}.jsonl"
    if big.is_file():
        ids = {c.id for c in prepare_prompts(size.prompts, seed=size.seed, max_turns=1, max_chars=600)}
        convs = [c for c in D.load_conversations(big) if c.id in ids]
        if len(convs) == len(ids):
            path = Path(tempfile.mkdtemp()) / own.name
            path.write_text("".join(json.dumps(c.to_json(), ensure_ascii=False) + "\n" for c in convs))
            return path, (f"the demo's {len(convs)} prompts taken from {big} (same prompts and greedy settings; "
                          f"{own.name} was not cached)")
    path, _ = prepare_training_data(target, size, vatspec_home(), progress=False)
    return path, f"{path} (regenerated now)"


def write(target, convs, out: Path, layers, dtype: str, max_length: int) -> dict:
    t0 = time.perf_counter()
    man = write_cache(target, convs, out, layer_ids=layers, dtype=dtype, max_length=max_length, batch_size=8,
                      progress=False)
    secs = time.perf_counter() - t0
    size = sum(p.stat().st_size for p in out.iterdir())  # shards + index + manifest
    return {"tokens": man["tokens"], "bytes": size, "bytes_per_token": size / man["tokens"],
            "tokens_per_s": man["tokens"] / secs, "seconds": secs}


def step_times(target, cached, cfgs, examples, steps: int, warmup: int) -> dict:
    """Median seconds of one optimizer step of the arms ``cfgs`` (lockstep), online and cached,
    alternating on the same batches; and of the target part alone (forward vs read + lm_head)."""
    from vatspec.data import BatchIterator

    counts = D.token_counts(examples, target.vocab_size)
    arms = [build_arm(c, target, counts, steps + warmup, device=target.device) for c in cfgs]
    batches = BatchIterator(examples, cfgs[0].data.batch_size, pad_id(target), seed=0)
    sources = {"online": target, "cached": cached}
    t = SideBySide(list(sources), repeats=steps, warmup=warmup)
    for step, order in t.rounds():
        batch = next(batches)
        for mode in order:
            gens = [step_generator(0, step, 0, 0) for _ in arms]
            with t.time(mode):
                with t.time(f"{mode}_target"):
                    plans = [plan_batch(a.drafter, batch, a.cfg.drafter, g, with_logits=not a.loss_cfg.chunk_size)
                             for a, g in zip(arms, gens)]
                    touts = shared_target_pass(sources[mode], batch, [a.drafter for a in arms], plans)
                for a, tout, plan, g in zip(arms, touts, plans, gens):
                    a.opt.zero_grad(set_to_none=True)
                    res = arm_step(a.model, a.drafter, batch, tout, plan, a.loss_cfg, g)
                    res.loss.backward()
                    torch.nn.utils.clip_grad_norm_(a.params, a.optim_cfg.grad_clip)
                    a.opt.step()
    med = {k: t.median(k) for k in ("online", "cached", "online_target", "cached_target")}
    med["ratio"] = t.ratio("online", "cached")
    return med


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: a shared 2-core CPU)")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per mode")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--subset", type=int, default=32, help="conversations for the per-layer-set bytes/token")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    recipe = load_recipe("demo")
    size = recipe.size
    target = open_target("default", device="cpu", dtype="float32")
    data, what = demo_corpus(target, size)
    convs = D.load_conversations(data)
    tmp = Path(tempfile.mkdtemp(prefix="bench-features-"))
    L = target.num_layers
    sets = {"eagle3": drafter_layer_ids("eagle3", L), "dflash": drafter_layer_ids("dflash", L)}
    names = list(recipe.arms)
    cfgs = arm_configs(recipe.arms, size, data, tmp / "runs")
    sets["demo (eagle3 + dflash)"] = sorted({i for c in cfgs for i in config_layer_ids(c.drafter, L)})
    print(f"corpus: {what}: {len(convs)} conversations, max length {size.max_length}; "
          f"{args.threads} thread(s)")

    # 1. the demo's corpus, whole: write throughput and disk size
    demo_layers = sets["demo (eagle3 + dflash)"]
    full = {dt: write(target, convs, tmp / f"demo-{dt}", demo_layers, dt, size.max_length)
            for dt in ("bfloat16", "float32")}
    print(f"\ndemo corpus, layers {demo_layers}: {full['float32']['tokens']} tokens")
    for dt, r in full.items():
        print(f"  {dt:>9}: {r['bytes'] / 2**20:7.1f} MiB on disk ({r['bytes_per_token']:.0f} bytes/token), "
              f"written at {r['tokens_per_s']:.0f} tokens/s ({r['seconds']:.1f} s)")

    # 2. bytes per token per drafter layer set and dtype (a subset: the size per token does not depend on it)
    sub = convs[: args.subset]
    per = {}
    print(f"\nbytes per token on disk ({len(sub)} conversations; shards + index + manifest):")
    for name, layers in sets.items():
        per[name] = {dt: write(target, sub, tmp / f"{name[:6]}-{dt}", layers, dt, size.max_length)["bytes_per_token"]
                     for dt in ("bfloat16", "float16", "float32")}
        print(f"  {name:<24} layers {str(layers):<16} " + "  ".join(f"{dt} {v:6.0f}" for dt, v in per[name].items()))

    # 3. step time, online vs cached (the demo's float32 cache), same batches
    examples = tokenize_items(convs, target.tokenizer, size.max_length, str(data))
    cached = CachedTarget(target, [FeatureCache(tmp / "demo-float32")])
    runs = {"eagle3 + VAT": [c for n, c in zip(names, cfgs) if n == "EAGLE-3 + VAT"],
            "dflash + VAT": [c for n, c in zip(names, cfgs) if n == "DFlash + VAT"],
            "demo: 4 arms in lockstep": cfgs}
    steps = {}
    print(f"\ntraining step, batch {size.batch_size} x <= {size.max_length} tokens, median of {args.steps} "
          "(online | cached, seconds; target part in brackets):")
    for name, arm_cfgs in runs.items():
        r = step_times(target, cached, arm_cfgs, examples, args.steps, args.warmup)
        steps[name] = r
        print(f"  {name:<26} online {r['online']:.3f} [{r['online_target']:.3f}]   cached {r['cached']:.3f} "
              f"[{r['cached_target']:.3f}]   ratio online/cached {r['ratio']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"corpus": what, "threads": args.threads, "demo_corpus": full,
                                               "bytes_per_token": per, "layer_sets": sets, "step_s": steps},
                                              indent=2))


if __name__ == "__main__":
    main()
