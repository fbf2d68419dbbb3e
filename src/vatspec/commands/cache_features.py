"""``vatspec cache-features``: run the target once over conversations and store its layer outputs
(``vatspec.features``), so that ``vatspec train data.features=DIR`` needs no target forward.

    vatspec cache-features train.jsonl --out cache/ --target /m --drafter eagle3 --drafter dflash --dtype bf16
    vatspec cache-features train.jsonl --out cache/ --target /m --feature-dtype fp32 --precision bf16
    vatspec cache-features train.jsonl --out cache/ --layers 1,14,26      # resumes if cache/ is partial
    vatspec cache-features --validate cache/ [--target /path/to/model] [--sample 8]
    torchrun --nproc_per_node=8 -m vatspec.cli cache-features train.jsonl --out cache/ --target /m   # one GPU a rank
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from vatspec.commands import add_dtype_arg, add_template_args, int_arg, report, use_template
from vatspec.features.format import PRECISIONS

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def size_arg(value: str) -> int:
    """argparse ``type=`` for ``--shard-size``: bytes, or a number with a unit (512MiB, 1GiB, 2GB)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"size {value!r} is not a number of bytes with an optional unit "
                                         "(KiB, MiB, GiB, KB, MB, GB)")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n < 1:
        raise argparse.ArgumentTypeError(f"size {value!r} must be at least 1 byte")
    return n


def layers_arg(value: str) -> list[int]:
    try:
        return [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"layer ids {value!r} must be integers (1,14,26 or 1 14 26)") from None


def drafter_arg(value: str) -> tuple[str, int]:
    """A drafter kind (``eagle3``, ``dflash``), or ``KIND:N`` where its depth is a setting (``dflash:N``: a DFlash
    draft of N layers reads N target layers)."""
    from vatspec.drafters import DRAFTERS

    kind, _, n = value.partition(":")
    cls = DRAFTERS.get(kind)
    if cls is None or (n and (not n.isdigit() or cls.fixed_depth is not None or int(n) < 1)):
        names = [*DRAFTERS, *(f"{k}:N" for k, c in DRAFTERS.items() if c.fixed_depth is None)]
        raise argparse.ArgumentTypeError(f"drafter {value!r} is not {', '.join(names[:-1])} or {names[-1]}")
    return kind, int(n or 1)


def part_arg(value: str) -> tuple[int, int]:
    """``I/N``: this process writes part I (0-based) of N: the shards k with k % N == I."""
    i, _, n = value.partition("/")
    if not (i.isdigit() and n.isdigit() and 0 <= int(i) < int(n)):
        raise argparse.ArgumentTypeError(f"part {value!r} is not I/N with 0 <= I < N (e.g. 0/4)")
    return int(i), int(n)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("data", nargs="?", help="conversations (.jsonl/.json/.parquet, a folder, a hub name), "
                                                "or the cache folder with --validate")
    parser.add_argument("--out", help="cache folder (created; a partial one is resumed)")
    parser.add_argument("--validate", metavar="DIR", help="re-read and check the cache in DIR instead of writing")
    parser.add_argument("--target", default=None, help="local HF model folder, or 'default' (SmolLM2-135M): "
                        "required; with --validate: default the manifest's target path")
    add_template_args(parser)
    parser.add_argument("--layers", type=layers_arg, nargs="+", help="layer ids to store (output of layer i)")
    parser.add_argument("--drafter", type=drafter_arg, action="append",
                        help="store this drafter's default layers: eagle3, dflash or dflash:N (repeatable: the "
                             "union); default with no --layers: eagle3 and dflash")
    add_dtype_arg(parser, "--feature-dtype", "the features' storage dtype", note="", default="bfloat16")
    parser.add_argument("--precision", default="auto", choices=("auto", *PRECISIONS),
                        help="the target pass's arithmetic: fp32 (the target's dtype) or bf16 (bfloat16 autocast, as "
                             "train.precision=bf16 runs the target online); it should be train.precision of the "
                             "training run; auto, as train.precision: bf16 on a GPU, fp32 elsewhere")
    parser.add_argument("--shard-size", type=size_arg, default="1GiB", help="bytes per shard (KiB, MiB, GiB, ...)")
    parser.add_argument("--max-length", type=int_arg(2), default=2048,
                        help="tokens per conversation (data.max_length)")
    parser.add_argument("--batch-size", type=int_arg(1), default=8, help="conversations per target forward")
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available; under torchrun "
                                                       "cuda:LOCAL_RANK)")
    parser.add_argument("--device-map", default=None, help="a target larger than one GPU: accelerate's device_map "
                        "(auto, balanced, ...) spreads it over the visible GPUs")
    parser.add_argument("--part", type=part_arg, default=None, metavar="I/N",
                        help="write only part I of N (independent processes, e.g. one per group of GPUs); "
                             "then run once more without --part to finish the index and manifest")
    add_dtype_arg(parser, note="unset: bfloat16 on a GPU, float32 on a CPU; it should be target.dtype of the "
                               "training run")
    parser.add_argument("--skip-bad", action="store_true", help="skip (and count) bad input records, as "
                                                                "data.skip_bad=true does in training")
    parser.add_argument("--sample", type=int_arg(0), default=4, help="--validate: rows compared with a fresh forward")
    parser.add_argument("--threads", type=int_arg(1), default=None, help="torch CPU threads")
    parser.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    import torch

    from vatspec.data import DataError
    from vatspec.features import FeatureCacheError
    from vatspec.outputs import OutputError, check_apart
    from vatspec.target import TargetError

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        if args.validate:
            return _validate(args)
        if not args.data or not args.out:
            return report("cache-features", ValueError("give DATA and --out DIR (or --validate DIR)"))
        # the cache folder is its own proof of ownership (its manifest, checked by write_cache); here:
        # not a file, and apart from the data and the target
        if os.path.exists(args.out) and not os.path.isdir(args.out):
            raise OutputError(f"--out {args.out} exists and is not a folder")
        check_apart(args.out, {"DATA": args.data if os.path.exists(args.data) else None,
                               "--target": args.target if args.target and os.path.exists(args.target) else None},
                    "--out")
        return _write(args)
    except (DataError, TargetError, FeatureCacheError, OutputError, ValueError) as e:
        return report("cache-features", e)


def _validate(args: argparse.Namespace) -> int:
    from vatspec.features.validate import validate_cache
    from vatspec.target import open_target

    target = open_target(args.target, device=args.device or "cpu", dtype=args.dtype) if args.target else None
    rep = validate_cache(args.validate, target, sample=args.sample)
    for p in rep.problems:
        print(f"vatspec cache-features: invalid: {p}")
    s = rep.summary
    if s:
        print(f"{args.validate}: {s['conversations']} conversations, {s['tokens']} tokens, {s['shards_ok']} of "
              f"{s['shards']} shards intact, {s['bytes'] / 2**20:.1f} MiB ({s['bytes_per_token']:.0f} bytes/token), "
              f"layers {s['layer_ids']}, {s['dtype']} computed in {s['precision']}"
              + (f"; {s['sampled']} rows match a fresh forward within {s['max_rel_error']:.1e}" if "sampled" in s
                 else ""))
    print("ok" if rep.ok else f"{len(rep.problems)} problem(s)")
    return 0 if rep.ok else 1


def _write(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from vatspec.data import check_data_template, load_conversations, pin_date, recorded_settings, split_turns
    from vatspec.drafters import DRAFTERS
    from vatspec.features import drafter_layer_ids, finalize_cache, write_cache
    from vatspec.features.format import manifest_precision
    from vatspec.outputs import write_lock
    from vatspec.target import open_target
    from vatspec.target.architecture import describe

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device, owned_group = args.device, False
    if args.part is not None:
        if world > 1:
            raise ValueError("--part splits the work between independent processes; under torchrun the ranks "
                             "split it already")
        rank, world = args.part
    elif world > 1:
        if not dist.is_initialized():
            dist.init_process_group("gloo")  # a barrier is all the ranks share
            owned_group = True
        if device is None and torch.cuda.is_available():
            device = f"cuda:{local}"
    if not args.target:
        raise ValueError("--target is required: a local HF model folder, or 'default' (the embedded SmolLM2-135M)")
    convs = load_conversations(args.data, skip_bad=args.skip_bad)
    target = open_target(args.target, device=device or "auto", dtype=args.dtype,
                         device_map=args.device_map)
    if rank == 0:
        print("\n".join(describe(target)), file=sys.stderr)
    # the day the data was rendered on, where the template stamps one
    template = pin_date(use_template(target, args), target.tokenizer, recorded_settings(convs))
    check_data_template(convs, template.settings(target.tokenizer), args.data)
    convs = split_turns(convs, target.tokenizer, template)  # as training splits them: the same rows
    if args.layers:
        layer_ids = [i for group in args.layers for i in group]
    else:
        layer_ids = [i for kind, n in (args.drafter or [(kind, 1) for kind in DRAFTERS])
                     for i in drafter_layer_ids(kind, target.num_layers, n)]
    precision = args.precision if args.precision != "auto" else ("bf16" if target.device.type == "cuda" else "fp32")
    if rank == 0:
        print(f"cache-features: the target in {target.dtype}".replace("torch.", "") + f", its pass in {precision}"
              + (" (auto)" if args.precision == "auto" else "") + f"; features stored as {args.feature_dtype}",
              file=sys.stderr)
    with write_lock(args.out, "--out", "cache-features", part=f"{rank}/{world}"):  # one writer per share
        man = write_cache(target, convs, args.out, layer_ids=layer_ids, dtype=args.feature_dtype,
                          precision=precision, shard_size=args.shard_size, max_length=args.max_length,
                          batch_size=args.batch_size, source=args.data, template=template, rank=rank, world=world,
                          progress=not args.no_progress)
    w = man["written"]
    if args.part is not None:
        print(f"{args.out}: part {rank}/{world} written ({w['shards']} shard(s), {w['tokens']} tokens); when every "
              "part is, run the same command without --part to finish the cache")
        return 0
    if world > 1:
        dist.barrier()
        if owned_group:  # not left to the interpreter's exit, where gloo can abort
            dist.destroy_process_group()
        if rank != 0:
            return 0
        man = finalize_cache(args.out)
    size = sum(s.get("bytes", 0) for s in man["shards"])
    rate = f" at {w['tokens'] / w['seconds']:.0f} tokens/s" if w["tokens"] else " (already complete)"
    print(f"{args.out}: {man['conversations']} conversations, {man['tokens']} tokens in {len(man['shards'])} "
          f"shard(s), {size / 2**20:.1f} MiB ({size / max(1, man['tokens']):.0f} bytes/token), layers "
          f"{man['layer_ids']}, {man['dtype']} computed in {manifest_precision(man)}; wrote {w['shards']} "
          f"shard(s){rate}")
    return 0
