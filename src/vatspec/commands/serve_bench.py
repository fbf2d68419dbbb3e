"""``vatspec serve-bench``: what exported drafts buy in a serving engine at the user's concurrency
(``vatspec.engines``): the engine started without speculation and once per draft (or servers already
running, ``--endpoint``), the same prompts at each concurrency, throughput ratios with intervals, the engine's
own acceptance beside vatspec's.

    vatspec serve-bench --target default --engine-python ~/vllm-cpu/bin/python \\
        --draft eagle3=served/eagle3 --draft eagle3_vat=served/eagle3_vat --concurrency 1,2,4,8 --out runs/sb
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import platform
import signal
import subprocess
import sys
from itertools import combinations
from pathlib import Path

from vatspec import benchmarks, data
from vatspec.commands import add_dtype_arg, add_report_to_arg, float_arg, int_arg, report
from vatspec.data import DataError
from vatspec.data.endpoints import api_key, check_url, fetch
from vatspec.engines import bench as B
from vatspec.engines import report as R
from vatspec.engines.launch import ENGINES, EngineLaunch, ServedDraft
from vatspec.export.record import read_record
from vatspec.outputs import OutputError, check_apart, check_folder, claim_folder

OWNER = "serve-bench"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help="the target's HF folder the engine serves, or 'default' (the embedded "
                        "SmolLM2); not needed with --endpoint alone")
    parser.add_argument("--draft", action="append", default=[], metavar="NAME=EXPORT",
                        help="an exported draft folder (`vatspec export`), served by a launched engine (repeatable)")
    parser.add_argument("--endpoint", action="append", default=[], metavar="NAME=URL",
                        help=f"a server already running, measured as it is (repeatable); name the one without "
                             f"speculation '{B.NONE}'")
    parser.add_argument("--engine", choices=ENGINES, default="vllm")
    parser.add_argument("--engine-python", default=sys.executable, metavar="PYTHON",
                        help="the Python of the environment holding the engine")
    parser.add_argument("--engine-arg", action="append", default=[], metavar="ARG",
                        help="a flag passed to every launched engine, e.g. --engine-arg=--enforce-eager (repeatable)")
    add_dtype_arg(parser, note="in the launched engines (--dtype); unset: the engine's own default")
    parser.add_argument("--k", type=int_arg(1), default=None,
                        help="tokens drafted a round (num_speculative_tokens; default: the draft's trained k, "
                             "DFlash at most its block size - 1)")
    parser.add_argument("--concurrency", type=_int_list, default=[1, 4, 16], metavar="N,N,...",
                        help="requests in flight, a closed loop")
    parser.add_argument("--temperature", type=_float_list, default=[0.0], metavar="T,T,...")
    parser.add_argument("--bench", action="append", default=[], metavar="NAME",
                        help="a bundled benchmark (repeatable; default: all, unless --prompts is given)")
    parser.add_argument("--prompts", action="append", default=[], metavar="FILE",
                        help="your own prompts: conversations in JSONL / JSON / parquet or an HF dataset folder, "
                             "e.g. your held-out split")
    parser.add_argument("--num-prompts", type=int_arg(1), default=8, help="the first N prompts of each")
    parser.add_argument("--max-tokens", type=int_arg(1), default=128)
    parser.add_argument("--repeats", type=int_arg(1), default=2, help="times every cell is measured, interleaved")
    parser.add_argument("--together", action="store_true",
                        help="start every launched server at once (memory for all), not one at a time")
    parser.add_argument("--timeout", type=float_arg(0.0, above=True), default=600.0,
                        help="seconds a whole request may take")
    parser.add_argument("--start-timeout", type=float_arg(0.0, above=True), default=900.0,
                        help="seconds an engine may take to start answering")
    parser.add_argument("--no-compare", action="store_true",
                        help="skip vatspec's own decoding of the prompts (the acceptance set beside the engine's)")
    parser.add_argument("--threads", type=int_arg(1), default=None, help="torch threads of vatspec's own decoding")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--out", default="runs/serve-bench", help="output folder (new, empty, or an earlier one's)")
    add_report_to_arg(parser)


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (DataError, OutputError, ValueError) as e:
        return report(OWNER, e)


def _int_list(text: str) -> list[int]:
    try:
        xs = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, got {text!r}") from None
    if not xs or min(xs) < 1:
        raise argparse.ArgumentTypeError(f"expected numbers >= 1, got {text!r}")
    return sorted(set(xs))


def _float_list(text: str) -> list[float]:
    parse = float_arg(0.0)
    try:
        return list(dict.fromkeys(parse(x) for x in text.split(",") if x.strip())) or [0.0]
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None


def _named(spec: str, flag: str) -> tuple[str, str]:
    name, sep, value = spec.partition("=")
    if not sep or not name or not value:
        raise ValueError(f"{flag} {spec!r}: expected NAME=VALUE")
    if not all(ch.isalnum() or ch in "-_." for ch in name):
        raise ValueError(f"{flag} {spec!r}: a name of letters, digits, '-', '_' and '.'")
    return name, value


def _run(args: argparse.Namespace) -> int:
    drafts = [ServedDraft.read(*_named(s, "--draft")) for s in args.draft]
    endpoints = [_named(s, "--endpoint") for s in args.endpoint]
    names = [d.name for d in drafts] + [n for n, _ in endpoints]
    if len(set(names)) != len(names) or any(d.name == B.NONE for d in drafts):
        raise ValueError(f"--draft / --endpoint: names must differ and '{B.NONE}' names the server without "
                         f"speculation, got {', '.join(names)}")
    for _, url in endpoints:
        check_url(url)
    if drafts and not args.target:
        raise ValueError("--draft needs --target (the model the engine serves)")
    if not drafts and not endpoints:
        raise ValueError("nothing to measure: give --draft NAME=EXPORT (launched) or --endpoint NAME=URL")
    target = _target_path(args.target) if args.target else None
    out = Path(args.out)
    check_apart(out, {**{f"--draft {d.name}": d.path for d in drafts}, "--target": target}, "--out")
    check_folder(out, OWNER, "--out")
    kwargs = _template_kwargs(drafts)
    prompts, benches = _prompts(args)
    arms = []
    if drafts:  # launched: the target alone, then each draft, by the same engine
        base = dict(engine=args.engine, python=args.engine_python, target=str(target), dtype=args.dtype,
                    args=tuple(args.engine_arg))
        if B.NONE not in dict(endpoints):
            arms.append(B.Arm(B.NONE, launch=EngineLaunch(**base)))
        arms += [B.Arm(d.name, launch=EngineLaunch(**base, draft=d, k=_k(d, args.k))) for d in drafts]
    arms += [B.Arm(n, url=u) for n, u in endpoints]
    if B.NONE not in [a.name for a in arms]:
        print(f"no server named '{B.NONE}' (without speculation): no ratios over it, only between the arms",
              file=sys.stderr)
    key = api_key()
    versions = {}
    for arm in arms:  # the user's servers: the model they serve (and their version where they say), before any work
        if arm.url:
            arm.model, versions[arm.name] = _served_model(arm.url, key)
    engine = _engine_info(args)  # the engine's environment runs, before any folder is written
    claim_folder(out, OWNER)
    report_ = {"format": "vatspec-serve-bench", "version": 1, "engine": engine, "machine": _machine(),
               "config": {"target": str(target or "(the endpoints')"), "benchmarks": benches, "prompts": len(prompts),
                          "concurrencies": args.concurrency, "temperatures": args.temperature,
                          "max_tokens": args.max_tokens, "repeats": args.repeats, "timeout_s": args.timeout,
                          "together": args.together, "chat_template_kwargs": kwargs, "seed": args.seed},
               "arms": {a.name: {**_arm_info(a), **({"version": versions[a.name]} if a.name in versions else {})}
                        for a in arms}, "cells": [], "complete": False}
    state = {"results": {"cells": []}}

    def save(results: dict) -> None:
        state["results"] = results
        _write(report_, results, out, plots=False)

    signal.signal(signal.SIGTERM, _sigterm)  # the servers' blocks stop their engines on the way out
    print(f"serve-bench: {len(arms)} servers x {len(args.temperature)} temperatures x {len(args.concurrency)} "
          f"concurrencies x {args.repeats} repeats, {len(prompts)} prompts each; logs in {out / 'logs'}",
          file=sys.stderr)
    try:
        results = B.serve_bench(arms, prompts, concurrencies=args.concurrency, temperatures=args.temperature,
                                repeats=args.repeats, max_tokens=args.max_tokens, timeout=args.timeout,
                                log_dir=out / "logs", template_kwargs=kwargs, together=args.together,
                                start_s=args.start_timeout, seed=args.seed, key=key, save=save,
                                say=lambda s: print(s, file=sys.stderr))
    except (KeyboardInterrupt, SystemExit) as e:
        report_["stopped"] = ("interrupted (Ctrl-C)" if isinstance(e, KeyboardInterrupt) else "stopped (SIGTERM)") \
            + "; every server started here was stopped, and the cells measured before are kept"
        paths = _write(report_, state["results"], out, plots=False)
        print(f"serve-bench: {report_['stopped']}: {paths['json']}", file=sys.stderr)
        return 130 if isinstance(e, KeyboardInterrupt) else 143
    if not results["complete"]:
        report_["stopped"] = "some servers failed (see Failures); what they measured before is kept and marked"
    if not args.no_compare and target is not None and drafts:
        report_["vatspec_acceptance"] = _vatspec_acceptance(args, target, arms, prompts, kwargs, results)
    paths = _write(report_, results, out, plots=not args.no_plots)
    print(paths["markdown"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    if args.report_to:
        from vatspec.train.tracking import log_report

        log_report(args.report_to, out, [p for p in paths.values() if p.suffix in (".md", ".png")], report_["config"])
    requests = [r for c in results["cells"] for r in c.get("requests", [])]
    if not any(r["error"] is None for r in requests):
        return 1  # nothing measured
    return 0 if results["complete"] and all(r["error"] is None for r in requests) else 3


def _sigterm(signum, frame):
    raise SystemExit(128 + signum)


def _write(report_: dict, results: dict, out: Path, plots: bool) -> dict:
    full = {**report_, "cells": results["cells"], "complete": results.get("complete", False),
            "started_s": results.get("started", {})}
    full["summary"] = B.summarize(full)
    arms = list(full["arms"])
    pairs = [(a, B.NONE) for a in arms if a != B.NONE and B.NONE in arms]
    pairs += [(b, a) for a, b in combinations([a for a in arms if a != B.NONE], 2)]  # a later draft over an earlier
    full["ratios"] = B.ratios(full, pairs)
    return R.write(full, out, plots=plots)


def _target_path(spec: str) -> Path:
    """The folder the engine loads: ``default`` (or its aliases) is the embedded target's converted folder."""
    from vatspec.target.model import target_folder

    path = target_folder(spec)
    if not (path / "config.json").is_file():
        hint = "run `vatspec prepare-target` first" if str(path) != spec else "an engine needs the model's files"
        raise ValueError(f"--target {spec}: {path} is not a local HF model folder (no config.json); {hint}")
    return path.resolve()


def _k(draft: ServedDraft, k: int | None) -> int:
    rec = read_record(draft.path) or {}
    trained = (rec.get("training") or {}).get("k")
    k = k or (trained if isinstance(trained, int) and trained > 0 else 3)
    if isinstance(draft.block_size, int) and k > draft.block_size - 1:  # a DFlash block fills at most this many
        k = draft.block_size - 1
    return k


def _template_kwargs(drafts: list[ServedDraft]) -> dict:
    """The template arguments every draft was trained with (their exports' records); drafts that disagree are
    refused: one set of prompts is sent to every server."""
    seen = {}
    for d in drafts:
        rec = read_record(d.path) or {}
        seen[d.name] = dict((rec.get("target") or {}).get("chat_template_kwargs") or {})
    values = {json.dumps(v, sort_keys=True) for v in seen.values()}
    if len(values) > 1:
        raise ValueError("the drafts were trained with different chat template arguments ("
                         + "; ".join(f"{n}: {v or 'none'}" for n, v in seen.items())
                         + "); benchmark them in separate runs")
    return next(iter(seen.values()), {})


def _prompts(args) -> tuple[list[list[dict]], list[str]]:
    benches = args.bench or ([] if args.prompts else benchmarks.list_benchmarks())
    sets = {b: benchmarks.load_benchmark(b) for b in benches}
    for f in args.prompts:
        sets[Path(f).stem] = data.load_conversations(f, require_assistant=False)
    prompts = []
    for name, convs in sets.items():
        for conv in convs[: args.num_prompts]:
            messages = [{"role": m["role"], "content": m["content"]} for m in conv.messages]
            while messages and messages[-1]["role"] == "assistant":
                messages.pop()
            if not messages:
                raise DataError(f"{name}: conversation {conv.id!r} has no user turn to answer")
            prompts.append(messages)
    if not prompts:
        raise DataError("no prompts: the benchmarks or --prompts files are empty")
    return prompts, list(sets)


def _served_model(url: str, key: str | None) -> tuple[str, str | None]:
    """The model a running server serves, and its version where it answers ``/version`` (vLLM, SGLang)."""
    from vatspec.data.endpoints import Endpoint, EndpointError

    ep = Endpoint(url, timeout=30, key=key)
    try:
        models = ep.call("/models").get("data") or []
    except EndpointError as e:
        raise DataError(f"--endpoint {url}: does not answer ({e})") from None
    if not models:
        raise DataError(f"--endpoint {url}: serves no model")
    try:
        status, raw = fetch(url.rstrip("/").removesuffix("/v1") + "/version", timeout=10, key=key)
        answer = json.loads(raw) if status == 200 else None
        version = str(answer["version"]) if isinstance(answer, dict) and answer.get("version") else None
    except (OSError, ValueError, http.client.HTTPException):
        version = None
    return models[0]["id"], version


def _engine_info(args) -> dict:
    info = {"name": args.engine if args.draft else "endpoints", "version": None, "python": None,
            "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith(("VLLM_", "SGLANG_"))}}
    if args.draft:
        info["python"] = args.engine_python
        try:
            res = subprocess.run([args.engine_python, "-c", f"import {args.engine}; print({args.engine}.__version__)"],
                                 capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ValueError(f"--engine-python {args.engine_python}: cannot run ({e})") from None
        if res.returncode != 0:
            raise ValueError(f"--engine-python {args.engine_python}: cannot import {args.engine} "
                             f"({(res.stderr.strip().splitlines() or ['no output'])[-1]})")
        info["version"] = res.stdout.strip().splitlines()[-1]
    return info


def _arm_info(arm: B.Arm) -> dict:
    if arm.launch is None:
        return {"url": arm.url, "model": arm.model, "draft": None}
    d = arm.launch.draft
    return {"launch": arm.launch.shown(), "draft": None if d is None else str(d.path),
            "method": None if d is None else d.method, "k": None if d is None else arm.launch.k}


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, StopIteration):
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"


def _vatspec_acceptance(args, target_path: Path, arms: list[B.Arm], prompts, kwargs, results) -> dict:
    """vatspec's own decoding of the prompts measured at concurrency 1 with each draft (same k, the first
    temperature): accepted tokens per round beside the engine's, paired over prompts."""
    import torch

    from vatspec.data.chat import ChatTemplate
    from vatspec.drafts import open_draft
    from vatspec.eval.bench import prompt_ids
    from vatspec.eval.decode import generate
    from vatspec.target import open_target

    if 1 not in args.concurrency:
        return {}
    if args.threads:
        torch.set_num_threads(args.threads)
    temp = args.temperature[0]
    target = open_target(str(target_path), device="cpu", dtype="float32")
    template = ChatTemplate(kwargs=dict(kwargs))
    ids = [prompt_ids(target.tokenizer, p, template) for p in prompts]
    out = {}
    for arm in arms:
        if arm.launch is None or arm.launch.draft is None:
            continue
        d, k = arm.launch.draft, arm.launch.k
        engine = B.engine_acceptance_per_prompt(results, d.name, temp)
        if not engine:
            continue
        drafter, _ = open_draft(d.path, target)
        ours = {}
        for i in sorted(engine):
            gen = torch.Generator().manual_seed(args.seed + i)
            res = generate(target, ids[i], drafter, k=k, max_new_tokens=args.max_tokens, temperature=temp,
                           generator=gen)
            rounds = [r for r in res.rounds if r.drafted > 0]
            ours[i] = (sum(r.accepted for r in rounds), len(rounds))
        diff = B.acceptance_difference(engine, ours, seed=args.seed)
        e_acc, e_d = sum(a for a, _ in engine.values()), sum(d_ for _, d_ in engine.values())
        o_acc, o_d = sum(a for a, _ in ours.values()), sum(d_ for _, d_ in ours.values())
        out[d.name] = {"prompts": len(ours), "k": k, "temperature": temp,
                       "engine": e_acc / e_d if e_d else None, "vatspec": o_acc / o_d if o_d else None,
                       "difference": None if diff is None else diff.to_dict()}
    return out
