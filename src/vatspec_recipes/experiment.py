"""One runner for every experiment: arms -> training in lockstep -> decoding -> report.

An experiment is a recipe (YAML: ``experiments/*.yaml`` of this package, named like ``demo-quick``, or a
file): a size (data, steps, decoding), the arms (a name and its ``vatspec train`` overrides each), the
pairs compared (an arm -> the arm it is measured against), how decoding chooses k, and the report it
writes. ``vatspec demo`` and ``vatspec ablate`` run the recipes ``demo`` (``demo-quick``, ``demo-full``:
the long recipe), ``ablation`` and ``objectives``; ``vatspec demo --recipe NAME|FILE`` runs any other.

    recipe = load_recipe("demo-quick")
    summary = run(recipe, Path("reports/demo"))

The run, on the embedded default target:
1. the training set: ``size.prompts`` bundled prompts answered by the target (cached under
   ``$VATSPEC_HOME/demo``; an interrupted regeneration resumes), optionally followed by ShareGPT
   conversations with their original answers;
2. a feature cache of the target's layer outputs (float32, computed at the arms' training precision),
   so training runs the lm_head only;
3. every arm trained per seed; arms that share their batches train in lockstep (``train.train_arms``);
4. decoding of the held-out bundled benchmarks at temperature 0, interleaved with the autoregressive
   baseline, at a k chosen on held-out training prompts (``decode``: ``per_pair``, each pair at its
   baseline's k; ``one_k``, every arm at the first arm's; ``none``, no decoding);
5. the report (``vatspec_recipes.report``) and the JSON behind it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import time
from pathlib import Path

import torch

from vatspec_recipes.recipe import ExperimentError, Recipe, Size
from vatspec_recipes.report import slug

log = logging.getLogger(__name__)  # the steps as they run; the commands print them to stderr


# ----------------------------------------------------------------------------- the steps
# regeneration's batches: 64 rows at most, 4096 first-prompt tokens at most (rows x the longest), so
# short prompts run 30-64 a batch and the longest ~12
REGEN_BATCH = (64, 4096)
# the cache's storage; computed at the arms' train.precision, training from it equals online training
FEATURE_DTYPE = "float32"


def prepare_training_data(target, size: Size, home: Path, progress: bool = True) -> tuple[Path, dict]:
    """``size.prompts`` bundled prompts, answered by the target (greedy); cached and resumable."""
    from vatspec import data as D
    from vatspec.benchmarks import prepare_prompts

    out = home / "demo" / f"regen-n{size.prompts}-t{size.regen_tokens}-s{size.seed}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    # short single-turn prompts: on a CPU the prefill of long prompts dominates regeneration
    prompts = prepare_prompts(size.prompts, seed=size.seed, max_turns=1, max_chars=600)
    t0 = time.perf_counter()
    stats = D.regenerate(prompts, target, out, batch_size=REGEN_BATCH[0], batch_tokens=REGEN_BATCH[1],
                         max_new_tokens=size.regen_tokens, max_length=size.max_length, progress=progress)
    info = {**dataclasses.asdict(stats), "seconds": time.perf_counter() - t0, "path": str(out),
            "tokens_per_s": stats.tokens_per_s}
    return out, info


def add_original_answers(regen_path: Path, size: Size) -> tuple[Path, dict]:
    """The regenerated training set followed by ``size.original_answers`` ShareGPT conversations with their
    original answers (first turn, prompt <= 600 characters, drawn with seed + 1), none with the id or the
    prompt of a regenerated one: ``<regen>+answers<N>.jsonl`` beside it, rewritten only when it would change."""
    from vatspec import data as D
    from vatspec.benchmarks import prepare_prompts, prompt_key
    from vatspec.features.format import atomic_write

    t0 = time.perf_counter()
    regen = D.load_conversations(regen_path)
    if len(regen) != size.prompts:  # data.heldout_pool counts on it: the held-out split must stay regenerated
        raise ExperimentError(f"{regen_path}: {len(regen)} conversations, not the {size.prompts} regenerated "
                              "prompts; delete it and run again")
    ids, keys = {c.id for c in regen}, {prompt_key(c) for c in regen}
    drawn = prepare_prompts(size.original_answers + len(regen), seed=size.seed + 1, sources=("sharegpt",),
                            max_turns=1, max_chars=600, answers=True)
    extra = [c for c in drawn if c.id not in ids and prompt_key(c) not in keys][: size.original_answers]
    out = regen_path.with_name(f"{regen_path.stem}+answers{size.original_answers}.jsonl")
    text = "".join(json.dumps(c.to_json(), ensure_ascii=False) + "\n" for c in [*regen, *extra])
    if not out.is_file() or out.read_text(encoding="utf-8") != text:
        atomic_write(out, text.encode("utf-8"))
    return out, {"path": str(out), "regenerated": len(regen), "original_answers": len(extra),
                 "seconds": time.perf_counter() - t0}


def prepare_features(target, data_path: Path, cfgs, progress: bool = True) -> tuple[Path, dict]:
    """The feature cache of the training set beside it (``<data>.features-m<max_length>``), holding the
    layers every config of ``cfgs`` reads; written once, reused while it fits, rebuilt when it does not."""
    from vatspec import data as D
    from vatspec.features import FeatureCacheError, config_layer_ids, write_cache
    from vatspec.features.format import CacheWriteError

    max_length, precision = cfgs[0].data.max_length, cfgs[0].train.precision
    out = data_path.with_name(f"{data_path.stem}.features-m{max_length}")
    layers = sorted({i for c in cfgs for i in config_layer_ids(c.drafter, target.num_layers)})
    convs = D.load_conversations(data_path)
    kw = {"layer_ids": layers, "dtype": FEATURE_DTYPE, "precision": precision, "max_length": max_length,
          "source": str(data_path), "progress": progress}
    try:
        man = write_cache(target, convs, out, **kw)
    except CacheWriteError:  # a full disk: what was written stays, to resume
        raise
    except FeatureCacheError as e:  # an earlier run's cache for other data or layers: the runner owns it
        log.info(f"    rebuilding the feature cache ({e})")
        shutil.rmtree(out)
        man = write_cache(target, convs, out, **kw)
    w = man["written"]
    info = {"path": str(out), "layer_ids": layers, "dtype": FEATURE_DTYPE, "precision": precision,
            "tokens": man["tokens"], "bytes": sum(s["bytes"] for s in man["shards"]), "written_tokens": w["tokens"],
            "seconds": w["seconds"]}
    return out, info


def train_precision(size: Size) -> str:
    """``size.precision``, "auto" resolved for the CPU the runner trains on (``precision.native_bf16``)."""
    from vatspec.target.precision import native_bf16

    if size.precision == "auto":
        return "bf16" if native_bf16(torch.device("cpu")) else "fp32"
    return size.precision


def arm_configs(arms: dict[str, tuple[str, ...]], size: Size, data_path: Path, runs_dir: Path,
                features: Path | None = None, train_seed: int | None = None) -> list:
    """One run config per arm: the size's data, steps (at the arm's drafter batch), optimizer and seed
    (``train_seed``, else ``size.seed``), then the arm's own overrides (which win), in ``runs_dir/<slug>``."""
    from vatspec.config import ConfigError, load_config

    common = [
        "target.path=default", f"data.train={data_path}", f"data.max_length={size.max_length}",
        *([f"data.features={features}"] if features else []),
        "data.heldout_fraction=0.1", "data.heldout_max=16", f"data.heldout_pool={size.prompts}",
        f"data.loss_on={size.loss_on}",
        f"drafter.draft_vocab_size={size.draft_vocab}", f"drafter.ttt_steps={size.ttt_steps}",
        f"drafter.block_size={size.block_size}", f"drafter.num_anchors={size.anchors}",
        f"train.seed={size.seed if train_seed is None else train_seed}", f"train.precision={train_precision(size)}",
        "train.keep_checkpoints=1", "train.save_every=0", "train.save_minutes=0",  # a rerun starts afresh
    ]
    cfgs = []
    for name, extra in arms.items():
        kind = next((e.split("=", 1)[1] for e in extra if e.startswith("drafter.kind=")), None)
        if kind is None:
            raise ExperimentError(f"arm {name!r}: its overrides name no drafter.kind")
        sized = [f"data.batch_size={size.batch_of(kind)}", f"train.steps={size.steps_of(kind)}",
                 f"train.eval_every={size.eval_every_of(kind)}", *size.optim_of(kind),
                 *([f"optim.lr={size.eagle3_lr}"] * (kind == "eagle3"))]
        try:
            cfgs.append(load_config(None, [*common, *sized, *extra, f"train.out_dir={runs_dir / slug(name)}"]))
        except ConfigError as e:
            raise ExperimentError(f"arm {name!r}: {e}") from None
    return cfgs


def train_lockstep(cfgs: list, progress: bool = True) -> list[dict]:
    """``train.train_arms`` over every group of configs that share their batches (the same data section and
    schedule); each one's final held-out metrics, in the order of ``cfgs``."""
    from vatspec.train import lockstep_key, train_arms

    groups: dict[str, list[int]] = {}
    for i, c in enumerate(cfgs):
        groups.setdefault(lockstep_key(c), []).append(i)
    finals: list[dict] = [{} for _ in cfgs]
    for idx in groups.values():
        for i, final in zip(idx, train_arms([cfgs[i] for i in idx], progress=progress)):
            finals[i] = final
    return finals


def runs_dir(out: Path, size: Size, seed: int) -> Path:
    """Where one seed's run folders are: ``runs/`` for one seed, ``runs/seed<S>/`` for several."""
    return out / "runs" if size.seeds == 1 else out / "runs" / f"seed{seed}"


# ----------------------------------------------------------------------------- the runner
def run(recipe: Recipe, out: Path, *, threads: int | None = None, progress: bool = True) -> dict:
    """Steps 1-5 of the module's docstring for ``recipe``, into the report folder ``out``; the summary."""
    from vatspec.outputs import vatspec_home
    from vatspec.target import open_target
    from vatspec.train import CHAINS_KEY

    t_start = time.perf_counter()
    size = dataclasses.replace(recipe.size, precision=train_precision(recipe.size))  # the report records what ran
    recipe = dataclasses.replace(recipe, size=size)
    arm_configs(recipe.arms, size, Path("data.jsonl"), out / "runs")  # a bad arm fails before any work
    prepare_out(out)
    if threads:
        torch.set_num_threads(threads)
    timings: dict[str, float] = {}
    log.info("1/5 preparing the embedded SmolLM2-135M-Instruct target")
    t = time.perf_counter()
    target = open_target("default", device="cpu", dtype="float32")
    timings["target"] = time.perf_counter() - t

    log.info(f"2/5 training set: {size.prompts} bundled prompts, responses regenerated by the target")
    t = time.perf_counter()
    data_path, regen = prepare_training_data(target, size, vatspec_home(), progress)
    log.info(f"    {data_path} ({regen['new_tokens']} new tokens this run, {regen['tokens_per_s']:.1f} tok/s)")
    if size.original_answers:
        data_path, regen["with_original_answers"] = add_original_answers(data_path, size)
        log.info(f"    + {regen['with_original_answers']['original_answers']} ShareGPT conversations with their "
                 f"original answers: {data_path}")
    timings["data"] = time.perf_counter() - t

    log.info(f"3/5 training {len(recipe.arms)} arms x {size.seeds} seed(s) ({size.precision}) from a feature cache "
             "(the target's layer outputs, computed once); arms sharing their batches train in lockstep")
    t = time.perf_counter()
    # both drafters' default layers too: every recipe at this size shares one cache
    both = {**recipe.arms, "_e": ("drafter.kind=eagle3",), "_d": ("drafter.kind=dflash",)}
    features, feature_info = prepare_features(target, data_path, arm_configs(both, size, data_path, out), progress)
    timings["features"] = time.perf_counter() - t
    log.info(f"    {features} ({feature_info['bytes'] / 2**20:.0f} MiB, {feature_info['tokens']} tokens, "
             f"{feature_info['written_tokens']} written this run)")
    t = time.perf_counter()
    cfgs, finals = {}, {}
    for seed in recipe.seeds():
        names = recipe.names(seed)
        seed_cfgs = arm_configs(recipe.arms, size, data_path, runs_dir(out, size, seed), features=features,
                                train_seed=seed)
        if size.seeds > 1:
            log.info(f"    seed {seed}")
        cfgs.update(zip(names.values(), seed_cfgs))
        finals.update(zip(names.values(), train_lockstep(seed_cfgs, progress=progress)))
    timings["train"] = time.perf_counter() - t
    chains = {n: f.pop(CHAINS_KEY, None) for n, f in finals.items()}  # kept in each run's heldout_chains.json
    trained = {"regeneration": regen, "features": feature_info, "train_final": finals,
               "train_paired": paired_tau_sim(chains, recipe.seed_pairs())}
    return decode_and_report(recipe, out, target, cfgs, trained, timings, t_start, progress)


def redecode(out: Path, *, threads: int | None = None, progress: bool = True) -> dict:
    """Steps 4-5 again on the drafts a finished run left in ``out``: k chosen anew and every draft decoded with
    the current decoding code, the report rewritten; nothing is retrained. The recipe, training figures and
    data-step timings are the ones its record (``demo.json``) holds."""
    from vatspec.config import ConfigError, load_config
    from vatspec.target import open_target

    record = out / "demo.json"
    try:
        old = json.loads(record.read_text())
        r = old["recipe"]
        recipe = Recipe(name=r["name"], title=r["title"], report=r["report"],
                        size=Size(**{**old["size"], "benches": tuple(old["size"]["benches"])}),
                        arms={a: tuple(o) for a, o in r["arms"].items()}, pairs=r["pairs"], decode=r["decode"],
                        hf_baseline=r["hf_baseline"])
        trained = {k: old[k] for k in ("regeneration", "features", "train_final", "train_paired")}
        spent = old["timings_s"]
        timings = {k: spent[k] for k in ("target", "data", "features", "train")}
        before_decoding = spent["total"] - spent["eval"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        why = "written before runs recorded their recipe" if isinstance(e, KeyError) and "recipe" in str(e) else \
            f"{type(e).__name__}: {e}"
        raise ExperimentError(f"{record}: not the record of a finished demo ({why}); run `vatspec demo` there "
                              "first") from None
    if threads:
        torch.set_num_threads(threads)
    log.info(f"re-decoding the drafts of {out} ({recipe.size.steps} steps, {recipe.size.seeds} seed(s)); "
             "nothing is retrained")
    target = open_target("default", device="cpu", dtype="float32")
    cfgs = {}
    for seed in recipe.seeds():
        for arm, name in recipe.names(seed).items():
            run_dir = runs_dir(out, recipe.size, seed) / slug(arm)
            try:
                cfg = load_config(run_dir / "config.yaml")
            except ConfigError as e:
                raise ExperimentError(f"{run_dir}: not a trained run of this demo ({e})") from None
            if not (run_dir / "latest").is_file():
                raise ExperimentError(f"{run_dir}: holds no checkpoint (no {run_dir / 'latest'}); train it again")
            cfgs[name] = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, out_dir=str(run_dir)))
    trained["redecoded"] = time.strftime("%Y-%m-%d %H:%M")
    t_start = time.perf_counter() - before_decoding  # the wall time: the original steps 1-3, then this decoding
    return decode_and_report(recipe, out, target, cfgs, trained, timings, t_start, progress)


def decode_and_report(recipe: Recipe, out: Path, target, cfgs: dict, trained: dict, timings: dict,
                      t_start: float, progress: bool = True) -> dict:
    """Steps 4-5: decode every trained arm (``cfgs``: result name -> its run config) at its calibrated k, then
    the summary and the report. ``trained``: the data and training figures of steps 2-3."""
    from vatspec.benchmarks import load_benchmark
    from vatspec.drafts import open_draft
    from vatspec.eval import bench
    from vatspec_recipes import report

    size, results = recipe.size, None
    t = time.perf_counter()
    if recipe.decode != "none":
        log.info(f"4/5 decoding {', '.join(size.benches)} ({size.eval_prompts} prompts each, T=0, "
                 f"{size.eval_tokens} new tokens), interleaved with the autoregressive baseline")
        methods = {n: open_draft(c.train.out_dir, target) for n, c in cfgs.items()}
        calibration = choose_k(recipe, target, methods, cfgs)
        prompts = {b: load_benchmark(b)[: size.eval_prompts] for b in size.benches}
        results = bench.evaluate(target, methods, prompts, temperature=0.0, max_new_tokens=size.eval_tokens,
                                 warmup=1, seed=size.seed, progress=progress, hf_baseline=recipe.hf_baseline,
                                 k={n: c["k"] for n, c in calibration.items()} or None,
                                 recheck=[n for n, c in calibration.items() if "chosen_on" not in c])
        if calibration:
            results["calibration"] = calibration
    timings["eval"] = time.perf_counter() - t
    log.info("5/5 writing the report")
    timings["total"] = time.perf_counter() - t_start
    summary = {"recipe": {"name": recipe.name, "title": recipe.title, "report": recipe.report,
                          "arms": {a: list(o) for a, o in recipe.arms.items()}, "pairs": recipe.pairs,
                          "decode": recipe.decode, "hf_baseline": recipe.hf_baseline},
               "size": dataclasses.asdict(size), "timings_s": timings, **trained, "threads": torch.get_num_threads()}
    if results is not None:
        summary.update(decode=results["summary"], benchmarks=results["benchmarks"], k=results["config"]["k"])
    if size.seeds > 1:
        summary["across_seeds"] = across_seeds_summary(recipe, summary["train_paired"], results)
    report.write(recipe, out, summary, results, cfgs)
    log.info(f"done in {timings['total'] / 60:.1f} min: {out}")
    return summary


def choose_k(recipe: Recipe, target, methods: dict, cfgs: dict) -> dict[str, dict]:
    """Each arm's k, chosen on held-out training prompts (the held-out split of training, never the
    benchmarks) from an arm's acceptance and the measured round cost: ``per_pair``, a pair's baseline chooses
    for both arms (an arm in no pair for itself); ``one_k``, the first arm for every arm. None chosen
    (``size.calibration_prompts = 0``): each draft's trained k."""
    size = recipe.size
    if not size.calibration_prompts:
        return {}
    from vatspec import data as D
    from vatspec.eval import bench
    from vatspec.eval.calibrate import calibrate
    from vatspec.train import heldout_split

    pairs = recipe.seed_pairs()

    def chooser(name: str) -> str:  # one_k: the first arm; per_pair: the root of the arm's chain of pairs
        if recipe.decode == "one_k":
            return next(iter(cfgs))
        while name in pairs:
            name = pairs[name]
        return name

    out: dict[str, dict] = {}
    for name in cfgs:
        who = chooser(name)
        if who not in out:
            cfg = cfgs[who]
            _, held = heldout_split(D.load_conversations(cfg.data.train), cfg.data, cfg.train.seed)
            ids = [bench.prompt_ids(target.tokenizer, c) for c in held[: size.calibration_prompts]]
            out[who] = calibrate(target, methods[who][0], ids, max_new_tokens=size.eval_tokens).to_dict()
            log.info(f"    {who}: k = {out[who]['k']} (expected speedup {out[who]['speedup'][out[who]['k']]:.2f} "
                     "on held-out prompts)")
        if name != who:
            out[name] = {**out[who], "chosen_on": who}
    return {n: out[n] for n in cfgs}


def paired_tau_sim(chains: dict[str, list[int] | None], pairs: dict[str, str]) -> dict[str, dict]:
    """Each paired arm's held-out tau_sim difference from the arm it is compared with, chain by chain (both
    are scored on the same held-out chains), with a 95% paired-bootstrap interval."""
    from vatspec.eval.stats import paired_difference

    out = {}
    for arm, base in pairs.items():
        a, b = chains.get(arm), chains.get(base)
        if a and b and len(a) == len(b):
            out[arm] = {"vs": base, **paired_difference(a, b).to_dict()}
    return out


def across_seeds_summary(recipe: Recipe, train_paired: dict, results: dict | None) -> dict:
    """Per paired arm: its per-seed differences (held-out tau_sim per chain, and, decoded, tau per prompt and the
    speedup averaged over benchmarks) and their mean over seeds with a 95% t-interval (``stats.across_seeds``)."""
    from vatspec.eval.report import paired_tau, speedup_intervals
    from vatspec.eval.stats import across_seeds

    seeds = [recipe.names(s) for s in recipe.seeds()]
    speed = speedup_intervals(results, recipe.seed_pairs()) if results is not None else None
    out = {}
    for arm, base in recipe.pairs.items():
        sims = [train_paired[n[arm]] for n in seeds if n[arm] in train_paired]
        row = {"vs": base, "seeds": list(recipe.seeds())}
        if len(sims) == len(seeds):
            row["tau_sim_per_seed"] = [d["estimate"] for d in sims]
            row["tau_sim"] = across_seeds(row["tau_sim_per_seed"], [d["base"] + 1 for d in sims]).to_dict()
        if results is not None:
            decs = [paired_tau(results, n[arm], n[base]) for n in seeds]
            row["decode_tau_per_seed"] = [d.estimate for d in decs]
            row["decode_tau"] = across_seeds(row["decode_tau_per_seed"], [d.base for d in decs]).to_dict()
            fast = [speed["difference"][f"{n[arm]} vs {n[base]}"]["average"] for n in seeds]
            row["speedup_per_seed"] = [d.estimate for d in fast]
            row["speedup"] = across_seeds(row["speedup_per_seed"], [d.base for d in fast]).to_dict()
        out[arm] = row
    return out


# what the runner writes in its folder: all a rerun removes (the user's other files stay)
OUTPUTS = ("runs", "eval", "training_curves.png", "demo.json", "report.md", "ablation.md", "ablation.json",
           "objectives.md", "objectives.json", "objectives_tau_sim.png", "config-*.yaml")


def prepare_out(out: Path) -> None:
    """The runner owns what it writes in its output folder: a folder an earlier run made (``.vatspec-owner``)
    loses those outputs and keeps everything else; any other non-empty folder is refused."""
    from vatspec.outputs import OutputError, check_folder, claim_folder

    try:
        check_folder(out, "demo", "--out")
        for pattern in OUTPUTS:
            for p in out.glob(pattern):
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        claim_folder(out, "demo")
    except OutputError as e:
        raise ExperimentError(str(e)) from None
